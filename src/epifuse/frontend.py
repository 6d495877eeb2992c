"""Parse an epilogue (a function or a string) into a `Program`; never execute it.

The visitor is a whitelist: each Python construct it knows becomes part of the program, and
anything else raises `EpilogueSyntaxError` with its line and column. Call names are resolved
against the ops registry here, so an unknown function fails at parse time with suggestions.

Accepted: one `def` whose parameters are `accum` and the operands; single-name assignments
(each name once); a final `return` of names; float/int/bool literals (complex ones in a complex
epilogue); `x.real`, `x.imag`; unary `-`, `+`, `~`;
`+ - * / **`, `& |`; comparisons; calls of registry ops spelled `op(x)`, `torch.op(x)`,
`F.op(x)`, `torch.nn.functional.op(x)`, `epifuse.ops.op(x)` or `x.op()`; `x.to(torch.float16)`;
`gate, up = accum.chunk(2, dim=-1)` and, over its halves, `D = torch.cat((a, b), dim=-1)` as
the whole value of a returned output.
"""
from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from typing import Any, Callable

from .errors import (EpilogueSyntaxError, Location, UnsupportedOperationError,
                     did_you_mean)
from .nesting import LINE_BREAK, TOO_DEEP_HINT, check_nesting
from .ops import OPS, lookup, spellings
from .ops.dtypes import CAST_METHODS
from .program import ACCUMULATORS, CallSite, Expr, GeneratedSource, Program, Statement, param_rule

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
MAX_SOURCE_CHARS = 100_000
# Operands and outputs are passed by keyword (epifuse.gemm(A, B, epi, C=C, D=D)), next to the
# other keyword parameters of the entry points that take them: epifuse.gemm, torch_ops.gemm,
# EpilogueArguments, FusedGemm (calling it and .arguments), the named epilogues (calling them
# and .arguments). None of those names can be an operand or output, whichever entry point the
# epilogue later goes through; tests/unit/test_api.py checks that every keyword parameter of
# those entry points is listed here. (GemmArguments' `out` is not: it takes no operands.)
RESERVED_KEYWORDS = frozenset({
    "A", "B", "epilogue", "out_dtype", "accumulate", "deterministic", "compute_dtype", "precision",
    "recompute", "accumulator_type",
})
MODULE_PREFIXES = {
    ("torch",), ("F",), ("nn", "functional"), ("torch", "nn", "functional"), ("functional",),
    ("torch", "special"), ("epifuse",), ("ops",), ("epifuse", "ops"),
}
_BINOPS = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div", ast.Pow: "pow",
           ast.BitAnd: "logical_and", ast.BitOr: "logical_or"}
