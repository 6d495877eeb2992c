"""Algebraic rewrites that keep torch's results (NaN and Inf included) while doing less work."""
from __future__ import annotations

import math

from .. import ops
from ..ir import CONST, Graph, Node, const, op
from ..rewrite import rewrite

_MIN_NORMAL = 2.0 ** -126


def _is_const(node: Node, value: float) -> bool:
    """A literal equal to value, sign of zero included."""
    return (node.op is CONST and node.arg == value
            and math.copysign(1.0, node.arg) == math.copysign(1.0, value))


def drop_identity_element(node: Node) -> Node | None:
    """x * 1 -> x, x + (-0.0) -> x, x - 0 -> x, x / 1 -> x (x + 0.0 stays: -0.0 + 0.0 is +0.0)."""
    opdef = node.op
    if opdef.identity is None or opdef.kind != "elementwise" or len(node.src) != 2:
        return None
    a, b = node.src
    if _is_const(b, opdef.identity) and a.dtype == "float":
        return a
    if opdef.commutative and _is_const(a, opdef.identity) and b.dtype == "float":
        return b
    return None


def cancel_double_negation(node: Node) -> Node | None:
    """neg(neg(x)) -> x"""
    if node.op is ops.neg and node.src[0].op is ops.neg:
        return node.src[0].src[0]
    return None


def pow_by_small_integer(node: Node) -> Node | None:
    """x ** 1 -> x, x ** 2 -> square(x), x ** 0.5 -> sqrt(x), x ** -1 -> reciprocal(x)"""
    if node.op is not ops.pow or node.src[1].op is not CONST:
        return None
    x, exponent = node.src[0], node.src[1].arg
    if node.src[0].dtype != "float":
        return None
    return {1.0: lambda: x, 2.0: lambda: op(ops.square, x), 0.5: lambda: op(ops.sqrt, x),
            -1.0: lambda: op(ops.reciprocal, x)}.get(exponent, lambda: None)()


def stable_log_sigmoid(node: Node) -> Node | None:
    """log(sigmoid(x)) -> 0 - softplus(-x): finite for very negative x, where sigmoid underflows;
    +0.0, as torch's log(1), where softplus(-x) underflows to 0 (a negation would give -0.0)."""
    if node.op is ops.log and node.src[0].op is ops.sigmoid:
        x = node.src[0].src[0]
        return op(ops.sub, const(0.0), op(ops.softplus, op(ops.neg, x), beta=1.0, threshold=20.0))
    return None


def log_of_clamped_sigmoid(node: Node) -> Node | None:
    """log(clamp(sigmoid(x), lo, hi)) -> -log1p(exp(clamp(-x, log(1/hi - 1), log(1/lo - 1)))) for
    0 < lo < 1, lo <= hi (hi at 1 or above, or absent: no lower clamp): the clamped-probability
    log of a BCE loss without the sigmoid's division, as log(1 + e) with e = exp(-x) kept in
    [1/hi - 1, 1/lo - 1] by clamping exp's argument (exp increases), so that 1 + e is never
    rounded and exp never overflows to inf, whose derivative times the clamp's zero would be NaN.
    More accurate than the original, which rounds sigmoid and then its log; the clamp's bounds
    hold to exp's rounding. Without a lower clamp, or one at 1 or above or below the normal
    floats, it does not apply."""
    if node.op is not ops.log or node.src[0].op is not ops.clamp or node.src[0].src[0].op is not ops.sigmoid:
        return None
    clamp = node.src[0]
    lo, hi = clamp.params.get("min"), clamp.params.get("max")  # floats or absent
    # lo normal: exp's argument stays below log(2**126), short of fp32's overflow at 88.7
    if lo is None or not _MIN_NORMAL <= lo < 1.0 or (hi is not None and not lo <= hi < math.inf):
        return None
    x = clamp.src[0].src[0]
    top = math.log(1.0 / lo - 1.0)
    if hi is not None and hi < 1.0:  # the log is positive: a negation
        e = op(ops.exp, op(ops.clamp, op(ops.neg, x), min=math.log(1.0 / hi - 1.0), max=top))
        return op(ops.neg, op(ops.log1p, e))
    # log1p(0) = +0.0 where sigmoid rounds to 1: 0 - log1p(e), not -log1p(e), keeps its sign
    return op(ops.sub, const(0.0), op(ops.log1p, op(ops.exp, op(ops.minimum, op(ops.neg, x), const(top)))))


def fuse_silu(node: Node) -> Node | None:
    """x * sigmoid(x) -> silu(x)"""
    if node.op is not ops.mul:
        return None
    a, b = node.src
    if b.op is ops.sigmoid and b.src[0] is a:
        return op(ops.silu, a)
    if a.op is ops.sigmoid and a.src[0] is b:
        return op(ops.silu, b)
    return None


RULES = [drop_identity_element, cancel_double_negation, pow_by_small_integer,
         stable_log_sigmoid, log_of_clamped_sigmoid, fuse_silu]


def simplify_algebra(graph: Graph) -> Graph:
    return rewrite(graph, RULES)


__all__ = ["simplify_algebra", "RULES"]
