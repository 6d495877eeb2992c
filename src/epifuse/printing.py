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
import keyword
import math
import re
from typing import Any

from .errors import InternalError, Location
from .frontend import IDENTIFIER
from .program import Expr, GeneratedSource, Program, Statement, fold_expr, param_rule
from .ir import ACCUM, ACCUM_UP, AXES, CONST, INPUT, Graph
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

# Operators print as the user writes them, with only the parentheses Python's precedence needs
# (with a pair around every operator, a long chain such as a + b + ... + z would nest too
# deeply for the frontend to read back); the frontend reads each back as the same call. Logic
# prints as calls: &, | and ~ read back only on conditions.
_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "pow": "**", "lt": "<", "le": "<=",
          "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_PREFIX = {"neg": "-"}
# Python's binding strength: comparisons (which chain, so never nest unparenthesized), + -,
# * /, unary -, **, then names, calls and literals.
_COMPARE, _SUM, _PRODUCT, _UNARY, _POWER, _ATOM = range(6)
_PRECEDENCE = {"add": _SUM, "sub": _SUM, "mul": _PRODUCT, "div": _PRODUCT, "pow": _POWER,
               "neg": _UNARY, **{name: _COMPARE for name in ("lt", "le", "gt", "ge", "eq", "ne")}}


def expr_source(expr: Expr, rename: dict[str, str] | None = None) -> str:
    """`expr` as source text, every call spelled by its registry name: op(args, key=value).
    Built sources first, without recursion (expressions may nest deeply)."""
    rename = rename or {}

    def combine(e: Expr, args: list) -> tuple[str, int]:   # (source, how strongly it binds)
        if e.kind == "name":
            return rename.get(e.value, e.value), _ATOM
        if e.kind == "const":
            literal = number_literal(e.value)
            return literal, _UNARY if literal.startswith("-") else _ATOM
        return _call_source(e, args)
    return fold_expr(expr, combine)[0]


def _call_source(expr: Expr, args: list[tuple[str, int]]) -> tuple[str, int]:
    """A call whose arguments are printed already as (source, binding strength)."""
    strength = _PRECEDENCE.get(expr.value) if not expr.params else None
    if strength is None or len(args) != (1 if expr.value in _PREFIX else 2):
        words = [source for source, _ in args]
        params = [f"{key}={param_literal(value)}" for key, value in expr.params]
        if OPS[expr.value].sequence:   # cat((a, b), dim=-1): the tensors as one tuple, dim one int
            words = [f"({', '.join(words)})"]
            params = [f"{key}={param_literal(value[0] if key == 'dim' else value)}" for key, value in expr.params]
        words += params
        return f"{expr.value}({', '.join(words)})", _ATOM
    if expr.value in _PREFIX:
        # -(-x) prints as --x, which reads back the same, and -x ** 2 means -(x ** 2)
        return _PREFIX[expr.value] + _wrap(args[0], _UNARY), _UNARY
    if strength == _POWER:      # right-associative, and binds tighter than a unary minus on its left
        lhs, rhs = _wrap(args[0], _ATOM), _wrap(args[1], _UNARY)
    elif strength == _COMPARE:  # a < b < c means (a < b) & (b < c): a comparison in one needs them
        lhs, rhs = _wrap(args[0], _COMPARE + 1), _wrap(args[1], _COMPARE + 1)
    else:                       # left-associative: a - (b - c) keeps its parentheses
        lhs, rhs = _wrap(args[0], strength), _wrap(args[1], strength + 1)
    return f"{lhs} {_INFIX[expr.value]} {rhs}", strength


def _wrap(arg: tuple[str, int], needs: int) -> str:
    """An argument's source, in parentheses when it binds less strongly than `needs`."""
    source, strength = arg
    return source if strength >= needs else f"({source})"


def statement_source(target: str, expr: Expr, rename: dict[str, str] | None = None) -> str:
    return f"{target} = {expr_source(expr, rename)}"


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
    return GeneratedSource("\n".join(lines) + "\n")


class FreshNames:
    """Fresh identifiers that collide with nothing already taken."""

    def __init__(self, taken):
        self.taken = set(taken)
        self.counts: dict[str, int] = {}   # prefix -> the last suffix tried

    def fresh(self, prefix: str) -> str:
        prefix = prefix if IDENTIFIER.match(prefix) and not prefix.startswith("__") else "v"
        name, i = prefix, self.counts.get(prefix, 0)
        if i:
            name = f"{prefix}_{i}"
        while name in self.taken:
            i += 1
            name = f"{prefix}_{i}"
        self.counts[prefix] = i
        self.taken.add(name)
        return name


