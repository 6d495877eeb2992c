"""The ops registry: one `OpDef` per op, read by every part of epifuse.

The parser's vocabulary, the reference executor, every backend's lowering table, the op
reference in the docs and the "did you mean" suggestions all come from `OPS`. A backend that
has no rule for an op reports the op as unsupported (see `backends.base`), never a KeyError.
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
    cost: Cost = field(default_factory=Cost)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.params)

    def __call__(self, *args, **kwargs):
        """Run the op on torch tensors (or numbers), so an epilogue is its own reference."""
        tensors = [a if isinstance(a, torch.Tensor) else torch.as_tensor(a) for a in args[:self.arity]]
        params = dict(self.params)
        for name, value in zip(self.param_names, args[self.arity:]):
            params[name] = value
        params.update(kwargs)
        return self.ref(*tensors, **params)

    def __repr__(self) -> str:
        return f"OpDef({self.name})"


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
