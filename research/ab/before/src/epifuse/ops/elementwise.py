"""Elementwise ops: arithmetic, comparisons, math functions and activations.

Each op's `ref` is the torch function it means; its semantics (NaN and Inf included) are the
contract every backend's lowering is tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dtypes import rounding_dtype
from .registry import Cost, OpDef, register

# Derivative rules (`vjp=`) follow torch's own formulas (tools/autograd/derivatives.yaml), so
# gradients match torch's at ties and edges too (relu at 0, clamp at its bounds, maximum of
# equal values). They are written with the ops below on Sym values: see registry.Sym.
_LN2 = 0.6931471805599453
_TWO_OVER_SQRT_PI = 1.1283791670955126
_SQRT_2_OVER_PI = 0.7978845608028654
_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


def _round_through(x: torch.Tensor, dtype="float32") -> torch.Tensor:
    target = dtype if isinstance(dtype, torch.dtype) else rounding_dtype(dtype)
    return x.to(target).to(x.dtype)


def _clamp(x, min=None, max=None):
    if isinstance(min, torch.Tensor) or isinstance(max, torch.Tensor):
        result = x if min is None else torch.maximum(x, torch.as_tensor(min, dtype=x.dtype))
        return result if max is None else torch.minimum(result, torch.as_tensor(max, dtype=x.dtype))
    return torch.clamp(x, min, max)


def _as_float(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def _gelu(x, approximate="none"):
    x = _as_float(x)
    return torch.where(torch.isposinf(x), x, F.gelu(x, approximate=approximate))  # CPU erf GELU: NaN


def _prelu(x, weight):
    return torch.where(x >= 0, x, weight * x)


def _multiply_add(a, b, c):
    return a * b + c


def _unary(name, ref, doc, flops=1, special=0, aliases=(), vjp=None, complex=None):
    return register(OpDef(name, 1, ref, doc=doc, aliases=aliases, cost=Cost(flops, special), vjp=vjp,
                          complex=complex))


def _binary(name, ref, doc, aliases=(), commutative=False, identity=None, kind="elementwise",
            vjp=None, selects=(), complex=None):
    if kind in ("compare", "logical"):
        vjp = _no_gradient
    return register(OpDef(name, 2, ref, doc=doc, aliases=aliases, kind=kind,
                          commutative=commutative, identity=identity, vjp=vjp, selects=selects,
                          complex=complex))


# Complex meanings (`complex=`), for a planar complex GEMM's epilogue: each input is an (re, im)
# pair of real values, None where a part is exactly zero (epifuse.complex_parts's `call` drops
# the terms a zero part makes, as C99's mixed real and complex arithmetic does).

def _complex_mul(call, a, b):
    (ar, ai), (br, bi) = a, b
    return (call("sub", call("mul", ar, br), call("mul", ai, bi)),
            call("add", call("mul", ar, bi), call("mul", ai, br)))


def _complex_div(call, a, b):
    """(a / b) as a * conj(b') / (|b'|^2 s), b' = b / s with s = max(|b.re|, |b.im|), so |b|^2
    neither overflows nor underflows where |b| is far from 1; by a real b, each part divided."""
    (ar, ai), (br, bi) = a, b
    if bi is None:
        return call("div", ar, br), call("div", ai, br)
    if br is None:
        return call("div", ai, bi), call("neg", call("div", ar, bi))
    scale = call("maximum", call("abs", br), call("abs", bi))
    sr, si = call("div", br, scale), call("div", bi, scale)
    denominator = call("mul", call("add", call("mul", sr, sr), call("mul", si, si)), scale)
    return (call("div", call("add", call("mul", ar, sr), call("mul", ai, si)), denominator),
            call("div", call("sub", call("mul", ai, sr), call("mul", ar, si)), denominator))


def _complex_exp(call, x):
    """e^(a + ib) = e^a (cos b + i sin b)."""
    xr, xi = x
    if xi is None:
        return call("exp", xr), None
    scale = call("exp", xr) if xr is not None else None
    cos_, sin_ = call("cos", xi), call("sin", xi)
    return (cos_, sin_) if scale is None else (call("mul", scale, cos_), call("mul", scale, sin_))


def _complex_abs(call, x):
    """|a + ib| (a real result), scaled as hypot is: m sqrt((a/m)^2 + (b/m)^2) with m the larger
    of |a| and |b| (0 where both are), so the squares neither overflow nor underflow."""
    xr, xi = x
    if xi is None or xr is None:
        return call("abs", xr if xi is None else xi)
    m = call("maximum", call("abs", xr), call("abs", xi))
    safe = call("where", call("eq", m, 0.0), 1.0, m)
    ur, ui = call("div", xr, safe), call("div", xi, safe)
    return call("mul", m, call("sqrt", call("add", call("mul", ur, ur), call("mul", ui, ui))))


def _complex_where(call, c, a, b):
    if c[1] is not None:
        raise TypeError("where's condition must be real")
    return tuple(None if x is None and y is None else call("where", c[0], x, y) for x, y in zip(a, b))


def _each_part(name):
    """An op that applies to the real and imaginary parts alike (+, -, negation, rounding)."""
    def rule(call, *inputs, **params):
        return tuple(call(name, *parts, **params) for parts in zip(*inputs))
    return rule


def _complex_eq(call, a, b):
    return call("logical_and", call("eq", a[0], b[0]), call("eq", a[1], b[1]))


def _complex_ne(call, a, b):
    return call("logical_or", call("ne", a[0], b[0]), call("ne", a[1], b[1]))


def _no_gradient(g, *inputs_and_result, **params):
    """Comparisons and logic: a boolean result carries no gradient to its inputs."""
    return (None,) * (len(inputs_and_result) - 1)


def _pow_vjp(g, a, b, y):
    da = where(eq(b, 0.0), 0.0, g * b * pow(a, b - 1.0))
    db = where(logical_and(eq(a, 0.0), b >= 0.0), 0.0, g * y * log(a))
    return da, db


def _extremum_vjp(keep_a_when):
    """maximum/minimum: the chosen input gets g, ties split it (torch's rule); NaN passes g."""
    def vjp(g, a, b, y):
        half = where(eq(a, b), g * 0.5, g)
        lose_a, lose_b = (a < b, a > b) if keep_a_when == "greater" else (a > b, a < b)
        return where(lose_a, 0.0, half), where(lose_b, 0.0, half)
    return vjp


def _gelu_vjp(g, x, y, approximate="none"):
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
        t = tanh(inner)
        right = 0.5 * x * (1.0 - t * t) * (_SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x))
        return (g * (0.5 * (1.0 + t) + right),)
    cdf = 0.5 * (1.0 + erf(x * _SQRT_HALF))
    pdf = exp(-0.5 * x * x) * _INV_SQRT_2PI
    return (g * (cdf + x * pdf),)


