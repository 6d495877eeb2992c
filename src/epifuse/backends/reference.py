"""The reference kernel: the epilogue evaluated with torch ops after a torch matmul.

Correct on every device and dtype epifuse accepts, but not fused: it is the fallback when no
generated kernel supports the arguments (CPU tensors without Triton's interpreter, say), and
the baseline that tests and `verify` compare against.
"""
from __future__ import annotations

import torch

from ..reference import evaluate
from .base import check_arguments, Kernel, Status, supported


def reference_accum(A: torch.Tensor, B: torch.Tensor, dtype=torch.float32,
                    accumulator_type: torch.dtype | None = None) -> torch.Tensor:
    """accum = A @ B in `dtype` (int64 for integer inputs, exact), broadcasting batch dims.
    An fp16 `accumulator_type` holds accum rounded to fp16 (the kernels' sums round at every
    step, so they agree with this within fp16's accumulated rounding, exactly on small integers)."""
    if not A.is_floating_point():
        return torch.matmul(A.to(torch.int64).cpu(), B.to(torch.int64).cpu()).to(A.device)
    accum = torch.matmul(A.to(dtype), B.to(dtype))
    if accumulator_type == torch.float16:
        accum = accum.to(torch.float16).to(dtype)
    return accum


class ReferenceKernel(Kernel):
    name = "reference"

    def supports(self, args) -> Status:
        return supported("torch matmul then the epilogue in torch ops: correct everywhere, not fused")

    def compile(self, args) -> None:
        check_arguments(self, args)

    def run(self, args, verify: bool = False) -> None:
        check_arguments(self, args)
        if verify:
            from ..debug import run as run_verified
            return run_verified(self, args)
        dtype = torch.float64 if args.compute_dtype == torch.float64 else torch.float32
        accum = reference_accum(args.A, args.B, dtype, args.accumulator_type).reshape(args.accum_shape)
        results = evaluate(args.graph, accum, args.operands, dtype)
        write_results(args, results)


def write_results(args, results: dict) -> None:
    """Copy evaluated outputs into their destinations (folding into reductions if accumulating)."""
    for name, value in results.items():
        dest = args.outputs[name]
        value = value.reshape(dest.shape)
        kind = args.reductions.get(name)
        if kind is not None and args.accumulate:
            old = dest.to(value.dtype)
            value = {"max": torch.maximum, "amax": torch.maximum, "min": torch.minimum}.get(
                kind, torch.add)(old, value)
        dest.copy_(saturate(value, dest.dtype))


FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def saturate(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The conversion every kernel applies to outputs: integers round to nearest even and
    saturate (NaN becomes 0); fp8 saturates to its largest finite value (NaN stays NaN);
    other floating types round to nearest even."""
    if dtype in FP8_MAX:
        return value.clamp(-FP8_MAX[dtype], FP8_MAX[dtype])
    if dtype.is_floating_point or dtype == torch.bool:
        return value
    info = torch.iinfo(dtype)
    value = torch.nan_to_num(value.double(), nan=0.0, posinf=info.max, neginf=info.min)
    return torch.round(value).clamp(info.min, info.max)
