"""The ops registry: one `OpDef` per op, read by every part of epifuse.

The parser's vocabulary, the reference executor, every backend's lowering table, the op
reference in the docs and the "did you mean" suggestions all come from `OPS`. A backend that
has no rule for an op reports the op as unsupported (see `backends.base`), never a KeyError.

Derivative rules (`vjp`) are written with the ops themselves: called on `Sym` values (IR nodes
in disguise) an op builds a node instead of running torch, so a backward is itself a Graph
that every backend lowers (see `epifuse.autodiff`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Cost:
    """Per-element cost of an op: plain arithmetic and special-function (exp, log, ...) ops."""

    flops: int = 1
    special: int = 0


@dataclass(frozen=True, eq=False)
class OpDef:
    """One op.

    name       canonical name (torch's where torch has one)
    arity      number of tensor inputs
    ref        torch reference: ref(*tensors, **params)
    params     compile-time parameters with their defaults, in torch's positional order
    kind       "elementwise", "compare" (bool result), "logical" (bool in and out),
               "cast" or "reduce"
    aliases    other names a user may write (torch.multiply, torch.clip, ...)
    doc        one line for the op reference
    commutative, identity   algebraic traits the rewrite rules read
    selects    the inputs the result is always one of (where's a and b, maximum's two): where
               they all are conditions, so is the result, as in torch
    vjp        derivative rule: vjp(g, *inputs, y, **params) -> one gradient per input (a Sym,
               or None where no gradient flows), built from ops on `Sym` values; g is the
               gradient of the result y. Reductions also get `count=` (a Sym: how many
               elements each result folds). Every op has one (comparisons return Nones).
    """

    name: str
    arity: int
    ref: Callable[..., torch.Tensor]
    params: tuple[tuple[str, Any], ...] = ()
    kind: str = "elementwise"
    aliases: tuple[str, ...] = ()
    doc: str = ""
    commutative: bool = False
    identity: float | None = None
    selects: tuple[int, ...] = ()
    cost: Cost = field(default_factory=Cost)
    vjp: Callable[..., tuple] | None = None

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.params)

    def __call__(self, *args, **kwargs):
        """Run the op on torch tensors (or numbers), so an epilogue is its own reference.

        The same reading as the parser's: max(a, b) / min(a, b) with a second operand that is
        not an int dim are elementwise; clamp bounds may be tensors.
        """
        if any(isinstance(a, Sym) for a in args[:self.arity]):
            return self._build(args, kwargs)  # a derivative rule building IR (see Sym)
        if self.name in ("max", "min") and len(args) == 2 and not kwargs and not isinstance(args[1], (int, tuple)):
            return OPS["maximum" if self.name == "max" else "minimum"](*args)
        tensors = [a if isinstance(a, torch.Tensor) else torch.as_tensor(a) for a in args[:self.arity]]
        params = dict(self.params)
        for name, value in zip(self.param_names, args[self.arity:]):
            params[name] = value
        params.update(kwargs)
        return self.ref(*tensors, **params)

    def _build(self, args, kwargs) -> "Sym":
        from ..ir import Node
        params = dict(zip(self.param_names, args[self.arity:]))
        params.update(kwargs)
        src = tuple(Sym.lift(a).node for a in args[:self.arity])
        return Sym(Node(self.name, src, tuple(sorted(params.items())) if params else None))

    def __repr__(self) -> str:
        return f"OpDef({self.name})"


class Sym:
    """A value in a derivative rule: an IR node with arithmetic that builds nodes.

    `g * y * (1.0 - y)` and `where(x > 0.0, g, 0.0)` (with `where` the registry op) build the
    same interned nodes the binder would. `==` keeps Python's meaning; write `eq(a, b)`.
    """

    __slots__ = ("node",)

    def __init__(self, node):
        self.node = node

    @staticmethod
    def lift(value) -> "Sym":
        if isinstance(value, Sym):
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"a derivative rule used {type(value).__name__}; only Syms and numbers mix")
        from ..ir import const
        return Sym(const(float(value)))

    def _binary(self, name, other, reverse=False):
        a, b = (Sym.lift(other), self) if reverse else (self, Sym.lift(other))
        return OPS[name](a, b)

    def __add__(self, o): return self._binary("add", o)
    def __radd__(self, o): return self._binary("add", o, True)
    def __sub__(self, o): return self._binary("sub", o)
    def __rsub__(self, o): return self._binary("sub", o, True)
    def __mul__(self, o): return self._binary("mul", o)
    def __rmul__(self, o): return self._binary("mul", o, True)
    def __truediv__(self, o): return self._binary("div", o)
    def __rtruediv__(self, o): return self._binary("div", o, True)
    def __pow__(self, o): return self._binary("pow", o)
    def __lt__(self, o): return self._binary("lt", o)
    def __le__(self, o): return self._binary("le", o)
    def __gt__(self, o): return self._binary("gt", o)
    def __ge__(self, o): return self._binary("ge", o)
    def __and__(self, o): return self._binary("logical_and", o)
    def __or__(self, o): return self._binary("logical_or", o)
    def __neg__(self): return OPS["neg"](self)
    def __invert__(self): return OPS["logical_not"](self)

    def __repr__(self) -> str:
        return f"Sym({self.node!r})"


OPS: dict[str, OpDef] = {}
_SPELLINGS: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    for spelling in (op.name, *op.aliases):
        if spelling in _SPELLINGS:
            raise RuntimeError(f"op spelling {spelling!r} registered twice")
        _SPELLINGS[spelling] = op
    OPS[op.name] = op
    return op


def lookup(spelling: str) -> OpDef | None:
    """The op a user-written name means, or None."""
    return _SPELLINGS.get(spelling)


def spellings() -> list[str]:
    return sorted(_SPELLINGS)