# ---- Graphs --------------------------------------------------------------------------------

def graph_source(graph: Graph, rank: int, name: str = "epilogue", accum: str = "accum",
                 up: str | None = None) -> str:
    """`graph` as the source of an epilogue function that parses and binds back to it.

    `accum` names what the graph's accum leaf reads: "accum" (the GEMM of the call), or an
    operand name, so the graph runs over a tensor saved earlier (the function still takes
    `accum`, unused). `up` names the operand a gated GEMM's second accumulator (accum_up)
    reads, saved likewise; a graph that reads accum_up needs it. Operands keep their names,
    so the same keyword arguments bind; reductions print their dims for this `rank`.
    """
    axes = AXES[3 - rank:]
    saved = [n for n in (accum, up) if n is not None and n != "accum"]
    params = ["accum", *saved] + [o.name for o in graph.operands if o.name not in saved]
    names = FreshNames({*params, *(o.name for o in graph.outputs)})
    text: dict[int, str] = {}
    lines = []
    for node in graph.nodes():
        if node.op is ACCUM:
            text[id(node)] = accum
        elif node.op is ACCUM_UP:
            if up is None:
                raise InternalError("graph_source: the graph reads a gated GEMM's accum_up, and no "
                                    "operand was named to read it (up=...)", str(graph))
            text[id(node)] = up
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
    return GeneratedSource(f"def {name}({', '.join(params)}):\n" + "\n".join(lines)
                           + f"\n    return {returned}\n")


# ---- Programs as JSON ----------------------------------------------------------------------

def dump_program(program: Program) -> str:
    """`program` as JSON text that `load_program` turns back into an equal Program: the same
    statements, outputs and source, places included (a program that nn or fused.py derived
    from another has a `source` that no longer spells it, so the source alone would not do).
    An expression is nested lists, [kind, value, [args...], [[key, value]...], place]; they are
    written and read without recursion, so no depth of nesting or number of statements is too
    many (json's own encoder and decoder recurse once per level)."""
    return _json_text([program.name, list(program.params), [_dump_loc(x) for x in program.param_locs],
                       [[s.target, _dump_expr(s.expr), _dump_loc(s.loc)] for s in program.statements],
                       [[name, _dump_loc(loc)] for name, loc in program.outputs],
                       program.source, program.filename])


