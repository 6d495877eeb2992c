"""TRITON: how each registry op lowers to Triton source, one entry per op.

A rule takes the source expressions (strings) and the op's parameters and returns an
expression. An op with no rule is refused by `supports()`, with its reason from UNSUPPORTED
(empty while every op has a rule) or "no Triton lowering yet". Helpers are `@triton.jit` device functions, emitted into a kernel file only when a
rule uses them; each has a formula version (the CPU interpreter has no libdevice) and, where
it is more accurate at little cost, a CUDA version. The formulas keep torch's NaN and Inf
results. User-visible division (`/`, reciprocal) rounds as IEEE division does, like torch;
divisions inside activations use the fast full-range division (2 ulp), which on Hopper
halves the cost of a sigmoid or tanh epilogue.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Callable

import torch

from ... import ops
from ...ir import CONST
from ...ops import OPS, OpDef, rounding_dtype

# The element type Triton gives a pointer to each torch dtype's tensors, and casts to.
TL_TYPES = {
    torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
    torch.float64: "tl.float64", torch.int8: "tl.int8", torch.uint8: "tl.uint8",
    torch.int16: "tl.int16", torch.int32: "tl.int32", torch.int64: "tl.int64",
    torch.float8_e4m3fn: "tl.float8e4nv", torch.float8_e5m2: "tl.float8e5",
}


@dataclass(frozen=True)
class Rule:
    emit: Callable[..., str]
    helpers: tuple[str, ...] = ()
    # operand positions the rule reads through: it gets that operand's own operand, and computes
    # the operand itself in a form that is exact where the rule applies
    through: tuple[int, ...] = ()


def _f(value: float) -> str:
    """A float literal in Triton source, rounded to fp32 so Triton types it as fp32."""
    value = float(value)
    if math.isnan(value):
        return "(_INF - _INF)"
    if math.isinf(value):
        return "_INF" if value > 0 else "(-_INF)"
    value32 = struct.unpack("<f", struct.pack("<f", value))[0] if abs(value) < 3.4028235e38 else value
    if math.isinf(value32) or abs(value) >= 3.4028235e38:
        return "_INF" if value > 0 else "(-_INF)"
    if value32 != 0.0 and abs(value32) < 1.1754943508222875e-38:
        value32 = math.copysign(0.0, value32)  # fp32 subnormal literals would be typed as fp64 by Triton
    if value32 == 0.0 and math.copysign(1.0, value32) < 0:
        # -0.0 from its bits: Triton (3.6 and before) makes a constant that equals 0 +0.0
        return "tl.cast(-2147483648, tl.float32, bitcast=True)"
    return repr(value32)


_NAN_ALL = "propagate_nan=tl.PropagateNan.ALL"

# The float8_e4m3fn code of what rounds past 448, and of inf, in the installed torch's cast:
# 0x7E (448, saturated) or 0x7F (NaN)
E4M3_OVERFLOW = int(torch.tensor(480.0).to(torch.float8_e4m3fn).view(torch.uint8))

TRITON: dict[OpDef, Rule] = {
    ops.add: Rule(lambda a, b: f"({a} + {b})"),
    ops.sub: Rule(lambda a, b: f"({a} - {b})"),
    ops.mul: Rule(lambda a, b: f"({a} * {b})"),
    ops.div: Rule(lambda a, b: f"tl.div_rn({a}, {b})"),
    ops.pow: Rule(lambda a, b: f"_pow({a}, {b})", ("_pow",)),
    ops.minimum: Rule(lambda a, b: f"tl.minimum({a}, {b}, {_NAN_ALL})"),
    ops.maximum: Rule(lambda a, b: f"tl.maximum({a}, {b}, {_NAN_ALL})"),
    ops.lt: Rule(lambda a, b: f"({a} < {b})"),
    ops.le: Rule(lambda a, b: f"({a} <= {b})"),
    ops.gt: Rule(lambda a, b: f"({a} > {b})"),
    ops.ge: Rule(lambda a, b: f"({a} >= {b})"),
    ops.eq: Rule(lambda a, b: f"({a} == {b})"),
    ops.ne: Rule(lambda a, b: f"({a} != {b})"),
    # where, not & and |: the interpreter broadcasts a scalar condition as a float array,
    # which numpy's bitwise_and refuses next to a bool tile.
    ops.logical_and: Rule(lambda a, b: f"tl.where({a}, {b}, False)"),
    ops.logical_or: Rule(lambda a, b: f"tl.where({a}, True, {b})"),
    ops.logical_not: Rule(lambda a: f"({a} == 0)"),
    # Triton's unary minus is 0 - x: +0.0 for +0.0, and an instruction of its own on Hopper;
    # x * -1.0 is IEEE negation, which the CUDA compiler folds into the next operation
    ops.neg: Rule(lambda a: f"({a} * -1.0)"),
    ops.abs: Rule(lambda a: f"tl.abs({a})"),
    ops.sqrt: Rule(lambda a: f"tl.sqrt_rn({a})"),
    ops.rsqrt: Rule(lambda a: f"tl.rsqrt({a})"),
    ops.square: Rule(lambda a: f"({a} * {a})"),
    ops.reciprocal: Rule(lambda a: f"tl.div_rn(1.0, {a})"),
    ops.sign: Rule(lambda a: f"tl.where({a} > 0, 1.0, tl.where({a} < 0, -1.0, 0.0))"),  # NaN -> 0 as torch
    ops.exp: Rule(lambda a: f"tl.exp({a})"),
    ops.exp2: Rule(lambda a: f"tl.exp2({a})"),
    ops.expm1: Rule(lambda a: f"_expm1({a})", ("_expm1",)),
    ops.log: Rule(lambda a: f"tl.log({a})"),
    ops.log2: Rule(lambda a: f"tl.log2({a})"),
    ops.log1p: Rule(lambda a: f"_log1p({a})", ("_log1p",)),
    ops.sin: Rule(lambda a: f"tl.sin({a})"),
    ops.cos: Rule(lambda a: f"tl.cos({a})"),
    ops.tan: Rule(lambda a: f"_tan({a})", ("_tan",)),
    ops.erf: Rule(lambda a: f"tl.erf({a})"),
    ops.tanh: Rule(lambda a: f"_tanh({a})", ("_tanh",)),
    ops.sigmoid: Rule(lambda a: f"_sigmoid({a})", ("_sigmoid",)),
    ops.relu: Rule(lambda a: f"tl.maximum({a}, 0.0, {_NAN_ALL})"),
    ops.relu6: Rule(lambda a: f"_clamp({a}, 0.0, 6.0)", ("_clamp",)),
    ops.silu: Rule(lambda a: f"tl.fdiv({a}, 1.0 + tl.exp({a} * -1.0))"),
    ops.hardswish: Rule(lambda a: f"tl.div_rn({a} * _clamp({a} + 3.0, 0.0, 6.0), 6.0)", ("_clamp",)),
    ops.hardsigmoid: Rule(lambda a: f"tl.div_rn(_clamp({a} + 3.0, 0.0, 6.0), 6.0)", ("_clamp",)),
    ops.mish: Rule(lambda a: f"({a} * _tanh(_softplus({a}, 1.0, 20.0)))", ("_tanh", "_softplus")),
    ops.where: Rule(lambda c, a, b: f"tl.where({c}, {a}, {b})"),
    ops.multiply_add: Rule(lambda a, b, c: f"({a} * {b} + {c})"),
    ops.prelu: Rule(lambda x, w: f"tl.where({x} >= 0, {x}, {w} * {x})"),
    ops.clamp: Rule(lambda a, min=None, max=None: _clamp(a, min, max), ("_clamp",)),
    ops.leaky_relu: Rule(lambda a, negative_slope=0.01:
                       f"tl.where({a} > 0, {a}, {a} * {_f(negative_slope)})"),
    ops.elu: Rule(lambda a, alpha=1.0: f"tl.where({a} > 0, {a}, {_f(alpha)} * _expm1({a}))",
                ("_expm1",)),
    ops.gelu: Rule(lambda a, approximate="none": f"_gelu_{approximate}({a})",
                 ("_gelu_none", "_gelu_tanh")),
    ops.softplus: Rule(lambda a, beta=1.0, threshold=20.0:
                     f"_softplus({a}, {_f(beta)}, {_f(threshold)})", ("_softplus",)),
    ops.to: Rule(lambda a, dtype="float32": f"{a}.to({TL_TYPES[rounding_dtype(dtype)]}).to(tl.float32)"),
    # rm and rn: the global row and column indices every template defines before its epilogue
    ops.row: Rule(lambda: "rm[:, None].to(tl.float32)"),
    ops.col: Rule(lambda: "rn[None, :].to(tl.float32)"),
}

# x.to(dtype) where Triton's own cast is not torch's: bf16 and fp8 in the interpreter (which
# truncates, drops rounding carries and garbles NaN); fp8 on CUDA, whose cvt.rn.satfinite
# saturates where torch's float8_e5m2 overflows to infinity (and its float8_e4m3fn to NaN, in
# torch versions that do not saturate: E4M3_OVERFLOW)
ROUND_THROUGH = {
    torch.bfloat16: Rule(lambda a, dtype=None: f"_round_bf16({a})", ("_round_bf16",)),
    torch.float8_e4m3fn: Rule(lambda a, dtype=None: f"_round_e4m3({a})", ("_round_e4m3",)),
    torch.float8_e5m2: Rule(lambda a, dtype=None: f"_round_e5m2({a})", ("_round_e5m2",)),
}

# A log whose argument a clamp keeps inside the normal positive floats needs no subnormal, zero,
# negative or infinity cases: a polynomial alone, 16 instructions where tl.log takes 26 on Hopper.
LOG_OF_NORMAL = Rule(lambda a: f"_log_normal({a})", ("_log_normal",))
_NORMAL_RANGE = (2.0 ** -125, 2.0 ** 125)


# exp(y) with subnormal results flushed to zero: exact wherever what the result meets absorbs a
# subnormal. c + exp(y) with |c| >= 2**-100, since c plus a subnormal rounds to c (the position of
# the exp among the add's operands picks the rule); an exp clamped below at a normal number
# (MIN_NORMAL or more: the epilogue emitter's logs of products, epilogue._log_of_products)
EXP_FLUSHED = Rule(lambda y: f"_exp_flushed({y})", ("_exp_flushed",))
ADD_EXP_FLUSHED = (Rule(lambda y, c: f"({c} + {EXP_FLUSHED.emit(y)})", EXP_FLUSHED.helpers, through=(0,)),
                   Rule(lambda c, y: f"({c} + {EXP_FLUSHED.emit(y)})", EXP_FLUSHED.helpers, through=(1,)))
_ABSORBS_SUBNORMALS = 2.0 ** -100
MIN_NORMAL = 2.0 ** -126


# log(1 + v) for v in (0, 2**120]: the log of normal numbers, plus the rounding of 1 + v
LOG1P_OF_EXCESS = Rule(lambda a: f"_log1p_of_excess({a})", ("_log1p_of_excess",))
_EXCESS_RANGE = (0.0, 2.0 ** 120)


def rule_for(node) -> Rule | None:
    """The rule that lowers `node`: its op's, or a cheaper one its operands allow."""
    if node.op is ops.to:
        found = ROUND_THROUGH.get(rounding_dtype(node.params.get("dtype", "float32")))
        if found is not None:
            return found
    if node.op is ops.log:
        low, high = value_bounds(node.src[0])
        if _NORMAL_RANGE[0] <= low and high <= _NORMAL_RANGE[1]:
            return LOG_OF_NORMAL
    if node.op is ops.log1p:
        low, high = value_bounds(node.src[0])
        if _EXCESS_RANGE[0] < low and high <= _EXCESS_RANGE[1]:
            return LOG1P_OF_EXCESS
    if node.op is ops.exp and value_bounds(node)[0] >= MIN_NORMAL:  # no result is subnormal
        return EXP_FLUSHED
    if node.op is ops.add:
        for k in (0, 1):
            exp, other = node.src[k], node.src[1 - k]
            if exp.op is ops.exp and other.op is CONST and abs(other.arg) >= _ABSORBS_SUBNORMALS:
                return ADD_EXP_FLUSHED[k]
    return TRITON.get(node.op)


