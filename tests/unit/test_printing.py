"""Printing: Programs as source and as JSON, for programs of any size. A Program the parser
accepts prints as source the parser reads back to the same Program, and dumps as JSON that
load_program reads back to an equal one, however many statements it has or however deeply its
expressions nest; so the torch ops' keys and derived backwards work for them too.
"""
from __future__ import annotations

import json
import random

import pytest
import torch

import epifuse
from epifuse import FusedGemm
from epifuse.errors import EpilogueSyntaxError
from epifuse.frontend import MAX_SOURCE_CHARS, parse
from epifuse.program import Expr
from epifuse.printing import FreshNames, dump_program, expr_source, load_program, program_source

from frontend_helpers import strip
from helpers import integer_tensor


def _chain(statements: int, space: str = " ") -> str:
    """`statements` statements, each reading the one before: x * s, then / s + t, in turn (with s a
    power of two and t integer-valued the float64 result is exact; d D / d accum is 1)."""
    lines = ["def chain(accum, s, t):", "    x0 = accum"]
    for i in range(1, statements + 1):
        lines.append(f"    x{i}{space}={space}x{i - 1}{space}*{space}s" if i % 2 else
                     f"    x{i}{space}={space}x{i - 1}{space}/{space}s{space}+{space}t")
    return "\n".join(lines + [f"    D = x{statements}", "    return D"]) + "\n"


def _shape(program) -> list:
    """A Program without places, as a flat list (nested tuples would compare recursively)."""
    found = [program.params, tuple(program.outputs[i][0] for i in range(len(program.outputs)))]
    for statement in program.statements:
        found.append(statement.target)
        stack = [statement.expr]
        while stack:
            e = stack.pop()
            found.append((e.kind, e.value, e.params, len(e.args)))
            stack.extend(e.args)
    return found


def _chain_reference(accum, s, t, statements: int):
    x = accum
    for i in range(1, statements + 1):
        x = x * s if i % 2 else x / s + t
    return x


def _long_sum(terms: int) -> str:
    """One statement: accum + b + b + ..., an expression `terms` deep (the parser takes a few
    hundred operators in one statement)."""
    return "def long_sum(accum, b):\n    D = accum" + " + b" * terms + "\n    return D\n"


# ---- JSON ------------------------------------------------------------------------------------------

LONG_AND_DEEP = {
    "3000-statements": _chain(3000),
    "sum-of-500": _long_sum(500),
    "minus-400": "def e(accum):\n" + "    D = " + "-" * 400 + "accum\n    return D\n",
    "where-12": "def e(accum, x):\n    D = " + "where(accum > x, " * 12 + "accum" + ", x)" * 12
                + "\n    return D\n",
}


@pytest.mark.parametrize("case", sorted(LONG_AND_DEEP))
def test_dump_and_load_round_trip_long_and_deep_programs(case):
    """Deep expressions were a RecursionError in dump_program (json recurses once per level)."""
    program = parse(LONG_AND_DEEP[case])
    text = dump_program(program)
    assert load_program(text) == program
    assert _shape(load_program(text)) == _shape(program)


def test_dump_writes_what_json_writes():
    """The JSON text is json's own (keys written before, and their digests, stay valid)."""
    program = parse("def e(accum, b, C):\n    D = where(accum > b, gelu(C, approximate='tanh'), -1e999)\n"
                    "    r = amax(D, dim=(0, 1))  # \u00e9t\u00e9 \"\\\n    return D, r\n")
    text = dump_program(program)
    assert text == json.dumps(json.loads(text), separators=(",", ":"))
    assert load_program(text) == program


NOT_PROGRAMS = ["", "[", "[1,]", "[1 2]", '{"a" 1}', '{"a":1,}', "{1:2}", "[1]]", "]", "[1,,2]", "nul",
                '{"a":}', "[1] x", '["a]', "[" * 100_000 + "]" * 100_000, "[" * 100_000]


@pytest.mark.parametrize("index", range(len(NOT_PROGRAMS)))
def test_what_is_not_a_dumped_program_is_a_value_error(index):
    """Malformed JSON, and JSON nested far deeper than a program, read without recursion."""
    with pytest.raises(ValueError, match="not a dumped epilogue program"):
        load_program(NOT_PROGRAMS[index])


# ---- source ----------------------------------------------------------------------------------------

_BINARY = ["add", "sub", "mul", "div", "pow", "lt", "le", "gt", "ge", "eq", "ne", "maximum"]


def _random_expr(rng: random.Random, depth: int) -> Expr:
    if depth == 0 or rng.random() < 0.2:
        if rng.random() < 0.6:
            return Expr("name", rng.choice(["accum", "a", "b"]))
        return Expr("const", rng.choice([0.5, 2.0, 3.0, 1e300]))
    pick = rng.random()
    if pick < 0.15:
        return Expr("call", "neg", (_random_expr(rng, depth - 1),))
    if pick < 0.2:
        return Expr("call", "relu", (_random_expr(rng, depth - 1),))
    return Expr("call", rng.choice(_BINARY), (_random_expr(rng, depth - 1), _random_expr(rng, depth - 1)))


