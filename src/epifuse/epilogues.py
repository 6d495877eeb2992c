"""Named epilogues: CUTLASS's classic epilogue functors, built on the one epifuse pipeline.

Each named epilogue is generated as epilogue *source* from templates over the ops registry's
names, so it is parsed, bound, optimized and lowered exactly like a user's function. It is a
`str` (its own source), which makes it usable wherever an epilogue function or string is:

>>> import torch, epifuse
>>> from epifuse.epilogues import LinearCombinationRelu
>>> epi = LinearCombinationRelu()
>>> print(epi, end="")
def linear_combination_relu(accum, alpha, beta, C):
    F = alpha * accum + beta * C
    D = relu(F)
    return D
>>> A, B, C = torch.ones(2, 3), -torch.ones(3, 2), torch.full((2, 2), 5.0)
>>> epi(A, B, alpha=1.0, beta=1.0, C=C)          # or epifuse.gemm(A, B, epi, ...)
tensor([[2., 2.],
        [2., 2.]])

    LinearCombination(scale, activation)   D = activation(alpha * accum + beta * C)
    LinearCombination{Relu,GELU,Sigmoid,Silu,Hardswish,LeakyRelu,Clamp}
    BiasElementwise(activation)            D = activation(alpha * accum + beta * C + bias)
    Generic(activation)                    a user's `def act(x): ...`, parsed (never run) and inlined

`scale` is a `ScaleType` (CUTLASS's names): DEFAULT (alpha and beta), NO_BETA_SCALING
(D = alpha * accum + C), ONLY_ALPHA_SCALING (no C), NOTHING (D = accum). alpha and beta may
be numbers, one-element tensors (read at run time), per-channel vectors ((N,) or (M, 1)), or
per-batch (L,) arrays: calling the epilogue (`epi(A, B, ...)`, `epi.arguments(A, B, ...)`)
reshapes a per-batch (L,) array to (L, 1, 1). Called that way, alpha and beta default to 1.0
(as in torch.addmm). `D` may be the very tensor `C` (an in-place update).

Unlike torch.addmm, `beta * C` is plain arithmetic: with beta = 0, NaN and Inf in C still
propagate (the epilogue means what its source says).
"""
from __future__ import annotations

import ast
import enum
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .errors import EpilogueArgumentError, EpilogueSyntaxError, flag, InternalError, Location
from .frontend import Expr, Program, clean_source, parse, read_source
from .ops import OPS, OpDef, lookup

# ---- printing a Program back to source ------------------------------------------------------


def number_literal(value: float) -> str:
    """A float literal the frontend parses back to the same value (inf as 1e999)."""
    value = float(value)
    if math.isnan(value):
        raise InternalError("a NaN literal cannot be printed as epilogue source")
    if math.isinf(value):
        return "1e999" if value > 0 else "-1e999"
    return repr(value)


def _param(value: Any) -> str:
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, tuple):
        return repr(tuple(int(v) for v in value))
    return number_literal(value)


# Operators print as the user writes them (fully parenthesized); the frontend reads each back
# as the same call. Logic prints as calls: &, | and ~ read back only on conditions.
_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "pow": "**", "lt": "<", "le": "<=",
          "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_PREFIX = {"neg": "-"}


def expr_source(expr: Expr, rename: dict[str, str] | None = None) -> str:
    """`expr` as source text, every call spelled by its registry name: op(args, key=value)."""
    rename = rename or {}
    if expr.kind == "name":
        return rename.get(expr.value, expr.value)
    if expr.kind == "const":
        return number_literal(expr.value)
    args = [expr_source(a, rename) for a in expr.args]
    if expr.value in _INFIX and not expr.params:
        return f"({args[0]} {_INFIX[expr.value]} {args[1]})"
    if expr.value in _PREFIX and not expr.params:
        return f"({_PREFIX[expr.value]}{args[0]})"
    args = [_unwrap(a, text) for a, text in zip(expr.args, args)]   # commas bind loosest
    args += [f"{key}={_param(value)}" for key, value in expr.params]
    return f"{expr.value}({', '.join(args)})"


def _unwrap(expr: Expr, text: str) -> str:
    """`text` without the parentheses around an operator expression at the top."""
    operator = expr.kind == "call" and not expr.params and (expr.value in _INFIX or expr.value in _PREFIX)
    return text[1:-1] if operator else text


def _statement(target: str, expr: Expr, rename: dict[str, str] | None = None) -> str:
    return f"{target} = {_unwrap(expr, expr_source(expr, rename))}"