def _clamp_vjp(g, x, y, min=None, max=None):
    if min is None and max is None:
        return (g,)
    inside = (x >= min) if max is None else (x <= max) if min is None else (x >= min) & (x <= max)
    return (where(inside, g, 0.0),)


def _silu_vjp(g, x, y):
    s = sigmoid(x)
    return (g * s * (1.0 + x * (1.0 - s)),)


def _mish_vjp(g, x, y):
    t = tanh(softplus(x))
    return (g * (t + x * sigmoid(x) * (1.0 - t * t)),)


add = _binary("add", torch.add, "a + b", commutative=True, identity=-0.0, complex=_each_part("add"),
    vjp=lambda g, a, b, y: (g, g))  # x + -0.0 == x, even x = -0.0
sub = _binary("sub", torch.sub, "a - b", aliases=("subtract",), identity=0.0, complex=_each_part("sub"),
    vjp=lambda g, a, b, y: (g, -g))
mul = _binary("mul", torch.mul, "a * b", aliases=("multiply",), commutative=True, identity=1.0,
              complex=_complex_mul,
    vjp=lambda g, a, b, y: (g * b, g * a))
div = _binary("div", torch.div, "a / b (true division)", aliases=("divide", "true_divide"), identity=1.0,
              complex=_complex_div,
    vjp=lambda g, a, b, y: (g / b, -g * a / (b * b)))
pow = _binary("pow", torch.pow, "a ** b; pow(finite negative, non-integer) is NaN; infinities as IEEE pow "
              "((-inf) ** -0.5 = 0)", aliases=("float_power",), vjp=_pow_vjp)
minimum = _binary("minimum", torch.minimum, "elementwise minimum; NaN if either is NaN",
                  commutative=True, selects=(0, 1),
    vjp=_extremum_vjp("less"))
maximum = _binary("maximum", torch.maximum, "elementwise maximum; NaN if either is NaN",
                  commutative=True, selects=(0, 1),
    vjp=_extremum_vjp("greater"))