@dataclass(frozen=True)
class LogSum:
    """A summand `rest + sign * log(y)` (rest None: no other term) whose logs are summed as one
    log per `group` neighbouring columns; `arg` is y, or e where the log is log1p(e) (y = 1 + e).
    Direct: log(y_1 ... y_group), where y stays away from 1 (the product's rounding,
    (group - 1) / 2 ulp of it, is then a few ulp of the logs' sum). Shifted, where y >= 1: with
    u = y - 1 (exact, or e itself), (1 + a)(1 + b) - 1 = a + b + ab keeps the product's excess
    over 1 to a few ulp, and log1p of it keeps them, near 1 as well."""
    rest: object
    sign: float
    arg: object
    group: int
    shifted: bool
    plus_one: bool = False  # arg is log1p's e: the excess itself

_GROUPS = (8, 4, 2)
_PRODUCT_LOG2_RANGE = (-120.0, 120.0)  # products inside _NORMAL_RANGE, with room for rounding
_AWAY_FROM_ONE = (0.78, 1.28)          # |log y| >= 0.24: a direct product costs at most 4 ulp


def log_sum(node) -> LogSum | None:
    """The LogSum of a summed node of the form log(y), -log(y), a + log(y), log(y) + a or a - log(y)
    (log(y) or -log(y) in each), where y's bounds allow a group; None otherwise."""
    def signed_log(n):
        if n.op is ops.log or n.op is ops.log1p:
            return n.src[0], 1.0, n.op is ops.log1p
        if n.op is ops.neg and (n.src[0].op is ops.log or n.src[0].op is ops.log1p):
            return n.src[0].src[0], -1.0, n.src[0].op is ops.log1p
        return None

    rest, found = None, signed_log(node)
    if found is None and (node.op is ops.add or node.op is ops.sub):
        a, b = node.src
        found, rest = signed_log(b), a
        if found is not None and node.op is ops.sub:
            found = (found[0], -found[1], found[2])
        elif found is None and node.op is ops.add:
            found, rest = signed_log(a), b
    if found is None:
        return None
    arg, sign, plus_one = found
    low, high = value_bounds(arg)
    if plus_one:  # log1p(e), e >= 0: always shifted, e being the excess (no 1 + e to round)
        if not low >= 0.0:
            return None
        low, high, shifted = 1.0 + low, 1.0 + high, True
    else:
        shifted = low >= 1.0 and low < _AWAY_FROM_ONE[1]
    if not (shifted or 0.0 < low and high <= _AWAY_FROM_ONE[0] or low >= _AWAY_FROM_ONE[1]):
        return None
    for group in _GROUPS:  # an infinite bound fits no group
        if (_PRODUCT_LOG2_RANGE[0] <= group * math.log2(low)
                and group * math.log2(high) <= _PRODUCT_LOG2_RANGE[1]):
            return LogSum(rest, sign, arg, group, shifted, plus_one)
    return None


