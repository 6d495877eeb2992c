"""Two-GPU training-step benchmark (issue 35): a LLaMA-sized MLP block under tensor parallelism
and under FSDP2, epifuse's FusedLinear against nn.Linear + SiLU, eager and under torch.compile.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m bench.distributed --out PATH.json
    python -m torch.distributed.run --standalone --nproc_per_node=2 -m bench.distributed --smoke --out PATH.json

(from the repository root; `PYTHONPATH=src:.` where epifuse is not installed). The block is
Linear(4096 -> 11008) -> SiLU -> Linear(11008 -> 4096) in bf16 (SwiGLU's gate is not fused yet, so
one up projection with SiLU stands in for it), one training step = forward, a mean-square loss,
backward and an SGD step. Variants, built from the same initial parameters:

- epifuse: `epifuse.nn.fuse_linear_activations` of the block (up projection, bias and SiLU in one
  FusedLinear; the down projection stays nn.Linear);
- eager: the block as it is;
- compile: the block under `torch.compile` (inductor, default mode: max-autotune would not fit
  the run's budget).

Parallelisms, on a 1-D mesh of every rank: `tp`, ColwiseParallel up and RowwiseParallel down,
every rank fed the same `--tokens` tokens; `fsdp2`, fully_shard on each linear layer and the
block, every rank fed its own tokens / world of them (the same global batch).

Each step is timed with CUDA events after `--warmup` steps (which include the first call's
compilations), `--reps` times; a rank's time is the median of its reps, and the step's time the
largest over the ranks (a step ends with the slowest rank). Rank 0 prints a table and writes the
JSON (the config, the GPU, torch and Triton versions, and per variant the ms, its ratio to eager,
the first-step loss and the first step's seconds). A variant that fails is recorded with its
error and the run goes on. On two H100s the whole run takes about 2-3 minutes (EPIFUSE_TUNE=fast,
the default: kernels are picked from the shipped choices, not timed).

`--smoke`: the same run on the CPU with gloo at toy sizes (hidden 64 -> 96, 32 tokens, float32;
perf_counter for the clock), which proves the script end to end without a GPU
(tests/bench/test_distributed_bench.py).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import traceback
from datetime import datetime, timezone

import torch
import torch.distributed as dist
from torch import nn

import epifuse
import epifuse.nn

VARIANTS = ("epifuse", "eager", "compile")
PARALLELISMS = ("tp", "fsdp2")


def _block(hidden: int, ffn: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(hidden, ffn), nn.SiLU(), nn.Linear(ffn, hidden))


def _variant(name: str, base: nn.Sequential) -> nn.Sequential:
    """A copy of `base` as the variant runs it (compile is wrapped after parallelizing)."""
    model = copy.deepcopy(base)
    if name == "epifuse":
        model = epifuse.nn.fuse_linear_activations(model, inplace=True)
        assert isinstance(model[0], epifuse.nn.FusedLinear), model
    return model


def _parallelize(model: nn.Sequential, parallelism: str, mesh) -> nn.Module:
    if parallelism == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    from torch.distributed.fsdp import fully_shard
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class _Clock:
    """CUDA events around each step on a GPU; perf_counter after a synchronization on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def time(self, step, reps: int) -> list:
        times = []
        for _ in range(reps):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                times.append((start, end))
            else:
                t0 = time.perf_counter()
                step()
                times.append(1e3 * (time.perf_counter() - t0))
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in times]
        return times

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def _largest(value: float, device) -> float:
    """The largest of every rank's `value`."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _time_variant(name: str, parallelism: str, base: nn.Sequential, x, mesh, config: dict, clock: _Clock,
                  device) -> dict:
    """The variant's first step (seconds, loss), then `warmup` - 1 more, then `reps` timed."""
    model = _parallelize(_variant(name, base), parallelism, mesh)
    if name == "compile":
        model = torch.compile(model, backend=config["compile_backend"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    clock.sync()
    t0 = time.perf_counter()
    loss = float(step().detach())
    clock.sync()
    row = {"first_step_s": _largest(time.perf_counter() - t0, device), "loss": loss}
    for _ in range(config["warmup"] - 1):
        step()
    clock.sync()
    dist.barrier()
    ms = statistics.median(clock.time(step, config["reps"]))
    row.update(ms=_largest(ms, device), rank_ms=ms)
    # the forward alone (autograd records, nothing runs backward): the step's split into
    # forward and the rest (backward and optimizer), to see where a variant loses time
    forward = statistics.median(clock.time(lambda: model(x), config["reps"]))
    row.update(forward_ms=_largest(forward, device))
    return row


def measure(config: dict, mesh, device, rank: int, world: int) -> list:
    """One row per parallelism and variant: ms (the largest rank median), first step's seconds,
    first-step loss, or the error that stopped it."""
    dtype = getattr(torch, config["dtype"])
    clock = _Clock(device.type == "cuda")
    torch.manual_seed(0)
    base = _block(config["hidden"], config["ffn"]).to(device, dtype)
    data = torch.randn(config["tokens"], config["hidden"], generator=torch.Generator().manual_seed(1))
    data = data.to(device, dtype)
    rows = []
    for parallelism in PARALLELISMS:
        # TP: every rank the whole batch (replicated); FSDP2: each rank its share of it
        x = data if parallelism == "tp" else data.chunk(world)[rank].contiguous()
        for name in VARIANTS:
            row = {"parallelism": parallelism, "variant": name}
            try:
                row.update(_time_variant(name, parallelism, base, x, mesh, config, clock, device))
            except Exception as exc:   # recorded; the other variants still run (on every rank alike)
                row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                if rank == 0:
                    traceback.print_exc()
            rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for row in rows:
        eager = next((r.get("ms") for r in rows if r["parallelism"] == row["parallelism"] and r["variant"] == "eager"),
                     None)
        if "ms" in row and eager:
            row["ratio_to_eager"] = row["ms"] / eager
    return rows


def _environment(device) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    facts = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
             "triton": triton_version, "cuda": torch.version.cuda, "epifuse": getattr(epifuse, "__version__", None),
             "epifuse_tune": os.environ.get("EPIFUSE_TUNE") or "fast",
             "env_vars": {k: v for k, v in os.environ.items() if k.startswith(("EPIFUSE_", "TRITON_", "TORCHINDUCTOR_"))}}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        facts.update(gpu=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1))
    else:
        facts.update(gpu=None, cpu=True)
    return facts


