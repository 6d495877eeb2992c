"""Bind a parsed Program to its operands: evaluate the statements into IR nodes.

`bind(program, operands, rank)` walks the SSA statements once, building interned nodes (so
repeated subexpressions are shared from the start), resolves reduction dims against accum's
rank, and returns a `Graph` whose outputs are in return order. Shapes and dtypes of the
tensors themselves are checked by the API layer; this module knows only operand roles.

A reduction's value may feed later math only with `in_tile=True` (GemmArguments: one kernel
computes it over a tile that spans the row) and only over accum's last dim, N; elsewhere it
can only be returned (epifuse.gemm runs the other forms as passes: staging.py).
"""
from __future__ import annotations

from .errors import EpilogueError, EpilogueSyntaxError, Location
from .program import CallSite, Expr, Program, fold_expr
from .ir import AXES, SECOND_ACCUMULATORS, Graph, Node, Operand, Output, accum, const, input_node
from .ops import OPS
from .staging import check_folds, needs_passes


def bind(program: Program, operands: dict[str, Operand], rank: int, in_tile: bool = False) -> Graph:
    """Build the Graph of `program` with `operands` (name -> Operand) for a rank-2/3 accum.
    `in_tile`: a reduction over N may feed later math (see the module docstring)."""
    if in_tile and needs_passes(program):
        check_folds(program)
    env: dict[str, Node] = {"accum": accum()}
    for name, leaf in SECOND_ACCUMULATORS.items():   # planar complex (complex_parts) or gated (chunk)
        if name in program.params:
            env[name] = Node(leaf)
    names: dict[Node, str] = {}
    locs: dict[Node, Location] = {}
    for name in program.operands:
        env[name] = input_node(operands[name])
        names.setdefault(env[name], name)
    for stmt in program.statements:
        node = _evaluate(stmt.expr, env, rank, locs, in_tile)
        env[stmt.target] = node
        names.setdefault(node, stmt.target)
        locs.setdefault(node, stmt.loc)
    outputs = []
    for name, loc in program.outputs:
        if name in operands and name not in program.updates:
            raise EpilogueError(f"Output '{name}' is also an input of the epilogue.", loc,
                                "Compute a new value from it and return that under another name, or update "
                                f"it in place where a condition holds: `{name} = where(cond, value, {name})`.")
        outputs.append(Output(name, env[name]))
    used_operands = tuple(operands[n] for n in program.operands)
    return Graph(tuple(outputs), used_operands, names, locs)


def _evaluate(expr: Expr, env: dict[str, Node], rank: int, locs: dict, in_tile: bool = False) -> Node:
    """Build the node of `expr`, sources first."""
    def combine(e: Expr, srcs: list) -> Node:
        if e.kind == "name":
            return env[e.value]
        if e.kind == "const":
            if isinstance(e.value, complex):
                raise EpilogueError(f"The complex literal {e.value!r} has no meaning in a real GEMM's epilogue.",
                                    e.loc, _COMPLEX_HINT)
            return const(e.value)
        return _call_node(e, srcs, rank, locs, in_tile)
    return fold_expr(expr, combine)


_COMPLEX_HINT = ("Complex values are the epilogues of planar complex GEMMs: "
                 "epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, epilogue, ...).")


_PASSES_HINT = ("epifuse.gemm runs such an epilogue as passes of the GEMM (a statistics pass, then one "
                "reading it: epifuse.staging), outside torch.compile. Or return the reduced value and "
                "finish the computation after the GEMM.")


