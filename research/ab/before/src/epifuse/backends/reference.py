"""The reference kernels: the epilogue evaluated with torch ops after a torch matmul.

Correct on every device and dtype epifuse accepts, but not fused: the fallback when no
generated kernel supports the arguments (CPU tensors without Triton's interpreter, say), and
the baseline that tests and `verify` compare against. The grouped one runs each group in turn.
"""
from __future__ import annotations

import torch

from .. import verify as verification
from ..grouped_arguments import check_arguments
from ..ir import conditional_stores
from ..reference import gemm_accumulators, node_values, output_values, saturate
from .base import Kernel, Status, supported


class ReferenceKernel(Kernel):
    name = "reference"

    def supports(self, args, cc: int | None = None) -> Status:
        return supported("torch matmul then the epilogue in torch ops: correct everywhere, not fused")

    def compile(self, args) -> None:
        check_arguments(self, args)

    def run(self, args, verify: bool = False) -> None:
        check_arguments(self, args)
        if verify:
            return verification.run(self, args)
        args.check_current()
        dtype = torch.float64 if args.compute_dtype == torch.float64 else torch.float32
        accum, accum2 = gemm_accumulators(args, dtype)
        values = node_values(args.graph, accum, args.operands, dtype, accum2)
        conditional, _ = conditional_stores(args.graph)
        where = {name: torch.broadcast_to(values[id(cond)] != 0 if when else values[id(cond)] == 0, accum.shape)
                 for name, (cond, _, when) in conditional.items()}
        write_results(args, output_values(args.graph, values, accum, dtype), where)


class GroupedReference(Kernel):
    name = "reference_grouped"

    def __init__(self):
        self._single = ReferenceKernel()

    def supports(self, grouped, cc: int | None = None) -> Status:
        return supported("the reference kernel on each group in turn: correct everywhere, not fused")

    def compile(self, grouped) -> None:
        check_arguments(self, grouped, grouped=True)

    def run(self, grouped, verify: bool = False) -> None:
        check_arguments(self, grouped, grouped=True)
        if verify:
            return verification.run_grouped(self, grouped)
        grouped.check_current()
        for problem in grouped.problems:
            self._single.run(problem)


def write_results(args, results: dict, where: dict | None = None) -> None:
    """Copy evaluated outputs into their destinations (folding into reductions if accumulating);
    an output in `where` (a conditional store: name -> mask) only where its mask holds."""
    for name, value in results.items():
        dest = args.outputs[name]
        value = value.reshape(dest.shape)
        op = args.reduction_op(name)
        if op is not None and args.accumulate:
            value = op.reduction.merge(dest.to(value.dtype), value)
        if where and name in where:
            mask = where[name].reshape(dest.shape)
            dest[mask] = saturate(value, dest.dtype)[mask].to(dest.dtype)
        else:
            dest.copy_(saturate(value, dest.dtype))
