"""Host-side trace of a compiled training step (issue 33: small models ran slower under the
epifuse backend than their GPU kernels add up to).

    PYTHONPATH=src:. python -m research.step_trace [--models gcn,linear_bce] [--variants compile,epifuse]

torch.profiler over 10 steps of each bench.models block compiled with each variant: CPU ops and
CUDA runtime calls by self CPU time (a cudaStreamSynchronize or a device-to-host copy inside a
step shows here), and the step's wall time against its CUDA time.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def trace(model: str, variant: str, steps: int = 10) -> str:
    from torch.profiler import ProfilerActivity, profile

    from bench.models import _compiled, build
    module, inputs, _ = build(model, 1.0, "cuda", torch.bfloat16)
    fn = _compiled(module, variant)

    def step():
        for p in module.parameters():
            p.grad = None
        fn(*inputs).backward()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=70)
    return f"== {model} {variant}: {wall:.3f} ms a step (wall)\n{table}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gcn,linear_bce")
    p.add_argument("--variants", default="compile,epifuse")
    ns = p.parse_args(argv)
    for model in ns.models.split(","):
        for variant in ns.variants.split(","):
            print(trace(model, variant), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
