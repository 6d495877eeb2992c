"""Elementwise ops: arithmetic, comparisons, math functions and activations.

Each op's `ref` is the torch function it means; its semantics (NaN and Inf included) are the
contract every backend's lowering is tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import Cost, OpDef, register

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16,
    "half": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "double": torch.float64, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}


def dtype_from_name(name: str) -> torch.dtype | None:
    return _DTYPES.get(name)


def _round_through(x: torch.Tensor, dtype: str) -> torch.Tensor:
    return x.to(_DTYPES[dtype]).to(x.dtype)


def _as_float(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def _gelu(x, approximate="none"):
    return F.gelu(_as_float(x), approximate=approximate)


def _prelu(x, weight):
    return torch.where(x >= 0, x, weight * x)


def _multiply_add(a, b, c):
    return a * b + c


def _unary(name, ref, doc, flops=1, special=0, aliases=()):
    return register(OpDef(name, 1, ref, doc=doc, aliases=aliases, cost=Cost(flops, special)))


def _binary(name, ref, doc, aliases=(), commutative=False, identity=None, kind="elementwise"):
    return register(OpDef(name, 2, ref, doc=doc, aliases=aliases, kind=kind,
                          commutative=commutative, identity=identity))


add = _binary("add", torch.add, "a + b", commutative=True, identity=0.0)
sub = _binary("sub", torch.sub, "a - b", aliases=("subtract",), identity=0.0)
mul = _binary("mul", torch.mul, "a * b", aliases=("multiply",), commutative=True, identity=1.0)
div = _binary("div", torch.div, "a / b (true division)", aliases=("divide", "true_divide"), identity=1.0)
pow = _binary("pow", torch.pow, "a ** b; pow(negative, non-integer) is NaN", aliases=("float_power",))
minimum = _binary("minimum", torch.minimum, "elementwise minimum; NaN if either is NaN",
                  commutative=True)
maximum = _binary("maximum", torch.maximum, "elementwise maximum; NaN if either is NaN",
                  commutative=True)

lt = _binary("lt", torch.lt, "a < b", aliases=("less",), kind="compare")
le = _binary("le", torch.le, "a <= b", aliases=("less_equal",), kind="compare")
gt = _binary("gt", torch.gt, "a > b", aliases=("greater",), kind="compare")
ge = _binary("ge", torch.ge, "a >= b", aliases=("greater_equal",), kind="compare")
eq = _binary("eq", torch.eq, "a == b", kind="compare", commutative=True)
ne = _binary("ne", torch.ne, "a != b", aliases=("not_equal",), kind="compare", commutative=True)
logical_and = _binary("logical_and", torch.logical_and, "a & b on conditions", kind="logical",
                      commutative=True)
logical_or = _binary("logical_or", torch.logical_or, "a | b on conditions", kind="logical",
                     commutative=True)
logical_not = register(OpDef("logical_not", 1, torch.logical_not, kind="logical",
                             doc="~a on a condition"))

neg = _unary("neg", torch.neg, "-x", aliases=("negative",))
abs = _unary("abs", torch.abs, "|x|", aliases=("absolute",))
sqrt = _unary("sqrt", lambda x: torch.sqrt(_as_float(x)), "square root", special=1)
rsqrt = _unary("rsqrt", lambda x: torch.rsqrt(_as_float(x)), "1 / sqrt(x)", special=1)
square = _unary("square", torch.square, "x * x")
reciprocal = _unary("reciprocal", lambda x: torch.reciprocal(_as_float(x)), "1 / x")
sign = _unary("sign", torch.sign, "-1, 0 or 1 (0 for NaN, as torch)")
exp = _unary("exp", lambda x: torch.exp(_as_float(x)), "e ** x", special=1)
exp2 = _unary("exp2", lambda x: torch.exp2(_as_float(x)), "2 ** x", special=1)
expm1 = _unary("expm1", lambda x: torch.expm1(_as_float(x)), "exp(x) - 1", special=1)
log = _unary("log", lambda x: torch.log(_as_float(x)), "natural logarithm", special=1)
log2 = _unary("log2", lambda x: torch.log2(_as_float(x)), "base-2 logarithm", special=1)
log1p = _unary("log1p", lambda x: torch.log1p(_as_float(x)), "log(1 + x)", special=1)
sin = _unary("sin", lambda x: torch.sin(_as_float(x)), "sine", special=1)
cos = _unary("cos", lambda x: torch.cos(_as_float(x)), "cosine", special=1)
tan = _unary("tan", lambda x: torch.tan(_as_float(x)), "tangent", special=2)
erf = _unary("erf", lambda x: torch.erf(_as_float(x)), "error function", special=1)
tanh = _unary("tanh", lambda x: torch.tanh(_as_float(x)), "hyperbolic tangent", special=1)
sigmoid = _unary("sigmoid", lambda x: torch.sigmoid(_as_float(x)), "1 / (1 + exp(-x))",
                 special=1, aliases=("expit",))
relu = _unary("relu", torch.relu, "max(x, 0); NaN stays NaN")
relu6 = _unary("relu6", lambda x: F.relu6(_as_float(x)), "min(max(x, 0), 6)", flops=2)
silu = _unary("silu", lambda x: F.silu(_as_float(x)), "x * sigmoid(x)", special=1, flops=3,
              aliases=("swish",))
hardswish = _unary("hardswish", lambda x: F.hardswish(_as_float(x)), "x * relu6(x + 3) / 6", flops=4)
hardsigmoid = _unary("hardsigmoid", lambda x: F.hardsigmoid(_as_float(x)), "relu6(x + 3) / 6", flops=3)
mish = _unary("mish", lambda x: F.mish(_as_float(x)), "x * tanh(softplus(x))", special=3, flops=4)

where = register(OpDef("where", 3, torch.where, doc="cond ? a : b", cost=Cost(1)))
multiply_add = register(OpDef("multiply_add", 3, _multiply_add, doc="a * b + c", cost=Cost(2)))
prelu = register(OpDef("prelu", 2, _prelu, doc="x if x >= 0 else weight * x (weight an operand)"))
clamp = register(OpDef("clamp", 1, lambda x, min=None, max=None: torch.clamp(x, min, max),
                       params=(("min", None), ("max", None)), aliases=("clip",),
                       doc="min(max(x, min), max); NaN stays NaN", cost=Cost(2)))
leaky_relu = register(OpDef("leaky_relu", 1, lambda x, negative_slope=0.01:
                            F.leaky_relu(_as_float(x), negative_slope),
                            params=(("negative_slope", 0.01),), doc="x if x > 0 else slope * x"))
elu = register(OpDef("elu", 1, lambda x, alpha=1.0: F.elu(_as_float(x), alpha),
                     params=(("alpha", 1.0),), doc="x if x > 0 else alpha * (exp(x) - 1)",
                     cost=Cost(3, 1)))
gelu = register(OpDef("gelu", 1, _gelu, params=(("approximate", "none"),),
                      doc='GELU; approximate="none" (erf) or "tanh"; gelu(+inf) = +inf '
                          "(torch's CPU kernel gives NaN there)", cost=Cost(6, 1)))
softplus = register(OpDef("softplus", 1, lambda x, beta=1.0, threshold=20.0:
                          F.softplus(_as_float(x), beta, threshold),
                          params=(("beta", 1.0), ("threshold", 20.0)),
                          doc="log(1 + exp(beta * x)) / beta; x where beta * x > threshold",
                          cost=Cost(4, 2)))
to = register(OpDef("to", 1, _round_through, params=(("dtype", "float32"),), kind="cast",
                    doc="round through a narrower type (x.to(torch.float16)); math stays in the compute dtype"))


__all__ = [n for n, v in list(globals().items()) if isinstance(v, OpDef)]
