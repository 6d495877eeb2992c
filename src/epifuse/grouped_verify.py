"""`kernel.run(grouped, verify=True)`: every output of every group against the float64 reference.

The same rule as epifuse.debug.run for one GEMM (references computed before the run, so
in-place updates are checked against the inputs as they were), reported as one Report whose
checks are named "group 2: D".
"""
from __future__ import annotations

import dataclasses

from .backends.base import check_arguments
from .debug import Report, VerificationError, check, reference_outputs


def run_verified(kernel, grouped, rtol: float | None = None, atol: float | None = None,
                 raise_on_mismatch: bool = True) -> Report:
    check_arguments(kernel, grouped, grouped=True)
    references = [reference_outputs(p) for p in grouped.problems]
    kernel.run(grouped)
    checks = []
    for i, (problem, refs) in enumerate(zip(grouped.problems, references)):
        for c in check(problem, refs, rtol, atol).checks:
            checks.append(dataclasses.replace(c, name=f"group {i}: {c.name}"))
    report = Report(repr(kernel), checks)
    if raise_on_mismatch and not report.ok:
        raise VerificationError(report)
    return report
