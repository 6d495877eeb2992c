"""Trace one tile: every intermediate value of an epilogue on one output tile.

    t = epifuse.debug.trace(args, tile=(1, 0))   # every intermediate value of tile (1, 0)
    print(t); t["F"]                               # a table; one value by its name

The epilogue is evaluated with the reference interpreter on the slice of one output tile (the
tile size of the kernel epifuse would pick, unless given), before optimization, so every name
the user wrote is there, and so is every unnamed sub-expression. Reductions in a trace reduce
over the tile only.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..arguments import GemmArguments
from ..backends.select import get_kernels
from ..backends.triton import configs
from ..backends.triton import device as target
from ..binding import bind
from ..errors import EpilogueArgumentError
from ..ir import ACCUM, CONST, INPUT, Graph, Node, Output
from ..reference import evaluate, reference_accum
from ..shapes import classify_operand


@dataclass
class Step:
    label: str            # the user's name, or the expression for an unnamed value
    expression: str       # op(sources) with the sources' labels
    value: torch.Tensor

    def summary(self) -> str:
        v = self.value
        if v.dtype == torch.bool:
            return f"{int(v.sum())} of {v.numel()} true"
        finite = v[torch.isfinite(v)]
        nans = int(torch.isnan(v).sum())
        text = (f"min {float(finite.min()):.4g}  max {float(finite.max()):.4g}  mean {float(finite.mean()):.4g}"
                if finite.numel() else "no finite values")
        return text + (f"  ({nans} NaN)" if nans else "")


@dataclass
class Trace:
    """The epilogue's values on one tile: `trace["F"]`, `trace.steps`, `print(trace)`."""

    tile: tuple[int, int]
    rows: range
    cols: range
    values: dict[str, torch.Tensor]
    steps: list[Step]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.values[name]

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def __str__(self) -> str:
        head = (f"tile {self.tile}: rows {self.rows.start}..{self.rows.stop - 1}, "
                f"columns {self.cols.start}..{self.cols.stop - 1}")
        texts = [s.label if s.expression == s.label else f"{s.label} = {s.expression}" for s in self.steps]
        texts = [t if len(t) <= 56 else t[:53] + "..." for t in texts]
        width = max((len(t) for t in texts), default=0)
        lines = [head]
        for text, s in zip(texts, self.steps):
            lines.append(f"  {text:<{width}}  {str(tuple(s.value.shape)):>12}  {s.summary()}")
        return "\n".join(lines)


def _default_tile_shape(args) -> tuple[int, int]:
    interpreter = configs.INTERPRETER
    if target.uses_interpreter(args.A.device) and args.A.device.type == "cpu" and not target.interpreter_requested():
        return (interpreter.block_m, interpreter.block_n)
    for kernel in get_kernels(args):
        config = getattr(kernel, "config", None)
        if config is not None:
            if target.uses_interpreter(args.A.device):
                config = interpreter
            return config.block_m, config.block_n
    return (64, 64)


def trace(args, tile: tuple[int, int] = (0, 0), tile_shape: tuple[int, int] | None = None,
          dtype: torch.dtype = torch.float64) -> Trace:
    """Every intermediate value of the epilogue of `args` on output tile `tile` = (i, j): rows
    i*BM ... and columns j*BN ... of accum (all batches), BM x BN = `tile_shape`."""
    if not isinstance(args, GemmArguments):
        raise EpilogueArgumentError(f"trace takes a GemmArguments, not {type(args).__name__}.")
    if args.A.device.type == "meta":
        raise EpilogueArgumentError("trace computes values, and tensors on the meta device have none.")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise EpilogueArgumentError(f"trace's dtype must be a floating torch.dtype, not {dtype!r}.")
    for what, pair, low in (("tile", tile, 0), ("tile_shape", tile_shape, 1)):
        if (pair is not None or what == "tile") and not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= low for v in pair)):
            raise EpilogueArgumentError(f"{what} must be two ints of {low} or more, not {pair!r}.")
    if getattr(args, "form", "real") != "real":
        raise EpilogueArgumentError(f"trace follows one accumulator, and these are {args.form} GEMM arguments "
                                    "(two accumulators).", hint="Trace a real GEMM's arguments.")
    bm, bn = tile_shape or _default_tile_shape(args)
    grid = (math.ceil(args.M / bm), math.ceil(args.N / bn))
    i, j = tile
    if not (0 <= i < grid[0] and 0 <= j < grid[1]):
        raise EpilogueArgumentError(f"Tile {tuple(tile)} is outside the {grid[0]} x {grid[1]} grid of "
                                    f"{bm} x {bn} tiles of accum {tuple(args.accum_shape)}.",
                                    hint=f"Pick i in [0, {grid[0] - 1}] and j in [0, {grid[1] - 1}], or pass tile_shape=.")
    rows, cols = range(i * bm, min((i + 1) * bm, args.M)), range(j * bn, min((j + 1) * bn, args.N))
    r, c = slice(rows.start, rows.stop), slice(cols.start, cols.stop)
    accum = reference_accum(args.A[..., r, :], args.B[..., :, c], dtype, args.accumulator_type).to(dtype)
    accum = accum.reshape(*args.accum_shape[:-2], len(rows), len(cols))
    operands, roles = {}, {}
    for name, value in args.epilogue.operands.items():
        roles[name] = classify_operand(name, value, args.accum_shape, args.A.device)[0]
        if isinstance(value, torch.Tensor) and value.numel() > 1:
            value = torch.broadcast_to(value, args.accum_shape)[..., r, c]
        operands[name] = value.to(dtype) if isinstance(value, torch.Tensor) else value
    program = args.epilogue.program
    named = dataclasses.replace(program, outputs=tuple((s.target, s.loc) for s in program.statements))
    graph = bind(named, roles, len(args.accum_shape))     # not optimized: the user's own steps
    env = {o.name: o.node for o in graph.outputs}
    nodes = [n for n in graph.nodes() if n.op is not CONST]
    every = Graph(tuple(Output(f"#{k}", n) for k, n in enumerate(nodes)), graph.operands,
                  graph.names, graph.locs)
    results = evaluate(every, accum, operands, dtype)
    value_of = {id(n): results[f"#{k}"] for k, n in enumerate(nodes)}
    labels: dict[int, str] = {}
    steps = []
    for node in nodes:
        label = _label(node, graph, labels)
        labels[id(node)] = label
        steps.append(Step(label, _expression(node, labels), value_of[id(node)]))
    values = {"accum": accum}
    for name in program.operands:
        value = operands[name]
        values[name] = value if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=dtype)
    for name, node in env.items():   # a name bound to a literal has no step of its own
        values[name] = value_of[id(node)] if id(node) in value_of else torch.tensor(node.arg, dtype=dtype)
    return Trace(tuple(tile), rows, cols, values, steps)


def _label(node: Node, graph: Graph, labels: dict) -> str:
    if node.op is ACCUM:
        return "accum"
    if node.op is INPUT:
        return node.arg.name
    return graph.name_of(node) or _expression(node, labels)


def _expression(node: Node, labels: dict) -> str:
    if node.op is ACCUM:
        return "accum"
    if node.op is INPUT:
        return node.arg.name
    if node.op is CONST:
        return repr(node.arg)
    parts = [labels.get(id(s)) or (repr(s.arg) if s.op is CONST else "?") for s in node.src]
    parts += [f"{k}={v!r}" for k, v in node.params.items()]
    text = f"{node.op.name}({', '.join(parts)})"
    return text if len(text) <= 72 else text[:69] + "..."
