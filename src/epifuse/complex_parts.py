"""A complex epilogue rewritten over real and imaginary parts.

A planar complex GEMM (epifuse.gemm_planar_complex) computes accum = (Ar + i Ai) @ (Br + i Bi)
into two real accumulators, and its epilogue is written over complex values:

    def epi(accum, alpha, beta, C):
        D = alpha * accum + beta * C          # alpha, beta complex numbers; C complex
        return D

`split(program, complex_operands)` rewrites such a Program, at the source level, into a real
one that the binder, the passes and the kernels take as they take any other:

- accum is its real part, and `accum_imag` (the IR leaf ACCUM_IMAG) its imaginary part;
- a complex operand X becomes two real operands, X_re and X_im (fresh names where those are
  taken); a real operand stays as it is;
- each op applies its registry entry's complex meaning (`OpDef.complex`: + - * /, conj, abs,
  exp, sums and means, where, ...); an op without one refuses complex inputs by name;
- a complex result D becomes two outputs, D_re and D_im; a real result (abs(accum),
  accum.real) one output under its own name.

While the rewrite runs, a part known to be zero (a real value's imaginary part) is None, and
the terms it would make are dropped, as C99's mixed real and complex arithmetic does: x * C
with x real is (x * C.re) + i (x * C.im), with no 0 * C.im term that would make inf * 0 a NaN.
Every part an op's rule reads more than once is first given a name of its own, so the
rewritten program grows linearly with the original.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import EpilogueError
from .program import Expr, Program, Statement
from .ops import OPS
from .printing import FreshNames

# The ops whose result is zero, or the other input, where an input is exactly zero (None):
# the rules' arithmetic on parts.
_DROPS_ZERO = {"add", "sub", "mul", "div", "neg"}


@dataclass(frozen=True)
class Split:
    """A complex epilogue as a real one.

    program   the real Program (params: accum, accum_imag, then the operands' parts)
    operands  each user operand name -> its parameter names: (re, im) for a complex one,
              (name,) for a real one
    outputs   each user output name -> the real program's output names: (re, im) for a
              complex result, (name,) for a real one
    """

    program: Program
    operands: dict
    outputs: dict


def split(program: Program, complex_operands) -> Split:
    """`program` over complex values as a real Program over parts; `complex_operands` names the
    operands that are complex (accum always is)."""
    return _Splitter(program, frozenset(complex_operands)).run()


class _Splitter:
    def __init__(self, program: Program, complex_operands: frozenset):
        self.program = program
        self.complex_operands = complex_operands
        taken = {*program.params, *(s.target for s in program.statements), "accum_imag",
                 *(name for name, _ in program.outputs)}
        self.names = FreshNames(taken)
        self.statements: list[Statement] = []
        self.own: dict[str, tuple] = {}   # a complex statement's target -> the names of its parts
        self.loc = None

    def run(self) -> Split:
        program = self.program
        env = {"accum": (_name("accum"), _name("accum_imag"))}
        params, locs, operands = ["accum", "accum_imag"], [], {}
        accum_loc = program.param_locs[program.params.index("accum")]
        locs += [accum_loc, accum_loc]
        for name, loc in zip(program.params, program.param_locs):
            if name == "accum":
                continue
            if name in self.complex_operands:
                parts = (self.names.fresh(f"{name}_re"), self.names.fresh(f"{name}_im"))
                env[name] = (_name(parts[0]), _name(parts[1]))
            else:
                parts = (name,)
                env[name] = (_name(name), None)
            operands[name] = parts
            params += parts
            locs += [loc] * len(parts)
        for stmt in program.statements:
            self.loc = stmt.loc
            env[stmt.target] = self.bind(stmt.target, self.evaluate(stmt.expr, env))
        outputs, returned = {}, []
        for name, loc in program.outputs:
            self.loc = loc
            re, im = env[name]
            if im is None:
                parts = (name,)
                self.assign(name, self.materialize(re))
            elif name in self.own and name not in outputs:
                parts = self.own[name]
            else:
                parts = (self.names.fresh(f"{name}_re"), self.names.fresh(f"{name}_im"))
                self.assign(parts[0], self.materialize(re))
                self.assign(parts[1], im)
            outputs[name] = parts
            returned += [(part, loc) for part in parts]
        real = Program(program.name, tuple(params), tuple(locs), tuple(self.statements), tuple(returned),
                       program.source, program.filename)
        return Split(real, operands, outputs)

    # ---- statements ------------------------------------------------------------------------
    def assign(self, target: str, expr: Expr) -> None:
        if not (expr.kind == "name" and expr.value == target):
            self.statements.append(Statement(target, expr, self.loc))

    def bind(self, target: str, value: tuple) -> tuple:
        """A statement's value, each non-zero part under a name of its own: the target's where
        the value is real, target_re and target_im where it is complex."""
        re, im = value
        if im is None:
            if re is None:
                return None, None
            self.assign(target, re)   # statement targets are taken: no fresh name is one of them
            return _name(target), None
        parts = self.hoist(re, f"{target}_re"), self.hoist(im, f"{target}_im")
        if all(part is not value_part for part, value_part in zip(parts, value)):
            self.own[target] = tuple(part.value for part in parts)   # named for it: its outputs' names
        return parts

    def hoist(self, part: Expr | None, prefix: str = "_part") -> Expr | None:
        """`part` as a name (or a literal), so a rule that reads it twice repeats no expression."""
        if part is None or part.kind != "call":
            return part
        name = self.names.fresh(prefix)
        self.statements.append(Statement(name, part, self.loc))
        return _name(name)

    # ---- expressions -----------------------------------------------------------------------
    def evaluate(self, expr: Expr, env: dict) -> tuple:
        """(re, im) of `expr`, each an Expr or None (zero)."""
        if expr.kind == "name":
            return env[expr.value]
        if expr.kind == "const":
            value = expr.value
            if isinstance(value, complex):
                return (_const(value.real, expr.loc) if value.real else None,
                        _const(value.imag, expr.loc) if value.imag else None)
            return expr, None
        loc, self.loc = self.loc, expr.loc or self.loc
        try:
            inputs = [self.evaluate(arg, env) for arg in expr.args]
            opdef = OPS[expr.value]
            params = dict(expr.params)
            if all(im is None for _, im in inputs) and opdef.kind != "complex":
                return self.call(opdef.name, *(re for re, _ in inputs), **params), None
            if opdef.complex is None:
                raise EpilogueError(
                    f"{opdef.name}() has no meaning on complex values here, and its input is complex.",
                    self.loc, "Take .real, .imag or abs() of the value first; complex values take "
                              "+ - * /, conj, abs, exp, sum, mean, where and casts.")
            inputs = [(self.hoist(re), self.hoist(im)) for re, im in inputs]
            try:
                result = opdef.complex(self.call, *inputs, **params)
            except TypeError as exc:   # a rule's own refusal (where's complex condition)
                raise EpilogueError(f"{opdef.name}(): {exc}.", self.loc) from None
            return result if isinstance(result, tuple) else (result, None)
        finally:
            self.loc = loc

    def call(self, name: str, *args, **params) -> Expr | None:
        """The real op `name` on parts (Exprs, None for zero, or numbers), as an Expr, or None
        where the result is zero."""
        args = [_const(a, self.loc) if isinstance(a, (int, float)) else a for a in args]
        if name in _DROPS_ZERO:
            if name == "add" and None in args:
                return args[1] if args[0] is None else args[0]
            if name == "sub" and args[1] is None:
                return args[0]
            if name == "sub" and args[0] is None:
                return self.call("neg", args[1])
            if name in ("mul", "neg") and None in args:
                return None
            if name == "div" and args[0] is None:
                return None
        args = [self.materialize(a) for a in args]
        return Expr("call", name, tuple(args), tuple(sorted(params.items())), self.loc)

    def materialize(self, part: Expr | None) -> Expr:
        return _const(0.0, self.loc) if part is None else part


def _name(name: str) -> Expr:
    return Expr("name", name)


def _const(value: float, loc) -> Expr:
    return Expr("const", float(value), loc=loc)


__all__ = ["Split", "split"]