lt = _binary("lt", torch.lt, "a < b", aliases=("less",), kind="compare")
le = _binary("le", torch.le, "a <= b", aliases=("less_equal",), kind="compare")
gt = _binary("gt", torch.gt, "a > b", aliases=("greater",), kind="compare")
ge = _binary("ge", torch.ge, "a >= b", aliases=("greater_equal",), kind="compare")
eq = _binary("eq", torch.eq, "a == b", kind="compare", commutative=True, complex=_complex_eq)
ne = _binary("ne", torch.ne, "a != b", aliases=("not_equal",), kind="compare", commutative=True,
             complex=_complex_ne)
logical_and = _binary("logical_and", torch.logical_and, "a & b on conditions", kind="logical",
                      commutative=True)
logical_or = _binary("logical_or", torch.logical_or, "a | b on conditions", kind="logical",
                     commutative=True)
logical_not = register(OpDef("logical_not", 1, torch.logical_not, kind="logical",
                             doc="~a on a condition",
    vjp=_no_gradient))

neg = _unary("neg", torch.neg, "-x", aliases=("negative",), complex=_each_part("neg"),
    vjp=lambda g, x, y: (-g,))
abs = _unary("abs", torch.abs, "|x|", aliases=("absolute",), complex=_complex_abs,
    vjp=lambda g, x, y: (g * sign(x),))
sqrt = _unary("sqrt", lambda x: torch.sqrt(_as_float(x)), "square root", special=1,
    vjp=lambda g, x, y: (g / (2.0 * y),))
rsqrt = _unary("rsqrt", lambda x: torch.rsqrt(_as_float(x)), "1 / sqrt(x)", special=1,
    vjp=lambda g, x, y: (-0.5 * g * (y * y * y),))
square = _unary("square", torch.square, "x * x", complex=lambda call, x: _complex_mul(call, x, x),
    vjp=lambda g, x, y: (g * 2.0 * x,))
reciprocal = _unary("reciprocal", lambda x: torch.reciprocal(_as_float(x)), "1 / x",
                    complex=lambda call, x: _complex_div(call, (1.0, None), x),
    vjp=lambda g, x, y: (-g * (y * y),))
sign = _unary("sign", torch.sign, "-1, 0 or 1 (0 for NaN, as torch)",
    vjp=lambda g, x, y: (None,))
exp = _unary("exp", lambda x: torch.exp(_as_float(x)), "e ** x", special=1, complex=_complex_exp,
    vjp=lambda g, x, y: (g * y,))
exp2 = _unary("exp2", lambda x: torch.exp2(_as_float(x)), "2 ** x", special=1,
    vjp=lambda g, x, y: (g * y * _LN2,))
expm1 = _unary("expm1", lambda x: torch.expm1(_as_float(x)), "exp(x) - 1", special=1,
    vjp=lambda g, x, y: (g * (y + 1.0),))
log = _unary("log", lambda x: torch.log(_as_float(x)), "natural logarithm", special=1,
    vjp=lambda g, x, y: (g / x,))
log2 = _unary("log2", lambda x: torch.log2(_as_float(x)), "base-2 logarithm", special=1,
    vjp=lambda g, x, y: (g / (x * _LN2),))
log1p = _unary("log1p", lambda x: torch.log1p(_as_float(x)), "log(1 + x)", special=1,
    vjp=lambda g, x, y: (g / (x + 1.0),))
sin = _unary("sin", lambda x: torch.sin(_as_float(x)), "sine", special=1,
    vjp=lambda g, x, y: (g * cos(x),))
cos = _unary("cos", lambda x: torch.cos(_as_float(x)), "cosine", special=1,
    vjp=lambda g, x, y: (-g * sin(x),))
tan = _unary("tan", lambda x: torch.tan(_as_float(x)), "tangent", special=2,
    vjp=lambda g, x, y: (g * (1.0 + y * y),))
erf = _unary("erf", lambda x: torch.erf(_as_float(x)), "error function", special=1,
    vjp=lambda g, x, y: (g * _TWO_OVER_SQRT_PI * exp(-(x * x)),))
tanh = _unary("tanh", lambda x: torch.tanh(_as_float(x)), "hyperbolic tangent", special=1,
    vjp=lambda g, x, y: (g * (1.0 - y * y),))
sigmoid = _unary("sigmoid", lambda x: torch.sigmoid(_as_float(x)), "1 / (1 + exp(-x))",
                 special=1, aliases=("expit",),
    vjp=lambda g, x, y: (g * (1.0 - y) * y,))