def program_source(program: Program, name: str | None = None) -> str:
    """A Program as the source of one epilogue function that parses back to the same statements.

    >>> p = parse("def e(accum, b):\\n    D = relu(accum + b)\\n    return D\\n")
    >>> print(program_source(p), end="")
    def e(accum, b):
        D = relu(accum + b)
        return D
    """
    lines = [f"def {name or program.name}({', '.join(program.params)}):"]
    lines += [f"    {_statement(s.target, s.expr)}" for s in program.statements]
    lines.append(f"    return {', '.join(n for n, _ in program.outputs)}")
    return "\n".join(lines) + "\n"


def names_used(program: Program) -> list[tuple[str, Location | None]]:
    """Every variable name the statements read, with its place."""
    found = []
    stack = [s.expr for s in program.statements]
    while stack:
        e = stack.pop()
        if e.kind == "name":
            found.append((e.value, e.loc))
        stack.extend(e.args)
    return found


# ---- user activation functions: parsed, renamed, spliced -------------------------------------

ACTIVATION_PREFIX = "act_"


@dataclass(frozen=True)
class ParsedActivation:
    """A one-argument function `def act(x): ...; return y`, as a Program over `accum`.

    `program.params` is ("accum",) or ("accum", x): `accum` is a placeholder that `x` shadows,
    never read (checked).
    """

    program: Program
    input: str

    def statements(self, x: str, out: str) -> list[str]:
        """Source lines computing `out = act(x)`; the function's locals get ACTIVATION_PREFIX."""
        returned = self.program.outputs[0][0]
        rename = {self.input: x}
        for s in self.program.statements:
            rename[s.target] = out if s.target == returned else ACTIVATION_PREFIX + s.target
        lines = [_statement(rename[s.target], s.expr, rename) for s in self.program.statements]
        if returned == self.input:
            lines.append(f"{out} = {x}")
        return lines


def parse_activation(activation: Callable | str) -> ParsedActivation:
    """Parse (never run) a one-argument activation function or a string holding one."""
    if isinstance(activation, str):
        source, filename, offset, from_string = activation, "<activation string>", 0, True
    else:
        if getattr(activation, "__name__", "") == "<lambda>":
            raise EpilogueSyntaxError("Lambdas cannot be activations.",
                                      hint="Write it with def: `def act(x): y = ...; return y`.")
        source, filename, offset = read_source(
            activation, hint="Pass the activation as a string: \"def act(x):\\n    y = ...\\n    return y\".")
        from_string = False
    # The same clean-up the frontend does, so positions below match what it will parse.
    text = clean_source(source)
    try:
        module = ast.parse(text)
    except SyntaxError:
        module = None   # the frontend reports it, with its place
    if module is not None:
        defs = [n for n in module.body if isinstance(n, ast.FunctionDef)]
        if len(defs) == 1:
            text, wrapped = _add_accum_parameter(text, defs[0], filename, offset)
    from .frontend import _parse_source  # the parser proper, keeping the user's file and lines
    program = _parse_source(text, filename, offset, from_string=from_string)
    if len(program.outputs) != 1:
        raise EpilogueSyntaxError("An activation returns exactly one value.", program.outputs[1][1],
                                  hint="Return one name: `return y`.")
    if len(program.params) == 1:
        return ParsedActivation(program, "accum")
    for name, loc in names_used(program):
        if name == "accum":
            raise EpilogueSyntaxError("Variable 'accum' is not defined.", loc,
                                      hint="An activation sees only its own argument.")
    return ParsedActivation(program, program.params[1])


def _add_accum_parameter(text: str, fn: ast.FunctionDef, filename: str, offset: int):
    """`def act(x)` -> `def act(accum, x)`, so the frontend (which wants accum) parses it."""
    args = fn.args
    lines = text.splitlines()
    if len(args.args) != 1 or args.vararg or args.kwarg or args.kwonlyargs or args.posonlyargs:
        loc = Location(filename, fn.lineno + offset, fn.col_offset, lines[fn.lineno - 1])
        raise EpilogueSyntaxError(f"An activation takes exactly one argument, but {fn.name}() takes "
                                  f"{len(args.args) + len(args.kwonlyargs) + len(args.posonlyargs)}.",
                                  loc, hint="Write `def act(x): y = ...; return y`.")
    first = args.args[0]
    if first.arg == "accum":
        return text, False
    line = lines[first.lineno - 1]
    lines[first.lineno - 1] = line[:first.col_offset] + "accum, " + line[first.col_offset:]
    return "\n".join(lines) + "\n", True


