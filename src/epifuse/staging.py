"""Epilogues whose reductions feed later math, run as passes of the same GEMM.

`D = exp(z - logsumexp(z, dim=1))` (a softmax over N) needs every column's value before any
element of D: a reduction over a dimension that spans tiles is known only once every tile has
run. `passes(program)` splits such a program into a sequence of programs, each a kernel of its
own over the same A @ B (recomputed: the GEMM is cheaper than writing the accumulator out and
reading it back, at the shapes where it matters):

- a statistics pass computes the reductions whose inputs need no other pending reduction, as
  outputs (fp32, or float64 when the epilogue computes in float64);
- the next pass reads them as operands, broadcast along the reduced dims (an (M, 1) column for
  a reduction over N), in place of the reductions; and so on until none feeds later math.

`mean -> variance -> normalize` takes three passes, `max -> sum of exp -> divide` three,
`logsumexp -> exp` two. A reduction the user returns is returned from the pass that computes
it. Names the passes add start with `_stat`, numbered past any name the program uses.
"""
from __future__ import annotations

import dataclasses
import functools

from .frontend import Expr, Program, Statement, fold_expr
from .ops import OPS


@dataclasses.dataclass(frozen=True)
class Pass:
    """One kernel of a staged epilogue.

    program   what it runs: its outputs are the statistics it computes and, in the last pass,
              the user's outputs
    computes  statistic name -> the `dim` its reduction was written with (None: every dim)
    returns   user output name -> the statistic that is its value (a returned reduction that
              later math also reads)
    """

    program: Program
    computes: dict
    returns: dict


def _is_reduction(e: Expr) -> bool:
    return e.kind == "call" and e.value in OPS and OPS[e.value].is_reduction


def _fed_reductions(program: Program) -> list[Expr]:
    """The reduction calls whose value another op reads: nested in a call, or assigned to a
    name that a later statement reads."""
    read_later: set[str] = set()
    for stmt in program.statements:
        fold_expr(stmt.expr, lambda e, _: read_later.add(e.value) if e.kind == "name" else None)
    fed: list[Expr] = []
    for stmt in program.statements:
        def visit(e: Expr, _args) -> None:
            for a in e.args:
                if _is_reduction(a) and a not in fed:
                    fed.append(a)
        fold_expr(stmt.expr, visit)
        if _is_reduction(stmt.expr) and stmt.target in read_later and stmt.expr not in fed:
            fed.append(stmt.expr)
    return fed


def needs_passes(program: Program) -> bool:
    return bool(_fed_reductions(program))


def _contains(expr: Expr, targets: set) -> bool:
    """Whether `expr` has one of the Expr objects in `targets` strictly inside or as itself."""
    return bool(fold_expr(expr, lambda e, args: e in targets or any(args)))


@functools.lru_cache(maxsize=256)
def passes(program: Program) -> tuple[Pass, ...]:
    """The passes that run `program` (one, itself, where no reduction feeds later math). Kept
    per program, so a repeated call runs the same pass programs, whose kept launches then
    serve it (runtime/callsite.py)."""
    result: list[Pass] = []
    taken = {*program.params, *(s.target for s in program.statements)}
    counter = 0
    while True:
        fed = _fed_reductions(program)
        if not fed:
            if program.outputs:
                result.append(Pass(program, {}, {}))
            return tuple(result)
        ready = _ready(program, fed)
        names = {}
        for r in ready:
            counter += 1
            while f"_stat{counter}" in taken:
                counter += 1
            names[r] = f"_stat{counter}"
            taken.add(names[r])
        returned = {s.target: names[s.expr] for s in program.statements
                    if s.expr in names and s.target in {n for n, _ in program.outputs}}
        result.append(Pass(_statistics_program(program, names),
                           {name: dict(r.params).get("dim") for r, name in names.items()}, returned))
        program = _reading_program(program, names, returned)


def _ready(program: Program, fed: list[Expr]) -> list[Expr]:
    """The reductions of `fed` whose input needs none of them: directly, or through a name."""
    pending = set(fed)
    needs: dict[str, bool] = {}

    def reads_pending(expr: Expr) -> bool:
        return bool(fold_expr(expr, lambda e, args: e in pending or (e.kind == "name" and needs.get(e.value, False))
                              or any(args)))
    for stmt in program.statements:
        needs[stmt.target] = reads_pending(stmt.expr)
    return [r for r in fed if not any(reads_pending(a) for a in r.args)]


def _needed_statements(program: Program, roots: list[Expr]) -> tuple[Statement, ...]:
    """The statements the expressions `roots` read, transitively, in program order."""
    by_target = {s.target: s for s in program.statements}
    wanted: set[str] = set()
    stack = list(roots)
    while stack:
        e = stack.pop()
        found: list[str] = []
        fold_expr(e, lambda x, _: found.append(x.value) if x.kind == "name" else None)
        for name in found:
            if name in by_target and name not in wanted:
                wanted.add(name)
                stack.append(by_target[name].expr)
    return tuple(s for s in program.statements if s.target in wanted)


def _statistics_program(program: Program, names: dict) -> Program:
    """The pass that computes the reductions `names` maps (Expr -> output name) as outputs."""
    loc = program.outputs[0][1]
    statements = _needed_statements(program, list(names))
    statements += tuple(Statement(name, r, r.loc or loc) for r, name in names.items())
    return dataclasses.replace(program, name=f"{program.name}_statistics", statements=statements,
                               outputs=tuple((name, r.loc or loc) for r, name in names.items()))


def _reading_program(program: Program, names: dict, returned: dict) -> Program:
    """`program` reading the reductions `names` maps as operands of those names; the outputs in
    `returned` come from the statistics pass instead."""
    def combine(e: Expr, args: list) -> Expr:
        if e in names:
            return Expr("name", names[e], loc=e.loc)
        same = all(new is old for new, old in zip(args, e.args))
        return e if same else dataclasses.replace(e, args=tuple(args))
    statements = tuple(dataclasses.replace(s, expr=fold_expr(s.expr, combine)) for s in program.statements)
    loc = program.param_locs[-1] if program.param_locs else program.outputs[0][1]
    return dataclasses.replace(program, params=program.params + tuple(names.values()),
                               param_locs=program.param_locs + (loc,) * len(names), statements=statements,
                               outputs=tuple(o for o in program.outputs if o[0] not in returned))


def keep_shape(dim, accum_shape: tuple) -> tuple:
    """The shape of a statistic reduced over `dim` (as written: an int, a tuple, None for
    every dim) as an operand of the next pass: accum's, with the reduced dims 1."""
    rank = len(accum_shape)
    dims = range(rank) if dim is None else (dim if isinstance(dim, (tuple, list)) else (dim,))
    reduced = {d % rank for d in dims}
    return tuple(1 if i in reduced else size for i, size in enumerate(accum_shape))
