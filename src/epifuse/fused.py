"""Class-based epilogues: subclass `FusedGemm` and define `epilogue`.

    class AlphaBetaX(epifuse.FusedGemm):
        def epilogue(self, accum, C, X, alpha, beta, x_factor):
            D = alpha * accum + beta * C + x_factor * X
            return D

    op = AlphaBetaX()
    D = op(A, B, C=C, X=X, alpha=1.0, beta=0.5, x_factor=2.0)

The method is parsed when the class is defined (never executed by epifuse; errors point at the
class's file and line; where Python keeps no source, as in `python -c`, `epilogue` may be the
method's source as a string) and becomes an ordinary epilogue: `self` is dropped and may not be used
in the body, the other parameters are the operands, the returned names the outputs. Calling the
op runs `epifuse.gemm`, so outputs not passed are allocated, autograd and torch.compile work,
and the kernel is tuned. Because the method is plain Python over torch ops, calling
`op.epilogue(A @ B, C, X, ...)` yourself is its eager reference.

Options given to the constructor apply to every call: `out_dtype`, `compute_dtype` (default:
the promoted dtype of the inputs, as for `epifuse.gemm`), `precision`, `deterministic`,
`accumulate`.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from .api import gemm
from .allocation import allocate_outputs
from .arguments import EpilogueArguments, GemmArguments, epilogue_program
from .errors import EpilogueArgumentError, EpilogueSyntaxError, did_you_mean
from .frontend import parse
from .program import Program, names_used
from .printing import program_source


def drop_self(program: Program, owner: str) -> Program:
    """The method's Program without its first parameter, which the body may not read."""
    if not program.params or program.params[0] == "accum":
        loc = program.param_locs[0] if program.param_locs else None
        raise EpilogueSyntaxError(f"{owner}.epilogue must take self first: "
                                  "def epilogue(self, accum, ...).", loc,
                                  hint="Or make it a @staticmethod.")
    me = program.params[0]
    for name, loc in names_used(program):
        if name == me:
            raise EpilogueSyntaxError(f"'{me}' cannot be used inside {owner}.epilogue: it is parsed, "
                                      "not run, so attributes of the op are not visible.", loc,
                                      hint="Make the value a parameter of epilogue and pass it when calling the op.")
    for name, loc in program.outputs:
        if name == me:
            raise EpilogueSyntaxError(f"{owner}.epilogue cannot return '{me}'.", loc)
    return dataclasses.replace(program, params=program.params[1:], param_locs=program.param_locs[1:])


def method_program(cls: type) -> Program:
    """Parse `cls.epilogue` (a method or a staticmethod) into the epilogue's Program."""
    raw = inspect.getattr_static(cls, "epilogue")
    if isinstance(raw, str):   # the method's source (for classes whose source is unreadable), or an activation's name
        program = epilogue_program(raw)
        if program.params and program.params[0] != "accum":
            program = drop_self(program, cls.__name__)
        return dataclasses.replace(program, name=cls.__name__)
    if isinstance(raw, classmethod):
        raise EpilogueSyntaxError(f"{cls.__name__}.epilogue cannot be a classmethod.",
                                  hint="Define it as def epilogue(self, accum, ...).")
    fn = raw.__func__ if isinstance(raw, staticmethod) else raw
    try:
        program = parse(fn)
    except EpilogueSyntaxError as exc:
        if exc.message.startswith("Cannot read the source"):
            raise EpilogueSyntaxError(exc.message, hint=(
                f"Define {cls.__name__} in a file, or give its source as a string: "
                "epilogue = \"def epilogue(self, accum, ...): ...\".")) from None
        me = next(iter(inspect.signature(fn).parameters), None) if callable(fn) else None
        loc = exc.loc
        if me and not isinstance(raw, staticmethod) and loc is not None \
                and loc.source_line[loc.col:].startswith(f"{me}."):
            raise EpilogueSyntaxError(
                f"'{me}' cannot be used inside {cls.__name__}.epilogue: it is parsed, not run, so "
                "attributes of the op are not visible.", loc,
                "Make the value a parameter of epilogue and pass it when calling the op.") from None
        raise
    if not isinstance(raw, staticmethod):
        program = drop_self(program, cls.__name__)
    return dataclasses.replace(program, name=cls.__name__)