def test_expressions_print_with_the_parentheses_python_needs():
    """Random trees of operators, unary minus and calls print as source that parses back to the
    same tree: precedence, left and right associativity, -x ** 2 and chained comparisons."""
    rng = random.Random(int(torch.randint(0, 2 ** 31, ())))
    for _ in range(500):
        expr = _random_expr(rng, 6)
        text = expr_source(expr)
        read = parse(f"def e(accum, a, b):\n    D = {text}\n    return D\n").statements[0].expr
        assert strip(read) == strip(expr), text
    cases = {"a - (b - accum)": ("sub", "a", ("sub", "b", "accum")),
             "a - b - accum": ("sub", ("sub", "a", "b"), "accum"),
             "(a ** b) ** accum": ("pow", ("pow", "a", "b"), "accum"),
             "a ** b ** accum": ("pow", "a", ("pow", "b", "accum")),
             "(-a) ** b": ("pow", ("neg", "a"), "b"), "-a ** b": ("neg", ("pow", "a", "b")),
             "--a": ("neg", ("neg", "a")), "(a < b) < accum": ("lt", ("lt", "a", "b"), "accum"),
             "a / (b * accum)": ("div", "a", ("mul", "b", "accum"))}

    def build(tree):
        if isinstance(tree, str):
            return Expr("name", tree)
        return Expr("call", tree[0], tuple(build(t) for t in tree[1:]))
    for text, tree in cases.items():
        assert expr_source(build(tree)) == text


def test_a_long_statement_prints_as_written_and_parses_back():
    """A sum of 500 terms printed one pair of parentheses per operator nested too deeply for the
    parser to read back (a class-based epilogue's source is printed, then parsed again)."""
    program = parse(_long_sum(500))
    printed = program_source(program)
    assert printed.splitlines()[1] == "    D = accum" + " + b" * 500
    assert _shape(parse(printed)) == _shape(program)
    for case, source in LONG_AND_DEEP.items():
        assert _shape(parse(program_source(parse(source)))) == _shape(parse(source)), case


class _LongSum(FusedGemm):
    epilogue = _long_sum(60).replace("(accum", "(self, accum")


def test_a_class_based_epilogue_with_a_long_sum_runs():
    A, B = integer_tensor(4, 3, dtype=torch.float32), integer_tensor(3, 5, dtype=torch.float32)
    b = integer_tensor(5, dtype=torch.float32)
    D = _LongSum()(A, B, b=b)
    assert torch.equal(D.double(), A.double() @ B.double() + 60 * b.double())


def test_printed_sources_are_read_without_the_user_source_limit():
    """What epifuse prints from a program it parsed grows with that program (a backward is
    several times longer than its forward): the limit on user source does not apply to it."""
    source = _chain(4500, space="")    # printed with spaces around each operator
    assert len(source) < MAX_SOURCE_CHARS
    program = parse(source)
    printed = program_source(program, name="again")
    assert len(printed) > MAX_SOURCE_CHARS
    assert _shape(parse(printed)) == _shape(program)
    with pytest.raises(EpilogueSyntaxError, match=f"the limit is {MAX_SOURCE_CHARS}"):
        parse(str(printed))


def test_fresh_names_skip_what_is_taken():
    names = FreshNames({"t", "t_2", "v"})
    assert [names.fresh("t") for _ in range(3)] == ["t_1", "t_3", "t_4"]
    assert names.fresh("__x") == "v_1" and names.fresh("u") == "u" and names.fresh("u") == "u_1"
    many = FreshNames(())
    assert len({many.fresh("t") for _ in range(20_000)}) == 20_000


# ---- end to end: the custom op's key and the derived backward ----------------------------------------

@pytest.mark.slow   # one of the longest: the README's run leaves it to -m slow (CI runs it)
def test_a_3000_statement_epilogue_runs_forward_and_backward():
    """Through autograd (the custom op's key, the backward printed and parsed): the derived
    backward of a 3000-statement chain is longer than the user source limit."""
    statements = 3000
    A = integer_tensor(3, 4, dtype=torch.float64).requires_grad_()
    B = integer_tensor(4, 2, dtype=torch.float64).requires_grad_()
    s = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    t = integer_tensor(2, dtype=torch.float64).requires_grad_()
    D = epifuse.gemm(A, B, _chain(statements), s=s, t=t)
    seed = integer_tensor(3, 2, dtype=torch.float64)
    grads = torch.autograd.grad(D, (A, B, s, t), seed)
    leaves = [x.detach().clone().requires_grad_() for x in (A, B, s, t)]
    want = _chain_reference(leaves[0] @ leaves[1], leaves[2], leaves[3], statements)
    want_grads = torch.autograd.grad(want, leaves, seed)
    assert torch.equal(D.detach(), want.detach())
    for got, expected in zip(grads, want_grads):
        assert torch.equal(got, expected)


def test_a_deep_expression_runs_forward_and_backward():
    A = integer_tensor(3, 4, dtype=torch.float64).requires_grad_()
    B = integer_tensor(4, 2, dtype=torch.float64)
    b = integer_tensor(2, dtype=torch.float64).requires_grad_()
    D = epifuse.gemm(A, B, _long_sum(500), b=b)
    D.sum().backward()
    assert torch.equal(D.detach(), A.detach() @ B + 500 * b.detach())
    assert torch.equal(b.grad, torch.full((2,), 500.0 * 3, dtype=torch.float64))
    assert torch.equal(A.grad, torch.ones(3, 2, dtype=torch.float64) @ B.t())