_CMPOPS = {ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge", ast.Eq: "eq", ast.NotEq: "ne"}


def parse(epilogue: Callable | str) -> Program:
    """Parse a function or a string holding one `def` into a Program.

    >>> parse("def epi(accum, alpha):\\n    D = accum * alpha\\n    return D").outputs[0][0]
    'D'
    """
    if isinstance(epilogue, str):
        return _parse_string(epilogue, isinstance(epilogue, GeneratedSource))
    if callable(epilogue):
        return _parse_function(epilogue)
    raise EpilogueSyntaxError(
        f"Expected an epilogue function or a string holding one, but got {type(epilogue).__name__}.")


@functools.lru_cache(maxsize=512)
def _parse_string(source: str, generated: bool) -> Program:
    return parse_source(source, "<epilogue string>", 0, from_string=True,
                        max_chars=None if generated else MAX_SOURCE_CHARS)


_FUNCTION_CACHE: dict[Any, Program] = {}


def _parse_function(fn: Callable) -> Program:
    try:  # keyed by the code whose source is read: a decorator's wrapper shares its code
        code = getattr(inspect.unwrap(fn), "__code__", None)
    except ValueError:  # a __wrapped__ cycle
        code = None
    if code is not None and code in _FUNCTION_CACHE:
        return _FUNCTION_CACHE[code]
    if getattr(fn, "__name__", "") == "<lambda>":
        raise EpilogueSyntaxError("Lambdas cannot be epilogues.",
                                  hint="Write the epilogue with `def` and return named outputs.")
    source, filename, offset = read_source(
        fn, hint="Pass the epilogue as a string instead: EpilogueArguments(\"def epi(accum): ...\", ...).")
    program = parse_source(source, filename, offset, from_string=False)
    if code is not None:
        _FUNCTION_CACHE[code] = program
    return program


def read_source(fn: Callable, hint: str) -> tuple[str, str, int]:
    """(source, file name, line offset) of a function, or an EpilogueSyntaxError with `hint`."""
    try:
        lines, first = inspect.getsourcelines(fn)
        filename = inspect.getsourcefile(fn) or "<unknown>"
    except (OSError, TypeError) as exc:
        raise EpilogueSyntaxError(
            f"Cannot read the source of {getattr(fn, '__name__', fn)!r} ({exc}).", hint=hint) from None
    return "".join(lines), filename, first - 1


def clean_source(source: str) -> str:
    """The text the parser sees: comment-only lines blanked, then dedented (see _parse_source)."""
    return textwrap.dedent("\n".join("" if line.lstrip().startswith("#") else line
                                      for line in LINE_BREAK.split(source)))


def parse_source(source: str, filename: str, line_offset: int, from_string: bool,
                 max_chars: int | None = MAX_SOURCE_CHARS, keywords: bool = True) -> Program:
    """Parse the one `def` of `source` (its lines shifted by `line_offset` in errors).
    `keywords`: the parameters and returned names are passed as keywords (an epilogue's
    operands and outputs), so none may be named as an option (RESERVED_KEYWORDS); an
    activation's are not (they are renamed where it is inlined)."""
    if max_chars is not None and len(source) > max_chars:
        raise EpilogueSyntaxError(f"The epilogue source is {len(source)} characters long; "
                                  f"the limit is {max_chars}.")
    # Comment-only lines (editors put them at column 0) would stop dedent; blank them instead,
    # which keeps line numbers. Lines end where Python's tokenizer ends them (\r\n, \r, \n), not
    # at str.splitlines()'s form feeds and \u2028: a comment must stay a comment.
    text = clean_source(source)
    lines = text.split("\n")
    module = parse_module(text, filename, line_offset)
    defs = [n for n in module.body if isinstance(n, ast.FunctionDef)]
    others = [n for n in module.body if not isinstance(n, ast.FunctionDef)]
    if len(defs) != 1 or (from_string and others):
        culprit = (others or defs[1:] or [None])[0]
        loc = None
        if culprit is not None:
            loc = Location(filename, culprit.lineno + line_offset, culprit.col_offset,
                           lines[culprit.lineno - 1] if culprit.lineno <= len(lines) else "")
        raise EpilogueSyntaxError("The epilogue must be exactly one function definition "
                                  "(`def epi(accum, ...): ... return D`), and nothing else.", loc)
    try:
        return _Visitor(lines, filename, line_offset, from_string, keywords).program(defs[0], text)
    except RecursionError:
        raise EpilogueSyntaxError("The epilogue is nested too deeply to parse.",
                                  hint=TOO_DEEP_HINT) from None


def parse_module(text: str, filename: str, line_offset: int = 0) -> ast.Module:
    """`ast.parse(text)` once check_nesting passed; every way it fails is an EpilogueSyntaxError
    placed in `filename`, its lines shifted by `line_offset`."""
    check_nesting(text, filename, line_offset)
    lines = LINE_BREAK.split(text)
    try:
        return ast.parse(text)   # not the file's path: CPython would re-read its line for a column
    except SyntaxError as exc:
        line = exc.lineno or 1
        loc = Location(filename, line + line_offset, max((exc.offset or 1) - 1, 0),
                       lines[line - 1] if 0 < line <= len(lines) else "")
        raise EpilogueSyntaxError(f"The epilogue is not valid Python: {exc.msg}", loc) from None
    except (RecursionError, MemoryError):
        raise EpilogueSyntaxError("The epilogue is nested too deeply to parse.",
                                  hint=TOO_DEEP_HINT) from None
    except (UnicodeError, ValueError) as exc:  # lone surrogates, and null bytes on some Pythons
        raise EpilogueSyntaxError(f"The epilogue is not valid Python source: {exc}") from None


class _Visitor:
    def __init__(self, lines: list[str], filename: str, line_offset: int, from_string: bool,
                 keywords: bool = True):
        self.lines = lines
        self.filename = filename
        self.line_offset = line_offset
        self.from_string = from_string
        self.reserved = RESERVED_KEYWORDS if keywords else frozenset()
        self.defined: dict[str, Location] = {}
        self.conditions: set[str] = set()   # names of boolean values (comparisons and logic)
        self.gated: ast.Assign | None = None   # the `gate, up = accum.chunk(2, dim=-1)` statement
        self.accum_reads: list[ast.AST] = []   # where accum is read (by name)
        self.params: tuple[str, ...] = ()
        self.updates: list[str] = []   # operands updated in place (conditional stores)
        self.top: ast.expr | None = None   # the whole value of the statement being read
        self.joined: dict[str, ast.stmt] = {}   # names bound to a cat of the gated halves

    # ---- places and errors -------------------------------------------------------------
    def loc(self, node: ast.AST) -> Location:
        line = getattr(node, "lineno", 1)
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return Location(self.filename, line + self.line_offset, getattr(node, "col_offset", 0), text)

    def fail(self, node: ast.AST, message: str, hint: str | None = None, cls=EpilogueSyntaxError):
        raise cls(message, self.loc(node), hint)

    def as_float(self, value: int | float, node: ast.AST) -> float:
        try:
            return float(value)
        except OverflowError:
            self.fail(node, f"The literal {_short_repr(value)} is too large for a float.",
                      hint="Write it as a float literal (1e308 is the largest finite one).")

    def check_identifier(self, name: str, node: ast.AST) -> None:
        if not IDENTIFIER.match(name):
            self.fail(node, f"The name {name!r} is not allowed: epilogue names must match "
                            "[A-Za-z_][A-Za-z0-9_]* (ASCII letters, digits, underscores).")
        if name.startswith("__"):
            self.fail(node, f"The name {name!r} is not allowed: names may not start with '__'.")

    def check_not_reserved(self, name: str, node: ast.AST) -> None:
        """Operands and outputs are passed as keywords, so they cannot share a name with an option."""
        if name in self.reserved:
            self.fail(node, f"The name {name!r} cannot be an operand or output: it clashes with the "
                            f"gemm option '{name}' (a keyword of epifuse.gemm and of the other entry "
                            "points that take operands by name), so no tensor could be passed under it.",
                      hint=f"Rename it (for example {name}_).")

    # ---- the function -------------------------------------------------------------------
    def program(self, fn: ast.FunctionDef, source: str) -> Program:
        if self.from_string and fn.decorator_list:
            self.fail(fn.decorator_list[0], "Decorators are not allowed on a string epilogue.")
        args = fn.args
        if args.vararg or args.kwarg or args.kwonlyargs or args.posonlyargs or args.defaults:
            self.fail(fn, "Epilogue parameters must be plain names without defaults, *args or **kwargs.")
        params = tuple(a.arg for a in args.args)
        self.params = params
        for a in args.args:
            self.check_identifier(a.arg, a)
            if a.arg in ACCUMULATORS[1:]:
                self.fail(a, f"The name '{a.arg}' is reserved: epifuse gives it to a part of the GEMM's "
                             "accumulator (the imaginary part of a planar complex one, the second half of a "
                             "gated one).",
                          hint="Write accum.imag in a complex epilogue, `gate, up = accum.chunk(2, dim=-1)` "
                               f"in a gated one; rename an operand called {a.arg}.")
            self.check_not_reserved(a.arg, a)
            if a.arg in self.defined:
                self.fail(a, f"Variable '{a.arg}' cannot be defined twice.",
                          hint="Each parameter of the epilogue needs its own name.")
            self.defined[a.arg] = self.loc(a)
        if "accum" not in params:
            self.fail(fn, "accum must be an input to the epilogue function",
                      hint=f"Write `def {fn.name}(accum, ...)`.")
        statements: list[Statement] = []
        outputs = None
        body = list(fn.body)
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) \
                    and isinstance(stmt.value.value, str) and i == 0:
                continue  # docstring
            if isinstance(stmt, ast.Pass):
                continue
            if isinstance(stmt, ast.Return):
                if i != len(body) - 1:
                    self.fail(stmt, "The return statement must be the last statement of the epilogue.")
                outputs = self.returned(stmt)
                continue
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
                    and isinstance(stmt.targets[0], (ast.Tuple, ast.List)):
                statements.extend(self.chunk(stmt))
                continue
            statements.append(self.statement(stmt))
        if self.joined and self.gated is None:
            self.fail(next(iter(self.joined.values())),
                      "cat joins two half-width tiles of a gated epilogue, and this epilogue does not chunk accum.",
                      hint="Chunk it first, `x1, x2 = accum.chunk(2, dim=-1)` (B is then the merged weight of "
                           "2 * (N / 2) columns); `D = cat((f(x1, x2), g(x1, x2)), dim=-1)` is then N wide.")
        if self.gated is not None and self.accum_reads:
            self.fail(self.accum_reads[0], "After `gate, up = accum.chunk(2, dim=-1)` the epilogue reads the "
                                           "halves, not accum itself (twice their width).",
                      hint="Use the two names the chunk gives.")
        if self.gated is not None:
            params = (params[0], "accum_up", *params[1:])
            self.defined["accum_up"] = self.loc(self.gated)
        if outputs is None:
            self.fail(fn, "The epilogue returns nothing.",
                      hint="End it with `return D` (or `return D, F`): each returned name is an output.")
        for name in self.updates:
            if name not in {o for o, _ in outputs}:
                self.fail(fn, f"'{name} = where(...)' updates operand {name} in place, but the epilogue does not "
                              f"return {name}.",
                          hint=f"Return {name} (it is written where the condition holds), or give the new value "
                               "a new name.")
        param_locs = tuple(self.defined[p] for p in params)
        return Program(fn.name, params, param_locs, tuple(statements), outputs, source, self.filename)

    def statement(self, stmt: ast.stmt) -> Statement:
        if isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
            self.fail(stmt, f"Variable '{stmt.target.id}' cannot be defined twice.",
                      hint="Epilogues are in SSA form: give the new value a new name.")
        if isinstance(stmt, ast.If):
            self.fail(stmt, "'if' is not supported in epilogues.",
                      hint="Use where(cond, a, b) to choose between values.")
        if isinstance(stmt, (ast.For, ast.While, ast.AsyncFor)):
            self.fail(stmt, "Loops are not supported in epilogues.")
        if not isinstance(stmt, ast.Assign):
            self.fail(stmt, f"The statement '{type(stmt).__name__}' is not supported in epilogues.",
                      hint="An epilogue holds assignments `name = expression` and one final return.")
        if len(stmt.targets) != 1 or not isinstance(stmt.targets[0], ast.Name):
            self.fail(stmt, "Assign exactly one name per statement (`x = ...`).")
        name = stmt.targets[0].id
        self.check_identifier(name, stmt.targets[0])
        self.top = stmt.value
        expr = self.expr(stmt.value)
        self.top = None
        if expr.kind == "call" and OPS[expr.value].kind == "join":
            self.joined[name] = stmt
        if name in self.defined:
            if self.conditional_update(name, stmt.value):
                self.updates.append(name)
                self.defined[name] = self.loc(stmt)
                return Statement(name, expr, self.loc(stmt))
            self.fail(stmt.targets[0], f"Variable '{name}' cannot be defined twice.",
                      hint="Epilogues are in SSA form: give the new value a new name"
                           + (f"; an operand updated in place is written `{name} = where(cond, value, {name})`."
                              if name in self.params and name not in ACCUMULATORS else "."))
        self.defined[name] = self.loc(stmt)
        if self.is_condition(expr):
            self.conditions.add(name)
        return Statement(name, expr, self.loc(stmt))

    def chunk(self, stmt: ast.Assign) -> list[Statement]:
        """`gate, up = accum.chunk(2, dim=-1)` (or torch.chunk(accum, 2, -1)): the two halves of
        accum's columns, which come from the two halves of B's (a gated GEMM: the kernel
        multiplies both and the epilogue's width is N / 2). `gate` is then accum, `up` the
        second accumulator `accum_up`; accum itself may not be read again."""
        hint = "Write `gate, up = accum.chunk(2, dim=-1)`: the one tuple assignment epilogues take."
        names = stmt.targets[0].elts
        if len(names) != 2 or not all(isinstance(n, ast.Name) for n in names):
            self.fail(stmt, "Unpack exactly two names from accum.chunk(2, dim=-1).", hint=hint)
        call = stmt.value
        if not isinstance(call, ast.Call) or _called_name(call) != "chunk":
            self.fail(stmt, "Assign exactly one name per statement (`x = ...`); a tuple assignment must unpack "
                            "accum.chunk(2, dim=-1).", hint=hint)
        receiver = call.func.value if isinstance(call.func, ast.Attribute) and \
            _attribute_chain(call.func.value) not in [list(p) for p in MODULE_PREFIXES] else None
        args = ([receiver] if receiver is not None else []) + list(call.args)
        keywords = {k.arg: k.value for k in call.keywords}
        if set(keywords) - {"chunks", "dim", "input"} or len(args) + len(keywords) != 3:
            self.fail(call, "chunk takes accum, the number of chunks (2) and dim (-1).", hint=hint)
        ordered = dict(zip(("input", "chunks", "dim"), args))
        ordered.update(keywords)
        if not (isinstance(ordered.get("input"), ast.Name) and ordered["input"].id == "accum"):
            self.fail(call, "Only accum can be chunked, into the gate and up halves of its columns.", hint=hint)
        if _literal_int(ordered.get("chunks")) != 2:
            self.fail(call, "accum.chunk takes 2 chunks: the gate and up halves.", hint=hint)
        if _literal_int(ordered.get("dim")) != -1:
            self.fail(call, "accum.chunk splits the last dimension (dim=-1), the columns of B.", hint=hint)
        if self.gated is not None:
            self.fail(stmt, "accum can be chunked once.", hint=hint)
        self.gated = stmt
        statements = []
        for target, part in zip(names, ("accum", "accum_up")):
            self.check_identifier(target.id, target)
            if target.id in self.defined:
                self.fail(target, f"Variable '{target.id}' cannot be defined twice.",
                          hint="Epilogues are in SSA form: give the new value a new name.")
            self.defined[target.id] = self.loc(stmt)
            statements.append(Statement(target.id, Expr("name", part, loc=self.loc(call)), self.loc(stmt)))
        return statements

    def is_condition(self, expr: Expr) -> bool:
        """Whether `expr` is boolean: a comparison or logic, or a name bound to one (operands and
        accum never are: a bool tensor operand is refused when bound)."""
        if expr.kind == "name":
            return expr.value in self.conditions
        if expr.kind != "call":
            return False
        opdef = OPS[expr.value]
        if opdef.selects:
            return all(self.is_condition(expr.args[i]) for i in opdef.selects)
        return opdef.kind in ("compare", "logical")

    def logic(self, node: ast.AST, symbol: str, operands: tuple[Expr, ...]) -> None:
        """~, & and | mean logic on conditions, as torch's do on bool tensors; on numbers torch's
        are bitwise (integers) or an error (floats), which an epilogue cannot mean."""
        if not all(self.is_condition(x) for x in operands):
            self.fail(node, f"'{symbol}' applies to conditions (comparisons such as accum > 0) in "
                            f"epilogues; on numbers torch's '{symbol}' is bitwise, which epilogues do not support.",
                      hint=f"Compare first (~(x > 0), (x > 0) {'&' if symbol == '~' else symbol} (y < 1)), "
                           "or call logical_not/logical_and/logical_or, which treat nonzero as true.")

    def conditional_update(self, name: str, value: ast.expr) -> bool:
        """Whether `name = value` is an operand's one in-place update, `where(cond, new, name)` or
        `where(cond, name, new)`: a conditional store, the rest of the operand left as it was."""
        if name not in self.params or name in ACCUMULATORS or name in self.updates:
            return False
        if not (isinstance(value, ast.Call) and len(value.args) == 3 and not value.keywords):
            return False
        func = value.func
        called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if called != "where":
            return False
        kept = [isinstance(a, ast.Name) and a.id == name for a in value.args[1:]]
        return kept.count(True) == 1

    def returned(self, stmt: ast.Return) -> tuple[tuple[str, Location], ...]:
        values = stmt.value.elts if isinstance(stmt.value, ast.Tuple) else [stmt.value]
        outputs = []
        for v in values:
            if not isinstance(v, ast.Name):
                self.fail(v if v is not None else stmt, "Return names, not expressions.",
                          hint="Assign the value first (`D = ...`) and return `D`: "
                               "each returned name is the keyword of its output tensor.")
            if v.id not in self.defined:
                self.undefined(v)
            if any(v.id == o for o, _ in outputs):
                self.fail(v, f"Output '{v.id}' is returned twice.")
            self.check_not_reserved(v.id, v)
            outputs.append((v.id, self.loc(v)))
        return tuple(outputs)

    def undefined(self, node: ast.Name):
        self.fail(node, f"Variable '{node.id}' is not defined.",
                  hint=did_you_mean(node.id, self.defined) or
                  "Epilogue inputs must be parameters of the function.")

    # ---- expressions --------------------------------------------------------------------
    def expr(self, node: ast.expr) -> Expr:
        loc = self.loc(node)
        if isinstance(node, ast.Name):
            if node.id not in self.defined:
                self.undefined(node)
            if node.id == "accum":
                self.accum_reads.append(node)
            if node.id in self.joined:
                self.fail(node, f"'{node.id}' is the cat of two half-width tiles, N wide: it can only be "
                                "returned, not used in further math.",
                          hint="Do the math on each piece inside the cat: cat((f(a), f(b)), dim=-1).")
            return Expr("name", node.id, loc=loc)
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, complex):   # only a complex epilogue takes it (binding refuses it)
                return Expr("const", value, loc=loc)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                self.fail(node, f"The literal {_short_repr(value)} is not a number.")
            return Expr("const", self.as_float(value, node), loc=loc)
        if isinstance(node, ast.UnaryOp):
            operand = self.expr(node.operand)
            if isinstance(node.op, ast.USub):
                return Expr("call", "neg", (operand,), loc=loc)
            if isinstance(node.op, ast.UAdd):
                return operand
            if isinstance(node.op, ast.Invert):
                self.logic(node, "~", (operand,))
                return Expr("call", "logical_not", (operand,), loc=loc)
            self.fail(node, "'not' is not supported; use ~cond or logical_not(cond).")
        if isinstance(node, ast.BinOp):
            opname = _BINOPS.get(type(node.op))
            if opname is None:
                self.fail(node, f"The operator '{_op_symbol(node.op)}' is not supported in epilogues.",
                          hint="Supported operators: + - * / ** & | and comparisons.")
            left, right = self.expr(node.left), self.expr(node.right)
            if opname in ("logical_and", "logical_or"):
                self.logic(node, _op_symbol(node.op), (left, right))
            return Expr("call", opname, (left, right), loc=loc)
        if isinstance(node, ast.Compare):
            return self.compare(node, loc)
        if isinstance(node, ast.Call):
            return self.call(node, loc)
        if isinstance(node, ast.Attribute):
            if node.attr in ("real", "imag"):   # x.real is torch.real(x): the registry's op
                return Expr("call", node.attr, (self.expr(node.value),), loc=loc)
            self.fail(node, f"Attribute access '.{node.attr}' is not supported in epilogues.",
                      hint="Only op calls such as torch.relu(x) or x.relu() may use dots, and .real "
                           "and .imag of complex values.")
        if isinstance(node, ast.Subscript):
            self.fail(node, "Subscripts (x[...]) are not supported in epilogues.")
        if isinstance(node, ast.Lambda):
            self.fail(node, "Lambdas are not supported in epilogues.")
        if isinstance(node, ast.IfExp):
            self.fail(node, "Conditional expressions are not supported in epilogues.",
                      hint="Use where(cond, a, b).")
        if isinstance(node, ast.BoolOp):
            self.fail(node, "'and'/'or' are not supported; use & and | on conditions.")
        self.fail(node, f"The expression '{type(node).__name__}' is not supported in epilogues.")

    def compare(self, node: ast.Compare, loc: Location) -> Expr:
        left = self.expr(node.left)
        result = None
        for op, right_node in zip(node.ops, node.comparators):
            opname = _CMPOPS.get(type(op))
            if opname is None:
                self.fail(node, f"The comparison '{type(op).__name__}' is not supported.")
            right = self.expr(right_node)
            term = Expr("call", opname, (left, right), loc=loc)
            result = term if result is None else Expr("call", "logical_and", (result, term), loc=loc)
            left = right
        return result

    def call(self, node: ast.Call, loc: Location) -> Expr:
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            self.fail(node, "*args and **kwargs are not supported in epilogue calls.")
        func = node.func
        receiver = None
        if isinstance(func, ast.Name):
            spelled = func.id
            if spelled in self.defined:
                self.fail(func, f"'{spelled}' is a value of the epilogue, not a function.")
        elif isinstance(func, ast.Attribute):
            spelled = func.attr
            chain = _attribute_chain(func.value)
            if chain is not None and chain[0] not in self.defined:
                if tuple(chain) not in MODULE_PREFIXES:
                    self.fail(func, f"Unsupported operation '{'.'.join(chain + [spelled])}'",
                              hint="Ops may be spelled op(x), torch.op(x), F.op(x), "
                                   "torch.nn.functional.op(x) or x.op().",
                              cls=UnsupportedOperationError)
            else:
                receiver = func.value
        else:
            self.fail(node, "Only named ops can be called in an epilogue.")
        args = ([receiver] if receiver is not None else []) + list(node.args)
        keywords = {}
        for k in node.keywords:
            if k.arg in keywords:
                self.fail(k, f"keyword argument repeated: {k.arg}")  # Python's own words
            keywords[k.arg] = k.value
        return self.resolve(spelled, args, keywords, node, loc, method=receiver is not None)

    def resolve(self, spelled: str, args, keywords, node, loc, method: bool) -> Expr:
        if method and spelled in CAST_METHODS and not args[1:] and not keywords:
            return Expr("call", "to", (self.expr(args[0]),), (("dtype", CAST_METHODS[spelled]),), loc)
        if spelled in ("max", "min") and _is_binary_extremum(args, keywords):
            spelled = "maximum" if spelled == "max" else "minimum"
        opdef = lookup(spelled)
        if opdef is None:
            self.fail(node, f"Unsupported operation '{spelled}'",
                      hint=did_you_mean(spelled, spellings()) or
                      "See the op reference (epifuse.ops.OPS) for the supported operations.",
                      cls=UnsupportedOperationError)
        if opdef.kind == "index":
            return self.index(opdef.name, args, keywords, node, loc, method)
        if opdef.kind == "join":
            return self.join(opdef, args, keywords, node, loc, method)
        if len(args) < opdef.arity:
            self.fail(node, f"{opdef.name}() takes {opdef.arity} tensor argument(s), got {len(args)}.")
        tensors = [self.expr(a) for a in args[:opdef.arity]]
        extra = args[opdef.arity:]
        if len(extra) > len(opdef.params):
            self.fail(node, f"{opdef.name}() takes at most {opdef.arity + len(opdef.params)} "
                            f"arguments, got {len(args)}.")
        raw = dict(zip(opdef.param_names, extra))
        for key, value in keywords.items():
            if key not in opdef.param_names:
                self.fail(value, f"{opdef.name}() got an unexpected keyword argument '{key}'.",
                          hint=did_you_mean(key, opdef.param_names))
            if key in raw:
                self.fail(value, f"{opdef.name}() got multiple values for '{key}'.")
            raw[key] = value
        if opdef.name == "clamp":
            return self.clamp(tensors[0], raw, loc, node)
        params = tuple((k, self.param(opdef.name, k, v)) for k, v in sorted(raw.items()))
        if opdef.kind == "composite":   # written as the ops it is made of, at the call's place
            site = CallSite(loc.filename, loc.line, loc.col, loc.source_line, opdef.name)

            def call(name, *inputs, **values):
                return Expr("call", name, tuple(inputs), tuple(sorted(values.items())), site)
            return opdef.expand(call, *tensors, **dict(params))
        return Expr("call", opdef.name, tuple(tensors), params, loc)

    def index(self, name: str, args, keywords, node, loc, method: bool) -> Expr:
        """row() / col(), or row(accum) / col(accum) as on torch tensors, where the argument gives
        accum's shape: the same op, so the argument must be accum, and is dropped."""
        hint = f"Write {name}(accum), which also runs on torch tensors (or {name}())."
        if method:
            self.fail(node, f"{name}() is not a method of a tensor.", hint=hint)
        given = list(args)
        for key, value in keywords.items():
            if key != "accum":
                self.fail(value, f"{name}() got an unexpected keyword argument '{key}'.", hint=hint)
            given.append(value)
        if len(given) > 1:
            self.fail(node, f"{name}() takes at most 1 argument (accum), got {len(given)}.", hint=hint)
        for arg in given:
            if not (isinstance(arg, ast.Name) and arg.id == "accum"):
                what = f"'{arg.id}'" if isinstance(arg, ast.Name) else "an expression"
                self.fail(arg, f"{name}() takes no argument but the accumulator: {what} is not accum.",
                          hint=hint)
        return Expr("call", name, (), (), loc)

    def join(self, opdef, args, keywords, node, loc, method: bool) -> Expr:
        """cat((a, b), dim=-1): two half-width tiles of a gated epilogue side by side, the whole
        value of a statement whose name is then only returned (expr() refuses reading it). The
        binder checks dim against accum's rank and that both pieces are tiles."""
        name = opdef.name
        hint = (f"Write `D = {name}((a, b), dim=-1)` with a and b computed from the halves of "
                "`x1, x2 = accum.chunk(2, dim=-1)`, and return D.")
        if method:
            self.fail(node, f"{name}() is not a method of a tensor.", hint=hint)
        if node is not self.top:
            self.fail(node, f"{name}(...) must be the whole value of an output (`D = {name}((a, b), dim=-1)`): "
                            "the joined tile is N wide, and no math is done at that width.",
                      hint=f"Do the math on each piece inside the {name}: {name}((f(a), f(b)), dim=-1).")
        given = dict(zip(("tensors", "dim"), args))
        if len(args) > 2:
            self.fail(node, f"{name}() takes 2 arguments (the tuple of tiles and dim), got {len(args)}.", hint=hint)
        for key, value in keywords.items():
            if key not in ("tensors", "dim"):
                self.fail(value, f"{name}() got an unexpected keyword argument '{key}'.", hint=hint)
            if key in given:
                self.fail(value, f"{name}() got multiple values for '{key}'.")
            given[key] = value
        pieces = given.get("tensors")
        if not isinstance(pieces, (ast.Tuple, ast.List)) or len(pieces.elts) != opdef.arity \
                or any(isinstance(e, ast.Starred) for e in pieces.elts):
            self.fail(pieces if pieces is not None else node,
                      f"{name}() takes one tuple of two tiles, the pieces written side by side: "
                      f"{name}((a, b), dim=-1).", hint=hint)
        dim = given.get("dim")
        if dim is None:
            self.fail(node, f"{name}() without dim joins along dim 0 (torch's default), the rows; the halves "
                            "of accum's columns join along the last dim.", hint=hint)
        if _literal_int(dim) is None:
            self.fail(dim, f"{name}() needs dim to be an int literal.", hint=hint)
        tensors = tuple(self.expr(e) for e in pieces.elts)
        return Expr("call", name, tensors, (("dim", (_literal_int(dim),)),), loc)

    def clamp(self, x: Expr, raw: dict, loc: Location, node: ast.AST) -> Expr:
        """clamp with literal bounds keeps its params; with value bounds it becomes max/min."""
        if all(_is_none(v) for v in raw.values()):
            self.fail(node, "clamp() needs a bound: min=, max= or both (torch.clamp refuses a call "
                            "with neither).", hint="Write clamp(x, min=..., max=...).")
        if all(_literal_number(v) is not None or _is_none(v) for v in raw.values()):
            params = tuple((k, _literal_number(v)) for k, v in sorted(raw.items()) if not _is_none(v))
            return Expr("call", "clamp", (x,), params, loc)
        result = x
        if "min" in raw and not _is_none(raw["min"]):
            result = Expr("call", "maximum", (result, self.expr(raw["min"])), loc=loc)
        if "max" in raw and not _is_none(raw["max"]):
            result = Expr("call", "minimum", (result, self.expr(raw["max"])), loc=loc)
        return result

    def param(self, op: str, key: str, node: ast.expr) -> Any:
        """A compile-time parameter: a number, a string, a dtype, or a tuple of ints for dim."""
        value = _param_literal(key, node)
        accepts, need = param_rule(key)
        if value is _UNREADABLE or not accepts(value):
            self.fail(node, f"{op}() needs {need}.")
        return value


