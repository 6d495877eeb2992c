"""The reference kernel: the epilogue evaluated with torch ops after a torch matmul.

Correct on every device and dtype epifuse accepts, but not fused: it is the fallback when no
generated kernel supports the arguments (CPU tensors without Triton's interpreter, say), and
the baseline that tests and `verify` compare against.
"""
from __future__ import annotations

import torch

from ..reference import evaluate, reference_accum, saturate
from .base import check_arguments, Kernel, Status, supported


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
        op = args.reduction_op(name)
        if op is not None and args.accumulate:
            value = op.reduction.merge(dest.to(value.dtype), value)
        dest.copy_(saturate(value, dest.dtype))
