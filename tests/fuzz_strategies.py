"""Hypothesis strategies for the fuzz tests: random epilogue sources and the problems they run on.

`examples()` writes random epilogue *source strings* from the ops registry (every spelling:
op(x), torch.op(x), F.op(x), x.op(), aliases, infix operators), binds them to operands of every
role (numbers, one-element tensors, rows, columns, tiles, their batched forms, per-batch
scalars) in random dtypes and layouts (transposed, sliced, expanded), over random small ragged
shapes, with several outputs (tiles in fp32/fp16/bf16 and reductions over random dims, with or
without `accumulate` and `deterministic`).

Values are tracked as "raw" (exact in fp32 and fp64 alike: accum, operands, their sums and
products of small dyadic inputs) so that comparisons, `sign`, `where` conditions and logical
ops only ever see raw values and never flip between a kernel and the reference. Ops whose
domain needs care get guarded inputs (log(abs(x) + 0.5), exp(clamp(x, ...)), tan(tanh(x)),
...); an op added to the registry later is fuzzed on inputs in (0.25, 0.75).
"""
from __future__ import annotations

import keyword
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from epifuse.frontend import MODULE_PREFIXES, RESERVED_KEYWORDS
from epifuse.ops import OPS, reductions, spellings


# ---- the op vocabulary, derived from the registry -------------------------------------------

COMPARE_SYMBOLS = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
ARITH_SYMBOLS = {"add": "+", "sub": "-", "mul": "*"}
# How to make an op's input safe: a format over the input's text.
GUARDED = {
    "log": "(abs({}) + 0.5)", "log2": "(abs({}) + 0.5)", "sqrt": "(abs({}) + 0.5)",
    "rsqrt": "(abs({}) + 0.5)", "reciprocal": "(abs({}) + 0.5)", "log1p": "abs({})",
    "exp": "clamp({}, -8.0, 8.0)", "exp2": "clamp({}, -10.0, 10.0)", "expm1": "clamp({}, -8.0, 8.0)",
    "sin": "clamp({}, -20.0, 20.0)", "cos": "clamp({}, -20.0, 20.0)", "tan": "tanh({})",
}
UNKNOWN_GUARD = "(sigmoid({}) * 0.5 + 0.25)"
SPECIAL = {"div", "pow", "where", "clamp", "to", "prelu", "multiply_add", "maximum", "minimum",
           "logical_and", "logical_or", "logical_not", "sign", "leaky_relu", "elu", "gelu", "softplus", "neg"}
REDUCTIONS = sorted(op.name for op in reductions())
ELEMENTWISE = sorted(n for n, op in OPS.items() if not op.is_reduction and op.kind not in ("composite", "complex", "join"))
# Unary elementwise ops with no parameters and no domain to guard (the registry decides which).
PLAIN_UNARY = sorted(n for n in ELEMENTWISE if OPS[n].kind == "elementwise" and OPS[n].arity == 1
                     and not OPS[n].params and n not in SPECIAL and n not in GUARDED)
KNOWN = set(COMPARE_SYMBOLS) | set(ARITH_SYMBOLS) | set(GUARDED) | SPECIAL | set(PLAIN_UNARY)
# Ops this file has no special knowledge of: fuzzed with default parameters on safe inputs.
UNKNOWN = sorted(n for n in ELEMENTWISE if n not in KNOWN)
# Each op about equally often, arithmetic a little more.
OP_CHOICES = ELEMENTWISE + ["add", "mul", "sub"] * 2

CONSTANTS = ["0.5", "2.0", "-1.5", "0.25", "3.0", "1.0", "0.0", "-2.0", "4.0", "-0.75", "2", "-1"]
PREFIXES = ["", "torch.", "F.", "torch.nn.functional.", "epifuse.ops."]

# Names that collide with what the generator emits, with Python and Triton: they must all work,
# since generated code only uses its own identifiers.
TRICKY_NAMES = ["tl", "triton", "acc", "acc_e", "mask", "mask_m", "rm", "rn", "pid_l", "pid", "v0",
                "v1", "x0", "x1", "y0", "y1", "a_ptr", "b_ptr", "M", "N", "K", "L", "BLOCK_M", "_INF",
                "_NAN", "_pow", "_clamp", "epifuse_kernel", "libdevice", "k", "a", "b", "offs_m",
                "r_y0", "x0_ptr", "y0_sm", "match", "case", "type", "print", "self", "cls", "Tensor"]
