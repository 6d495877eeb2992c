"""Joins: `torch.cat((a, b), dim=-1)` of two values of a gated epilogue's half-width tile
(`x1, x2 = accum.chunk(2, dim=-1)`, each N / 2 wide) is an output of full width N, a's columns
first, then b's: RoPE's `cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)` in the kernel of
the q/k projection. No value of full width exists inside the kernel: the join is the value of
a returned output only, which the gated kernel stores in two pieces, at columns rn and
rn + N / 2. The parser and the binder refuse every other use by name (torch's default dim, 0,
among them: written without dim=-1 the join would be along the rows). Called on torch tensors
it runs torch.cat.
"""
from __future__ import annotations

import torch

from .registry import Cost, OpDef, register


def _cat(a, b, dim=0):
    return torch.cat((a, b), dim=dim)


cat = register(OpDef("cat", 2, _cat, params=(("dim", 0),), kind="join", aliases=("concat", "concatenate"),
                     sequence=True, cost=Cost(0),
                     doc="a and b side by side along dim (torch's default 0): in an epilogue, dim=-1 only, "
                         "joining two half-width tiles of a gated epilogue (accum.chunk(2, dim=-1)) into an "
                         "output of full width N, a's columns first; only as the value of a returned output"))

__all__ = ["cat"]