def value_bounds(node, _known: dict | None = None) -> tuple[float, float]:
    """Bounds every non-NaN value of `node` lies within, as far as constants, clamps,
    elementwise minimum / maximum with constants and exp of those show (exp's widened by
    2**-16 for fp32's rounding of its argument times log2(e), ~1e-5 near overflow); (-inf, inf)
    otherwise."""
    known = {} if _known is None else _known  # a node shared by both operands is bounded once
    if id(node) not in known:
        known[id(node)] = _bounds(node, known)
    return known[id(node)]


def _bounds(node, known: dict) -> tuple[float, float]:
    if node.op is CONST:
        return node.arg, node.arg
    if node.op is ops.exp:
        low, high = value_bounds(node.src[0], known)
        return (_exp_bound(low) * (1.0 - _EXP_ROUNDING), _exp_bound(high) * (1.0 + _EXP_ROUNDING))
    if node.op is ops.clamp:
        # a clamp's bounds are numbers or absent: the parser turns value bounds into maximum / minimum
        low, high = node.params.get("min", -math.inf), node.params.get("max", math.inf)
        x_low, x_high = value_bounds(node.src[0], known)
        return min(max(x_low, low), high), min(max(x_high, low), high)  # min > max gives max
    if node.op is ops.minimum or node.op is ops.maximum:
        pick = min if node.op is ops.minimum else max
        (a_low, a_high), (b_low, b_high) = (value_bounds(s, known) for s in node.src)
        return pick(a_low, b_low), pick(a_high, b_high)
    return -math.inf, math.inf


