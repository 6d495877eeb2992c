"""Epilogues back to text: numbers, expressions, Programs and Graphs as epilogue source, and
Programs as JSON.

Everything epifuse writes as an epilogue goes through here: the named epilogues' templates
(epifuse.epilogues), class-based epilogues (epifuse.fused), a backward Graph printed so it runs
through the same pipeline as a user's epilogue (epifuse.autodiff, epifuse.torch_ops), and the
JSON that the torch ops carry so another process reads an epilogue it never parsed. What is
printed parses back to the same thing: numbers exactly (`repr` round-trips a float, infinities
are 1e999 and NaN (1e999 - 1e999)), and only identifiers the frontend accepts.
"""
from __future__ import annotations

import json
import math
from typing import Any

from .errors import InternalError, Location
from .frontend import IDENTIFIER, Expr, Program, Statement, param_rule
from .ir import ACCUM, AXES, CONST, INPUT, Graph
from .ops import OPS

# ---- numbers and parameters ---------------------------------------------------------------


def number_literal(value: float) -> str:
    """A literal the frontend reads back as `value`: repr for finite floats, 1e999 for an
    infinity, and NaN as (1e999 - 1e999), which folding evaluates to NaN."""
    value = float(value)
    if math.isnan(value):
        return "(1e999 - 1e999)"
    if math.isinf(value):
        return "1e999" if value > 0 else "-1e999"
    return repr(value)


