"""How each op of the registry is called in an epilogue for the tests that walk the registry
(unit/test_ops.py, unit/test_autograd.py, gpu/test_gpu.py)."""
from epifuse.ops import OPS

# composites: test_staging; complex parts: test_planar_complex; joins (cat): test_cat
ELEMENTWISE = sorted(n for n, op in OPS.items() if not op.is_reduction and op.kind not in ("composite", "complex", "join"))

# How to call each op in an epilogue: `x` is the accum-derived value, `C` an operand tile.
CALLS = {
    1: "{op}(x)",
    2: "{op}(x, C)",
    3: "{op}(x, C, x)",
}
# Selections are written to be continuous where x crosses 0 (they pick x or 0 there): the
# kernel's accum and the float64 one may differ in sign for x within rounding of 0.
SPECIAL_CALLS = {
    "where": "where(x > 0, x, 0.0 * C)",
    "logical_and": "where(logical_and(x > 0, C > 0), x, 0.0)",
    "logical_or": "where(logical_or(x > 0, C < 0), x, 0.0)",
    "logical_not": "where(logical_not(x > 0), x, 0.0)",
    "lt": "where(lt(x, C), x - C, 0.0)",   # comparisons too: x within rounding of C
    "le": "where(le(x, C), x - C, 0.0)",   # may compare either way
    "gt": "where(gt(x, C), x - C, 0.0)",
    "ge": "where(ge(x, C), x - C, 0.0)",
    "to": "x.to(torch.float16)",
    "clamp": "clamp(x, -0.5, 0.75)",
    "leaky_relu": "leaky_relu(x, 0.2)",
    "elu": "elu(x, alpha=1.5)",
    "softplus": "softplus(x, beta=2.0, threshold=5.0)",
    "prelu": "prelu(x, C)",
    "row": "x + row() * C",   # the indices, with gradients flowing past them to x and C
    "col": "x - col() * C",
}
# Ops that jump where no selection can hide it (sign at 0, eq and ne at C): integer-valued
# inputs keep accum exact, so the kernel's and the float64 one agree on which side they are
# (random ones disagreed about once in 40000 runs), and eq is true somewhere.
JUMPS = {"sign", "eq", "ne"}
# Domains where the op is well-conditioned for a relative-error check.
DOMAIN = {"log": "abs", "log2": "abs", "sqrt": "abs", "rsqrt": "abs", "log1p": "abs",
          "reciprocal": "abs", "div": "abs", "pow": "abs", "tan": "small"}


def expression(name: str) -> str:
    if name in SPECIAL_CALLS:
        return SPECIAL_CALLS[name]
    return CALLS[OPS[name].arity].format(op=name)


def source_for(name: str) -> str:
    # "small" keeps tan well inside (-pi/2, pi/2) even for a 6-sigma accum (the GPU test's
    # accum is ~N(0, 1)): near a pole any fp32 GEMM differs from the float64 one by far more
    # than the tolerance (x = 0.3 accum failed once at 2.6e-5 on the H100, 2026-11-23).
    pre = {"abs": "    x = abs(accum) + 0.5\n", "small": "    x = accum * 0.2\n"}.get(
        DOMAIN.get(name), "    x = accum\n")
    return f"def epi(accum, C):\n{pre}    D = {expression(name)}\n    return D\n"
