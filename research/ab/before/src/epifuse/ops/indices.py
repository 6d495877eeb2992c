"""Indices: where each element of accum is. `row()` is its index along M and `col()` along N,
global (not within a tile) and counted from 0 in every batch, as floats (exact below 2**24), so
`where(col() == target, z, 0.0)` with `target` an (M, 1) column of class indices picks each
row's target logit. `row(accum)` and `col(accum)` spell the same in an epilogue (the parser
reads the argument as accum's shape and needs it to be accum) and on torch tensors, where the
shape must be given, so an epilogue written with them is its own eager reference.
"""
from __future__ import annotations

import torch

from ..errors import ShapeError
from .registry import Cost, OpDef, register


def _index_reference(name: str, axis: int):
    along = "M" if axis == -2 else "N"

    def ref(accum=None):
        if not isinstance(accum, torch.Tensor):
            raise TypeError(f"{name}() is the position of each element of accum along "
                            f"{along}; on torch tensors, call it as {name}(accum) (which an epilogue takes too)")
        if accum.dim() < 2:
            raise ShapeError(f"{name}(accum) needs accum of 2 or 3 dimensions ((M, N) or (L, M, N)), "
                             f"got shape {tuple(accum.shape)}.",
                             hint=f"Pass the accumulator A @ B itself: {name}(accum) counts along its {along}.")
        shape = [1] * accum.dim()
        shape[axis] = accum.shape[axis]
        return torch.arange(accum.shape[axis], device=accum.device, dtype=torch.float32).reshape(shape)
    ref.__name__ = name
    return ref


def _no_gradient(g, y):
    return ()


row = register(OpDef("row", 0, _index_reference("row", -2), kind="index", axis="M", vjp=_no_gradient,
                     doc="the index along M of each element of accum (from 0 in every batch; exact below "
                         "2**24); row(accum) is the same, and also runs on torch tensors", cost=Cost(1)))
col = register(OpDef("col", 0, _index_reference("col", -1), kind="index", axis="N", vjp=_no_gradient,
                     doc="the index along N of each element of accum (exact below 2**24); col(accum) is the "
                         "same, and also runs on torch tensors", cost=Cost(1)))

__all__ = ["row", "col"]
