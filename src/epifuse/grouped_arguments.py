"""The arguments of a grouped GEMM, checked: GroupedGemmArguments, a list of 2-D GEMMs with one
shared epilogue run together (every group's GemmArguments checked as a single call's, then
what the groups must share), and check_arguments, which names the arguments object a kernel
runs on."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .arguments import (
    GemmArguments,
    _dtype,
    _options,
    _role_name,
    _stand_in_note,
    bound_graph,
)
from .errors import EpilogueArgumentError, ShapeError
from .program import Program
from .ir import AXES, Operand
from .printing import statement_source
from .shapes import address, classify_operand, span


class GroupedGemmArguments:
    """A list of 2-D GEMMs with one shared epilogue, run together.

    Attributes the kernels read: `problems` (the GemmArguments, one per group), `graph` and
    `key` (the shared bound epilogue), `roles` (each operand's widest role), `device`,
    `reductions`, `largest_span` and the options every group shares (`accumulator_type`,
    `precision`, `accumulate`, `deterministic`, `compute_dtype`).
    """

    def __init__(self, problems: Sequence[GemmArguments]):
        if not isinstance(problems, (list, tuple)):
            raise EpilogueArgumentError(
                f"GroupedGemmArguments takes a list of GemmArguments, not {type(problems).__name__}.")
        if not problems:
            raise EpilogueArgumentError("GroupedGemmArguments needs at least one problem; the list is empty.")
        for i, p in enumerate(problems):
            if not isinstance(p, GemmArguments):
                raise EpilogueArgumentError(
                    f"Group {i} is a {type(p).__name__}, not GemmArguments.",
                    hint="Build each group with epifuse.GemmArguments(A, B, epilogue=...).")
        self.problems = tuple(problems)   # checked together once: not to be changed after
        first = self.problems[0]
        for i, p in enumerate(self.problems):
            if p.form != "real":
                raise EpilogueArgumentError(f"Group {i} is a {p.form} GEMM; grouped GEMMs take one accumulator.",
                                            hint=f"Run {p.form} GEMMs one at a time.")
            _check_two_dimensional(i, p)
            if i:
                _check_same_setup(i, p, first)
        self.roles = _widest_roles(self.problems)
        self.graph, self.key = _shared_graph(self.problems, self.roles)
        for i, p in enumerate(self.problems[1:], start=1):
            _check_same_tensors(i, p, first)
        _check_no_cross_group_overlap(self.problems)
        self.device = first.A.device
        self.accumulator_type = first.accumulator_type
        self.precision = first.precision
        self.accumulate = first.accumulate
        self.deterministic = first.deterministic
        self.compute_dtype = first.compute_dtype
        self.reductions = dict(first.reductions)
        self.largest_span = max(p.largest_span for p in self.problems)
        self.stand_in = any(p.stand_in for p in self.problems)
        self.planar = self.gated = False
        self.form = "real"

    def current(self) -> bool:
        """Whether every group's tensors are as they were checked (GemmArguments.current)."""
        return all(p.current() for p in self.problems)

    def check_current(self) -> bool:
        """GemmArguments.check_current for every group, and where memory moved, that no group's
        output now shares memory with another group's tensors. Nothing is recorded unless every group passes, so a refused run is refused again."""
        moved = [(p, p._moved_layouts()) for p in self.problems]
        moved = [(p, now) for p, now in moved if now is not None]
        if not moved:
            return False
        _check_no_cross_group_overlap(self.problems)
        for p, now in moved:
            p._accept(now)
        self.__dict__.pop("_plans", None)
        return True

    def __len__(self) -> int:
        return len(self.problems)

    def __iter__(self):
        return iter(self.problems)

    def __getitem__(self, index: int) -> GemmArguments:
        return self.problems[index]

    def __repr__(self) -> str:
        """The groups' sizes (M x N x K, the first few) and what they share, without tensor values."""
        first = self.problems[0]
        sizes = ", ".join(f"{p.M}x{p.N}x{p.K}" for p in self.problems[:4]) + (", ..." if len(self) > 4 else "")
        program = first.epilogue.program
        operands = ", ".join(f"{o.name}: {_role_name(o)}" for o in self.roles)
        outputs = ", ".join(f"{n}: {first._output_kind(n)} {_dtype(t.dtype)}" for n, t in first.outputs.items())
        return (f"GroupedGemmArguments({len(self)} groups [{sizes}] (M x N x K), A={_dtype(first.A.dtype)}, "
                f"B={_dtype(first.B.dtype)}, epilogue={program.name}({operands}) -> {outputs}, "
                f"accumulator={_dtype(self.accumulator_type)}, compute={_dtype(self.compute_dtype)}, "
                f"precision={self.precision!r}{_options(None, self.accumulate, self.deterministic)}"
                f"{_stand_in_note(self.stand_in)})")


# ---- what the groups must share ------------------------------------------------------------

def _check_two_dimensional(i: int, p: GemmArguments) -> None:
    if p.rank != 2:
        raise ShapeError(f"Group {i} is batched: A is {tuple(p.A.shape)} and B is {tuple(p.B.shape)}, "
                         f"so accum is {tuple(p.accum_shape)}; grouped GEMM problems are 2-D.",
                         hint="Pass each batch entry as a group of its own (A[l], B[l]).")


def _check_same_setup(i: int, p: GemmArguments, first: GemmArguments) -> None:
    """Device, input dtypes and options: one launch has one of each."""
    if p.A.device != first.A.device:
        raise ShapeError(f"Group {i} is on {p.A.device} but group 0 is on {first.A.device}; "
                         "all groups must be on one device.")
    for label in ("A", "B"):
        mine, theirs = getattr(p, label).dtype, getattr(first, label).dtype
        if mine != theirs:
            raise ShapeError(f"Group {i}: {label} is {mine} but group 0's {label} is {theirs}; "
                             "all groups must use the same dtypes.")
    for option in ("accumulator_type", "precision", "accumulate", "deterministic"):
        mine, theirs = getattr(p, option), getattr(first, option)
        if mine != theirs:
            raise EpilogueArgumentError(f"Group {i} has {option}={mine!r} but group 0 has {theirs!r}; "
                                        "all groups share one setting.")
    if p.compute_dtype != first.compute_dtype:
        raise EpilogueArgumentError(
            f"Group {i} computes in {p.compute_dtype} ({_compute_dtype_origin(p)}) but group 0 in "
            f"{first.compute_dtype} ({_compute_dtype_origin(first)}); all groups share one compute dtype.",
            hint="Pass the same compute_dtype to every group's EpilogueArguments.")


def _compute_dtype_origin(p: GemmArguments) -> str:
    """Where a group's compute dtype comes from: given, or the default for its inputs
    (default_compute_dtype: float64 where one of A, B and the tensor operands is)."""
    if p.epilogue.compute_dtype is not None:
        return f"compute_dtype={p.compute_dtype} is given"
    tensors = (("A", p.A), ("B", p.B), *((f"operand {n}", v) for n, v in p.operands.items()))
    wide = [label for label, t in tensors if isinstance(t, torch.Tensor) and t.dtype == torch.float64]
    if not wide:
        return "the default: none of A, B and its tensor operands is float64"
    return f"the default, as its {wide[0]} is torch.float64"


def _operand_roles(p: GemmArguments) -> dict[str, Operand]:
    """Every operand's role in this group (the bound graph keeps only the operands it reads)."""
    return {name: classify_operand(name, value, p.accum_shape, p.A.device)[0]
            for name, value in p.operands.items()}


def _widest_roles(problems: list[GemmArguments]) -> tuple[Operand, ...]:
    """Each operand's role for the shared kernel: the union of the axes it varies along in any
    group. A group where it varies along fewer axes is read with stride 0 along the others,
    which is exactly torch's broadcasting of that group's tensor."""
    first = problems[0]
    names = first.epilogue.program.operands
    outputs = [name for name, _ in first.epilogue.program.outputs]
    roles = _operand_roles(first)
    for i, p in enumerate(problems[1:], start=1):
        program = p.epilogue.program
        mine = [name for name, _ in program.outputs]
        if program.operands != names:
            raise EpilogueArgumentError(
                f"Group {i}'s epilogue takes the operands ({', '.join(program.operands)}) but group 0's "
                f"takes ({', '.join(names)}); all groups share one epilogue.")
        if mine != outputs:
            raise EpilogueArgumentError(
                f"Group {i}'s epilogue returns ({', '.join(mine)}) but group 0's returns "
                f"({', '.join(outputs)}); all groups share one epilogue.")
        for name, role in _operand_roles(p).items():
            shared = roles[name]
            if role.kind != shared.kind:
                raise EpilogueArgumentError(
                    f"Group {i}: operand {name} is a {_kind(role)} but group 0's is a {_kind(shared)}.",
                    hint="Numbers are passed once for the launch: pass a one-element tensor in "
                         "every group for a per-group scalar.")
            axes = tuple(a for a in AXES if a in shared.axes or a in role.axes)
            roles[name] = Operand(name, shared.kind, axes)
    return tuple(roles[name] for name in names)


def _kind(role: Operand) -> str:
    return "Python number" if role.kind == "number" else "tensor"


def _shared_graph(problems: list[GemmArguments], roles: tuple[Operand, ...]):
    """The epilogue bound to the widest roles; every group's must be the same graph."""
    graph, key = bound_graph(problems[0].epilogue.program, roles, 2)
    for i, p in enumerate(problems[1:], start=1):
        _, mine = bound_graph(p.epilogue.program, roles, 2)
        if mine != key:
            ours, theirs = _first_difference(p.epilogue.program, problems[0].epilogue.program)
            raise EpilogueArgumentError(
                f"Group {i}'s epilogue computes `{ours}` where group 0's computes `{theirs}`; all "
                "groups share one epilogue.",
                hint="Build every group's EpilogueArguments from the same function or string.")
    return graph, key


def _first_difference(program: Program, first: Program) -> tuple[str, str]:
    """The first line (a statement, or the return after the shorter body) in which two epilogues
    of the same operands and outputs but different graphs differ, as each spells it."""
    mine, theirs = _lines(program), _lines(first)
    for a, b in zip(mine, theirs):
        if a != b:
            return a, b
    return "; ".join(mine), "; ".join(theirs)   # lines equal, graphs not: show them whole


def _lines(program: Program) -> list[str]:
    return [*(statement_source(s.target, s.expr) for s in program.statements),
            "return " + ", ".join(name for name, _ in program.outputs)]


def _check_same_tensors(i: int, p: GemmArguments, first: GemmArguments) -> None:
    """Numbers equal; operand and output tensors of the same dtype in every group."""
    for name, value in p.operands.items():
        theirs = first.operands[name]
        if isinstance(value, torch.Tensor):
            if value.dtype != theirs.dtype:
                raise ShapeError(f"Group {i}: operand {name} is {value.dtype} but group 0's is "
                                 f"{theirs.dtype}; all groups must use the same dtypes.")
        elif not _same_number(value, theirs):
            raise EpilogueArgumentError(
                f"Group {i}: operand {name} = {value!r} but group 0 has {name} = {theirs!r}; a number "
                "operand is passed once for the launch, so it must be equal in every group.",
                hint=f"Pass {name} as a one-element tensor in every group to vary it per group.")
    for name, dest in p.outputs.items():
        theirs = first.outputs[name].dtype
        if dest.dtype != theirs:
            raise ShapeError(f"Group {i}: output {name} is {dest.dtype} but group 0's is {theirs}; "
                             "all groups must use the same dtypes.")


def _same_number(a, b) -> bool:
    """Equal, with the same sign (-0.0 is not 0.0: 1 / x tells them apart), or both NaN."""
    a, b = float(a), float(b)
    return (a == b and math.copysign(1.0, a) == math.copysign(1.0, b)) or (math.isnan(a) and math.isnan(b))


def _check_no_cross_group_overlap(problems: list[GemmArguments]) -> None:
    """One launch runs every group at once: an output of one group must not share memory with
    any tensor of another (each GemmArguments already checked its own). Intervals sorted by
    start, so only neighbours in address order are compared."""
    spans = []
    for i, p in enumerate(problems):
        tensors = [("A", p.A, False), ("B", p.B, False),
                   *((n, t, False) for n, t in p.operands.items() if isinstance(t, torch.Tensor)),
                   *((n, t, True) for n, t in p.outputs.items())]
        for name, t, written in tensors:
            if t.numel():
                memory, start = address(t)
                spans.append((memory, start, start + span(t) * t.element_size(), i, name, written))
    spans.sort()
    open_spans: list[tuple] = []
    for current in spans:
        open_spans = [s for s in open_spans if s[0] == current[0] and s[2] > current[1]]
        for other in open_spans:
            if other[3] != current[3] and (other[5] or current[5]):
                raise ShapeError(f"Group {other[3]}'s {other[4]} and group {current[3]}'s {current[4]} "
                                 "share memory, and one of them is an output; groups run at once.",
                                 hint="Give every group its own output tensors.")
        open_spans.append(current)


def check_arguments(kernel, args, grouped: bool = False) -> None:
    """A clear error where `args` is not the arguments object `kernel` runs on."""
    expected = GroupedGemmArguments if grouped else GemmArguments
    if not isinstance(args, expected):
        raise EpilogueArgumentError(f"{kernel!r} runs on {expected.__name__}, not on {type(args).__name__}.",
                                    hint=f"Pass the {expected.__name__} the kernel was chosen for.")
