"""Reductions over accum's dimensions: sum, mean, max, min, amax (max of |x|), logsumexp.

A reduction's input is broadcast to accum's shape first, so `dim` always counts accum's
dimensions ((M, N) or (L, M, N)); `dim=None` reduces everything. Each op's `Reduction` says
what it folds and how partial results combine; sums accumulate in fp32 (or float64 in the
reference) whatever the destination's dtype.
"""
from __future__ import annotations

import torch

from .registry import OPS, Cost, OpDef, Reduction, register


def _reference(reduction: Reduction):
    """The torch reference of a reduction: its fold over `dim` (everything for None, as
    torch.sum(x) does)."""
    def ref(x, dim=None, keepdim=False):
        x = x if x.is_floating_point() else x.float()
        if reduction.magnitude:
            x = x.abs()
        if reduction.combine == "add":
            fold = torch.mean if reduction.mean else torch.sum
            return fold(x) if dim is None else fold(x, dim=dim, keepdim=keepdim)
        if reduction.combine == "logsumexp":
            return torch.logsumexp(x, dim=tuple(range(x.dim())) if dim is None else dim, keepdim=keepdim)
        fold = torch.amax if reduction.combine == "maximum" else torch.amin
        return fold(x, dim=() if dim is None else dim, keepdim=keepdim)
    return ref


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


def _logsumexp_vjp(g, x, y, dim=None, keepdim=False, count=None):
    return (g * OPS["exp"](x - y),)   # softmax(x) along the folded dims


def _reduction(name, reduction: Reduction, doc: str, vjp, cost=None) -> OpDef:
    # sums and means are linear: over complex values, those of the real and imaginary parts
    linear = reduction.combine == "add" and not reduction.magnitude
    return register(OpDef(name, 1, _reference(reduction), params=_PARAMS, kind="reduce", doc=doc,
                          cost=cost or Cost(), vjp=vjp, reduction=reduction,
                          complex=_each_part(name) if linear else None))


def _each_part(name):
    """Each part folded; a part known to be zero stays a reduction of the reduced shape (of the
    other part times 0.0), so the result's two parts are outputs of one shape."""
    def rule(call, x, **params):
        if x[0] is None and x[1] is None:
            return None, None
        return tuple(call(name, part if part is not None else call("mul", other, 0.0), **params)
                     for part, other in zip(x, x[::-1]))
    return rule


sum = _reduction("sum", Reduction("add", 0.0), "sum over dim (fp32 accumulation)", _sum_vjp)
mean = _reduction("mean", Reduction("add", 0.0, mean=True), "mean over dim", _mean_vjp)
max = _reduction("max", Reduction("maximum", float("-inf"), needs_elements=True),
                 "maximum over dim (with two tensors: elementwise maximum)", _extreme_vjp)
min = _reduction("min", Reduction("minimum", float("inf"), needs_elements=True),
                 "minimum over dim (with two tensors: elementwise minimum)", _extreme_vjp)
amax = _reduction("amax", Reduction("maximum", 0.0, magnitude=True, needs_elements=True),
                  "maximum of |x| over dim (for fp8 scaling)", _amax_vjp, Cost(2))
logsumexp = _reduction("logsumexp", Reduction("logsumexp", float("-inf")),
                       "log(sum(exp(x))) over dim, stable: each tile folds exp(x - its max), and the "
                       "tiles' results fold by a log-sum-exp of theirs (-inf over nothing)",
                       _logsumexp_vjp, Cost(3, 1))

__all__ = [n for n, v in list(globals().items()) if isinstance(v, OpDef)]