def param_literal(value: Any) -> str:
    """An op parameter as source: None, a bool, an identifier-like string, a tuple of ints, a number."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, str):
        if not IDENTIFIER.match(value):
            raise InternalError(f"cannot print the parameter {value!r}")
        return repr(value)
    if isinstance(value, tuple):
        return repr(tuple(int(v) for v in value))
    if isinstance(value, int):
        return repr(value)
    return number_literal(value)


# ---- Programs ------------------------------------------------------------------------------

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
    args += [f"{key}={param_literal(value)}" for key, value in expr.params]
    return f"{expr.value}({', '.join(args)})"


def _unwrap(expr: Expr, text: str) -> str:
    """`text` without the parentheses around an operator expression at the top."""
    operator = expr.kind == "call" and not expr.params and (expr.value in _INFIX or expr.value in _PREFIX)
    return text[1:-1] if operator else text


def statement_source(target: str, expr: Expr, rename: dict[str, str] | None = None) -> str:
    return f"{target} = {_unwrap(expr, expr_source(expr, rename))}"


def program_source(program: Program, name: str | None = None) -> str:
    """A Program as the source of one epilogue function that parses back to the same statements.

    >>> from epifuse.frontend import parse
    >>> p = parse("def e(accum, b):\\n    D = relu(accum + b)\\n    return D\\n")
    >>> print(program_source(p), end="")
    def e(accum, b):
        D = relu(accum + b)
        return D
    """
    lines = [f"def {name or program.name}({', '.join(program.params)}):"]
    lines += [f"    {statement_source(s.target, s.expr)}" for s in program.statements]
    lines.append(f"    return {', '.join(n for n, _ in program.outputs)}")
    return "\n".join(lines) + "\n"


class FreshNames:
    """Fresh identifiers that collide with nothing already taken."""

    def __init__(self, taken):
        self.taken = set(taken)

    def fresh(self, prefix: str) -> str:
        prefix = prefix if IDENTIFIER.match(prefix) and not prefix.startswith("__") else "v"
        name, i = prefix, 0
        while name in self.taken:
            i += 1
            name = f"{prefix}_{i}"
        self.taken.add(name)
        return name


# ---- Graphs --------------------------------------------------------------------------------

def graph_source(graph: Graph, rank: int, name: str = "epilogue", accum: str = "accum") -> str:
    """`graph` as the source of an epilogue function that parses and binds back to it.

    `accum` names what the graph's accum leaf reads: "accum" (the GEMM of the call), or an
    operand name, so the graph runs over a tensor saved earlier (the function still takes
    `accum`, unused). Operands keep their names, so the same keyword arguments bind;
    reductions print their dims for this `rank`.
    """
    axes = AXES[3 - rank:]
    params = ["accum"] + ([accum] if accum != "accum" else []) + [o.name for o in graph.operands
                                                                   if o.name != accum]
    names = FreshNames({*params, *(o.name for o in graph.outputs)})
    text: dict[int, str] = {}
    lines = []
    for node in graph.nodes():
        if node.op is ACCUM:
            text[id(node)] = accum
        elif node.op is CONST:
            text[id(node)] = number_literal(node.arg)
        elif node.op is INPUT:
            text[id(node)] = node.arg.name
        else:
            args = [text[id(s)] for s in node.src]
            for key, value in sorted(node.params.items()):
                if key == "dim":
                    value = tuple(axes.index(a) for a in value)
                if value is not None:
                    args.append(f"{key}={param_literal(value)}")
            var = names.fresh("t")
            lines.append(f"    {var} = {node.op.name}({', '.join(args)})")
            text[id(node)] = var
    for out in graph.outputs:
        lines.append(f"    {out.name} = {text[id(out.node)]}")
    returned = ", ".join(o.name for o in graph.outputs)
    return f"def {name}({', '.join(params)}):\n" + "\n".join(lines) + f"\n    return {returned}\n"


# ---- Programs as JSON ----------------------------------------------------------------------

def dump_program(program: Program) -> str:
    """`program` as JSON text that `load_program` turns back into an equal Program: the same
    statements, outputs and source, places included (a program that nn or fused.py derived
    from another has a `source` that no longer spells it, so the source alone would not do)."""
    return json.dumps([program.name, list(program.params), [_dump_loc(x) for x in program.param_locs],
                       [[s.target, _dump_expr(s.expr), _dump_loc(s.loc)] for s in program.statements],
                       [[name, _dump_loc(loc)] for name, loc in program.outputs],
                       program.source, program.filename], separators=(",", ":"))


def load_program(text: str) -> Program:
    """The Program `dump_program` wrote as `text`; ValueError when the text is not one. Every
    name is checked as the parser checks it (an identifier; a call names an op of the registry),
    since the text may come from a file on disk rather than from this process."""
    try:
        name, params, param_locs, statements, outputs, source, filename = json.loads(text)
        return Program(_identifier(name), tuple(_identifier(p) for p in params),
                       tuple(_load_loc(x) for x in param_locs),
                       tuple(Statement(_identifier(t), _load_expr(e), _load_loc(x)) for t, e, x in statements),
                       tuple((_identifier(n), _load_loc(x)) for n, x in outputs), _str(source), _str(filename))
    except (ValueError, TypeError, RecursionError) as exc:
        raise ValueError(f"not a dumped epilogue program ({type(exc).__name__}: {exc})") from None


def _dump_loc(loc: Location | None):
    return None if loc is None else [loc.filename, loc.line, loc.col, loc.source_line]


def _load_loc(x) -> Location | None:
    if x is None:
        return None
    filename, line, col, source_line = x
    if not (isinstance(line, int) and isinstance(col, int)):
        raise TypeError(f"a place's line and column are numbers, not {line!r}, {col!r}")
    return Location(_str(filename), line, col, _str(source_line))


def _dump_expr(e: Expr):
    return [e.kind, _dump_value(e.value), [_dump_expr(a) for a in e.args],
            [[k, _dump_value(v)] for k, v in e.params], _dump_loc(e.loc)]


def _load_expr(x) -> Expr:
    kind, value, args, params, loc = x
    value = _load_value(value)
    args = tuple(_load_expr(a) for a in args)
    params = tuple((_identifier(k), _load_value(v)) for k, v in params)
    if kind == "call":
        opdef = OPS.get(value) if isinstance(value, str) else None
        if opdef is None:
            raise TypeError(f"unknown op {value!r}")
        if len(args) != opdef.arity:
            raise TypeError(f"{value} takes {opdef.arity} tensor arguments, not {len(args)}")
        for k, v in params:
            if k not in opdef.param_names or not param_rule(k)[0](v):
                raise TypeError(f"{value}() cannot take {k}={v!r}")
    elif kind == "name":
        _identifier(value)
    elif kind != "const" or not isinstance(value, (int, float)):
        raise TypeError(f"unknown expression {kind!r} {value!r}")
    if kind != "call" and (args or params):
        raise TypeError(f"a {kind} has no arguments")
    return Expr(kind, value, args, params, _load_loc(loc))


def _dump_value(v):
    """Literals and params: None, bools, ints, floats, strings and tuples of them. Floats are
    tagged and written by float.hex (exact, and JSON has no inf or nan); tuples are tagged, so
    a tuple comes back a tuple."""
    if isinstance(v, tuple):
        return {"t": [_dump_value(i) for i in v]}
    if isinstance(v, float):
        return {"f": v.hex()}
    if v is None or isinstance(v, (bool, int, str)):
        return v
    raise TypeError(f"cannot dump the literal {v!r}")


def _load_value(x):
    if isinstance(x, dict):
        if set(x) == {"t"} and isinstance(x["t"], list):
            return tuple(_load_value(i) for i in x["t"])
        if set(x) == {"f"} and isinstance(x["f"], str):
            return float.fromhex(x["f"])
        raise TypeError(f"unknown literal {x!r}")
    if x is None or isinstance(x, (bool, int, str)):
        return x
    raise TypeError(f"unknown literal {x!r}")


def _str(x) -> str:
    if not isinstance(x, str):
        raise TypeError(f"expected a string, not {x!r}")
    return x


def _identifier(x) -> str:
    if not (isinstance(x, str) and IDENTIFIER.match(x)):
        raise TypeError(f"expected an identifier, not {x!r}")
    return x


__all__ = ["number_literal", "param_literal", "expr_source", "statement_source", "program_source",
           "graph_source", "FreshNames", "dump_program", "load_program"]
