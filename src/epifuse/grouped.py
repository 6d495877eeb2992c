"""Grouped GEMM: many problems of different sizes, one epilogue, one launch.

    problems = [GemmArguments(A_i, B_i, epilogue=EpilogueArguments(epi, bias=bias_i, D=D_i))
                for A_i, B_i, bias_i, D_i in experts]
    grouped = GroupedGemmArguments(problems)
    epifuse.get_kernels(grouped)[0].run(grouped)

Each group (problem) has its own M, N, K, operand tensors and outputs; all groups share the
epilogue, the dtypes of A, B, every operand and every output, the accumulator type, precision
and device, and are 2-D. Number operands are passed once for the launch, so they must be equal
in every group (a one-element tensor may differ). An operand may broadcast differently from
group to group (a (1, 1) column in a one-row group, say): the kernel takes the widest role and
reads the narrower ones with stride 0. Everything is checked here, and a mismatch raises an
EpilogueError subclass naming the group and what differs.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .api import GemmArguments, _bound_graph
from .errors import EpilogueArgumentError, ShapeError
from .ir import AXES, Operand
from .shapes import classify_operand, span


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

    def __len__(self) -> int:
        return len(self.problems)

    def __iter__(self):
        return iter(self.problems)

    def __getitem__(self, index: int) -> GemmArguments:
        return self.problems[index]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{p.M}x{p.N}x{p.K}" for p in self.problems[:4])
        more = f", ... ({len(self)} groups)" if len(self) > 4 else ""
        return f"GroupedGemmArguments([{sizes}{more}])"


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
    for option in ("accumulator_type", "precision", "accumulate", "deterministic", "compute_dtype"):
        mine, theirs = getattr(p, option), getattr(first, option)
        if mine != theirs:
            raise EpilogueArgumentError(f"Group {i} has {option}={mine!r} but group 0 has {theirs!r}; "
                                        "all groups share one setting.")


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
        if program.operands != names or mine != outputs:
            raise EpilogueArgumentError(
                f"Group {i}'s epilogue has operands ({', '.join(program.operands)}) and outputs "
                f"({', '.join(mine)}), but group 0's has operands ({', '.join(names)}) and outputs "
                f"({', '.join(outputs)}); all groups share one epilogue.")
        for name, role in _operand_roles(p).items():
            shared = roles[name]
            if role.kind != shared.kind:
                raise EpilogueArgumentError(
                    f"Operand {name} is a {_kind(shared)} in group 0 but a {_kind(role)} in group {i}.",
                    hint="Numbers are passed once for the launch: pass a one-element tensor in "
                         "every group for a per-group scalar.")
            axes = tuple(a for a in AXES if a in shared.axes or a in role.axes)
            roles[name] = Operand(name, shared.kind, axes)
    return tuple(roles[name] for name in names)


def _kind(role: Operand) -> str:
    return "Python number" if role.kind == "number" else "tensor"


def _shared_graph(problems: list[GemmArguments], roles: tuple[Operand, ...]):
    """The epilogue bound to the widest roles; every group's must be the same graph."""
    graph, key = _bound_graph(problems[0].epilogue.program, roles, 2)
    for i, p in enumerate(problems[1:], start=1):
        _, mine = _bound_graph(p.epilogue.program, roles, 2)
        if mine != key:
            raise EpilogueArgumentError(
                f"Group {i}'s epilogue computes something different from group 0's (the same "
                "operand and output names, another computation); all groups share one epilogue.",
                hint="Build every group's EpilogueArguments from the same function or string.")
    return graph, key


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
    a, b = float(a), float(b)
    return a == b or (math.isnan(a) and math.isnan(b))


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
            if t.numel() and t.device.type != "meta":
                start = t.data_ptr()
                spans.append((start, start + span(t) * t.element_size(), i, name, written))
    spans.sort()
    open_spans: list[tuple] = []
    for current in spans:
        open_spans = [s for s in open_spans if s[1] > current[0]]
        for other in open_spans:
            if other[2] != current[2] and (other[4] or current[4]):
                raise ShapeError(f"Group {other[2]}'s {other[3]} and group {current[2]}'s {current[3]} "
                                 "share memory, and one of them is an output; groups run at once.",
                                 hint="Give every group its own output tensors.")
        open_spans.append(current)


def grouped_kernel_statuses(grouped: GroupedGemmArguments, cc: int | None = None) -> list:
    """(kernel, Status) for every grouped kernel, best first; the reference loop last."""
    from .backends.grouped_reference import GroupedReference
    from .backends.triton import tiled
    from .backends.triton.grouped import TritonGrouped
    if tiled.uses_interpreter(grouped.device):
        candidates = [TritonGrouped(tiled.INTERPRETER_CONFIG)]
    else:
        candidates = [TritonGrouped(c) for c in tiled.CUDA_CONFIGS]
    result = [(k, k.supports(grouped, cc)) for k in candidates]
    reference = GroupedReference()
    result.append((reference, reference.supports(grouped)))
    return result
