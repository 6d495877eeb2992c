"""Epilogues whose reductions feed later math, run as passes of the same GEMM.

`D = exp(z - logsumexp(z, dim=1))` (a softmax over N) needs every column's value before any
element of D. Where every such reduction folds accum's last dim, N, alone (`over_rows`) and N
fits one tile (at most backends/triton/configs.WIDEST_N columns), one kernel runs the program
as written, its tile spanning the row: the reduction is folded in registers and read back
there (epifuse.gemm decides: api._in_one_pass; the kernels' statuses say which ran or why not).
Otherwise a reduction over a dimension that spans tiles is known only once every tile has run,
and `passes(program)` splits the program into a sequence of programs, each a kernel of its
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

from .errors import EpilogueError
from .program import Expr, Program, Statement, fold_expr
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


def _root(name: str, aliases: dict) -> str:
    """The name `name` copies (`D = m` makes D an alias of m), followed to its end."""
    seen = set()
    while name in aliases and name not in seen:
        seen.add(name)
        name = aliases[name]
    return name


def _aliases(program: Program) -> dict:
    return {s.target: s.expr.value for s in program.statements if s.expr.kind == "name"}


def _fed_reductions(program: Program) -> list[Expr]:
    """The reduction calls whose value an op reads: nested in a call, or assigned to a name
    (or an alias of it: `D = m`) that a call reads. A reduction only returned, under its name
    or an alias, feeds nothing."""
    aliases = _aliases(program)
    read_by_calls: set[str] = set()

    def visit(e: Expr, _args) -> None:
        if e.kind == "call":
            read_by_calls.update(_root(a.value, aliases) for a in e.args if a.kind == "name")
    for stmt in program.statements:
        fold_expr(stmt.expr, visit)
    fed: list[Expr] = []
    for stmt in program.statements:
        def nested(e: Expr, _args) -> None:
            for a in e.args:
                if _is_reduction(a) and a not in fed:
                    fed.append(a)
        fold_expr(stmt.expr, nested)
        if _is_reduction(stmt.expr) and stmt.target in read_by_calls and stmt.expr not in fed:
            fed.append(stmt.expr)
    return fed


def _live(program: Program) -> Program:
    """`program` without the statements no output reads."""
    roots = [Expr("name", name) for name, _ in program.outputs]
    return dataclasses.replace(program, statements=_needed_statements(program, roots))


def needs_passes(program: Program) -> bool:
    """Whether one kernel cannot run `program` as written (passes() may still need just one,
    once statements no output reads are dropped)."""
    return bool(_fed_reductions(program))


def over_rows(program: Program, rank: int) -> bool:
    """Whether every reduction that feeds later math in `program` (over a rank-`rank` accum)
    folds accum's last dim, N, and only it: what one kernel runs where a tile spans N."""
    def last_only(r: Expr) -> bool:
        dim = dict(r.params).get("dim")
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        return (dim is not None and all(isinstance(d, int) and not isinstance(d, bool) and -rank <= d < rank
                                        for d in dims)
                and {d % rank for d in dims} == {rank - 1})
    return all(last_only(r) for r in _fed_reductions(program))