PLAIN_NAMES = ["alpha", "beta", "bias", "scale", "C", "E", "G", "aux", "t", "u", "w", "z", "out2"]
_FORBIDDEN = (set(spellings()) | {p[0] for p in MODULE_PREFIXES} | set(RESERVED_KEYWORDS)
              | set(keyword.kwlist) | {"accum"})
NAME_POOL = [n for n in TRICKY_NAMES + PLAIN_NAMES if n not in _FORBIDDEN]


@dataclass
class Value:
    text: str          # a name, a literal or a parenthesized expression
    raw: bool = False  # exact in fp32 and fp64 alike (accum, operands, their sums and products)
    base: bool = False  # accum, an operand, a literal: raw, and small enough to multiply exactly
    scalar: bool = False  # the same for every element (literals, numbers, one-element tensors)
    condition: bool = False  # boolean (a comparison or logic): what ~, & and | may take


@dataclass
class Operand:
    name: str
    role: str          # number | scalar | row | col | tile | batch
    shape: tuple = ()
    dtype: torch.dtype = torch.float32
    layout: str = "contiguous"
    number: float = 0.0


@dataclass
class Output:
    name: str
    reduce: str | None = None
    dims: tuple | None = None
    keepdim_shape: bool = False
    dtype: torch.dtype = torch.float32
    layout: str = "contiguous"


@dataclass
class Example:
    source: str
    M: int
    N: int
    K: int
    batch: str                 # "" | "both" | "a" | "b" | "a1"
    in_dtype: torch.dtype
    layout_a: str
    layout_b: str
    operands: list
    outputs: list
    accumulate: bool
    deterministic: bool
    seed: int
    casts: set = field(default_factory=set)

    @property
    def L(self) -> int:
        return 2 if self.batch else 1

    @property
    def accum_shape(self) -> tuple:
        return (self.L, self.M, self.N) if self.batch else (self.M, self.N)


# ---- strategies ---------------------------------------------------------------------------------

def _call(draw, op: str, args: list[str], extra: str = "") -> str:
    """A call of `op` in a random spelling: op(x), torch.op(x), x.op(), an alias."""
    names = [op, *OPS[op].aliases]
    spelled = draw(st.sampled_from(names))
    if args and draw(st.integers(0, 3)) == 0 and not args[0].lstrip("-").replace(".", "").isdigit():
        receiver = args[0] if args[0].isidentifier() else f"({args[0]})"
        rest = ", ".join(args[1:] + ([extra] if extra else []))
        return f"{receiver}.{spelled}({rest})"
    prefix = draw(st.sampled_from(PREFIXES))
    return f"{prefix}{spelled}({', '.join(args + ([extra] if extra else []))})"


@st.composite
def values(draw, env: list[Value], depth: int, want_raw: bool = False) -> Value:
    """An expression over the values in env (or literals), at most `depth` ops deep."""
    if want_raw:
        bases = [v for v in env if v.base]
        if depth > 0 and draw(st.integers(0, 2)) == 0:
            a = draw(st.sampled_from(bases))
            b = draw(st.sampled_from(bases + [Value(c, True, True, True) for c in CONSTANTS[:4]]))
            op = draw(st.sampled_from(["+", "-", "*"]))
            return _made(f"({a.text} {op} {b.text})", a, b, raw=True)
        return draw(st.sampled_from([v for v in env if v.raw]))
    if depth == 0 or draw(st.integers(0, 5)) == 0:
        if draw(st.integers(0, 5)) == 0:
            return Value(draw(st.sampled_from(CONSTANTS)), raw=True, base=True, scalar=True)
        return draw(st.sampled_from(env))
    op = draw(st.sampled_from(OP_CHOICES))
    return draw(applied(op, env, depth))


def _made(text: str, *parts: Value, raw: bool = False, condition: bool = False) -> Value:
    return Value(text, raw=raw, scalar=all(p.scalar for p in parts), condition=condition)


