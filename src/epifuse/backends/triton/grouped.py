"""The grouped family: every group of a GroupedGemmArguments in one launch of the pointer kernel.

The grid is the groups' tiles laid end to end (empty groups have none); each program finds its
group in a device table with one int64 row per group with tiles: where its tiles start in the
launch's tile order, its M, N, K, and the address and strides of A, B and every tensor operand
and output (`table_columns` fixes the order; rows are filled by the same names). A program
bisects the tile starts to find its group, turns the addresses into typed pointers, then runs
the tiled kernel's main loop and epilogue unchanged. Reductions work as in the tiled kernel,
each group with its own destinations and work buffers. The source is specialized on what
holds for a column in every group (a stride of 0 or 1, 16-byte alignment), as Triton
specializes kernel arguments. Groups of fake or meta tensors plan and compile (their pointer
columns hold the alignment their real tensors will have) but never run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...shapes import is_stand_in, misalignment
from ..base import Status, unsupported
from . import configs
from . import device as target
from . import plan as plans
from .families import INT32_LIMIT, Family, Launch, common_check, triton_meta
from .layout import Layout
from .rules import TL_TYPES
from .source import SourceSpec


@dataclass(frozen=True)
class Column:
    """One int64 field of a group's table row, bound to a kernel variable of the same name.
    `pointer` columns hold an address, cast to a pointer to the tensor's element type."""

    name: str
    pointer: bool = False
    stride: bool = False


def table_columns(layout: Layout) -> tuple[Column, ...]:
    columns = [Column("tile_start"), Column("M"), Column("N"), Column("K"),
               Column("a_ptr", pointer=True), Column("stride_am", stride=True),
               Column("stride_ak", stride=True), Column("b_ptr", pointer=True),
               Column("stride_bk", stride=True), Column("stride_bn", stride=True)]
    tensors = [(o.prefix, o.axes) for o in layout.operands if o.kind == "tensor"]
    for prefix, axes in tensors + [(y.prefix, y.axes) for y in layout.outputs]:
        columns.append(Column(f"{prefix}_ptr", pointer=True))
        columns.extend(Column(f"{prefix}_s{a.lower()}", stride=True) for a in axes)
    return tuple(columns)


def column_hints(columns: tuple[Column, ...], rows: list[list[int]]) -> dict[str, str]:
    """What holds for a column in every row: "zero" or "one" (strides only), or "div16"."""
    hints = {}
    for i, c in enumerate(columns):
        values = [row[i] for row in rows]
        if c.name == "tile_start" or not values:
            continue
        if c.stride and all(v == 0 for v in values):
            hints[c.name] = "zero"
        elif c.stride and all(v == 1 for v in values):
            hints[c.name] = "one"
        elif all(v % 16 == 0 for v in values):
            hints[c.name] = "div16"
    return hints


def _tile_count(problems, config) -> int:
    return sum(target.cdiv(p.M, config.block_m) * target.cdiv(p.N, config.block_n) for p in problems)


def _check(grouped, config, cc) -> Status | None:
    for i, problem in enumerate(grouped.problems):
        refusal = common_check(problem, cc)
        if refusal is not None:
            return unsupported(f"group {i}: {refusal.reason}")
    if _tile_count(grouped.problems, config) >= INT32_LIMIT:
        return unsupported("the groups have 2**31 tiles or more, more than one launch can number")
    return None


def _pointee(problem, layout: Layout, buffers: dict) -> dict[str, str]:
    """The element type of every pointer column (the same in every group)."""
    types = {"a_ptr": TL_TYPES[problem.A.dtype], "b_ptr": TL_TYPES[problem.B.dtype]}
    for o in layout.operands:
        if o.kind == "tensor":
            types[f"{o.prefix}_ptr"] = TL_TYPES[problem.operands[o.name].dtype]
    for y in layout.outputs:
        types[f"{y.prefix}_ptr"] = TL_TYPES[buffers[y.name][0].dtype]
    return types


