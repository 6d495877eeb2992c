"""Verification: a kernel's outputs against the float64 reference.

    report = epifuse.debug.run(kernel, args, verify=True)   # raises VerificationError on a mismatch
    kernel.run(args, verify=True)                             # the same, from any kernel

The reference is computed before the kernel runs (so in-place updates such as D = C and
`accumulate=True` reductions are checked against what the inputs were): the epilogue's graph
evaluated in float64 on `A.double() @ B.double()`. Each output is reported with its largest
error, where it is, and the tolerance: an element passes when
|out - ref| <= atol + rtol * (|ref| + rms(ref)), with rtol from the output dtype (and tf32 for
fp32 inputs on a GPU). NaN must be NaN and infinities must match exactly.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from .grouped_arguments import check_arguments
from .errors import EpilogueArgumentError
from .reference import evaluate, gemm_accumulators, saturate

_RTOL = {torch.float64: 1e-5, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2,
         torch.float8_e4m3fn: 0.13, torch.float8_e5m2: 0.26}
_TF32_RTOL = 5e-3
# tf32 rounds fp32 inputs to 10 mantissa bits: on random data 2 of 4096 conditions such as
# accum > C came out the other way; a bool output may differ in this share of its elements.
_TF32_BOOL_FLIPS = 1e-3


def _tf32(args) -> bool:
    return args.A.dtype == torch.float32 and args.precision != "highest" and args.A.device.type == "cuda"


class VerificationError(RuntimeError):
    """A kernel's outputs differ from the float64 reference by more than the tolerance."""

    def __init__(self, report: "Report"):
        self.report = report
        super().__init__(str(report))


@dataclass
class OutputCheck:
    """How one output compares with the reference."""

    name: str
    ok: bool
    max_error: float                 # the largest |out - ref| (inf for a NaN/Inf mismatch)
    index: tuple[int, ...] | None    # where the worst element is (by error over tolerance)
    got: float | None
    expected: float | None
    rtol: float
    atol: float
    rel_error: float                 # ||out - ref|| / ||ref|| over finite entries
    note: str = ""

    def __str__(self) -> str:
        where = "" if self.index is None else f" at {self.index}"
        values = "" if self.got is None else f" (got {self.got:.6g}, expected {self.expected:.6g})"
        status = "ok  " if self.ok else "FAIL"
        text = (f"{status} {self.name}: largest error {self.max_error:.3g}{where}{values}; "
                f"relative error {self.rel_error:.2e}; tolerance rtol {self.rtol:.1e}")
        if self.atol:
            text += f", atol {self.atol:g}"
        return text + (f"; {self.note}" if self.note else "")


@dataclass
class Report:
    """The checks of every output of one kernel run."""

    kernel: str
    checks: list[OutputCheck]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        head = f"{self.kernel}: " + ("matches the float64 reference" if self.ok
                                     else "DIFFERS from the float64 reference")
        return "\n".join([head, *(f"  {c}" for c in self.checks)])


def default_tolerance(args, name: str) -> tuple[float, float]:
    """(rtol, atol) for output `name`: by its dtype, looser for tf32 on a GPU."""
    dest = args.outputs[name]
    if dest.dtype == torch.bool:
        return 0.0, 0.0   # exact (a one-off would pass every bool); under tf32, see check()
    if not dest.dtype.is_floating_point:
        return 0.0, 1.0   # a tie rounded the other way
    rtol = _RTOL.get(dest.dtype, 2e-5)
    return (max(rtol, _TF32_RTOL) if _tf32(args) else rtol), 0.0


