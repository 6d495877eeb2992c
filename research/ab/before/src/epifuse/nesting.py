"""How deeply a source may nest before CPython's parser sees it.

CPython's parser, and the builder of the ast objects it returns, recurse in C once per level of
nesting; in a thread with a small stack they overflow it (a crash, not an exception) long
before any RecursionError. check_nesting measures every statement from its tokens (the
tokenize module is iterative) and refuses one that nests deeper than NESTING_LIMIT.
"""
from __future__ import annotations

import io
import re
import tokenize

from .errors import EpilogueSyntaxError, Location

LINE_BREAK = re.compile(r"\r\n|\r|\n")
TOO_DEEP_HINT = "Split the long expression into several assignments."


# CPython's parser, and the builder of the ast objects it returns, recurse in C once per level
# of nesting, and in a thread with a small stack they overflow it (a crash, not an exception)
# long before any RecursionError or their own limits. Measured on CPython 3.11 (x86-64), a level
# costs about 1.9 KiB of stack for a bracket (each restarts the whole chain of precedence
# rules), 250 bytes for a lambda, 400 for an indented block and at most 130 for any other
# operator, `.`, call, subscript, `not`, `if`/`else` or comprehension `for`: a 128 KiB thread
# crashes on 75 nested brackets, 450 nested lambdas or 1,500 chained attributes. So before
# ast.parse sees a source, check_nesting bounds the nesting of every statement from its tokens
# (the tokenize module is iterative), in units of 128 bytes: NESTING_LIMIT is 64 KiB.
NESTING_LIMIT = 512
NESTING_COSTS = {"bracket": 16, "block": 4, "lambda": 2, "operator": 1}
_NOT_COUNTED = frozenset({"(", ")", "[", "]", "{", "}", ",", ":", ";", "..."})
_NESTING_KEYWORDS = frozenset({"not", "and", "or", "if", "else", "for", "in", "is", "await", "yield",
                               "async", "from", "as"})
_FSTRING_WORD = re.compile(r"[A-Za-z_]+")
_FSTRING_PREFIX = re.compile(r"[A-Za-z]*")
_FSTRING_START = getattr(tokenize, "FSTRING_START", None)   # Python 3.12 on
_FSTRING_END = getattr(tokenize, "FSTRING_END", None)


class _Level:
    """One level of brackets in a statement (or the statement itself): the cost of the
    elements (separated by commas) already closed, and of the current one, as the operators
    met at this level plus the costliest bracket closed inside it."""

    __slots__ = ("weight", "closed", "operators", "inner", "lambdas")

    def __init__(self, weight: int):
        self.weight = weight
        self.closed = 0
        self.operators = 0
        self.inner = 0
        self.lambdas = 0   # lambdas whose parameters (their commas) have not ended with ':'

    def cost(self, child: int = 0) -> int:
        return self.weight + max(self.closed, self.operators + max(self.inner, child))


def _path_cost(levels: list) -> int:
    """The costliest path from the statement down through the open brackets."""
    cost = 0
    for level in reversed(levels):
        cost = level.cost(cost)
    return cost


def _fstring_cost(text: str) -> int:
    """The nesting of an f-string token (before Python 3.12, one token): CPython parses each
    replacement field with a parser of its own, inside the enclosing statement's. Bounded by
    the fields' deepest brackets, as levels, and every bracket, operator character and keyword
    in the fields, as if they all nested."""
    body = text[len(_FSTRING_PREFIX.match(text).group()):]
    depth = deepest = 0
    inside = []
    i = 0
    while i < len(body):
        char = body[i]
        if not depth and body.startswith(("{{", "}}"), i):
            i += 2
            continue
        if char in "([{" and (depth or char == "{"):
            depth += 1
            deepest = max(deepest, depth)
            inside.append(char)   # the call, subscript or display it makes counts as an operator
        elif char in ")]}" and depth:
            depth -= 1
        elif depth:
            inside.append(char)
        i += 1
    fields = "".join(inside)
    operators = sum(fields.count(char) for char in "([{+-*/%@&|^~<>=!.:")
    for word in _FSTRING_WORD.findall(fields):
        operators += NESTING_COSTS["lambda"] if word == "lambda" else word in _NESTING_KEYWORDS
    return NESTING_COSTS["bracket"] * deepest + operators


def check_nesting(text: str, filename: str, line_offset: int = 0) -> None:
    """Raise an EpilogueSyntaxError where a statement of `text` nests deeper than NESTING_LIMIT
    (see NESTING_COSTS): brackets, lambdas, indented blocks, chains of unary or binary
    operators, attributes, calls, subscripts, conditional expressions, comprehensions."""
    costs = NESTING_COSTS
    blocks = 0
    levels = [_Level(0)]
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            kind, string = token.type, token.string
            level = levels[-1]
            if kind in (tokenize.NEWLINE, tokenize.ENDMARKER) or (kind == tokenize.OP and string == ";"
                                                                 and len(levels) == 1):
                levels = [_Level(0)]
                continue
            if kind == tokenize.INDENT:
                blocks += 1
            elif kind == tokenize.DEDENT:
                blocks -= 1
                continue
            elif kind == tokenize.OP and string in "([{" or kind == _FSTRING_START:
                level.operators += 1   # the call, subscript or display it makes at this level
                levels.append(_Level(costs["bracket"]))
            elif kind == tokenize.OP and string in ")]}" or kind == _FSTRING_END:
                if len(levels) > 1:
                    closed = levels.pop()
                    levels[-1].inner = max(levels[-1].inner, closed.cost())
                continue
            elif kind == tokenize.OP and string == ",":
                if not level.lambdas:
                    level.closed = max(level.closed, level.operators + level.inner)
                    level.operators = level.inner = 0
                continue
            elif kind == tokenize.OP and string == ":":
                level.lambdas = max(level.lambdas - 1, 0)
                continue
            elif kind == tokenize.OP and string not in _NOT_COUNTED:
                level.operators += costs["operator"]
            elif kind == tokenize.NAME and string == "lambda":
                level.operators += costs["lambda"]
                level.lambdas += 1
            elif kind == tokenize.NAME and string in _NESTING_KEYWORDS:
                level.operators += costs["operator"]
            elif kind == tokenize.STRING and "f" in _FSTRING_PREFIX.match(string).group().lower():
                level.inner = max(level.inner, _fstring_cost(string))
            else:
                continue
            cost = blocks * costs["block"] + _path_cost(levels)
            if cost > NESTING_LIMIT:
                _too_deep(text, filename, line_offset, token.start, cost)
    except (tokenize.TokenError, SyntaxError):
        return  # what was read before the error is checked; ast.parse reports the error


def _too_deep(text: str, filename: str, line_offset: int, place, cost: int) -> None:
    line, col = place
    lines = LINE_BREAK.split(text)
    costs = NESTING_COSTS
    raise EpilogueSyntaxError(
        f"The statement nests too deeply to parse safely: its nesting reaches {cost}, and "
        f"epifuse's nesting limit is {NESTING_LIMIT} (a level of brackets counts "
        f"{costs['bracket']}, an indented block {costs['block']}, a lambda {costs['lambda']}, "
        f"any other operator, '.', call or subscript {costs['operator']}).",
        Location(filename, line + line_offset, col, lines[line - 1] if 0 < line <= len(lines) else ""),
        TOO_DEEP_HINT)


__all__ = ["NESTING_LIMIT", "NESTING_COSTS", "TOO_DEEP_HINT", "LINE_BREAK", "check_nesting"]