def load_program(text: str) -> Program:
    """The Program `dump_program` wrote as `text`; ValueError when the text is not one. Every
    name is checked as the parser checks it (an identifier; a call names an op of the registry),
    since the text may come from a file on disk rather than from this process."""
    try:
        name, params, param_locs, statements, outputs, source, filename = _json_value(text)
        return Program(_function_name(name), tuple(_identifier(p) for p in params),
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


def _dump_expr(expr: Expr) -> list:
    """`expr` as nested lists."""
    return fold_expr(expr, lambda e, args: [e.kind, _dump_value(e.value), args,
                                            [[k, _dump_value(v)] for k, v in e.params], _dump_loc(e.loc)])


def _load_expr(x) -> Expr:
    """The Expr that nested lists `x` spell (see _dump_expr), built sources first, without
    recursion; TypeError or ValueError where they spell none."""
    done: dict[int, Expr] = {}
    stack: list[tuple[Any, bool]] = [(x, False)]
    while stack:
        node, expanded = stack.pop()
        if id(node) in done:
            continue
        if not (isinstance(node, list) and len(node) == 5 and isinstance(node[2], list)):
            raise TypeError(f"an expression is [kind, value, args, params, place], not {node!r:.80}")
        if not expanded:
            stack.append((node, True))
            stack.extend((a, False) for a in node[2] if id(a) not in done)
            continue
        kind, value, args, params, loc = node
        done[id(node)] = _load_node(kind, value, tuple(done[id(a)] for a in args), params, loc)
    return done[id(x)]


def _load_node(kind, value, args: tuple[Expr, ...], params, loc) -> Expr:
    """One expression whose arguments are loaded already, checked as the parser checks it."""
    value = _load_value(value)
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


# ---- JSON without recursion -----------------------------------------------------------------

def _json_text(value) -> str:
    """json.dumps(value, separators=(",", ":")), the same text, for lists and dicts nested to
    any depth: the containers being written are kept on a stack."""
    parts: list[str] = []
    stack: list[tuple[Any, str, bool]] = [(iter((value,)), "", False)]   # items, closer, of a dict
    comma = False
    while stack:
        items, closer, pairs = stack[-1]
        for item in items:
            if comma:
                parts.append(",")
            if pairs:
                key, item = item
                if not isinstance(key, str):
                    raise TypeError(f"a JSON key is a string, not {key!r}")
                parts += [_JSON_STRING(key), ":"]
            if isinstance(item, list):
                parts.append("[")
                stack.append((iter(item), "]", False))
                comma = False
                break
            if isinstance(item, dict):
                parts.append("{")
                stack.append((iter(item.items()), "}", True))
                comma = False
                break
            parts.append(_JSON_STRING(item) if isinstance(item, str) else
                         _JSON_WORDS[item] if item is None or isinstance(item, bool) else
                         int.__repr__(item) if isinstance(item, int) else json.dumps(item))
            comma = True
        else:
            stack.pop()
            parts.append(closer)
            comma = True
    return "".join(parts)


_JSON_STRING = json.encoder.encode_basestring_ascii   # what json.dumps writes a str as
_JSON_WORDS = {None: "null", True: "true", False: "false"}
_SPACE = re.compile(r"[ \t\n\r]*")
_SCALAR = json.JSONDecoder().raw_decode


def _json_value(text: str):
    """json.loads(text) for arrays and objects nested to any depth: containers are kept on a
    stack; strings, numbers, true, false and null are read by json's scanner, which does not
    recurse for them. ValueError (json's JSONDecodeError) where the text is not JSON."""
    if not isinstance(text, str):
        raise TypeError(f"expected JSON text, not {type(text).__name__}")
    open_: list = []          # [container, key of the value being read (objects)]
    pos = _SPACE.match(text, 0).end()
    while True:
        char = text[pos:pos + 1]
        if char in ("[", "{"):
            container = [] if char == "[" else {}
            pos = _SPACE.match(text, pos + 1).end()
            if text.startswith("]" if char == "[" else "}", pos):
                value, pos = container, pos + 1
            else:
                open_.append([container, None])
                if char == "{":
                    pos = _json_key(text, pos, open_[-1])
                continue
        else:
            value, pos = _SCALAR(text, pos)
        while True:   # put the value in its container; close every container that ends here
            if not open_:
                pos = _SPACE.match(text, pos).end()
                if pos != len(text):
                    raise json.JSONDecodeError("Extra data", text, pos)
                return value
            container, key = open_[-1]
            if isinstance(container, list):
                container.append(value)
            else:
                container[key] = value
            pos = _SPACE.match(text, pos).end()
            char = text[pos:pos + 1]
            if char == ",":
                pos = _SPACE.match(text, pos + 1).end()
                if isinstance(container, dict):
                    pos = _json_key(text, pos, open_[-1])
                break
            if char != ("]" if isinstance(container, list) else "}"):
                raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
            open_.pop()
            value, pos = container, pos + 1


def _json_key(text: str, pos: int, level: list) -> int:
    """Read an object's `"key":` at `pos` into `level`; the position of its value."""
    if not text.startswith('"', pos):
        raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, pos)
    level[1], pos = _SCALAR(text, pos)
    pos = _SPACE.match(text, pos).end()
    if not text.startswith(":", pos):
        raise json.JSONDecodeError("Expecting ':' delimiter", text, pos)
    return _SPACE.match(text, pos + 1).end()


def _str(x) -> str:
    if not isinstance(x, str):
        raise TypeError(f"expected a string, not {x!r}")
    return x


def _identifier(x) -> str:
    if not (isinstance(x, str) and IDENTIFIER.match(x)):
        raise TypeError(f"expected an identifier, not {x!r}")
    return x


def _function_name(x) -> str:
    """The epilogue function's own name: any name Python accepts for a `def` (the parser takes
    it as written, non-ASCII letters included), unlike the ASCII names of its values."""
    if not (isinstance(x, str) and x.isidentifier() and not keyword.iskeyword(x)):
        raise TypeError(f"expected a function name, not {x!r}")
    return x


__all__ = ["number_literal", "param_literal", "expr_source", "statement_source", "program_source",
           "graph_source", "FreshNames", "dump_program", "load_program"]