def _address(t: torch.Tensor) -> int:
    """A pointer column's value: `t`'s address. A stand-in (fake, meta tensor) has none, and a
    table of stand-ins is never launched (run refuses them): its column holds how many bytes
    past a 16-byte boundary the real tensor of its metadata lies (shapes.misalignment), which
    is all the hints read, so the source compiled from stand-ins is the one real tensors get."""
    return misalignment(t) if is_stand_in(t) else t.data_ptr()


def _row(problem, layout: Layout, roles: dict, buffers: dict, tile_start: int) -> dict[str, int]:
    """One group's table fields by column name. An operand is read along its widest role's
    axes, with stride 0 along those it does not vary along in this group."""
    a, b = problem.a_strides, problem.b_strides
    fields = dict(tile_start=tile_start, M=problem.M, N=problem.N, K=problem.K,
                  a_ptr=_address(problem.A), stride_am=a[1], stride_ak=a[2],
                  b_ptr=_address(problem.B), stride_bk=b[1], stride_bn=b[2])
    for o in layout.operands:
        if o.kind == "tensor":
            fields[f"{o.prefix}_ptr"] = _address(problem.operands[o.name])
            for axis in roles[o.name].axes:
                fields[f"{o.prefix}_s{axis.lower()}"] = problem.strides[o.name].get(axis, 0)
    for y in layout.outputs:
        tensor, strides = buffers[y.name]
        fields[f"{y.prefix}_ptr"] = _address(tensor)
        fields.update({f"{y.prefix}_s{axis.lower()}": strides[axis] for axis in y.axes})
    return fields


def _bisection_steps(groups: int) -> int:
    """ceil(log2(groups)): enough halvings to narrow the groups down to one."""
    return max(groups - 1, 0).bit_length()


def _launch(grouped, config, layout: Layout) -> Launch:
    """Every group's buffers and problem, the table of the groups with tiles (kept alive by the
    plan's values), the number operands (equal in every group), and the source specialized on
    the table's pointer types and column hints."""
    columns = table_columns(layout)
    roles = {o.name: o for o in grouped.roles}
    problems, rows, tiles = [], [], 0
    first_buffers = None
    for p in grouped.problems:
        buffers, finish = plans.reduction_buffers(p, layout, config, 1)
        first_buffers = first_buffers or buffers
        problems.append(plans.problem(p, layout, buffers, finish))
        if p.M == 0 or p.N == 0:
            continue
        fields = _row(p, layout, roles, buffers, tiles)
        rows.append([fields[c.name] for c in columns])
        tiles += target.cdiv(p.M, config.block_m) * target.cdiv(p.N, config.block_n)
    first = grouped.problems[0]
    pointee = _pointee(first, layout, first_buffers)
    hints = column_hints(columns, rows)
    table = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), len(columns)).to(grouped.device)
    values = dict(table_ptr=table, NUM_GROUPS=len(rows), SEARCH_STEPS=_bisection_steps(len(rows)),
                  **{o.prefix: float(first.operands[o.name]) for o in layout.operands if o.kind == "number"})
    meta = triton_meta(first, config, 1)
    meta.update(ROW=len(columns), EVEN_K=all(p.K % config.block_k == 0 for p in grouped.problems),
                EVEN_M=all(p.M % config.block_m == 0 for p in grouped.problems),
                EVEN_N=all(p.N % config.block_n == 0 for p in grouped.problems))
    spec = SourceSpec("pointer", "grouped",
                      table=tuple((c.name, pointee.get(c.name, "") if c.pointer else "", hints.get(c.name, ""))
                                  for c in columns))
    return Launch(values, meta, (tiles,), spec=spec, problems=problems)


GROUPED = Family("triton_grouped", lambda config: SourceSpec("pointer", "grouped"), _check, _launch,
                 lambda grouped, config: f"grouped tiled {config}, {len(grouped)} groups in one launch",
                 interpreter_config=configs.INTERPRETER, grouped=True)