relu = _unary("relu", torch.relu, "max(x, 0); NaN stays NaN",
    vjp=lambda g, x, y: (where(y <= 0.0, 0.0, g),))
relu6 = _unary("relu6", lambda x: F.relu6(_as_float(x)), "min(max(x, 0), 6)", flops=2,
    vjp=lambda g, x, y: (where((x <= 0.0) | (x >= 6.0), 0.0, g),))
silu = _unary("silu", lambda x: F.silu(_as_float(x)), "x * sigmoid(x)", special=1, flops=3,
              aliases=("swish",),
    vjp=_silu_vjp)
hardswish = _unary("hardswish", lambda x: F.hardswish(_as_float(x)), "x * relu6(x + 3) / 6", flops=4,
    vjp=lambda g, x, y: (where(x < -3.0, 0.0, where(x <= 3.0, g * (x / 3.0 + 0.5), g)),))
hardsigmoid = _unary("hardsigmoid", lambda x: F.hardsigmoid(_as_float(x)), "relu6(x + 3) / 6", flops=3,
    vjp=lambda g, x, y: (where((x > -3.0) & (x < 3.0), g / 6.0, 0.0),))
mish = _unary("mish", lambda x: F.mish(_as_float(x)), "x * tanh(softplus(x))", special=3, flops=4,
    vjp=_mish_vjp)

where = register(OpDef("where", 3, torch.where, doc="cond ? a : b", cost=Cost(1), selects=(1, 2),
    complex=_complex_where,
    vjp=lambda g, c, a, b, y: (None, where(c, g, 0.0), where(c, 0.0, g))))
multiply_add = register(OpDef("multiply_add", 3, _multiply_add, doc="a * b + c", cost=Cost(2),
    complex=lambda call, a, b, c: _each_part("add")(call, _complex_mul(call, a, b), c),
    vjp=lambda g, a, b, c, y: (g * b, g * a, g)))
prelu = register(OpDef("prelu", 2, _prelu, doc="x if x >= 0 else weight * x (weight an operand)",
    vjp=lambda g, x, w, y: (where(x >= 0.0, g, g * w), where(x >= 0.0, 0.0, g * x))))
clamp = register(OpDef("clamp", 1, _clamp,
                       params=(("min", None), ("max", None)), aliases=("clip",),
                       doc="min(max(x, min), max); NaN stays NaN", cost=Cost(2),
    vjp=_clamp_vjp))
leaky_relu = register(OpDef("leaky_relu", 1, lambda x, negative_slope=0.01:
                            F.leaky_relu(_as_float(x), negative_slope),
                            params=(("negative_slope", 0.01),), doc="x if x > 0 else slope * x",
    vjp=lambda g, x, y, negative_slope=0.01: (where(x > 0.0, g, g * negative_slope),)))
elu = register(OpDef("elu", 1, lambda x, alpha=1.0: F.elu(_as_float(x), alpha),
                     params=(("alpha", 1.0),), doc="x if x > 0 else alpha * (exp(x) - 1)",
                     cost=Cost(3, 1),
    vjp=lambda g, x, y, alpha=1.0: (where(x <= 0.0, g * alpha * exp(x), g),)))
gelu = register(OpDef("gelu", 1, _gelu, params=(("approximate", "none"),),
                      doc='GELU; approximate="none" (erf) or "tanh"; gelu(+inf) = +inf '
                          "(torch's CPU kernel gives NaN there)", cost=Cost(6, 1),
    vjp=_gelu_vjp))
softplus = register(OpDef("softplus", 1, lambda x, beta=1.0, threshold=20.0:
                          F.softplus(_as_float(x), beta, threshold),
                          params=(("beta", 1.0), ("threshold", 20.0)),
                          doc="log(1 + exp(beta * x)) / beta; x where beta * x > threshold",
                          cost=Cost(4, 2),
    vjp=lambda g, x, y, beta=1.0, threshold=20.0: (where(x * beta > threshold, g, g * sigmoid(x * beta)),)))
to = register(OpDef("to", 1, _round_through, params=(("dtype", "float32"),), kind="cast",
                    doc="round through a narrower type (x.to(torch.float16)); math stays in the compute dtype",
                    complex=_each_part("to"),
    vjp=lambda g, x, y, dtype="float32": (g,)))


__all__ = [n for n, v in list(globals().items()) if isinstance(v, OpDef)]
