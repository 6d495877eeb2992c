"""Where a kept epifuse.gemm's host time goes, stage by stage, on a GPU (issue 34's host-time
target): the whole call, the signature, the lookup, the kept launch with Triton's launch
replaced by nothing, the launch alone, torch.addmm and torch.empty, at 256x256x256 fp16.
    PYTHONPATH=src:. python research/host_path_probe.py [--tune 0]
Prints one JSON object."""
from __future__ import annotations

import json
import os
import sys

import torch

if "--tune" in sys.argv:
    os.environ["EPIFUSE_TUNE"] = sys.argv[sys.argv.index("--tune") + 1]

import epifuse  # noqa: E402
from bench.overhead import _per_call_us  # noqa: E402
from epifuse.runtime import callsite  # noqa: E402


def per_call_us(fn, calls: int = 3000) -> float:
    """bench.overhead's host time per call, the best of three rounds."""
    return min(_per_call_us(fn, calls) for _ in range(3))


def main() -> None:
    A = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    B = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    bias = torch.randn(256, device="cuda", dtype=torch.float16)
    D = torch.empty(256, 256, device="cuda", dtype=torch.float16)
    src = "def epi(accum, bias, alpha):\n    D = relu(accum * alpha + bias)\n    return D\n"
    tensors = {"bias": bias, "alpha": 2.0, "D": D}
    options = (None, False, False, None, "default")
    for _ in range(3):
        epifuse.gemm(A, B, src, **tensors)
    call = callsite.signature(src, A, B, tensors, options)
    site = callsite.lookup(call)
    rows = {"kernel": None, "epifuse_gemm": per_call_us(lambda: epifuse.gemm(A, B, src, **tensors))}
    rows["signature"] = per_call_us(lambda: callsite.signature(src, A, B, tensors, options))
    rows["lookup"] = per_call_us(lambda: callsite.lookup(call))
    rows["signature_and_lookup"] = per_call_us(lambda: callsite.lookup(callsite.signature(src, A, B, tensors, options)))
    launch, seen = site.launch_with, []
    site.launch_with = lambda values: seen.append(values)
    site.call(A, B, tensors)
    values = seen[-1]
    site.launch_with = lambda values: None
    rows["site_call_without_launch"] = per_call_us(lambda: site.call(A, B, tensors))
    site.launch_with = launch
    rows["site_call"] = per_call_us(lambda: site.call(A, B, tensors))
    rows["launch_with"] = per_call_us(lambda: launch(values))
    rows["torch_addmm_out"] = per_call_us(lambda: torch.addmm(bias, A, B, out=D))
    rows["torch_empty"] = per_call_us(lambda: torch.empty(256, 256, device="cuda", dtype=torch.float16))
    rows["is_compiling"] = per_call_us(lambda: torch.compiler.is_compiling())
    rows["empty_python_call"] = per_call_us(lambda: None)
    from epifuse.runtime import tune
    rows["kernel"] = tune.HISTORY[-1]["choice"] if tune.HISTORY else os.environ.get("EPIFUSE_TUNE", "")
    head = getattr(call, "head", None)   # a tree before the two-step lookup keys sites by the whole signature
    rows["guard"] = type(callsite._SITES[head][0].guard).__name__ if head is not None else "none"
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
