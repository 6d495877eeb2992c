"""The grouped reference kernel: the reference kernel on each group in turn.

Correct for everything GroupedGemmArguments accepts, but neither fused nor one launch: the
fallback when the grouped Triton kernel cannot take the arguments, and the baseline it is
checked against.
"""
from __future__ import annotations

from .base import check_arguments, Kernel, Status, supported
from .reference import ReferenceKernel


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
            from ..grouped_verify import run_verified
            return run_verified(self, grouped)
        for problem in grouped.problems:
            self._single.run(problem)
