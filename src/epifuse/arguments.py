"""What a GEMM call is made of, checked: EpilogueArguments and GemmArguments.

    epi = EpilogueArguments(fn_or_string, alpha=3.0, C=C, D=D, F=F)
    args = GemmArguments(A=A, B=B, out=D, accumulator_type=torch.float32, epilogue=epi)

Everything a user can get wrong is checked here, before any kernel compiles or any output is
touched, and raised as an EpilogueError subclass that names the problem. A GemmArguments holds
the bound, optimized Graph (`graph`, with its canonical hash `key`), each tensor's strides per
accum axis, and `signature`: everything a kernel's support and choice can depend on, the key
of the kernel memo. Grouped GEMMs' arguments are grouped_arguments.py's; the outputs epifuse
allocates, allocation.py's.
"""
from __future__ import annotations

import difflib
import math
import os
import threading
from typing import Any, Callable

import torch

from .activations import activation_source, is_activation_name, named_activation
from .binding import bind
from .errors import EpilogueArgumentError, ShapeError, did_you_mean, flag
from .frontend import parse
from .program import Program
from .ir import ACCUM_IMAG, AXES, Graph, Operand, joined_shape
from .passes import canonical_hash, optimize
from .shapes import (
    accum_shape_of,
    accumulator_types,
    check_tensor,
    classify_operand,
    is_stand_in,
    misalignment,
    output_strides,
    overlaps,
    same_view,
    span,
)

# environment variables that change which kernels run or which is chosen
_CHOICE_ENVIRONMENT = ("TRITON_INTERPRET", "EPIFUSE_TUNE")

IDENTITY_EPILOGUE = "def identity(accum):\n    D = accum\n    return D\n"


def epilogue_program(epilogue: Callable | str | Program | None) -> Program:
    """The Program of an epilogue as every entry point takes one: a Program as it is; None the
    identity (`D = accum`); a bare activation name, any of activations.ACTIVATIONS ("gelu",
    "relu_squared"), `D = act(accum)`, as FusedLinear(epilogue=...) without a bias; a function
    or a string holding one `def`, parsed (never run)."""
    if isinstance(epilogue, Program):
        return epilogue
    if epilogue is None:
        return parse(IDENTITY_EPILOGUE)
    if is_activation_name(epilogue):
        name = epilogue.strip()
        return parse(activation_source(named_activation(name), bias=False, name=name))
    return parse(epilogue)


def check_keywords(program: Program, tensors: dict, required, allowed) -> None:
    """Every name in `required` is a keyword of `tensors` and every keyword is in `allowed`; else
    an EpilogueArgumentError naming the first that is not (and a passed keyword it looks like)."""
    missing = [name for name in required if name not in tensors]
    unexpected = [name for name in tensors if name not in allowed]
    if missing:
        name = missing[0]
        places = {**dict(zip(program.params, program.param_locs)), **dict(program.outputs)}
        role = "an operand" if name in program.operands else "an output tensor"
        hint = f"Pass {name}=... ({role})."
        close = difflib.get_close_matches(name, unexpected, n=1, cutoff=0.6)
        if close:
            hint += f" The keyword {close[0]!r} you passed looks like a misspelling of it."
        raise EpilogueArgumentError(
            f"Argument {name} is not provided in the kwargs of the EpilogueArguments constructor",
            places.get(name), hint)
    if unexpected:
        raise EpilogueArgumentError(f"Unexpected keyword argument '{unexpected[0]}'",
                                    hint=did_you_mean(unexpected[0], allowed) or
                                    f"The epilogue's operands and outputs are: {', '.join(allowed)}.")