_UNREADABLE = object()


def _param_literal(key: str, node: ast.expr) -> Any:
    """The value a param's source spells, before _PARAM_RULES judge it; _UNREADABLE where it
    spells none of the kinds of value params take."""
    if key == "dtype":
        name = _dtype_name(node)
        return _UNREADABLE if name is None else name
    if key == "dim":
        if _is_none(node):
            return None
        elts = node.elts if isinstance(node, (ast.Tuple, ast.List)) else [node]
        dims = [_literal_int(e) for e in elts]
        return _UNREADABLE if None in dims else tuple(dims)
    if isinstance(node, ast.Constant) and isinstance(node.value, (bool, str)):
        return node.value
    value = _literal_number(node)
    return _UNREADABLE if value is None else value


def _attribute_chain(node: ast.expr) -> list[str] | None:
    """['torch', 'nn', 'functional'] for torch.nn.functional; None if not a plain chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id] + parts[::-1]


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _signed(node: ast.expr) -> tuple[int, ast.expr]:
    """(+1 or -1, the node under any unary + and - signs)."""
    sign = 1
    while isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        sign = -sign if isinstance(node.op, ast.USub) else sign
        node = node.operand
    return sign, node


def _literal_int(node: ast.expr) -> int | None:
    """The value of an int literal (with signs), or None: torch takes no float as a dim."""
    sign, node = _signed(node)
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return sign * node.value
    return None


def _literal_number(node: ast.expr) -> float | None:
    """The value of a number literal (with signs), or None; an int too large for a float is None."""
    sign, node = _signed(node)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        try:
            return sign * float(node.value)
        except OverflowError:
            return None
    return None


def _short_repr(value) -> str:
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 64 else \
        f"{str(value)[:12]}... ({len(str(abs(value)))} digits)"
    return text if len(text) <= 60 else text[:57] + "..."


def _is_none(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _dtype_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    chain = _attribute_chain(node) if isinstance(node, ast.Attribute) else None
    if chain and len(chain) == 2 and chain[0] == "torch":
        return chain[1]
    return None


def _is_binary_extremum(args, keywords) -> bool:
    """max(a, b) is the elementwise maximum; max(x), max(x, dim=1), max(x, 1) reduce."""
    if "dim" in keywords or "keepdim" in keywords or len(args) != 2:
        return False
    second = args[1]
    while isinstance(second, ast.UnaryOp) and isinstance(second.op, (ast.USub, ast.UAdd)):
        second = second.operand  # max(x, -1) reduces the last dim, as torch.max(x, -1) does
    return not (isinstance(second, ast.Constant) and isinstance(second.value, int)
                and not isinstance(second.value, bool)) and not isinstance(second, (ast.Tuple, ast.List))


def _op_symbol(op: ast.operator) -> str:
    return {ast.FloorDiv: "//", ast.Mod: "%", ast.MatMult: "@", ast.LShift: "<<",
            ast.RShift: ">>", ast.BitXor: "^", ast.BitAnd: "&", ast.BitOr: "|"}.get(type(op), type(op).__name__)


__all__ = ["parse", "parse_source", "parse_module", "read_source", "clean_source"]