def check_folds(program: Program) -> None:
    """Refuse a reduction whose input varies along accum only through another reduction's
    value (`sum(max(accum, dim=1))`): an epilogue broadcasts a reduction's input to accum's
    shape, so it would fold every broadcast copy of the statistic, where torch folds the
    statistic's own values."""
    by_target = {s.target: s.expr for s in program.statements}
    memo: dict[str, bool] = {}

    def varies(expr: Expr) -> bool:
        def combine(e: Expr, args: list) -> bool:
            if e.kind == "name":
                if e.value in program.params:
                    return True   # accum, or an operand (treated as varying: it may be a tile)
                if e.value not in memo:
                    memo[e.value] = False   # a cycle cannot occur in SSA; guards the recursion
                    memo[e.value] = varies(by_target[e.value]) if e.value in by_target else False
                return memo[e.value]
            if e.kind == "const" or _is_reduction(e):
                return False
            return any(args)
        return bool(fold_expr(expr, combine))

    for stmt in program.statements:
        def visit(e: Expr, _args) -> None:
            if _is_reduction(e) and e.args and not varies(e.args[0]):
                raise EpilogueError(
                    f"{e.value}() folds a value that varies along accum only through another reduction's "
                    "result; in an epilogue a reduction's input is broadcast to accum's shape first, so it "
                    "would fold every broadcast copy of that result (torch folds its values once).",
                    e.loc or stmt.loc,
                    "Return the inner reduction's value and reduce it after the GEMM.")
        fold_expr(stmt.expr, visit)


def _contains(expr: Expr, targets: set) -> bool:
    """Whether `expr` has one of the Expr objects in `targets` strictly inside or as itself."""
    return bool(fold_expr(expr, lambda e, args: e in targets or any(args)))


@functools.lru_cache(maxsize=256)
def passes(program: Program) -> tuple[Pass, ...]:
    """The passes that run `program` (one, itself, where no reduction feeds later math). Kept
    per program, so a repeated call runs the same pass programs, whose kept launches then
    serve it (runtime/callsite.py)."""
    program = _live(program)
    if _fed_reductions(program):
        check_folds(program)
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
        aliases = _aliases(program)
        by_target = {s.target: s.expr for s in program.statements}
        returned = {}
        for name, _ in program.outputs:
            expr = by_target.get(_root(name, aliases))
            if expr is not None and expr in names:
                returned[name] = names[expr]
        result.append(Pass(_statistics_program(program, names),
                           {name: dict(r.params).get("dim") for r, name in names.items()}, returned))
        program = _live(_reading_program(program, names, returned))


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


def _location(program: Program):
    return program.outputs[0][1] if program.outputs else (program.param_locs[0] if program.param_locs else None)


def _statistics_program(program: Program, names: dict) -> Program:
    """The pass that computes the reductions `names` maps (Expr -> output name) as outputs."""
    loc = _location(program)
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
    loc = program.param_locs[-1] if program.param_locs else _location(program)
    return dataclasses.replace(program, params=program.params + tuple(names.values()),
                               param_locs=program.param_locs + (loc,) * len(names), statements=statements,
                               outputs=tuple(o for o in program.outputs if o[0] not in returned))


def pass_inputs(step: Pass, tensors: dict, stats: dict) -> dict:
    """What one pass's GEMM is given: the user's operands and numbers it reads and the user's
    tensors for its outputs (from `tensors`), the statistics of the passes before it (from
    `stats`, by name), and where the user passed a tensor for a returned statistic, that tensor
    for it."""
    names = {name for name, _ in step.program.outputs}
    given = {n: t for n, t in tensors.items() if n in step.program.params or n in names}
    given.update({n: stats[n] for n in step.program.params if n in stats})
    given.update({stat: tensors[user] for user, stat in step.returns.items() if user in tensors})
    return given


def statistics(step: Pass, outputs: dict, accum_shape: tuple) -> dict:
    """The statistics `step` computes, from its `outputs` by name, shaped as operands of the
    passes after it (keep_shape)."""
    return {name: value.reshape(keep_shape(step.computes[name], accum_shape))
            for name, value in outputs.items() if name in step.computes}


def keep_shape(dim, accum_shape: tuple) -> tuple:
    """The shape of a statistic reduced over `dim` (as written: an int, a tuple, None for
    every dim) as an operand of the next pass: accum's, with the reduced dims 1."""
    rank = len(accum_shape)
    dims = range(rank) if dim is None else (dim if isinstance(dim, (tuple, list)) else (dim,))
    reduced = {d % rank for d in dims}
    return tuple(1 if i in reduced else size for i, size in enumerate(accum_shape))
