"""The kernel's epilogue parameters: which arguments a generated kernel takes for a Graph's
operands and outputs, in which order, and how each output is stored.

`launch_layout(graph, deterministic)` is read by the source templates (the parameter list and
the epilogue's names) and by the plan (the values it passes), so the two cannot drift apart.
Every identifier it makes (x0, x0_ptr, x0_sm, y1_scale, ...) is made here from positions:
nothing the user wrote reaches generated code.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...ir import AXES, Graph
from ...ops import OpDef


@dataclass(frozen=True)
class OperandParams:
    name: str           # the user's operand name (the launcher's key); never emitted
    kind: str           # "number" | "tensor"
    axes: tuple         # axes it varies along (strides passed for these)
    prefix: str         # x0, x1, ...


@dataclass(frozen=True)
class OutputParams:
    """How one output is stored.

    reduce: None for a tile store, else the reduction op. mode: "tile"; "atomic" (each
    program folds its partial into the fp32 destination, or an fp32 work buffer, with an
    atomic add, or for amax an integer atomic max of the bits: see reduction_mode);
    "partials" (each program writes its partial to a (L, PM, PN) buffer that a finishing step
    reduces: run-to-run identical, and NaN-exact for max/min). axes: the axes whose strides the kernel takes.
    """

    name: str
    reduce: OpDef | None
    mode: str
    axes: tuple
    prefix: str
    dims: tuple = ()

    @property
    def scaled(self) -> bool:
        """A mean folded by atomics: each partial is scaled by 1 / count before it is added."""
        return self.mode == "atomic" and self.reduce.reduction.mean


@dataclass(frozen=True)
class Layout:
    operands: tuple[OperandParams, ...]
    outputs: tuple[OutputParams, ...]

    def param_names(self) -> list[str]:
        names = []
        for o in self.operands:
            if o.kind == "number":
                names.append(o.prefix)
            else:
                names.append(f"{o.prefix}_ptr")
                names.extend(f"{o.prefix}_s{a.lower()}" for a in o.axes)
        for y in self.outputs:
            names.append(f"{y.prefix}_ptr")
            names.extend(f"{y.prefix}_s{a.lower()}" for a in y.axes)
            if y.scaled:
                names.append(f"{y.prefix}_scale")
        return names

    def tile_slots(self) -> list:
        """The (M, N) operands, then the tile outputs: what a TMA descriptor or a shared-memory
        tile buffer could move (OperandParams and OutputParams, each with its name and prefix)."""
        return ([o for o in self.operands if {"M", "N"} <= set(o.axes)]
                + [y for y in self.outputs if y.mode == "tile"])

    def tma_candidates(self) -> list[str]:
        """Prefixes of the tile slots."""
        return [slot.prefix for slot in self.tile_slots()]


def reduction_mode(op: OpDef, deterministic: bool) -> str:
    """Sums fold with atomics unless asked to be deterministic. amax always folds with an atomic
    integer maximum of the fp32 bits: |x|, and NaN with its sign cleared, order as int32 as they
    do as floats, so the result is exact (identical run to run) and NaN where any element is.
    max and min use partials, which keep NaN exact for either sign."""
    reduction = op.reduction
    if reduction.magnitude:
        return "atomic"
    return "atomic" if reduction.combine == "add" and not deterministic else "partials"


def launch_layout(graph: Graph, deterministic: bool = False) -> Layout:
    operands = tuple(OperandParams(o.name, o.kind, tuple(o.axes), f"x{i}")
                     for i, o in enumerate(graph.operands))
    outputs = []
    for j, out in enumerate(graph.outputs):
        if out.node.op.is_reduction:
            dims = out.node.dims
            mode = reduction_mode(out.node.op, deterministic)
            axes = AXES if mode == "partials" else tuple(a for a in AXES if a not in dims)
            outputs.append(OutputParams(out.name, out.node.op, mode, axes, f"y{j}", dims))
        else:
            outputs.append(OutputParams(out.name, None, "tile", AXES, f"y{j}"))
    return Layout(operands, tuple(outputs))
