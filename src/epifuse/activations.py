"""Activations: the one table of activation names, and user activation functions.

An `Activation` is a unary registry op with its parameters, a user's one-argument function
(parsed, never run, and inlined), or none. `ACTIVATIONS` names the activations by torch's
names, as `FusedLinear(epilogue="gelu")` and every epilogue argument (`epifuse.gemm(A, B,
"gelu")`, `EpilogueArguments("gelu", D=D)`) take them; CUTLASS's functor names (Relu(),
LeakyRelu(0.1), Clamp(0, 6)) build the same kind of Activation for the named epilogues;
`of_module` reads a torch activation module (nn.GELU(approximate="tanh")) as one.

>>> Activation("gelu", approximate="tanh").statements("F", "D")
["D = gelu(F, approximate='tanh')"]
"""
from __future__ import annotations

import ast
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from .errors import EpilogueArgumentError, EpilogueSyntaxError, Location, did_you_mean
from .frontend import clean_source, parse_source, read_source
from .program import Program
from .nesting import check_nesting
from .ops import OPS, OpDef, lookup
from .printing import param_literal, statement_source

ACTIVATION_PREFIX = "act_"


def activation_prefix(n: int) -> str:
    """The prefix of the locals of the `n`-th function inlined into one epilogue (from 0):
    "act_", then "act2_", "act3_", ... Every local is a name (it does not start with a digit),
    so no prefixed local of one inlining spells one of another's."""
    return ACTIVATION_PREFIX if n == 0 else f"act{n + 1}_"


@dataclass(frozen=True)
class ParsedActivation:
    """A one-argument function `def act(x): ...; return y`, as a Program over `accum`.

    `program.params` is ("accum",) or ("accum", x): `accum` is a placeholder that `x` shadows,
    never read (checked).
    """

    program: Program
    input: str

    def statements(self, x: str, out: str, prefix: str = ACTIVATION_PREFIX) -> list[str]:
        """Source lines computing `out = act(x)`; the function's locals get `prefix` (give each
        function inlined into one epilogue its own: `activation_prefix`)."""
        returned = self.program.outputs[0][0]
        rename = {self.input: x}
        for s in self.program.statements:
            rename[s.target] = out if s.target == returned else prefix + s.target
        lines = [statement_source(rename[s.target], s.expr, rename) for s in self.program.statements]
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
    lines = text.split("\n")
    check_nesting(text, filename, offset)   # before ast.parse: CPython's parser recurses in C
    try:
        module = ast.parse(text)
    except SyntaxError:
        module = None   # the frontend reports it, with its place
    fn = None
    if module is not None:
        defs = [n for n in module.body if isinstance(n, ast.FunctionDef)]
        if len(defs) == 1:
            fn = defs[0]
            text, wrapped = _add_accum_parameter(text, fn, filename, offset)
    program = parse_source(text, filename, offset, from_string=from_string, keywords=False)
    if len(program.outputs) != 1:
        raise EpilogueSyntaxError("An activation returns exactly one value.", program.outputs[1][1],
                                  hint="Return one name: `return y`.")
    if len(program.params) == 1:
        return ParsedActivation(program, "accum")
    # accum is the parser's placeholder here, not the function's: every read of it is refused,
    # row(accum)'s too (the parser reads that argument as accum's shape and keeps no trace of it).
    reads = [n for stmt in fn.body for n in ast.walk(stmt) if isinstance(n, ast.Name) and n.id == "accum"]
    if reads:
        first = min(reads, key=lambda n: (n.lineno, n.col_offset))
        loc = Location(filename, first.lineno + offset, first.col_offset, lines[first.lineno - 1])
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
                 label: str = "", infinite: bool = False, **params):
        """`infinite=True` admits infinite parameters, as torch's modules hold them
        (nn.Softplus(threshold=inf)); parameters are finite numbers otherwise."""
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
                if not isinstance(value, str) and not (infinite and isinstance(value, float) and math.isinf(value)):
                    _finite(f"{opdef.name}({key}=...)", value)
        object.__setattr__(self, "op", opdef.name if opdef else None)
        object.__setattr__(self, "params", tuple(sorted(
            (k, v if isinstance(v, str) else float(v)) for k, v in params.items())))
        object.__setattr__(self, "function", function)
        object.__setattr__(self, "label", label or (opdef.name if opdef else "function" if function else "identity"))

    @property
    def is_identity(self) -> bool:
        return self.op is None and self.function is None

    def statements(self, x: str, out: str, prefix: str = ACTIVATION_PREFIX) -> list[str]:
        """Source lines that compute `out = activation(x)`; a function's locals get `prefix`."""
        if self.function is not None:
            return self.function.statements(x, out, prefix)
        if self.op is None:
            return [f"{out} = {x}"]
        args = [x] + [f"{k}={param_literal(v)}" for k, v in self.params]
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