@st.composite
def applied(draw, op: str, env: list[Value], depth: int) -> Value:
    """`op` applied to sub-expressions, in a random spelling, with safe inputs where needed."""
    def sub(raw=False) -> Value:
        return draw(values(env, depth - 1, raw))

    def call(args: list[Value], extra: str = "", texts: list[str] | None = None) -> Value:
        return _made(_call(draw, op, texts or [a.text for a in args], extra), *args)

    if op in ARITH_SYMBOLS:
        a, b = sub(), sub()
        if draw(st.booleans()):
            return _made(f"({a.text} {ARITH_SYMBOLS[op]} {b.text})", a, b, raw=a.base and b.base)
        return _made(_call(draw, op, [a.text, b.text]), a, b, raw=a.base and b.base)
    if op in COMPARE_SYMBOLS:
        a, b = sub(True), sub(True)
        symbol = COMPARE_SYMBOLS[op]
        style = draw(st.sampled_from(["infix", "call", "chain"]))
        if style == "chain":  # (a < b) & (b < c): both pairs must be alike (see _same_kind)
            c = sub(True)
            tile = next((v for v in (a, b, c) if not v.scalar), a)
            a, b, c = (_same_kind(v, tile) for v in (a, b, c))
            return _made(f"({a.text} {symbol} {b.text} {symbol} {c.text})", a, b, c, raw=True, condition=True)
        text = f"({a.text} {symbol} {b.text})" if style == "infix" else _call(draw, op, [a.text, b.text])
        return _made(text, a, b, raw=True, condition=True)
    if op in ("logical_and", "logical_or"):  # & and | on conditions only (on numbers they are bitwise)
        a = sub(True)
        b = _same_kind(sub(True), a)
        a = _same_kind(a, b)
        if a.condition and b.condition and draw(st.booleans()):
            return _made(f"({a.text} {'&' if op == 'logical_and' else '|'} {b.text})", a, b, raw=True,
                         condition=True)
        return _made(_call(draw, op, [a.text, b.text]), a, b, raw=True, condition=True)
    if op in ("logical_not", "sign"):  # discontinuous: only on exact values
        a = sub(True)
        if op == "logical_not" and a.condition and draw(st.booleans()):
            return _made(f"(~{a.text})", a, raw=True, condition=True)
        return _made(_call(draw, op, [a.text]), a, raw=True, condition=op == "logical_not")
    if op == "neg":
        a = sub()
        return _made(f"(-{a.text})", a) if draw(st.booleans()) else call([a])
    if op in GUARDED:
        a = sub()
        return call([a], texts=[GUARDED[op].format(a.text)])
    if op in PLAIN_UNARY:
        return call([sub()])
    if op in ("maximum", "minimum"):
        a, b = sub(), sub()
        if draw(st.booleans()):  # two tensors: max/min mean the elementwise op (an int is a dim)
            second = b.text + (".0" if b.text.lstrip("-").isdigit() else "")
            prefix = draw(st.sampled_from(["", "torch."]))
            return _made(f"{prefix}{'max' if op == 'maximum' else 'min'}({a.text}, {second})", a, b)
        return call([a, b])
    if op == "where":
        return call([sub(True), sub(), sub()])
    if op == "multiply_add":
        return call([sub(), sub(), sub()])
    if op == "prelu":
        return call([sub(), sub()])
    if op == "div":
        a, b = sub(), sub()
        denominator = f"(abs({b.text}) + 0.5)"
        if draw(st.booleans()):
            return _made(f"({a.text} / {denominator})", a, b)
        return call([a, b], texts=[a.text, denominator])
    if op == "pow":
        a, b = sub(), sub()
        if draw(st.booleans()):
            exponent = draw(st.sampled_from(["2.0", "0.5", "-1.0", "3.0", "1.5", "-0.5", "1.0", "2"]))
            return _made(f"((abs({a.text}) + 0.5) ** {exponent})", a)
        return call([a, b], texts=[f"(abs({a.text}) + 0.5)", f"clamp({b.text}, -2.0, 2.0)"])
    if op == "leaky_relu":
        return call([sub()], draw(st.sampled_from(["", "0.2", "negative_slope=0.5", "negative_slope=0.01"])))
    if op == "elu":
        return call([sub()], draw(st.sampled_from(["", "alpha=0.5", "2.0"])))
    if op == "gelu":
        return call([sub()], draw(st.sampled_from(["", "approximate='tanh'", "approximate='none'"])))
    if op == "softplus":
        return call([sub()], draw(st.sampled_from(["", "beta=2.0", "beta=0.5, threshold=10.0", "threshold=10.0"])))
    if op == "clamp":
        a = sub()
        if draw(st.integers(0, 2)) == 0:  # value bounds: maximum / minimum
            bound = sub()
            return _made(f"clamp({a.text}, {draw(st.sampled_from(['min', 'max']))}={bound.text})", a, bound)
        return call([a], draw(st.sampled_from(["min=-1.0, max=2.0", "min=0.0", "max=1.5", "-0.5, 0.5",
                                               "None, 3.0", "min=-2.0, max=None"])))
    if op == "to":
        a = sub()
        dtype = draw(st.sampled_from(["float16", "float32", "float64"]))
        spelled = draw(st.sampled_from([f".to(torch.{dtype})", f".to('{dtype}')",
                                        {"float16": ".half()", "float32": ".float()",
                                         "float64": ".double()"}[dtype]]))
        return _made(f"{a.text if a.text.isidentifier() else f'({a.text})'}{spelled}", a)
    args = [sub() for _ in range(OPS[op].arity)]  # an op this file does not know yet
    return call(args, texts=[UNKNOWN_GUARD.format(a.text) for a in args])