# ---- activations -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Activation:
    """An activation: a unary registry op with its parameters, a parsed user function, or none.

    >>> Activation("gelu", approximate="tanh").statements("F", "D")
    ["D = gelu(F, approximate='tanh')"]
    """

    op: str | None = None
    params: tuple[tuple[str, Any], ...] = ()
    function: ParsedActivation | None = None
    label: str = ""

    def __init__(self, op: str | None = None, *, function: ParsedActivation | None = None,
                 label: str = "", **params):
        opdef = None
        if op is not None:
            opdef = lookup(op)
            if opdef is None or opdef.arity != 1 or opdef.kind != "elementwise":
                unary = sorted(n for n, d in OPS.items() if d.arity == 1 and d.kind == "elementwise")
                raise EpilogueArgumentError(f"{op!r} is not a unary elementwise op, so it cannot be an activation.",
                                            hint=f"Use one of: {', '.join(unary)}; or pass a function.")
            for key, value in params.items():
                if key not in opdef.param_names:
                    raise EpilogueArgumentError(f"{opdef.name}() has no parameter {key!r}.",
                                                hint=f"Its parameters: {', '.join(opdef.param_names) or 'none'}.")
                if not isinstance(value, str):
                    _finite(f"{opdef.name}({key}=...)", value)
        object.__setattr__(self, "op", opdef.name if opdef else None)
        object.__setattr__(self, "params", tuple(sorted(
            (k, v if isinstance(v, str) else float(v)) for k, v in params.items())))
        object.__setattr__(self, "function", function)
        object.__setattr__(self, "label", label or (opdef.name if opdef else "function" if function else "identity"))

    @property
    def is_identity(self) -> bool:
        return self.op is None and self.function is None

    def statements(self, x: str, out: str) -> list[str]:
        """Source lines that compute `out = activation(x)`."""
        if self.function is not None:
            return self.function.statements(x, out)
        if self.op is None:
            return [f"{out} = {x}"]
        args = [x] + [f"{k}={_param(v)}" for k, v in self.params]
        return [f"{out} = {self.op}({', '.join(args)})"]

    def __repr__(self) -> str:
        if self.function is not None:
            return f"Activation(function {self.function.program.name})"
        inner = ", ".join([repr(self.op)] + [f"{k}={v!r}" for k, v in self.params])
        return f"Activation({inner})"


def Identity() -> Activation:
    return Activation(None)


def Relu() -> Activation:
    return Activation("relu")


def GELU(approximate: str = "none") -> Activation:
    """GELU with erf (`approximate="none"`) or the tanh approximation (`"tanh"`)."""
    if approximate not in ("none", "tanh"):
        raise EpilogueArgumentError(f"GELU approximate must be 'none' (erf) or 'tanh', got {approximate!r}.")
    return Activation("gelu", approximate=approximate) if approximate != "none" else Activation("gelu")


def Sigmoid() -> Activation:
    return Activation("sigmoid")


def Silu() -> Activation:
    return Activation("silu")


def Hardswish() -> Activation:
    return Activation("hardswish")


def Tanh() -> Activation:
    return Activation("tanh")


def LeakyRelu(slope: float = 0.01) -> Activation:
    return Activation("leaky_relu", negative_slope=_finite("LeakyRelu slope", slope))


def Clamp(min: float | None = None, max: float | None = None) -> Activation:  # noqa: A002 (torch's names)
    if min is None and max is None:
        raise EpilogueArgumentError("Clamp needs a min, a max, or both.")
    bounds = {k: _finite(f"Clamp {k}", v) for k, v in (("min", min), ("max", max)) if v is not None}
    if len(bounds) == 2 and bounds["min"] > bounds["max"]:
        raise EpilogueArgumentError(f"Clamp min {bounds['min']} is larger than max {bounds['max']}.")
    return Activation("clamp", **bounds)


#: The activation shortcuts, by name (the docs' list and `as_activation("LeakyRelu")` read it).
ACTIVATIONS: dict[str, Callable[..., Activation]] = {
    f.__name__: f for f in (Identity, Relu, GELU, Sigmoid, Silu, Hardswish, Tanh, LeakyRelu, Clamp)}


