"""A parsed Program as JSON text, and back: what the torch ops carry (epifuse.torch_ops), so a
process that loads a torch.compile cache reads the epilogue it never parsed. Reading checks
every name and param as the parser does, since the text may come from a file on disk.
"""
from __future__ import annotations

import json

from .errors import Location
from .frontend import IDENTIFIER, Expr, Program, Statement, param_rule
from .ops import OPS


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
