"""Training-step benchmark (issue 6): forward + backward of an MLP block and of a linear layer
with a fused BCE loss, epifuse against eager PyTorch (and torch.compile max-autotune with --inductor).

    PYTHONPATH=src:. python -m bench.training [--tokens 8192] [--inductor] [--backend] [--out DIR]

`--backend` adds the MLP under torch.compile's default mode and under
`torch.compile(backend=epifuse.backend.backend)` (issue 33: Inductor plus epifuse's fusion pass,
`backend="epifuse"` by name where the package is installed).

MLP: Linear(4096 -> 16384) -> GELU(tanh) -> Linear(16384 -> 4096), bf16, 8192 tokens; the
epifuse version is `epifuse.nn.fuse_linear_activations` of the same module (the bias and GELU
fused into the first GEMM, the bias into the second). BCE: a 4096 -> 4096 linear layer whose
logits only feed a mean BCE-with-logits loss; epifuse fuses the loss into the GEMM.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn

import epifuse
import epifuse.backend
import epifuse.runtime.tune
# Triton's do_bench, imported on first use: bench.first_call times a cold first step in a child
# that imported this module, and that step pays Triton's import, as a user's does
from epifuse.runtime.tune import do_bench


def _mlp(h, f):
    return nn.Sequential(nn.Linear(h, f), nn.GELU(approximate="tanh"), nn.Linear(f, h))


def bce_epilogue(accum, bias, target):
    x = accum + bias
    loss = mean(softplus(x) - x * target)  # noqa: F821 - parsed by epifuse, not run
    return loss


def _kernel_table(fn, steps: int = 5) -> list:
    """GPU time per kernel name over `steps` calls of fn (torch.profiler), largest first:
    where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / steps, e.count // steps) for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    return [{"kernel": k[:90], "us_per_step": round(us, 1), "calls_per_step": n} for k, us, n in rows[:8]]


def _bce_loss(x, weight, bias, target):
    logits = x @ weight.t() + bias
    return nn.functional.binary_cross_entropy_with_logits(logits.float(), target)


def measure(tokens=8192, hidden=4096, ffn=16384, inductor=False, backend=False) -> list[dict]:
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device=dev, dtype=dt, requires_grad=True)
    base = _mlp(hidden, ffn).to(dev, dt)
    variants = {"eager": base, "epifuse": epifuse.nn.fuse_linear_activations(_mlp(hidden, ffn).to(dev, dt))}
    variants["epifuse"].load_state_dict(base.state_dict())
    if inductor:
        twin = _mlp(hidden, ffn).to(dev, dt)
        twin.load_state_dict(base.state_dict())
        variants["inductor"] = torch.compile(twin, mode="max-autotune-no-cudagraphs")
    if backend:
        for name, options in (("compile", {}), ("epifuse_backend", {"backend": epifuse.backend.backend})):
            twin = _mlp(hidden, ffn).to(dev, dt)
            twin.load_state_dict(base.state_dict())
            variants[name] = torch.compile(twin, **options)
    rows = []
    losses = {}
    for name, model in variants.items():
        def step():
            model.zero_grad(set_to_none=True)
            x.grad = None
            loss = model(x).float().square().mean()
            loss.backward()
            return loss
        start = time.perf_counter()
        losses[name] = float(step())
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        ms = do_bench(step, warmup=25, rep=200, return_mode="median")
        rows.append({"workload": "mlp_step", "variant": name, "ms": ms, "first_call_s": first,
                     "loss": losses[name], "gpu_kernels": _kernel_table(step)})
    # linear + fused BCE loss
    w = torch.randn(hidden, hidden, device=dev, dtype=dt) / hidden ** 0.5
    b = torch.zeros(hidden, device=dev, dtype=torch.float32)
    target = torch.randint(0, 2, (tokens, hidden), device=dev).float()
    weight = w.clone().requires_grad_(True)
    bias = b.clone().requires_grad_(True)

    def eager_bce():
        weight.grad = bias.grad = None
        loss = _bce_loss(x.detach(), weight, bias, target)
        loss.backward()
        return loss

    def epifuse_bce():
        weight.grad = bias.grad = None
        loss = epifuse.gemm(x.detach(), weight.t(), bce_epilogue, bias=bias, target=target)
        loss.sum().backward()
        return loss

    bce_variants = [("eager", eager_bce), ("epifuse", epifuse_bce)]
    if inductor:
        compiled_loss = torch.compile(_bce_loss, mode="max-autotune-no-cudagraphs")

        def inductor_bce():
            weight.grad = bias.grad = None
            loss = compiled_loss(x.detach(), weight, bias, target)
            loss.backward()
            return loss
        bce_variants.append(("inductor", inductor_bce))
    for name, fn in bce_variants:
        start = time.perf_counter()
        value = float(fn().sum())
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
        rows.append({"workload": "bce_step", "variant": name, "ms": ms, "first_call_s": first, "loss": value,
                     "gpu_kernels": _kernel_table(fn)})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--inductor", action="store_true")
    p.add_argument("--backend", action="store_true")
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    rows = measure(ns.tokens, inductor=ns.inductor, backend=ns.backend)
    eager = {r["workload"]: r["ms"] for r in rows if r["variant"] == "eager"}
    for r in rows:
        r["ratio_to_eager"] = r["ms"] / eager[r["workload"]]
        print(f"{r['workload']:9s} {r['variant']:9s} {r['ms']:8.3f} ms  x{r['ratio_to_eager']:.2f} of eager  "
              f"first {r['first_call_s']:.1f} s  loss {r['loss']:.5f}")
        for k in r["gpu_kernels"][:5]:
            print(f"      {k['us_per_step']:9.1f} us  x{k['calls_per_step']}  {k['kernel']}")
    if ns.out:
        with open(os.path.join(ns.out, "training.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                       "epifuse_tuning": epifuse.runtime.tune.HISTORY}, f, indent=1)


if __name__ == "__main__":
    main()