def as_activation(activation: Any) -> Activation:
    """An Activation from None, an Activation, a registry op (name or `epifuse.ops` object),
    a torch function with a registry name (torch.relu), or a one-argument Python function
    (or a string holding one), which is parsed, never called."""
    if activation is None:
        return Identity()
    if isinstance(activation, Activation):
        return activation
    if isinstance(activation, OpDef):
        return Activation(activation.name)
    if isinstance(activation, str):
        if activation.lstrip().startswith("def "):
            return Activation(function=parse_activation(activation))
        if activation in ACTIVATIONS:
            return ACTIVATIONS[activation]()
        return Activation(activation)
    if callable(activation):
        name = getattr(activation, "__name__", "")
        module = getattr(activation, "__module__", "") or ""
        if (module.startswith("torch") or not hasattr(activation, "__code__")) and lookup(name):
            return Activation(name)  # torch.relu, F.silu, ...: the registry op of that name
        return Activation(function=parse_activation(activation), label=name)
    raise EpilogueArgumentError(f"Cannot use {type(activation).__name__} as an activation.",
                                hint="Pass an op name ('relu'), epifuse.ops.relu, an Activation, or a "
                                     "function `def act(x): ...`.")


def _finite(what: str, value) -> float:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and abs(value) <= sys.float_info.max:
        return float(value)
    shown = "an integer too large for a float" if number and isinstance(value, int) else repr(value)
    raise EpilogueArgumentError(f"{what} must be a finite number, got {shown}.")


# ---- scale types -----------------------------------------------------------------------------


