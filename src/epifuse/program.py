"""A parsed epilogue: `Program`, its `Statement`s and `Expr`s, as the parser (frontend.py) makes
them and every later stage (binding, printing, staging, autodiff's rewrites) reads them, with
the walks they share (`fold_expr`, `rename`, `names_used`) and the rule each op parameter's
value follows (`param_rule`: the parser checks source by it, load_program a key read from disk).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from .errors import Location
from .ops import rounding_dtype

# The parameters the GEMM fills rather than the caller: accum; in a planar complex GEMM the
# imaginary part of its accumulator, which only epifuse.complex_parts writes into a program (a
# complex epilogue spells it accum.imag); in a gated GEMM the second half of accum's columns,
# which the parser writes for `gate, up = accum.chunk(2, dim=-1)` (accum is then the first).
ACCUMULATORS = ("accum", "accum_imag", "accum_up")


@dataclass(frozen=True, eq=False)
class Expr:
    """An expression of the program: a variable, a literal, or a call of a registry op.

    Equal when kind, value, args, params and place are. An expression may nest as deeply as
    a statement the parser accepts allows, or deeper when built by hand, so neither its hash
    (kept once computed, from its arguments' hashes) nor `==` recurses: both walk a stack.
    """

    kind: str                      # "name" | "const" | "call"
    value: Any                     # the variable name, the float, or the op name
    args: tuple["Expr", ...] = ()
    params: tuple[tuple[str, Any], ...] = ()
    loc: Location | None = None
    _hash: int | None = field(default=None, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        stack = [self]
        while stack:   # arguments first: each hash is computed once, from its arguments' hashes
            e = stack[-1]
            pending = [a for a in e.args if a._hash is None]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            if e._hash is None:
                object.__setattr__(e, "_hash", hash((e.kind, e.value, tuple(a._hash for a in e.args),
                                                     e.params, e.loc)))
        return self._hash

    def __eq__(self, other) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        stack = [(self, other)]
        while stack:
            a, b = stack.pop()
            if a is b:
                continue
            if (a._hash is not None and b._hash is not None and a._hash != b._hash) or \
                    len(a.args) != len(b.args) or \
                    (a.kind, a.value, a.params, a.loc) != (b.kind, b.value, b.params, b.loc):
                return False
            stack.extend(zip(a.args, b.args))
        return True

    def __reduce__(self):
        # the hash is recomputed where the expression is rebuilt: str hashes differ between processes
        return (Expr, (self.kind, self.value, self.args, self.params, self.loc))


@dataclass(frozen=True)
class Statement:
    target: str
    expr: Expr
    loc: Location


@dataclass(frozen=True)
class Program:
    """A parsed epilogue: parameters (inputs, `accum` among them), SSA statements, outputs."""

    name: str
    params: tuple[str, ...]
    param_locs: tuple[Location, ...]
    statements: tuple[Statement, ...]
    outputs: tuple[tuple[str, Location], ...]
    source: str
    filename: str

    @property
    def operands(self) -> tuple[str, ...]:
        return tuple(p for p in self.params if p not in ACCUMULATORS)

    @property
    def updates(self) -> tuple[str, ...]:
        """Operands the epilogue updates in place, `D = where(cond, value, D)`: the statements
        that rebind a parameter (SSA admits no other). Each is also the output of that name,
        written only where the condition selects the new value."""
        return tuple(s.target for s in self.statements if s.target in self.params)


class GeneratedSource(str):
    """Epilogue source that epifuse printed itself from a Program (printing's program_source
    and graph_source: a class-based epilogue's text, a derived backward). It is parsed like
    any string, but without MAX_SOURCE_CHARS, which bounds what a user hands in: a printed
    program grows with the one it came from (a backward is several times longer than its
    forward); the nesting of each statement is bounded as in any source."""

    __slots__ = ()


@dataclass(frozen=True, eq=False)
class CallSite(Location):
    """The place of a composite op's call (`softmax(z, dim=2)`) and the op written there, which
    the ops it is written as carry: an error about one of them (the binder's about logsumexp's
    dim) names the op the user wrote. Otherwise it is its place: equal to, and hashed as, the
    Location of the same place, which is all that printing and dump_program keep."""

    op: str = ""

    def __eq__(self, other) -> bool:
        if not isinstance(other, Location):
            return NotImplemented
        return (self.filename, self.line, self.col, self.source_line) == \
            (other.filename, other.line, other.col, other.source_line)

    __hash__ = Location.__hash__


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# What each param accepts, and what its error says it needs: the parser checks source by these
# rules, and load_program checks a key read from disk by the same ones.
_PARAM_RULES = {
    "dtype": (lambda v: isinstance(v, str) and rounding_dtype(v) is not None,
              "a dtype such as torch.float16 for 'dtype'"),
    "dim": (lambda v: v is None or (isinstance(v, tuple) and all(_is_int(d) for d in v)),
            "dim to be an int or a tuple of ints"),
    "keepdim": (lambda v: isinstance(v, bool), "keepdim to be True or False"),
    "approximate": (lambda v: v in ("none", "tanh"), "approximate to be 'none' or 'tanh'"),
}


def param_rule(key: str):
    """(accepts(value), what the error says the param needs) for param `key` of any op."""
    return _PARAM_RULES.get(key, (_is_number, f"'{key}' to be a number literal"))


def names_used(program: Program) -> list[tuple[str, Location | None]]:
    """Every variable name the statements read, with its place."""
    found = []
    stack = [s.expr for s in program.statements]
    while stack:
        e = stack.pop()
        if e.kind == "name":
            found.append((e.value, e.loc))
        stack.extend(e.args)
    return found


def fold_expr(expr: Expr, combine: Callable[[Expr, list], Any]) -> Any:
    """combine(e, [its arguments' values]) for every Expr of `expr`, arguments first, each
    object once, without recursion (expressions may nest deeply): the one walk the printer,
    the dumper, the binder and rename share."""
    done: dict[int, Any] = {}
    stack: list[tuple[Expr, bool]] = [(expr, False)]
    while stack:
        e, expanded = stack.pop()
        if id(e) in done:
            continue
        if e.args and not expanded:
            stack.append((e, True))
            stack.extend((a, False) for a in e.args if id(a) not in done)
        else:
            done[id(e)] = combine(e, [done[id(a)] for a in e.args])
    return done[id(expr)]


def rename(expr: Expr, names: dict[str, str]) -> Expr:
    """`expr` with each variable in `names` read under its new name. Unchanged parts are the
    same objects."""
    def combine(e: Expr, args: list) -> Expr:
        if e.kind == "name":
            return replace(e, value=names[e.value]) if e.value in names else e
        same = all(new is old for new, old in zip(args, e.args))
        return e if same else replace(e, args=tuple(args))
    return fold_expr(expr, combine)


__all__ = ["ACCUMULATORS", "Expr", "Statement", "Program", "GeneratedSource", "CallSite", "param_rule", "names_used",
           "fold_expr", "rename"]
