"""Where a FusedLinear layer's time goes against nn.Linear + activation, on one GPU, at the
per-rank shapes of bench.distributed (issue 35: the two-GPU step is 1.7-2x slower than eager,
and half of that is in the forward).

    PYTHONPATH=src:. python -m research.layer_profile [--device cuda] [--out DIR]

Per shape and variant: the forward's GPU-bound time (CUDA events over back-to-back calls), the
host time per forward (perf_counter over the same calls, no sync between them: at or above the
GPU time means the host bounds it), and a training step (forward, mean-square loss, backward).
Then torch.profiler over three FusedLinear steps: the top ops by device time and by host time.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn

import epifuse
import epifuse.nn

SHAPES = {"tp_rank": (8192, 4096, 5504), "fsdp_rank": (4096, 4096, 11008)}


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _variants(hidden, ffn, dtype, device):
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(hidden, ffn), nn.SiLU()).to(device, dtype)
    fused = epifuse.nn.fuse_linear_activations(nn.Sequential(nn.Linear(hidden, ffn), nn.SiLU()).to(device, dtype),
                                               inplace=True)
    fused[0].weight.data.copy_(eager[0].weight.data)
    fused[0].bias.data.copy_(eager[0].bias.data)
    return {"eager": eager, "epifuse": fused}


def _measure(model, x, reps, device):
    def fwd():
        return model(x)

    def step():
        y = model(x)
        (y.float() ** 2).mean().backward()

    for _ in range(3):
        step()
    _sync(device)
    out = {}
    for name, fn in (("fwd", fwd), ("step", step)):
        _sync(device)
        t0 = time.perf_counter()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        for _ in range(reps):
            fn()
        host = (time.perf_counter() - t0) / reps * 1e3
        if device == "cuda":
            end.record()
            torch.cuda.synchronize()
            out[f"{name}_ms"] = start.elapsed_time(end) / reps
        else:
            out[f"{name}_ms"] = (time.perf_counter() - t0) / reps * 1e3
        out[f"{name}_host_ms"] = host
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--small", action="store_true", help="tiny shapes (a CPU check of the script)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    shapes = {k: (32, 32, 48) for k in SHAPES} if a.small else SHAPES
    rows, tables = [], []
    for shape_name, (tokens, hidden, ffn) in shapes.items():
        x = torch.randn(tokens, hidden, device=a.device, dtype=dtype)
        models = _variants(hidden, ffn, dtype, a.device)
        for variant, model in models.items():
            r = {"shape": shape_name, "variant": variant, **_measure(model, x, a.reps, a.device)}
            rows.append(r)
            print(json.dumps(r), flush=True)
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
        model = models["epifuse"]
        with profile(activities=acts) as prof:
            for _ in range(3):
                y = model(x)
                (y.float() ** 2).mean().backward()
            _sync(a.device)
        sort = "cuda_time_total" if a.device == "cuda" else "cpu_time_total"
        tables.append(f"== {shape_name} epifuse, by device time\n"
                      + prof.key_averages().table(sort_by=sort, row_limit=18, max_name_column_width=70))
        tables.append(f"== {shape_name} epifuse, by host self time\n"
                      + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                                  max_name_column_width=70))
    for t in tables:
        print(t)
    print(f"{'shape':10s} {'variant':8s} {'fwd ms':>8s} {'host':>8s} {'step ms':>8s} {'host':>8s}")
    for r in rows:
        print(f"{r['shape']:10s} {r['variant']:8s} {r['fwd_ms']:8.3f} {r['fwd_host_ms']:8.3f} "
              f"{r['step_ms']:8.3f} {r['step_host_ms']:8.3f}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        name = torch.cuda.get_device_name().replace(" ", "-") if a.device == "cuda" else "cpu"
        with open(os.path.join(a.out, f"layer_profile_{name}.json"), "w") as f:
            json.dump({"rows": rows, "tables": tables, "epifuse_tune": os.environ.get("EPIFUSE_TUNE", "fast")}, f, indent=1)


if __name__ == "__main__":
    main()
