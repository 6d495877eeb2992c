"""Where a cold first call's seconds go, by wall-clock sampling (issue 34's 3 s target).

    PYTHONPATH=src:. python -m research.cold_timeline [--workload bias_gelu] [--shape S2] [--training] [--warm]

Each case runs in a fresh child forked as bench.first_call's are (torch and epifuse imported, the
GPU untouched, empty epifuse and Triton caches). A sampler thread reads every thread's stack each
5 ms (sys._current_frames; no tracing, so Triton's Python front end is not slowed as under
cProfile) and counts, per thread, each function on the stack once per sample (inclusive time).
The table lists, for the calling thread and then for all other threads together, the functions
of epifuse, Triton and subprocess with the most samples: the caller's share is the critical
path, the others' what overlapped it. `--warm` times the next process instead, on the caches the
cold one filled (a warm start: bench.first_call's warm column).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from bench.first_call import _caches, _sync, in_child
from bench.workloads import SHAPES, WORKLOADS
from research.stack_sampler import PERIOD_S, Sampler

def gemm_child(spec: dict) -> dict:
    os.environ.update(spec["env"])
    import epifuse

    from bench.run import _epifuse_call
    M, N, K = spec["shape"]
    device = spec["device"]
    w = WORKLOADS[spec["workload"]]
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    s = w.build(M, N, K, torch.bfloat16 if device == "cuda" else torch.float32, device, gen)
    call, _ = _epifuse_call(epifuse, w, s, False)
    _sync(device)
    start = time.perf_counter()
    with Sampler() as sampler:
        call()
        _sync(device)
    return {"seconds": time.perf_counter() - start, **sampler.table(spec["top"])}


def training_child(spec: dict) -> dict:
    os.environ.update(spec["env"])
    import epifuse.nn

    from bench.training import _mlp
    torch.manual_seed(0)
    model = epifuse.nn.fuse_linear_activations(_mlp(4096, 16384).to("cuda", torch.bfloat16))
    x = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with Sampler() as sampler:
        model(x).float().square().mean().backward()
        torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - start, **sampler.table(spec["top"])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="bias_gelu")
    p.add_argument("--shape", default="S2")
    p.add_argument("--training", action="store_true")
    p.add_argument("--warm", action="store_true", help="time a second process on the caches the first filled")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--policy", default="fast")
    p.add_argument("--device", default="cuda", help="cpu: the plumbing at 64x64x32 under Triton's interpreter")
    a = p.parse_args(argv)
    import epifuse  # noqa: F401 - imported before the fork, as bench.first_call does
    with tempfile.TemporaryDirectory() as root:
        env = {**_caches(root, "case"), "EPIFUSE_TUNE": a.policy, "EPIFUSE_QUIET": "1"}
        spec = {"env": env, "top": a.top}
        when = "warm" if a.warm else "cold"
        if a.training:
            case = (training_child, spec)
            title = f"{when} training step (FusedLinear MLP 4096 -> 16384 -> 4096, bf16, 1024 tokens)"
        else:
            shape = (SHAPES.get(a.shape) or tuple(int(n) for n in a.shape.split("x"))
                     if a.device == "cuda" else (64, 64, 32))
            case = (gemm_child, {**spec, "workload": a.workload, "shape": shape, "device": a.device})
            title = f"{when} {a.workload} {a.shape}"
        result = in_child(*case)
        if a.warm and "error" not in result:
            result = in_child(*case)   # the same caches, now filled
    if "error" in result:
        print(result["error"])
        return 1
    print(f"{title}: {result['seconds']:.2f} s (inclusive seconds per function, sampled every "
          f"{PERIOD_S * 1e3:.0f} ms)")
    for who in ("caller", "others"):
        part = result.get(who)
        if not part:
            continue
        print(f"-- {who}: {part['samples']} samples")
        for label, seconds in part["top"]:
            print(f"  {seconds:7.3f}  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