class ScaleType(enum.Enum):
    """How alpha and beta enter `alpha * accum + beta * C` (CUTLASS's ScaleType::Kind)."""

    DEFAULT = "default"                        # alpha * accum + beta * C
    NO_BETA_SCALING = "no_beta_scaling"        # alpha * accum + C
    ONLY_ALPHA_SCALING = "only_alpha_scaling"  # alpha * accum
    NOTHING = "nothing"                        # accum
    # CUTLASS's per-channel kinds are the same templates with (N,) alpha/beta tensors:
    PER_CHANNEL_SCALING = "default"
    ONLY_ALPHA_PER_CHANNEL_SCALING = "only_alpha_scaling"

    @classmethod
    def of(cls, value) -> "ScaleType":
        """A ScaleType from itself or a name: "default", "NoBetaScaling", "only_alpha_scaling"."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = "".join(c for c in value.lower() if c.isalnum())
            for member in cls.__members__.values():
                if key == member.value.replace("_", ""):
                    return member
        raise EpilogueArgumentError(f"Unknown scale type {value!r}.",
                                    hint="Use epifuse.epilogues.ScaleType.DEFAULT, NO_BETA_SCALING, "
                                         "ONLY_ALPHA_SCALING or NOTHING.")


_LINEAR = {
    ScaleType.DEFAULT: (("alpha", "beta", "C"), "alpha * accum + beta * C"),
    ScaleType.NO_BETA_SCALING: (("alpha", "C"), "alpha * accum + C"),
    ScaleType.ONLY_ALPHA_SCALING: (("alpha",), "alpha * accum"),
    ScaleType.NOTHING: ((), "accum"),
}
#: Roles a picture of the DAG (`epifuse show`) assumes for the template operands.
_ROLES = {"alpha": "number", "beta": "number", "C": "tile", "bias": "row"}


# ---- the named epilogues ----------------------------------------------------------------------


def _restore(cls, source: str, state: dict):
    obj = str.__new__(cls, source)
    obj.__dict__.update(state)
    return obj


class NamedEpilogue(str):
    """An epilogue built from a template. Its string value is its source (so it goes wherever
    an epilogue function or string goes); calling it runs the GEMM with it fused.

    Attributes: `title` (the CUTLASS-style name), `operands`, `outputs`, `roles` (the operand
    roles `epifuse show` draws), `per_batch` (operands that may be per-batch (L,) arrays).
    """

    def __new__(cls, *args, **kwargs):
        if cls is NamedEpilogue:
            raise TypeError("NamedEpilogue is built by its subclasses (LinearCombination, ...).")
        return super().__new__(cls, *args, **kwargs)

    @classmethod
    def _build(cls, source: str, title: str, description: str, per_batch=("alpha", "beta")):
        self = str.__new__(cls, source)
        self.title = title
        self.description = description
        self.program = parse(source)       # validates now: errors surface at construction
        self.operands = self.program.operands
        self.outputs = tuple(n for n, _ in self.program.outputs)
        self.roles = {n: _ROLES[n] for n in self.operands if n in _ROLES}
        self.per_batch = tuple(n for n in per_batch if n in self.operands)
        return self

    def __reduce__(self):
        return (_restore, (type(self), str(self), dict(self.__dict__)))

    def __repr__(self) -> str:
        return self.description

    @property
    def source(self) -> str:
        return str(self)

    # ---- running -----------------------------------------------------------------------------
    def prepare(self, A: torch.Tensor, B: torch.Tensor, tensors: dict) -> dict:
        """The keyword tensors with defaults (alpha = beta = 1.0) and per-batch (L,) alpha/beta
        reshaped to (L, 1, 1)."""
        tensors = dict(tensors)
        for name in ("alpha", "beta"):
            if name in self.operands:
                tensors.setdefault(name, 1.0)
        return per_batch_scalars(tensors, self.per_batch, A, B)

    def __call__(self, A: torch.Tensor, B: torch.Tensor, **kwargs):
        """`epifuse.gemm(A, B, self, **kwargs)` after `prepare`: returns D (or D and Z)."""
        from .api import gemm
        return gemm(A, B, self, **self.prepare(A, B, kwargs))

    def arguments(self, A: torch.Tensor, B: torch.Tensor, *, accumulator_type=torch.float32,
                  precision: str = "default", compute_dtype=torch.float32,
                  out_dtype: torch.dtype | None = None, **tensors):
        """GemmArguments for `get_kernels` / `kernel.run`; outputs not passed are allocated."""
        from .api import EpilogueArguments, GemmArguments
        from .fused import allocate_outputs
        tensors = allocate_outputs(self.program, A, B, self.prepare(A, B, tensors), out_dtype)
        epi = EpilogueArguments(self, compute_dtype=compute_dtype, **tensors)
        return GemmArguments(A, B, out=tensors.get("D"), accumulator_type=accumulator_type,
                             epilogue=epi, precision=precision)


def per_batch_scalars(tensors: dict, names, A: torch.Tensor, B: torch.Tensor) -> dict:
    """Reshape each (L,) tensor among `names` to (L, 1, 1), a per-batch scalar, for a batched
    GEMM. (L,) is ambiguous when L == N (it is also a row); that raises with the fix."""
    from .shapes import accum_shape_of
    accum_shape, (L, M, N, K) = accum_shape_of(A, B)
    if len(accum_shape) != 3:
        return tensors
    out = dict(tensors)
    for name in names:
        value = out.get(name)
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == L and L > 1:
            if L == N:
                raise EpilogueArgumentError(
                    f"{name} has shape ({L},), which is both one value per batch (L={L}) and one "
                    f"per column (N={N}).",
                    hint=f"Pass {name}.reshape({L}, 1, 1) for per-batch or {name}.reshape(1, {N}) "
                         "for per-column values.")
            out[name] = value.reshape(L, 1, 1)
    return out


def _linear_source(fname: str, scale: ScaleType, activation: Activation, bias: bool,
                   store_preactivation: bool) -> str:
    operands, expression = _LINEAR[scale]
    params = ["accum", *operands] + (["bias"] if bias else [])
    if bias:
        expression = f"{expression} + bias" if expression != "accum" else "accum + bias"
    pre = "Z" if store_preactivation else "F"
    if activation.is_identity and not store_preactivation:
        body = [f"D = {expression}"]
    else:
        body = [f"{pre} = {expression}", *activation.statements(pre, "D")]
    outputs = "D, Z" if store_preactivation else "D"
    lines = [f"def {fname}({', '.join(params)}):", *(f"    {s}" for s in body), f"    return {outputs}"]
    return "\n".join(lines) + "\n"


def _snake(title: str) -> str:
    out = []
    for i, c in enumerate(title):
        if c.isupper() and i and (not title[i - 1].isupper() or (i + 1 < len(title) and title[i + 1].islower())):
            out.append("_")
        out.append(c.lower())
    return "".join(out)


class LinearCombination(NamedEpilogue):
    """D = activation(alpha * accum + beta * C), per `scale` (a ScaleType or its name)."""

    def __new__(cls, scale: ScaleType | str = ScaleType.DEFAULT, activation: Any = None):
        scale = ScaleType.of(scale)
        act = as_activation(activation)
        title = cls.__name__
        source = _linear_source(_snake(title), scale, act, bias=False, store_preactivation=False)
        args = [] if scale is ScaleType.DEFAULT else [f"scale=ScaleType.{scale.name}"]
        if cls is LinearCombination and not act.is_identity:
            args.append(f"activation={act!r}")
        return cls._build(source, title, f"{title}({', '.join(args)})")


def _variant(name: str, make: Callable[..., Activation], doc: str, params: str = ""):
    """A LinearCombination<Activation> class whose constructor takes the activation's
    parameters (keywords) and `scale`."""

    def __new__(cls, *args, scale: ScaleType | str = ScaleType.DEFAULT, **kwargs):
        act = make(*args, **kwargs)
        scale = ScaleType.of(scale)
        source = _linear_source(_snake(name), scale, act, bias=False, store_preactivation=False)
        shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
        if scale is not ScaleType.DEFAULT:
            shown.append(f"scale=ScaleType.{scale.name}")
        return cls._build(source, name, f"{name}({', '.join(shown)})")

    return type(name, (LinearCombination,), {"__new__": __new__, "__doc__": doc, "__module__": __name__})


LinearCombinationRelu = _variant("LinearCombinationRelu", Relu, "D = relu(alpha * accum + beta * C)")
LinearCombinationGELU = _variant("LinearCombinationGELU", GELU,
                                 'D = gelu(alpha * accum + beta * C); approximate="none" (erf) or "tanh"')
LinearCombinationSigmoid = _variant("LinearCombinationSigmoid", Sigmoid, "D = sigmoid(alpha * accum + beta * C)")
LinearCombinationSilu = _variant("LinearCombinationSilu", Silu, "D = silu(alpha * accum + beta * C)")
LinearCombinationHardswish = _variant("LinearCombinationHardswish", Hardswish,
                                      "D = hardswish(alpha * accum + beta * C)")
LinearCombinationLeakyRelu = _variant("LinearCombinationLeakyRelu", LeakyRelu,
                                      "D = leaky_relu(alpha * accum + beta * C, slope) (slope default 0.01)")
LinearCombinationClamp = _variant("LinearCombinationClamp", Clamp,
                                  "D = clamp(alpha * accum + beta * C, min, max)")


class BiasElementwise(NamedEpilogue):
    """D = activation(alpha * accum + beta * C + bias); with `store_preactivation=True` also
    the pre-activation Z (returned as D, Z), as CUTLASS's LinearCombinationBiasElementwise."""

    def __new__(cls, activation: Any = None, scale: ScaleType | str = ScaleType.DEFAULT,
                store_preactivation: bool = False):
        scale = ScaleType.of(scale)
        act = as_activation(activation)
        source = _linear_source("bias_elementwise", scale, act, bias=True,
                                store_preactivation=flag("store_preactivation", store_preactivation))
        shown = [] if act.is_identity else [repr(act)]
        if scale is not ScaleType.DEFAULT:
            shown.append(f"scale=ScaleType.{scale.name}")
        if store_preactivation:
            shown.append("store_preactivation=True")
        return cls._build(source, "BiasElementwise", f"BiasElementwise({', '.join(shown)})")