class EpilogueArguments:
    """An epilogue and the tensors and numbers its names refer to.

    The epilogue is a function, a string holding one `def`, a parsed Program, or an
    activation's name ("gelu": `D = gelu(accum)`; see epilogue_program). Keyword arguments name every operand (the function's parameters other than accum) and
    every output (each returned name). Options: `accumulate=True` folds reduction results into
    what the destinations hold; `deterministic=True` asks for run-to-run identical reductions;
    `compute_dtype` is the type the epilogue math runs in: torch.float32 or torch.float64; by
    default (None) the promoted dtype of the inputs, never narrower (see `default_compute_dtype`),
    which GemmArguments decides once it has A and B.
    """

    def __init__(self, epilogue: Callable | str | Program, /, *, accumulate: bool = False,
                 deterministic: bool = False, compute_dtype: torch.dtype | None = None,
                 **tensors: Any):
        self.program = epilogue_program(epilogue)
        self.accumulate = flag("accumulate", accumulate)
        self.deterministic = flag("deterministic", deterministic)
        self.compute_dtype = compute_dtype
        program = self.program
        expected = list(program.operands) + [name for name, _ in program.outputs]
        check_keywords(program, tensors, required=expected, allowed=expected)
        self.operands = {n: tensors[n] for n in program.operands}
        self.outputs = {n: tensors[n] for n, _ in program.outputs}
        for name, value in self.outputs.items():
            if not isinstance(value, torch.Tensor):
                raise EpilogueArgumentError(
                    f"Output {name} must be a torch.Tensor, but got {type(value).__name__}.")
            _check_not_tracked_by_autograd(name, value)
        for name, value in self.operands.items():
            if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
                raise EpilogueArgumentError(
                    f"Operand {name} must be a number or a torch.Tensor, but got {type(value).__name__}.")
            if isinstance(value, torch.Tensor) and (value.is_complex() or value.dtype == torch.bool):
                raise EpilogueArgumentError(f"Operand {name} has dtype {value.dtype}; use a real "
                                            "floating-point or integer tensor.")

    def __repr__(self) -> str:
        program = self.program
        values = ", ".join(f"{n}={_describe_value(v)}" for n, v in {**self.operands, **self.outputs}.items())
        options = _options(self.compute_dtype, self.accumulate, self.deterministic)
        return (f"EpilogueArguments({program.name}({', '.join(program.params)}) -> "
                f"{', '.join(n for n, _ in program.outputs)}; {values}{options})")


def _check_not_tracked_by_autograd(name: str, output: torch.Tensor) -> None:
    """Kernels write outputs in place, behind autograd's back; as with torch's out=, an output
    that requires grad is refused while grad mode is on (torch.no_grad() allows it)."""
    if output.requires_grad and torch.is_grad_enabled():
        raise EpilogueArgumentError(
            f"Output {name} requires grad: epifuse writes outputs in place, which autograd cannot "
            "track (and torch forbids writing in place into a leaf that requires grad).",
            hint=f"For differentiable outputs call epifuse.gemm(A, B, epilogue, ...) without passing "
                 f"{name}; to just fill the tensor, pass {name}.detach() or build the arguments "
                 "under torch.no_grad().")


_BIND_CACHE: dict[tuple, tuple[Program, Graph, str]] = {}
_BIND_LOCK = threading.Lock()


def bound_graph(program: Program, roles: tuple[Operand, ...], rank: int,
                in_tile: bool = False) -> tuple[Graph, str]:
    """The optimized Graph of `program` with operands in `roles` over a rank-`rank` accum, and
    its canonical hash; bound once per program object, roles, rank and `in_tile` (whether a
    reduction over N may feed later math: binding.bind)."""
    key = (id(program), roles, rank, in_tile)
    hit = _BIND_CACHE.get(key)
    if hit is not None and hit[0] is program:
        return hit[1], hit[2]
    graph = optimize(bind(program, {o.name: o for o in roles}, rank, in_tile))
    entry = (program, graph, canonical_hash(graph))
    with _BIND_LOCK:
        _BIND_CACHE[key] = entry
    return entry[1], entry[2]