def _same_kind(value: Value, other: Value) -> Value:
    """Make a scalar condition a tile one when it meets a tile condition (`+ accum * 0.0`):
    `&`/`|` of a scalar and a tile condition crashes the interpreter, a known bug (see
    test_known_bug_logical_and_of_scalar_and_tile_conditions); the fuzzer steers around it."""
    if value.scalar and not other.scalar:
        return Value(f"({value.text} + accum * 0.0)", raw=value.raw, scalar=False)
    return value


def _unique_names(draw, count: int) -> list[str]:
    pool = draw(st.permutations(NAME_POOL))
    return list(pool[:count])


@st.composite
def operands(draw, name: str, batched: bool) -> Operand:
    roles = ["number", "scalar", "row", "col", "tile"] + (["batch"] if batched else [])
    role = draw(st.sampled_from(roles))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16, torch.int32]))
    if role == "number":
        number = draw(st.sampled_from([2.0, -1.5, 0.25, 3, -1, 0.0, 1.0]))
        return Operand(name, role, number=number)
    if role == "scalar":
        shape = draw(st.sampled_from([(), (1,), (1, 1)] + ([(1, 1, 1)] if batched else [])))
    elif role == "row":
        shape = draw(st.sampled_from(["N", "1N"] + (["L1N", "11N"] if batched else [])))
    elif role == "col":
        shape = draw(st.sampled_from(["M1"] + (["LM1", "1M1"] if batched else [])))
    elif role == "tile":
        shape = draw(st.sampled_from(["MN"] + (["LMN", "LMN", "1MN"] if batched else [])))
    else:
        shape = "L11"
    layouts = ["contiguous"]
    if role in ("row", "col", "tile"):
        layouts += ["sliced", "transposed"]
    if role == "tile":
        layouts += ["expanded_row", "expanded_col"]
    layout = draw(st.sampled_from(layouts))
    return Operand(name, role, shape, dtype, layout)


