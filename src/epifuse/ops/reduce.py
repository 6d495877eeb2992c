"""Reductions over accum's dimensions: sum, mean, max, min, amax (max of |x|).

A reduction's input is broadcast to accum's shape first, so `dim` always counts accum's
dimensions ((M, N) or (L, M, N)); `dim=None` reduces everything. Sums accumulate in fp32 (or
float64 in the reference) whatever the destination's dtype.
"""
from __future__ import annotations

import torch

from .registry import OPS, Cost, OpDef, register


def _reducer(fn):
    def ref(x, dim=None, keepdim=False):
        x = x if x.is_floating_point() else x.float()
        return fn(x, dim, keepdim)
    return ref


def _sum(x, dim, keepdim):
    return torch.sum(x, dim=dim, keepdim=keepdim) if dim is not None else torch.sum(x)


def _mean(x, dim, keepdim):
    return torch.mean(x, dim=dim, keepdim=keepdim) if dim is not None else torch.mean(x)


def _max(x, dim, keepdim):
    return torch.amax(x, dim=dim if dim is not None else (), keepdim=keepdim)


def _min(x, dim, keepdim):
    return torch.amin(x, dim=dim if dim is not None else (), keepdim=keepdim)


def _amax(x, dim, keepdim):
    return _max(x.abs(), dim, keepdim)


_PARAMS = (("dim", None), ("keepdim", False))

# Derivative rules: g (the result's gradient) varies only along the kept axes and broadcasts
# back over the reduced ones. y is the reduction's value (an input of the backward graph) and
# count how many elements each value folds. max/min/amax send g to every element equal to the
# extreme (ties each get all of g; torch splits it evenly between them).


def _sum_vjp(g, x, y, dim=None, keepdim=False, count=None):
    return (g,)


def _mean_vjp(g, x, y, dim=None, keepdim=False, count=None):
    return (g / count,)


def _extreme_vjp(g, x, y, dim=None, keepdim=False, count=None):
    return (OPS["where"](OPS["eq"](x, y), g, 0.0),)


def _amax_vjp(g, x, y, dim=None, keepdim=False, count=None):
    return (OPS["where"](OPS["eq"](OPS["abs"](x), y), g * OPS["sign"](x), 0.0),)


sum = register(OpDef("sum", 1, _reducer(_sum), params=_PARAMS, kind="reduce",
                     doc="sum over dim (fp32 accumulation)", identity=0.0, vjp=_sum_vjp))
mean = register(OpDef("mean", 1, _reducer(_mean), params=_PARAMS, kind="reduce",
                      doc="mean over dim", vjp=_mean_vjp))
max = register(OpDef("max", 1, _reducer(_max), params=_PARAMS, kind="reduce",
                     doc="maximum over dim (with two tensors: elementwise maximum)", vjp=_extreme_vjp))
min = register(OpDef("min", 1, _reducer(_min), params=_PARAMS, kind="reduce",
                     doc="minimum over dim (with two tensors: elementwise minimum)", vjp=_extreme_vjp))
amax = register(OpDef("amax", 1, _reducer(_amax), params=_PARAMS, kind="reduce",
                      doc="maximum of |x| over dim (for fp8 scaling)", cost=Cost(2), vjp=_amax_vjp))

__all__ = [n for n, v in list(globals().items()) if isinstance(v, OpDef)]
