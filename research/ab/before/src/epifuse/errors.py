"""The exception tree and the message formatter.

Every user error is an `EpilogueError` (a `ValueError`). When the error comes from a place in
the epilogue's source, the message ends with that place: file, line, column, the source line
and a caret, then a suggestion if there is one. Bugs in epifuse itself raise `InternalError`,
which says so and carries the IR that triggered it.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass


@dataclass(frozen=True)
class Location:
    """A place in epilogue source: 1-based line, 0-based column, as `ast` reports them."""

    filename: str
    line: int
    col: int
    source_line: str = ""

    def render(self) -> str:
        text = f'  File "{self.filename}", line {self.line}, column {self.col + 1}'
        if self.source_line:
            stripped = self.source_line.rstrip()
            indent = len(stripped) - len(stripped.lstrip())
            caret = " " * (self.col - indent) + "^"
            text += f"\n    {stripped.lstrip()}\n    {caret}"
        return text


class EpilogueError(ValueError):
    """A problem with a user's epilogue or its arguments."""

    def __init__(self, message: str, loc: Location | None = None, hint: str | None = None):
        self.message = message
        self.loc = loc
        self.hint = hint
        parts = [message]
        if loc is not None:
            parts.append(loc.render())
        if hint:
            parts.append(hint)
        super().__init__("\n".join(parts))


class EpilogueSyntaxError(EpilogueError):
    """The epilogue uses Python that epifuse does not accept."""


class UnsupportedOperationError(EpilogueError):
    """A call of a function that is not in the ops registry."""


class EpilogueArgumentError(EpilogueError):
    """Operands and outputs given to EpilogueArguments / GemmArguments do not fit the epilogue."""


class ShapeError(EpilogueError):
    """A tensor's shape, dtype, device or layout does not fit the GEMM."""


class UnsupportedError(EpilogueError):
    """No kernel supports these arguments; the message lists each kernel's reason."""


class InternalError(RuntimeError):
    """A bug in epifuse. Please report it with the IR printed below."""

    def __init__(self, message: str, ir: str = ""):
        super().__init__(f"internal error in epifuse (a bug, not your mistake): {message}"
                         + (f"\nIR:\n{ir}" if ir else ""))


def flag(name: str, value) -> bool:
    """A yes/no option's value: True or False (or 1 and 0), not a string, whose bool() is True
    even for "False"."""
    try:
        ok = not isinstance(value, (str, bytes)) and value in (True, False)
    except (RuntimeError, ValueError, TypeError):   # a tensor or array of several values
        ok = False
    if not ok:
        raise EpilogueArgumentError(f"{name} must be True or False, not {value!r}.")
    return bool(value)


def did_you_mean(name: str, candidates) -> str | None:
    close = difflib.get_close_matches(name, sorted(candidates), n=3, cutoff=0.6)
    if not close:
        return None
    return "Did you mean: " + ", ".join(repr(c) for c in close) + "?"