def _table(rows: list, config: dict, world: int) -> str:
    lines = [f"MLP {config['hidden']} -> {config['ffn']} -> {config['hidden']}, {config['tokens']} tokens, "
             f"{config['dtype']}, {world} ranks: ms per training step (largest rank median of {config['reps']})",
             f"{'parallelism':12s} {'variant':8s} {'ms':>9s} {'fwd ms':>8s} {'x eager':>8s} {'first s':>8s} "
             f"{'loss':>12s}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['parallelism']:12s} {r['variant']:8s} failed: {r['error'][:120]}")
            continue
        lines.append(f"{r['parallelism']:12s} {r['variant']:8s} {r['ms']:9.3f} {r['forward_ms']:8.3f} "
                     f"{r.get('ratio_to_eager', 0):8.3f} {r['first_step_s']:8.1f} {r['loss']:12.6g}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="the JSON to write (rank 0)")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, toy sizes, float32")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--warmup", type=int, default=None, help="untimed steps, the first included")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--compile-backend", default="inductor")
    ns = p.parse_args(argv)
    defaults = ({"hidden": 64, "ffn": 96, "tokens": 32, "dtype": "float32", "warmup": 2, "reps": 3} if ns.smoke
                else {"hidden": 4096, "ffn": 11008, "tokens": 8192, "dtype": "bfloat16", "warmup": 5, "reps": 20})
    config = {k: getattr(ns, k) if getattr(ns, k) is not None else v for k, v in defaults.items()}
    config.update(compile_backend=ns.compile_backend, smoke=ns.smoke, optimizer="SGD(lr=1e-3)",
                  loss="mean square of the block's output, in float32",
                  tp="ColwiseParallel up, RowwiseParallel down; every rank the whole batch",
                  fsdp2="fully_shard per linear layer and the block; each rank batch / world tokens")
    cuda = torch.cuda.is_available() and not ns.smoke
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (world,))
    start = time.perf_counter()
    rows = measure(config, mesh, device, rank, world)
    if rank == 0:
        result = {"config": config, "world": world, "environment": _environment(device), "rows": rows,
                  "seconds": round(time.perf_counter() - start, 1)}
        print(_table(rows, config, world), flush=True)
        if ns.out:
            with open(ns.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