@st.composite
def examples(draw) -> Example:
    # ragged sizes, and sometimes multiples of 8 (aligned rows: the persistent TMA kernel's case)
    M = draw(st.integers(1, 70))
    N = draw(st.one_of(st.integers(1, 70), st.sampled_from([8, 16, 32, 40, 64])))
    K = draw(st.one_of(st.integers(1, 40), st.sampled_from([8, 16, 32, 40])))
    batch = draw(st.sampled_from(["", "", "both", "a", "b", "a1"]))
    in_dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    layout_a = draw(st.sampled_from(["contiguous", "contiguous", "contiguous", "transposed", "sliced"]))
    layout_b = draw(st.sampled_from(["contiguous", "contiguous", "transposed", "sliced"]))
    n_operands = draw(st.integers(0, 3))
    n_statements = draw(st.integers(1, 4))
    n_tiles = draw(st.integers(0, 2))
    n_reductions = draw(st.integers(0 if n_tiles else 1, 2))
    names = _unique_names(draw, n_operands + n_statements + n_reductions + 1)
    op_names, names = names[:n_operands], names[n_operands:]
    ops = [draw(operands(n, bool(batch))) for n in op_names]

    env = [Value("accum", raw=True, base=True)] + [
        Value(o.name, raw=True, base=True, scalar=o.role in ("number", "scalar", "batch")) for o in ops]
    lines, tile_candidates = [], ["accum"]
    for i in range(n_statements):
        target = names.pop(0)
        value = draw(values(env, draw(st.integers(1, 3))))
        lines.append(f"{target} = {value.text}")
        env.append(Value(target, raw=value.raw, scalar=value.scalar, condition=value.condition))
        tile_candidates.append(target)
    outputs, casts = [], set()
    last = tile_candidates.pop()  # the last statement is always used: by a tile or a reduction
    chosen = ([last] if n_tiles else []) + draw(st.lists(st.sampled_from(tile_candidates), min_size=max(n_tiles - 1, 0),
                                                         max_size=max(n_tiles - 1, 0), unique=True))
    rank = 3 if batch else 2
    for name in chosen:
        dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
        layout = draw(st.sampled_from(["contiguous", "contiguous", "transposed", "sliced", "padded"]))
        if dtype == torch.bfloat16 and name != "accum" and draw(st.integers(0, 3)) == 0:
            # a bf16 round trip right before the store (the interpreter truncates; see TOLERANCE)
            target = names.pop(0) if names else f"{name}_bf16"
            lines.append(f"{target} = {name}.to(torch.bfloat16)")
            casts.add(torch.bfloat16)
            name = target
        outputs.append(Output(name, dtype=dtype, layout=layout))
    for i in range(n_reductions):
        target = names.pop(0) if names else f"r{len(outputs)}"
        kind = draw(st.sampled_from(REDUCTIONS))
        source = Value(last) if i == 0 and not n_tiles else draw(values(env, 1))
        dims = draw(st.one_of(st.none(), st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank,
                                                  unique=True).map(sorted).map(tuple)))
        spelled = _reduction_call(draw, kind, source.text, dims, rank)
        lines.append(f"{target} = {spelled}")
        dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))
        layout = draw(st.sampled_from(["contiguous", "contiguous", "sliced", "padded"]))
        outputs.append(Output(target, kind, dims, draw(st.booleans()), dtype, layout))
    params = ", ".join(["accum"] + [o.name for o in ops])
    returned = ", ".join(o.name for o in outputs)
    body = "".join(f"    {line}\n" for line in lines)
    if draw(st.integers(0, 4)) == 0:
        body = '    """A docstring."""\n    # a comment\n' + body + "    pass\n"
    source = f"def epi({params}):\n{body}    return {returned}\n"
    return Example(source, M, N, K, batch, in_dtype, layout_a, layout_b, ops, outputs,
                   accumulate=bool(n_reductions) and draw(st.integers(0, 3)) == 0,
                   deterministic=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
                   casts=casts)


def _reduction_call(draw, kind: str, x: str, dims, rank: int) -> str:
    if dims is not None:
        dims = tuple(d - rank if draw(st.booleans()) else d for d in dims)  # negative dims too
    receiver = x if x.isidentifier() else f"({x})"
    if dims is None:
        return draw(st.sampled_from([f"{kind}({x})", f"torch.{kind}({x})", f"{receiver}.{kind}()",
                                     f"{kind}({x}, dim=None)"]))
    dim = str(dims[0]) if len(dims) == 1 and draw(st.booleans()) else repr(tuple(dims))
    keep = draw(st.sampled_from(["", ", keepdim=True", ", keepdim=False"]))
    return draw(st.sampled_from([f"{kind}({x}, dim={dim}{keep})", f"torch.{kind}({x}, {dim}{keep})",
                                 f"{receiver}.{kind}(dim={dim}{keep})"]))