class GemmArguments:
    """A GEMM `accum = A @ B` and its epilogue, bound and checked.

    A is (M, K) or (L, M, K); B is (K, N) or (L, K, N); either may be 2-D while the other is
    batched (it is then shared across L). `out` is the main output (the epilogue's D); without
    an epilogue, `D = accum` is stored into `out`.

    The arguments may be run again and again: a kernel reads the tensors' contents at each run,
    and first compares every tensor's sizes, strides and address with those they were checked
    with (`current`): a tensor resized or re-strided since (`resize_`, `set_`, `t_()`) is
    refused, one whose memory moved is checked again (`check_current`). Built from fake or meta
    tensors they plan and compile kernels, which then run on arguments of real tensors.
    """

    def __init__(self, A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None = None,
                 accumulator_type: torch.dtype | None = None,
                 epilogue: EpilogueArguments | None = None, precision: str = "default", *,
                 A_imag: torch.Tensor | None = None, B_imag: torch.Tensor | None = None):
        if epilogue is not None and not isinstance(epilogue, EpilogueArguments):
            raise EpilogueArgumentError(
                f"GemmArguments' epilogue must be an EpilogueArguments, not {type(epilogue).__name__}.",
                hint="Wrap it with its tensors: epilogue=EpilogueArguments(epi, C=C, D=D).")
        if out is not None and not isinstance(out, torch.Tensor):
            raise EpilogueArgumentError(f"`out` must be a torch.Tensor, but got {type(out).__name__}.")
        if epilogue is None:
            if out is None:
                raise EpilogueArgumentError("GemmArguments needs `out` or an `epilogue`.")
            epilogue = EpilogueArguments(IDENTITY_EPILOGUE, D=out)
        elif out is not None and "D" not in epilogue.outputs:
            names = ", ".join(epilogue.outputs)
            raise EpilogueArgumentError(
                f"`out` is the epilogue's output D, but this epilogue returns {names} and no D, so "
                "nothing would be written to it.",
                hint="Pass the output tensors by name to EpilogueArguments, and leave out `out`.")
        elif out is not None and epilogue.outputs["D"] is not out:
            raise EpilogueArgumentError("`out` and the epilogue's output D are different tensors.",
                                        hint="Pass the same tensor as out=D and D=... (or leave out `out`).")
        if precision not in ("default", "highest"):
            raise EpilogueArgumentError(f"precision must be 'default' or 'highest', got {precision!r}.")
        self.A_imag, self.B_imag = A_imag, B_imag
        self.planar = _check_planes(A, B, A_imag, B_imag)
        self.gated = "accum_up" in epilogue.program.params
        self.B_given, self.B_up = B, None   # B as passed: a gated GEMM's both halves
        if self.gated:   # accum.chunk(2, dim=-1): B's columns in two halves, each a GEMM of its own
            if self.planar:
                raise EpilogueArgumentError("A planar complex GEMM cannot also chunk accum into gated halves.")
            B, self.B_up = _halves(B)
        self.A, self.B = A, B
        self.out = out
        self.epilogue = epilogue
        if accumulator_type is None:
            accumulator_type = torch.float32 if not isinstance(A, torch.Tensor) or A.is_floating_point() \
                else torch.int32
        self.accumulator_type = accumulator_type
        self.precision = precision
        self.accumulate = epilogue.accumulate
        self.deterministic = epilogue.deterministic
        self.compute_dtype = epilogue.compute_dtype if epilogue.compute_dtype is not None \
            else default_compute_dtype(A, B, *epilogue.operands.values())
        self.accum_shape, (self.L, self.M, self.N, self.K) = accum_shape_of(A, B)
        self.rank = len(self.accum_shape)
        self.a_strides = _gemm_strides(A)
        self.b_strides = _gemm_strides(B)
        self._check_accumulator()
        roles, self.strides = [], {}
        self.operands = {}
        for name, value in epilogue.operands.items():
            role, strides = classify_operand(name, value, self.accum_shape, A.device)
            roles.append(role)
            self.operands[name] = value
            self.strides[name] = strides
        self.roles = tuple(roles)
        self.graph, self.key = bound_graph(epilogue.program, self.roles, self.rank, in_tile=True)
        if not self.planar and any(node.op is ACCUM_IMAG for node in self.graph.nodes()):
            raise EpilogueArgumentError(
                "The epilogue reads the imaginary part of a planar complex accumulator (accum_imag), and "
                "this GEMM is real.", hint="Pass A_imag= and B_imag= (or call epifuse.gemm_planar_complex).")
        self.outputs = dict(epilogue.outputs)
        self.reductions = {}
        for out_ in self.graph.outputs:
            dest = self.outputs[out_.name]
            reduction = out_.node.op if out_.node.op.is_reduction else None
            if reduction is not None:
                self.reductions[out_.name] = reduction.name
            shape = self.accum_shape
            if out_.node.op.kind == "join":   # cat((a, b), dim=-1) of the halves: B's whole width
                shape = joined_shape(shape)
                if isinstance(dest, torch.Tensor) and tuple(dest.shape) != shape:
                    raise ShapeError(f"Output {out_.name} is cat((a, b), dim=-1) of two tiles of the gated half "
                                     f"width {self.N}, so its shape is {shape} (the width of B's {2 * self.N} "
                                     f"columns), but the tensor passed has shape {tuple(dest.shape)}.",
                                     hint=f"Pass a tensor of shape {shape}, or leave {out_.name} out to have "
                                          "epifuse.gemm allocate it.")
            self.strides[out_.name] = output_strides(
                out_.name, dest, shape, A.device,
                out_.node.dims if reduction else None, reduction)
        self._check_aliasing()
        self._labeled = (("A", A), ("B", B), *self._second_inputs(),
                         *((f"Operand {n}", v) for n, v in self.operands.items() if isinstance(v, torch.Tensor)),
                         *((f"Output {n}", t) for n, t in self.outputs.items()))
        tensors = [t for _, t in self._labeled]
        self.largest_span = max(span(t) for t in tensors)
        # planning stand-ins (meta, fake tensors): kernels are chosen and compiled, never run
        self.stand_in = any(is_stand_in(t) for t in tensors)
        self._built = self._layouts()

    def __repr__(self) -> str:
        """What the call is, without tensor values: sizes, dtypes, the epilogue with each
        operand's role and each output's kind, the options."""
        sizes = (f"L={self.L}, " if self.rank == 3 else "") + f"M={self.M}, N={self.N}, K={self.K}"
        roles = {role.name: role for role in self.roles}
        operands = ", ".join(f"{n}: {_role_name(roles[n])} {_describe_value(v)}" for n, v in self.operands.items())
        outputs = ", ".join(f"{n}: {self._output_kind(n)} {_describe_value(t)}" for n, t in self.outputs.items())
        device = "" if self.stand_in or self.A.device.type == "cpu" else f", device={self.A.device}"
        planes = (f", planar complex (A_imag={_describe_value(self.A_imag)}, "
                  f"B_imag={_describe_value(self.B_imag)})") if self.planar else \
            ", gated (B is the first half of B's columns, B_up the second)" if self.gated else ""
        return (f"GemmArguments({sizes}, A={_describe_value(self.A)}, B={_describe_value(self.B)}{planes}, "
                f"epilogue={self.epilogue.program.name}({operands}) -> {outputs}, "
                f"accumulator={_dtype(self.accumulator_type)}, compute={_dtype(self.compute_dtype)}, "
                f"precision={self.precision!r}{device}"
                f"{_options(None, self.accumulate, self.deterministic)}{_stand_in_note(self.stand_in)})")

    @property
    def form(self) -> str:
        """The GEMM's accumulators: "real" (one), "planar" (complex: real and imaginary
        parts), "gated" (the two halves of B's columns)."""
        return "planar" if self.planar else "gated" if self.gated else "real"

    def _second_inputs(self) -> tuple:
        """The inputs of the second accumulator, by label: the imaginary planes of a planar
        complex GEMM, the second half of B's columns of a gated one."""
        if self.planar:
            return (("A_imag", self.A_imag), ("B_imag", self.B_imag))
        return (("B_up", self.B_up),) if self.gated else ()

    def _output_kind(self, name: str) -> str:
        op = self.reduction_op(name)
        if op is None:
            return "tile"
        axes = AXES[3 - self.rank:]
        dims = [axes.index(a) for a in self.graph.output(name).node.params["dim"]]
        over = "all dims" if len(dims) == self.rank else \
            f"dim={dims[0]}" if len(dims) == 1 else f"dim={tuple(dims)}"
        return f"{op.name} over {over}"

    # ---- the tensors since these arguments were built -------------------------------------------
    def _layouts(self) -> list:
        if self.stand_in:   # no addresses
            return [(None, t.shape, t.stride(), t.dtype, t.device) for _, t in self._labeled]
        return [(t.data_ptr(), t.shape, t.stride(), t.dtype, t.device) for _, t in self._labeled]

    def current(self) -> bool:
        """Whether every tensor has the sizes, strides and address it had when these arguments
        were checked: the cheap test before a kept launch."""
        return self._layouts() == self._built

    def check_current(self) -> bool:
        """Raise ShapeError where a tensor was resized or re-strided since these arguments were
        built (`resize_`, `set_`, an in-place view op): M, N, K, the strides and every check
        were of the old sizes, and a kernel would index past the tensor. A tensor whose memory
        moved (its storage reallocated, freed) is checked again (its storage holds it, its 16-byte
        alignment, which the kernel was chosen and compiled for, is the same, and no output
        overlaps another tensor); True then, and the plans kernels made for these arguments, which
        hold the old addresses, are dropped here, whichever kernel asked."""
        now = self._moved_layouts()
        if now is None:
            return False
        self._accept(now)
        return True

    def _moved_layouts(self) -> list | None:
        """None where every tensor is as it was built; else the layouts now, once every check of
        check_current passed on them (nothing is recorded: _accept does that)."""
        now = self._layouts()
        if now == self._built:
            return None
        for (label, t), (ptr, shape, strides, dtype, device), (new_ptr, *_) in zip(self._labeled, self._built, now):
            if t.dtype != dtype or t.device != device:
                raise ShapeError(f"{label} is {t.dtype} on {t.device} now, but was {dtype} on {device} when "
                                 "these GemmArguments were built (`.data =` or `set_` since): the kernel "
                                 "was chosen and compiled for the old one.",
                                 hint="Build new GemmArguments for the tensor as it is now.")
            if t.shape != shape or t.stride() != strides:
                raise ShapeError(f"{label} has shape {tuple(t.shape)} and strides {t.stride()} now, but "
                                 f"{tuple(shape)} and {strides} when these GemmArguments were built "
                                 "(resize_, set_ or an in-place view op since): a kernel would index it "
                                 "with the old ones.",
                                 hint="Build new GemmArguments for the new sizes.")
            check_tensor(label, t)
            if new_ptr is not None and new_ptr % 16 != ptr % 16:
                raise ShapeError(f"{label} moved to memory of another 16-byte alignment since these "
                                 "GemmArguments were built; the kernels were chosen for the old one.",
                                 hint="Build new GemmArguments for the tensor as it is now.")
        self._check_aliasing()
        return now

    def _accept(self, now: list) -> None:
        self._built = now
        self.__dict__.pop("_plans", None)

    def _check_accumulator(self) -> None:
        A, B = self.A, self.B
        if A.dtype.is_floating_point != B.dtype.is_floating_point:
            raise ShapeError(f"A is {A.dtype} and B is {B.dtype}: both must be floating point or both integer.")
        allowed = accumulator_types(A.dtype, B.dtype)
        if self.accumulator_type not in allowed:
            inputs = A.dtype if A.dtype == B.dtype else f"{A.dtype} x {B.dtype}"
            raise ShapeError(f"accumulator_type {self.accumulator_type} does not fit {inputs} inputs; "
                             f"use {' or '.join(str(t) for t in allowed)}.")
        if self.compute_dtype not in (torch.float32, torch.float64):
            raise ShapeError(f"compute_dtype must be torch.float32 or torch.float64, got {self.compute_dtype}.")

    def _check_aliasing(self) -> None:
        outs = list(self.outputs.items())
        inputs = (("A", self.A), ("B", self.B), *self._second_inputs())
        for i, (name, dest) in enumerate(outs):
            for label, t in inputs:
                if overlaps(dest, t):
                    raise ShapeError(f"Output {name} overlaps the GEMM input {label}.",
                                     hint="Write the epilogue's outputs to separate tensors.")
            for other, t in outs[i + 1:]:
                if overlaps(dest, t):
                    raise ShapeError(f"Outputs {name} and {other} overlap in memory.")
            for op_name, value in self.operands.items():
                if isinstance(value, torch.Tensor) and overlaps(dest, value):
                    if not same_view(dest, value) or name in self.reductions:
                        raise ShapeError(f"Output {name} partly overlaps operand {op_name}.",
                                         hint="An output may alias an operand only as the very same "
                                              "view (an in-place update such as D = C).")

    @property
    def signature(self) -> tuple:
        """Everything that decides which kernels support these arguments and which of them is
        chosen: the bound epilogue, every tensor's shape, strides, dtype, device and 16-byte
        alignment, the options, and the environment variables that change the choice. Number
        operands enter by kind only: no kernel's support or speed depends on their values."""
        sig = self.__dict__.get("_signature")
        if sig is None:
            tensors = [("A", self.A), ("B", self.B), *self._second_inputs(), *self.operands.items(),
                       *self.outputs.items()]
            sig = (self.key, self.rank, self.accumulator_type, self.precision, self.accumulate,
                   self.deterministic, self.compute_dtype,
                   tuple((name, tuple(t.shape), t.stride(), t.dtype, t.device, misalignment(t) == 0)
                         if isinstance(t, torch.Tensor) else (name, "number")
                         for name, t in tensors),
                   tuple(os.environ.get(v) for v in _CHOICE_ENVIRONMENT))
            self.__dict__["_signature"] = sig
        return sig

    def reduction_op(self, name: str):
        """The reduction OpDef of output `name`, or None for a tile output."""
        node = self.graph.output(name).node
        return node.op if node.op.is_reduction else None

    def reduced_count(self, name: str) -> int:
        """How many elements one value of reduction output `name` folds together."""
        dims = next(o.node.params["dim"] for o in self.graph.outputs if o.name == name)
        sizes = dict(zip(AXES, (self.L, self.M, self.N)))
        return math.prod(sizes[a] for a in dims)


