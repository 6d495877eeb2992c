"""Emit the Triton source of a grouped GEMM: one launch, one program per tile of any group.

The launch passes a device table with one int64 row per (non-empty) group: where its tiles
start in the launch's tile order, its M, N, K, and the address and strides of A, B and every
tensor operand and output (`table_columns` fixes the order; the launcher fills rows by the same
names). A program bisects the tile starts to find its group, turns the addresses into typed
pointers, then runs the tiled kernel's main loop and epilogue unchanged: the names it binds
(a_ptr, stride_am, M, x0_ptr, x0_sn, y0_ptr, ...) are the ones those read.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import InternalError
from ...ir import Graph
from .codegen import (
    _HEADER,
    _TILED_EPILOGUE_START,
    _TILED_MAINLOOP,
    Layout,
    _emit_epilogue,
    launch_layout,
)
from .rules import helper_source


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


def number_params(layout: Layout) -> list[str]:
    """Number operands are kernel arguments (equal in every group), as in the tiled kernel."""
    return [o.prefix for o in layout.operands if o.kind == "number"]


_FIND_GROUP = '''
    tile_id = tl.program_id(0)
    # Bisect the groups' tile starts: the last group starting at or before this tile.
    lo = tile_id * 0
    hi = lo + NUM_GROUPS
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go_right = tl.load(table_ptr + mid * ROW) <= tile_id
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    row_ptr = table_ptr + lo * ROW
'''

# The tiled main loop's first lines take the tile and batch from the grid; here they come
# from the group's row, and there is no batch.
_TILED_HEAD = "    pid = tl.program_id(0)\n    pid_l = tl.program_id(1).to(tl.int64)\n"

_META = ["ROW", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "UPCAST", "PRECISION", "EPI_N",
         "ACC_INT", "ACC_F16", "EVEN_K", "EVEN_M", "EVEN_N"]


def _bind_row(columns: tuple[Column, ...], pointee: dict[str, str], hints: dict[str, str]) -> list[str]:
    """Bind every column of the group's row. `hints` tells, per column, what holds in every
    group of the launch, as Triton's specialization of kernel arguments would: "zero" or "one"
    (a stride bound as that literal) or "div16" (a multiple of 16: bytes for an address,
    elements for a size or stride), so loads can be vectorized."""
    lines = []
    for i, c in enumerate(columns):
        field = f"tl.load(row_ptr + {i})"
        hint = hints.get(c.name)
        if c.name == "tile_start":
            lines.append(f"pid = (tile_id - {field}).to(tl.int32)")
            continue
        if hint in ("zero", "one"):
            lines.append(f"{c.name} = {int(hint == 'one')}")
            continue
        value = f"{field}.to(tl.pointer_type({pointee[c.name]}))" if c.pointer else f"{field}.to(tl.int32)"
        lines.append(f"{c.name} = tl.multiple_of({value}, 16)" if hint == "div16" else f"{c.name} = {value}")
    return lines + ["stride_al = 0", "stride_bl = 0", "pid_l = 0"]


def _mean_scales(layout: Layout) -> list[str]:
    """An atomic mean folds each partial sum times 1 / (elements reduced), which varies by group."""
    size = {"M": "M.to(tl.float32)", "N": "N.to(tl.float32)", "L": "1.0"}
    lines = []
    for y in layout.outputs:
        if y.scaled:
            count = " * ".join(size[a] for a in y.dims)
            lines.append(f"{y.prefix}_scale = 1.0 / tl.maximum({count}, 1.0)")
    return lines


def emit_grouped_kernel(graph: Graph, target: str, key: str, pointee: dict[str, str],
                        hints: dict[str, str], deterministic: bool = False) -> str:
    """The module source of `epifuse_grouped_kernel` for `graph` on `target` ("cuda" or
    "interpret"). `pointee` maps each pointer column to its element type ("tl.float16"):
    addresses become typed pointers with a type written into the source; `hints` are the
    columns' specializations (see `_bind_row`)."""
    layout = launch_layout(graph, deterministic)
    if _TILED_HEAD not in _TILED_MAINLOOP:
        raise InternalError("the tiled main loop no longer starts as the grouped kernel expects")
    preamble = _bind_row(table_columns(layout), pointee, hints) + _mean_scales(layout)
    mainloop = _TILED_MAINLOOP.replace(_TILED_HEAD, "".join(f"    {ln}\n" for ln in preamble), 1)
    lines, helpers = _emit_epilogue(graph, layout)
    body = "".join(f"    {ln}\n" for ln in lines)
    meta = _META + [f"{y.prefix.upper()}_{part}" for y in layout.outputs if y.mode == "tile"
                    for part in ("KIND", "LO", "HI")]
    params = ["table_ptr", "NUM_GROUPS", "SEARCH_STEPS", *number_params(layout),
              *(f"{m}: tl.constexpr" for m in meta)]
    libdevice = "from triton.language.extra import libdevice\n" if target == "cuda" else ""
    return (_HEADER.format(key=key, target=target, libdevice=libdevice)
            + helper_source(helpers, target)
            + "\n\n@triton.jit\ndef epifuse_grouped_kernel(\n    " + ",\n    ".join(params) + ",\n):"
            + _FIND_GROUP + mainloop + _TILED_EPILOGUE_START + body)