class Generic(NamedEpilogue):
    """D = activation(alpha * accum + beta * C) for a user's one-argument activation function
    (`def act(x): ...; return y`), parsed, never called, and inlined into the epilogue."""

    def __new__(cls, activation: Any, scale: ScaleType | str = ScaleType.DEFAULT):
        if activation is None:
            raise EpilogueArgumentError("Generic needs an activation function.",
                                        hint="Pass `def act(x): y = ...; return y` (or use LinearCombination).")
        scale = ScaleType.of(scale)
        act = as_activation(activation)
        source = _linear_source("linear_combination_generic", scale, act, bias=False,
                                store_preactivation=False)
        shown = [act.label if act.function is not None else repr(act)]
        if scale is not ScaleType.DEFAULT:
            shown.append(f"scale=ScaleType.{scale.name}")
        return cls._build(source, "Generic", f"Generic({', '.join(shown)})")


LinearCombinationGeneric = Generic

#: Every named epilogue class, by name (the docs and `epifuse show module:Name` read it).
NAMED = {c.__name__: c for c in (
    LinearCombination, LinearCombinationRelu, LinearCombinationGELU, LinearCombinationSigmoid,
    LinearCombinationSilu, LinearCombinationHardswish, LinearCombinationLeakyRelu,
    LinearCombinationClamp, BiasElementwise, Generic)}

__all__ = ["ScaleType", "Activation", "as_activation", "parse_activation", "NamedEpilogue",
           "per_batch_scalars", "program_source", "expr_source", *ACTIVATIONS, *NAMED,
           "LinearCombinationGeneric", "ACTIVATIONS", "NAMED"]