def reference_outputs(args, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Every output of `args` by the reference interpreter in `dtype`, in its destination's
    shape, folded into the destination's current value for `accumulate=True` reductions."""
    if args.A.device.type == "meta":
        raise EpilogueArgumentError("verify=True compares values, and tensors on the meta device have none.",
                                    hint="Run without verify, or on cpu or cuda tensors.")
    accum, accum2 = gemm_accumulators(args, dtype)
    operands = {k: (v.to(dtype) if isinstance(v, torch.Tensor) else v) for k, v in args.operands.items()}
    results = evaluate(args.graph, accum, operands, dtype, accum2)
    out = {}
    for name, value in results.items():
        dest = args.outputs[name]
        value = value.reshape(dest.shape)
        op = args.reduction_op(name)
        if op is not None and args.accumulate:
            value = op.reduction.merge(dest.to(dtype), value)
        if dest.dtype == torch.bool:
            value = (value != 0).to(dtype)   # NaN is true, as torch converts it
        elif not dest.dtype.is_floating_point:
            value = saturate(value, dest.dtype).to(dtype)
        out[name] = value
    return out


def compare(name: str, out: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float = 0.0) -> OutputCheck:
    """Check `out` against `ref` elementwise; see the module docstring for the rule."""
    out = out.detach().to(torch.float64)
    ref = ref.detach().to(device=out.device, dtype=torch.float64).reshape(out.shape)
    nan_out, nan_ref = torch.isnan(out), torch.isnan(ref)
    finite = torch.isfinite(ref)
    both = finite & torch.isfinite(out)
    diff = torch.where(both, (out - ref).abs(), torch.zeros_like(out))
    scale = float(ref[finite].square().mean().sqrt()) if bool(finite.any()) else 0.0
    allowed = atol + rtol * (ref.abs().where(finite, torch.zeros_like(ref)) + scale)
    ratio = torch.where(allowed > 0, diff / allowed.clamp_min(1e-300),
                        torch.where(diff > 0, torch.full_like(diff, math.inf), torch.zeros_like(diff)))
    # Mismatched NaN, or an infinity where the other is different, fails outright.
    special = (nan_out != nan_ref) | (~finite & ~nan_ref & (out != ref)) | (finite & ~torch.isfinite(out))
    ratio = torch.where(special, torch.full_like(ratio, math.inf), ratio)
    norm = float(ref[finite].norm()) if bool(finite.any()) else 0.0
    diff_norm = float(diff[finite].norm()) if bool(finite.any()) else 0.0
    rel = diff_norm / norm if norm > 0 else diff_norm
    if out.numel() == 0:
        return OutputCheck(name, True, 0.0, None, None, None, rtol, atol, 0.0)
    flat = int(torch.argmax(ratio.reshape(-1)))
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), out.shape)) if out.dim() else ()
    worst = float(ratio.reshape(-1)[flat])
    got, expected = float(out.reshape(-1)[flat]), float(ref.reshape(-1)[flat])
    note = ""
    if bool(special.reshape(-1)[flat]):
        note = "NaN or Inf where the reference differs"
    max_error = math.inf if bool(special.any()) else float(diff.max())
    return OutputCheck(name, worst <= 1.0, max_error, index, got, expected, rtol, atol, rel, note)


def check(args, references: dict, rtol: float | None = None, atol: float | None = None,
          kernel: str = "kernel") -> Report:
    checks = []
    for name, ref in references.items():
        r, a = default_tolerance(args, name)
        c = compare(name, args.outputs[name], ref, r if rtol is None else rtol, a if atol is None else atol)
        out = args.outputs[name]
        if not c.ok and out.dtype == torch.bool and _tf32(args) and rtol is None and atol is None:
            flips = int((out.cpu() != ref.cpu().reshape(out.shape).bool()).sum())
            if flips <= max(1, out.numel() * _TF32_BOOL_FLIPS):
                c = dataclasses.replace(c, ok=True, note=f"{flips} of {out.numel()} flipped: tf32's rounding of "
                                                         "the inputs moves conditions near their threshold")
        checks.append(c)
    return Report(kernel, checks)



def run(kernel, args, verify: bool = True, rtol: float | None = None, atol: float | None = None,
        raise_on_mismatch: bool = True) -> Report | None:
    """`kernel.run(args)`, then (with verify) check every output against the float64 reference.

    Raises VerificationError naming the largest error and where it is, unless
    `raise_on_mismatch=False` (then the Report says). Returns the Report (None without verify).
    """
    if not verify:
        kernel.run(args)
        return None
    check_arguments(kernel, args)
    references = reference_outputs(args)   # before the run: outputs may alias operands
    kernel.run(args)
    report = check(args, references, rtol, atol, repr(kernel))
    if raise_on_mismatch and not report.ok:
        raise VerificationError(report)
    return report


def with_verify(run_method: Callable) -> Callable:
    """Give a kernel class's `run(self, args)` a `verify=False` keyword (and rtol, atol):

        class MyKernel(Kernel):
            @with_verify
            def run(self, args): ...
    """
    @functools.wraps(run_method)
    def wrapped(self, args, verify: bool = False, rtol: float | None = None, atol: float | None = None):
        if not verify:
            return run_method(self, args)
        references = reference_outputs(args)
        run_method(self, args)
        report = check(args, references, rtol, atol, repr(self))
        if not report.ok:
            raise VerificationError(report)
        return report
    return wrapped


def run_grouped(kernel, grouped, rtol: float | None = None, atol: float | None = None,
                raise_on_mismatch: bool = True) -> Report:
    """`kernel.run(grouped)`, then every output of every group checked as `run` checks one
    GEMM's, reported as one Report whose checks are named "group 2: D"."""
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


__all__ = ["run", "run_grouped", "with_verify", "VerificationError", "Report", "OutputCheck",
           "reference_outputs", "compare", "check", "default_tolerance"]