def _call_node(expr: Expr, srcs: list[Node], rank: int, locs: dict, in_tile: bool = False) -> Node:
    opdef = OPS[expr.value]
    if opdef.kind == "complex":
        raise EpilogueError(f"{opdef.name}() takes a part of a complex value, and this GEMM's accumulator "
                            "and operands are real.", expr.loc, _COMPLEX_HINT)
    for s in srcs:
        if not s.op.is_reduction:
            continue
        if not in_tile:
            raise EpilogueError(
                f"The result of {s.op.name}() is used by {opdef.name}(); here (torch.compile, autograd, "
                "sharding) a reduction's result can only be returned as an output.", expr.loc,
                _PASSES_HINT + " Without autograd, GemmArguments and epifuse.gemm run a reduction over N "
                "that feeds later math in one kernel where a tile spans N.")
        if s.dims != (AXES[-1],):
            raise EpilogueError(
                f"The result of {s.op.name}() is used by {opdef.name}(); one kernel runs a reduction that "
                f"feeds later math only over accum's last dimension (N), whose rows a tile can span, not "
                f"over {', '.join(s.dims)}.", expr.loc, _PASSES_HINT)
    params = dict(expr.params)
    if opdef.kind == "join":
        _check_join(opdef.name, params["dim"], srcs, rank, expr.loc)
    if opdef.is_reduction:   # a composite's (softmax's logsumexp) is named as the op written
        written = expr.loc.op if isinstance(expr.loc, CallSite) else opdef.name
        params = {"dim": _axes_of(params.get("dim"), rank, expr.loc, written)}
    node = Node(opdef, srcs, tuple(sorted(params.items())) if params else None)
    locs.setdefault(node, expr.loc)
    return node


def _check_join(op: str, dim: tuple, srcs: list[Node], rank: int, loc: Location) -> None:
    """cat((a, b), dim=-1) joins the gated halves along the columns: dim is the last, and both
    pieces are tiles (vary along M and N), as torch.cat needs pieces of one shape."""
    (d,) = dim
    if d not in (-1, rank - 1):
        axes = AXES[3 - rank:]
        raise EpilogueSyntaxError(
            f"{op}(dim={d}) does not join along the columns: accum has {rank} dimensions ({', '.join(axes)}), "
            f"and only the last, dim=-1 (or {rank - 1}), joins the two halves of accum's columns.", loc,
            f"Write {op}((a, b), dim=-1).")
    for which, s in zip(("first", "second"), srcs):
        if not {"M", "N"} <= s.axes:
            varies = ", ".join(a for a in AXES if a in s.axes)
            raise EpilogueError(
                f"{op}((a, b), dim=-1) joins two tiles of the gated epilogue's half width, each varying "
                f"along M and N; its {which} piece varies along {varies or 'nothing (a scalar)'}.", loc,
                "Join values computed from the chunked halves, such as x1 * cos - x2 * sin (torch.cat "
                "refuses pieces of different shapes too).")


def _axes_of(dim, rank: int, loc: Location, op: str) -> tuple[str, ...]:
    """Reduction dims (ints over accum's rank, or None for all) as axis letters; a dim that
    names no dimension, one outside accum's, or one twice is an EpilogueSyntaxError."""
    axes = AXES[3 - rank:]
    if dim is None:
        return tuple(axes)
    dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
    if not dims:
        raise EpilogueSyntaxError(
            f"{op}(dim={dim!r}) names no dimension to reduce.", loc,
            "Leave dim out (or write dim=None) to reduce every dimension, or name the dimensions, "
            f"as in dim=({rank - 2}, {rank - 1}). An empty dim is refused: torch.sum reads it as "
            "every dimension and NumPy as none.")
    result = []
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool):
            raise EpilogueSyntaxError(f"{op}(dim={dim!r}) needs dim to be an int or a tuple of ints.",
                                      loc)
        if not -rank <= d < rank:
            raise EpilogueSyntaxError(
                f"{op}(dim={d}) is out of range: accum has {rank} dimensions "
                f"({', '.join(axes)}), so dim must be in [{-rank}, {rank - 1}].", loc)
        axis = axes[d % rank]
        if axis in result:
            raise EpilogueSyntaxError(f"{op}() reduces dim {d} twice.", loc)
        result.append(axis)
    return tuple(a for a in AXES if a in result)