class FusedGemm:
    """A GEMM with the epilogue its subclass defines. See the module docstring.

    Class attributes set when a subclass is defined: `program` (the parsed epilogue), `source`
    (its text, accepted wherever an epilogue is), `operands`, `outputs`. A subclass may set
    `roles = {"alpha": "number", "bias": "row", ...}` for the pictures of `epifuse show`.
    """

    program: Program | None = None
    source: str | None = None
    operands: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    roles: dict = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "epilogue" not in cls.__dict__:
            return   # an intermediate base class; its subclasses define the epilogue
        cls.program = method_program(cls)
        cls.source = program_source(cls.program)
        cls.operands = cls.program.operands
        cls.outputs = tuple(n for n, _ in cls.program.outputs)

    def __init__(self, *, out_dtype: torch.dtype | None = None, compute_dtype: torch.dtype | None = None,
                 precision: str = "default", deterministic: bool = False, accumulate: bool = False):
        if type(self).program is None:
            raise TypeError(f"{type(self).__name__} defines no epilogue: subclass FusedGemm and write "
                            "def epilogue(self, accum, ...).")
        self.options = dict(out_dtype=out_dtype, compute_dtype=compute_dtype, precision=precision,
                            deterministic=deterministic, accumulate=accumulate)

    def epilogue(self, accum, *operands):  # pragma: no cover - the subclass's method is parsed instead
        raise NotImplementedError

    def _check(self, tensors: dict) -> None:
        """Missing operands and unknown keywords, reported at the method's own lines."""
        program = type(self).program
        places = dict(zip(program.params, program.param_locs))
        for name in program.operands:
            if name not in tensors:
                hint = f"Pass {name}=... when calling {type(self).__name__}."
                close = did_you_mean(name, [k for k in tensors if k not in program.operands])
                raise EpilogueArgumentError(
                    f"Argument {name} is not provided in the kwargs of the EpilogueArguments constructor",
                    places.get(name), hint + (" " + close if close else ""))
        known = set(program.operands) | set(self.outputs)
        for name in tensors:
            if name not in known:
                raise EpilogueArgumentError(f"Unexpected keyword argument '{name}'",
                                            hint=did_you_mean(name, known) or
                                            f"{type(self).__name__} takes: {', '.join(sorted(known))}.")

    def __call__(self, A: torch.Tensor, B: torch.Tensor, **tensors) -> Any:
        """Run the fused GEMM; returns the outputs in return order (one output: the tensor).
        Outputs passed as keywords are written in place; the others are allocated."""
        self._check(tensors)
        return gemm(A, B, type(self).source, **self.options, **tensors)

    def arguments(self, A: torch.Tensor, B: torch.Tensor, *, accumulator_type=torch.float32, **tensors):
        """GemmArguments for `epifuse.get_kernels` / `kernel.run`; missing outputs are allocated."""
        self._check(tensors)
        o = self.options
        tensors = allocate_outputs(type(self).program, A, B, tensors, o["out_dtype"], o["compute_dtype"],
                                   o["accumulate"])
        epi = EpilogueArguments(type(self).program, accumulate=o["accumulate"],
                                deterministic=o["deterministic"], compute_dtype=o["compute_dtype"],
                                **tensors)
        return GemmArguments(A, B, out=tensors.get("D"), accumulator_type=accumulator_type,
                             epilogue=epi, precision=o["precision"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self.operands)}) -> {', '.join(self.outputs)}"


__all__ = ["FusedGemm", "method_program", "drop_self"]