_EXP_ROUNDING = 2.0 ** -16


def _exp_bound(x: float) -> float:
    return math.inf if x > 709.0 else math.exp(x)


# Ops with no Triton rule, and why (supports() reports the reason).
UNSUPPORTED: dict[OpDef, str] = {}


def _clamp(a: str, lo, hi) -> str:
    lo_s = _f(lo) if lo is not None else "-_INF"
    hi_s = _f(hi) if hi is not None else "_INF"
    if lo is None and hi is None:
        return a
    if lo is None:
        return f"tl.minimum({a}, {hi_s}, {_NAN_ALL})"
    if hi is None:
        return f"tl.maximum({a}, {lo_s}, {_NAN_ALL})"
    return f"_clamp({a}, {lo_s}, {hi_s})"


# Device helpers: name -> {"any": formula source, "cuda": optional faster/accurate source}.
HELPERS: dict[str, dict[str, str]] = {
    "_clamp": {"any": '''
@triton.jit
def _clamp(x, lo, hi):
    # min(max(x, lo), hi): NaN stays NaN, and lo > hi gives hi, as torch.clamp does; two
    # instructions where compare-and-select takes four.
    return tl.minimum(tl.maximum(x, lo, propagate_nan=tl.PropagateNan.ALL), hi,
                      propagate_nan=tl.PropagateNan.ALL)
'''},
    "_log_normal": {"any": '''
@triton.jit
def _log_normal(x):
    # log(x) for x in [2**-125, 2**125] or NaN, within 1 ulp: x = 2**k * m with m in [2/3, 4/3)
    # (k from the bits, m by an exact scaling that keeps NaN), log(m) = log1p(f) with f = m - 1
    # exact, f - f**2/2 + f**3 q(f) and q a degree-7 fit on [-1/3, 1/3]; plus k log(2).
    k = (x.to(tl.int32, bitcast=True) - 0x3F2AAAAB) & -8388608
    f = x * (0x3F800000 - k).to(tl.float32, bitcast=True) - 1.0
    q = f * -0.12883572280406952 + 0.1403375267982483
    q = q * f + -0.12187246233224869
    q = q * f + 0.1399536430835724
    q = q * f + -0.16680173575878143
    q = q * f + 0.2001110017299652
    q = q * f + -0.249998077750206
    q = q * f + 0.33333203196525574
    r = (f * f) * (q * f - 0.5) + f
    return k.to(tl.float32) * 8.262958405176314e-08 + r  # k * 2**23 * (log(2) * 2**-23)
'''},
    "_log1p_of_excess": {"any": '''
@triton.jit
def _log1p_of_excess(v):
    # log(1 + v) for v in [0, 2**120] or NaN: the log of w = 1 + v, plus the rounding of that
    # sum relative to w (w - 1 is exact below 2**24; above, the term is below an ulp of the log)
    w = 1.0 + v
    return _log_normal(w) + tl.fdiv(v - (w - 1.0), w)
'''},
    "_sigmoid": {"any": '''
@triton.jit
def _sigmoid(x):
    return tl.fdiv(1.0, 1.0 + _exp_flushed(x * -1.0))
'''},
    "_exp_flushed": {"any": '''
@triton.jit
def _exp_flushed(x):
    return tl.exp(x)
''', "cuda": '''
@triton.jit
def _exp_flushed(x):
    # exp(x) as tl.exp computes it (2**(x log2(e)), the constant rounded to fp32) but with
    # subnormal results flushed to zero (exp2 lowers to ex2.approx.ftz): three instructions
    # fewer; only where the result is added to a number that absorbs a subnormal
    return tl.exp2(x * 1.4426950408889634)
'''},
    "_expm1": {"any": '''
@triton.jit
def _expm1(x):
    # Taylor series near 0, where exp(x) - 1 would cancel; exp(x) - 1 elsewhere.
    small = x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0)))))
    return tl.where(tl.abs(x) < 0.1, small, tl.exp(x) - 1.0)
'''},
    "_log1p": {"any": '''
@triton.jit
def _log1p(x):
    # Goldberg's trick: exact for the rounded u = 1 + x.
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.where(u == _INF, u, tl.log(u) * tl.div_rn(x, u - 1.0)))
''', "cuda": '''
@triton.jit
def _log1p(x):
    return libdevice.log1p(x)
'''},
    "_tanh": {"any": '''
@triton.jit
def _tanh(x):
    # tanh(|x|), which is +0.0 or positive, with x's sign bit: tanh(-0.0) is -0.0
    t = _expm1(-2.0 * tl.abs(x))
    r = tl.fdiv(t * -1.0, 2.0 + t)
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
'''},
    "_tan": {"any": '''
@triton.jit
def _tan(x):
    return tl.div_rn(tl.sin(x), tl.cos(x))
''', "cuda": '''
@triton.jit
def _tan(x):
    return libdevice.tan(x)
'''},
    "_pow": {"any": '''
@triton.jit
def _pow(a, b):
    # Conditions are combined with where, not & and |: b may be a scalar here.
    r = tl.exp2(b * tl.log2(tl.abs(a)))
    b_int = tl.floor(b) == b
    b_odd = tl.where(b_int, tl.floor(b * 0.5) * 2.0 != b, False)
    negative = tl.where(a < 0, True, tl.where(a == 0, tl.div_rn(1.0, a) < 0, False))
    r = tl.where(tl.where(negative, b_odd, False), -r, r)
    nan_case = tl.where(a < 0, tl.where(a > -_INF, b_int == 0, False), False)
    r = tl.where(nan_case, _INF - _INF, r)
    one = tl.where(b == 0, True, tl.where(a == 1.0, True, tl.where(a == -1.0, tl.abs(b) == _INF, False)))
    return tl.where(one, 1.0, r)
''', "cuda": '''
@triton.jit
def _pow(a, b):
    return libdevice.pow(a, b)
'''},
    "_softplus": {"any": '''
@triton.jit
def _softplus(x, beta, threshold):
    return tl.where(x * beta > threshold, x, tl.fdiv(_log1p(tl.exp(x * beta)), beta))
'''},
    "_gelu_none": {"any": '''
@triton.jit
def _gelu_none(x):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
'''},
    "_gelu_tanh": {"any": '''
@triton.jit
def _gelu_tanh(x):
    # 0.5 * (1 + tanh(u)) == sigmoid(2u): one exp and one division, no cancellation near -1.
    # exp(-2u) = exp2(x * (K1 + K2 x^2)), K1 = -2 sqrt(2/pi) log2(e), K2 = 0.044715 K1: the
    # constants folded, two multiplies and an fma before the exp2 (the epilogue's issue slots
    # are what a fused GELU costs on Hopper).
    x2 = x * x
    return tl.fdiv(x, 1.0 + tl.exp2(x * (-2.302208198 + -0.1029432396 * x2)))
'''},
    # x.to(dtype) (ROUND_THROUGH); the interpreter's through header.py.j2's conversions from the bits
    "_round_bf16": {"any": '''
@triton.jit
def _round_bf16(x):
    return _to_f32(_bf16_from_f32(x))
''', "cuda": '''
@triton.jit
def _round_bf16(x):
    return x.to(tl.bfloat16).to(tl.float32)
'''},
    "_round_e4m3": {"any": f'''
@triton.jit
def _round_e4m3(x):
    return _to_f32(_fp8_from_f32(x, tl.float8e4nv, {E4M3_OVERFLOW}))
''', "cuda": '''
@triton.jit
def _round_e4m3(x):
    return x.to(tl.float8e4nv).to(tl.float32)
''' if E4M3_OVERFLOW == 126 else '''
@triton.jit
def _round_e4m3(x):
    # what rounds past 448 (|x| > 464), and inf, is NaN
    return tl.where(tl.abs(x) > 464.0, _INF - _INF, x.to(tl.float8e4nv).to(tl.float32))
'''},
    "_round_e5m2": {"any": '''
@triton.jit
def _round_e5m2(x):
    return _to_f32(_fp8_from_f32(x, tl.float8e5, 0))
''', "cuda": '''
@triton.jit
def _round_e5m2(x):
    # what rounds past 57344 (|x| >= 61440) is infinite
    return tl.where(tl.abs(x) >= 61440.0, x * _INF, x.to(tl.float8e5).to(tl.float32))
'''},
    "_load_acquire": {"any": '''
@triton.jit
def _load_acquire(ptr):
    return tl.load(ptr, volatile=True)
''', "cuda": '''
@triton.jit
def _load_acquire(ptr):
    # ld.acquire: this thread's later accesses are ordered after the write it read (Triton's
    # loads take no memory order), with no reply to wait for before the value is used
    return tl.inline_asm_elementwise("ld.global.acquire.gpu.b64 $0, [$1];", "=l,l", [ptr],
                                     dtype=tl.int64, is_pure=False, pack=1)
'''},
}