PLANE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_planes(A, B, A_imag, B_imag) -> bool:
    """Whether the GEMM is planar complex (A_imag and B_imag given), once its planes are checked:
    each imaginary plane is a floating-point tensor of its real plane's shape, dtype, device and
    strides (the kernel walks both with one set of strides)."""
    if A_imag is None and B_imag is None:
        return False
    for label, t in (("A", A), ("B", B)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{label} must be a torch.Tensor, but got {type(t).__name__}.")
    if A_imag is None or B_imag is None:
        given, missing = ("A_imag", "B_imag") if B_imag is None else ("B_imag", "A_imag")
        raise EpilogueArgumentError(f"{given} is given and {missing} is not: a planar complex GEMM needs "
                                    "the imaginary planes of both A and B.",
                                    hint=f"Pass {missing}= too (zeros for a real factor).")
    for label, real, plane in (("A", A, A_imag), ("B", B, B_imag)):
        if not isinstance(plane, torch.Tensor):
            raise EpilogueArgumentError(f"{label}_imag must be a torch.Tensor, but got {type(plane).__name__}.")
        if real.dtype not in PLANE_DTYPES:
            raise ShapeError(f"{label} is {real.dtype}; a planar complex GEMM takes planes of "
                             "float16, bfloat16, float32 or float64.")
        differs = [what for what, a, b in (("shape", tuple(real.shape), tuple(plane.shape)),
                                           ("dtype", real.dtype, plane.dtype),
                                           ("device", real.device, plane.device),
                                           ("strides", real.stride(), plane.stride())) if a != b]
        if differs:
            raise ShapeError(f"{label}_imag and {label} differ in {' and '.join(differs)} "
                             f"({label}: {tuple(real.shape)} {real.dtype} on {real.device}, strides {real.stride()}; "
                             f"{label}_imag: {tuple(plane.shape)} {plane.dtype} on {plane.device}, strides "
                             f"{plane.stride()}): the kernel walks both planes with one set of strides.",
                             hint=f"Make both planes alike, e.g. {label}.contiguous() and {label}_imag.contiguous().")
    return True


def _halves(B) -> tuple:
    """B's columns as the gate and up halves of a gated GEMM (views)."""
    if not isinstance(B, torch.Tensor):
        raise ShapeError(f"B must be a torch.Tensor, but got {type(B).__name__}.")
    if B.dim() not in (2, 3) or B.shape[-1] % 2:
        raise ShapeError(f"A gated epilogue (accum.chunk(2, dim=-1)) splits B's columns into two halves, and B "
                         f"has shape {tuple(B.shape)}: its last dimension must be even.",
                         hint="Pass the merged [gate | up] weight: gate's columns first, then up's.")
    half = B.shape[-1] // 2
    return B[..., :half], B[..., half:]


def _gemm_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, row, column) strides; batch 0 when the operand is shared across L."""
    if t.dim() == 3:
        return (t.stride(0) if t.shape[0] > 1 else 0, t.stride(1), t.stride(2))
    return (0, t.stride(0), t.stride(1))


# ---- reprs: what a call is, never a tensor's values -------------------------------------------

_ROLE_NAMES = {(): "scalar", ("N",): "row", ("M",): "column", ("M", "N"): "tile", ("L",): "per-batch scalar",
               ("L", "N"): "per-batch row", ("L", "M"): "per-batch column", ("L", "M", "N"): "tile"}


def _role_name(role: Operand) -> str:
    return "number" if role.kind == "number" else _ROLE_NAMES[role.axes]


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe_value(value) -> str:
    """A number as it is; a tensor by dtype and shape (and meta or fake), never its values."""
    if not isinstance(value, torch.Tensor):
        return repr(value)
    kind = "" if not is_stand_in(value) else " meta" if value.is_meta else " fake"
    return f"{_dtype(value.dtype)}[{', '.join(str(s) for s in value.shape)}]{kind}"


def _options(compute_dtype, accumulate: bool, deterministic: bool) -> str:
    """The options that differ from their defaults, as keywords."""
    shown = [f"compute_dtype={_dtype(compute_dtype)}"] if compute_dtype is not None else []
    shown += [f"{name}=True" for name, on in (("accumulate", accumulate), ("deterministic", deterministic)) if on]
    return "".join(", " + s for s in shown)


def _stand_in_note(stand_in: bool) -> str:
    return ", stand-ins (fake or meta tensors: to plan and compile from, not to run on)" if stand_in else ""


# ---- the compute dtype a call that names none takes ----------------------------------------

def default_compute_dtype(*inputs) -> torch.dtype:
    """The compute dtype of a call that names none: never narrower than the promoted dtype of
    the tensors among `inputs` (A, B and the tensor operands; numbers do not promote). That is
    float64 where one of them is float64 (nothing promotes past it; torch.promote_types is not
    asked, as it refuses fp8), else float32."""
    wide = any(isinstance(value, torch.Tensor) and value.dtype == torch.float64 for value in inputs)
    return torch.float64 if wide else torch.float32


def check_real(args) -> None:
    """A ShapeError where `args` (single or grouped) hold fake or meta tensors: kernels are
    chosen and compiled from those, never run on them."""
    if args.stand_in:
        raise ShapeError("These arguments hold fake or meta tensors, which have no memory to compute "
                         "on: kernels are chosen and compiled from them, not run on them.",
                         hint="Build the arguments from real tensors of the same metadata and run the "
                              "kernel on those.")