#: CUTLASS's activation functors by name: `as_activation("LeakyRelu")`, and the docs' list.
CUTLASS_NAMES: dict[str, Callable[..., Activation]] = {
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
        if activation in CUTLASS_NAMES:
            return CUTLASS_NAMES[activation]()
        if activation in ACTIVATIONS:
            return ACTIVATIONS[activation]
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


#: Every activation by torch's name: what FusedLinear(epilogue=...) takes.
ACTIVATIONS: dict[str, Activation] = {
    "identity": Identity(), "relu": Relu(), "gelu": GELU(), "gelu_tanh": GELU("tanh"),
    "silu": Silu(), "sigmoid": Sigmoid(), "tanh": Tanh(), "relu6": Activation("relu6"),
    "mish": Activation("mish"), "hardswish": Hardswish(), "hardsigmoid": Activation("hardsigmoid"),
    "softplus": Activation("softplus"), "elu": Activation("elu"), "leaky_relu": Activation("leaky_relu"),
    "relu_squared": Activation(function=parse_activation(
        "def relu_squared(x):\n    y = square(relu(x))\n    return y\n"), label="relu_squared"),
}

# torch activation modules without parameters, by the ACTIVATIONS entry they are
_MODULES = {nn.ReLU: "relu", nn.SiLU: "silu", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.ReLU6: "relu6",
            nn.Mish: "mish", nn.Hardswish: "hardswish", nn.Hardsigmoid: "hardsigmoid", nn.Identity: "identity"}
# and those with parameters: (op, the module attributes that are its parameters)
_MODULES_WITH_PARAMS = {nn.LeakyReLU: ("leaky_relu", "negative_slope"), nn.ELU: ("elu", "alpha"),
                        nn.Softplus: ("softplus", "beta", "threshold")}


def is_activation_name(epilogue) -> bool:
    """Whether an epilogue argument is a bare name ("gelu"): a string that is one identifier,
    which the entry points read as an ACTIVATIONS name. Source code never is one (an epilogue
    string holds a `def`), so it stays source code."""
    return isinstance(epilogue, str) and epilogue.strip().isidentifier()


def named_activation(name: str) -> Activation:
    """The ACTIVATIONS entry `name` names; an EpilogueArgumentError listing them otherwise."""
    name = name.strip()
    activation = ACTIVATIONS.get(name)
    if activation is None:
        close = did_you_mean(name, ACTIVATIONS)
        raise EpilogueArgumentError(
            f"Unknown activation {name!r}",
            hint=(close + " " if close else "") + f"The activations are: {', '.join(ACTIVATIONS)}; "
                 "or pass an epilogue function, or a string holding one `def`.")
    return activation


def of_module(module: nn.Module) -> Activation | None:
    """The Activation a torch activation module computes, or None if it is none epifuse has
    (or its parameters are NaN, which no epilogue literal spells)."""
    if type(module) in _MODULES:
        return ACTIVATIONS[_MODULES[type(module)]]
    if type(module) is nn.GELU:
        return GELU(module.approximate)
    spec = _MODULES_WITH_PARAMS.get(type(module))
    if spec is None:
        return None
    op, *names = spec
    values = {name: float(getattr(module, name)) for name in names}
    if any(math.isnan(v) for v in values.values()):
        return None
    return Activation(op, infinite=True, **values)


def activation_source(activation: Activation | str, bias: bool, name: str = "fused_linear") -> str:
    """The epilogue source applying `activation` to accum (+ bias): `D = act(accum + bias)`.
    A string is an expression in `x` ("relu(x)", "square(relu(x))")."""
    params = "accum, bias" if bias else "accum"
    pre = "accum + bias" if bias else "accum"
    result = [f"D = {activation}"] if isinstance(activation, str) else activation.statements("x", "D")
    body = [f"x = {pre}", *result]
    return f"def {name}({params}):\n" + "".join(f"    {line}\n" for line in body) + "    return D\n"


__all__ = ["Activation", "ParsedActivation", "parse_activation", "activation_prefix", "as_activation",
           "of_module", "activation_source", "is_activation_name", "named_activation", "ACTIVATIONS", "CUTLASS_NAMES",
           *CUTLASS_NAMES]