# Helpers whose formula calls other helpers.
HELPER_NEEDS = {"_tanh": ("_expm1",), "_softplus": ("_log1p",), "_sigmoid": ("_exp_flushed",),
                "_log1p_of_excess": ("_log_normal",)}


def helper_source(names, target: str) -> str:
    """Source of the helpers `names` (and what they call), for target "cuda" or "interpret"."""
    wanted, stack = set(), list(names)
    while stack:
        name = stack.pop()
        if name not in wanted:
            wanted.add(name)
            stack.extend(HELPER_NEEDS.get(name, ()))
    ordered = [n for n in HELPERS if n in wanted]
    parts = []
    for name in ordered:
        variants = HELPERS[name]
        parts.append(variants.get(target, variants["any"]) if target == "cuda" else variants["any"])
    return "".join(parts)


def missing_rules() -> dict[OpDef, str]:
    """Every elementwise registry op without a rule, with the reason (UNSUPPORTED or 'no
    lowering yet'); reductions are lowered by the epilogue's reduction stage instead, a join
    (cat of a gated epilogue's halves) by the gated kernel's store of its output, and
    composites and the parts of complex values never reach a kernel (the parser and
    epifuse.complex_parts write them as other ops)."""
    return {op: UNSUPPORTED.get(op, "no Triton lowering yet")
            for op in OPS.values() if op not in TRITON and not op.is_reduction
            and op.kind not in ("composite", "complex", "join")}
