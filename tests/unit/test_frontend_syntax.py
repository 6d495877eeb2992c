"""The frontend's expressions and statements: max/min as elementwise ops or reductions, casts,
unary minus, powers, comparisons, where, docstrings, SSA chains and several outputs.

Parsing is checked on `epifuse.frontend.parse` directly; end-to-end checks run the generated
Triton kernel through the interpreter on small, integer-valued inputs, so most results are exact.
"""
from __future__ import annotations

import pytest
import torch

import epifuse
from epifuse import EpilogueArguments, GemmArguments, get_kernels, ops
from epifuse.frontend import parse
from epifuse.ops import relu, where

from frontend_helpers import (K, M, N, accum_of, body, bound, cpu_ab, only_expr, op_names,
                              output_node, shape_of, strip)
from helpers import integer_tensor


@pytest.fixture
def AB():
    return cpu_ab()


# ---- max / min: elementwise with two tensors, a reduction with dim ------------------------------

@pytest.mark.parametrize("text, name, params", [
    ("max(accum, C)", "maximum", {}),
    ("torch.max(accum, C)", "maximum", {}),
    ("torch.maximum(accum, C)", "maximum", {}),
    ("max(accum, 2.0)", "maximum", {}),
    ("min(accum, C)", "minimum", {}),
    ("accum.max(C)", "maximum", {}),
    ("max(accum, dim=1)", "max", {"dim": (1,)}),
    ("max(accum, 1)", "max", {"dim": (1,)}),
    ("accum.max(dim=1)", "max", {"dim": (1,)}),
    ("torch.max(accum, dim=-1, keepdim=True)", "max", {"dim": (-1,), "keepdim": True}),
    ("max(accum, dim=(0, 1))", "max", {"dim": (0, 1)}),
    ("max(accum)", "max", {}),
    ("min(accum, dim=0)", "min", {"dim": (0,)}),
    ("amax(accum, dim=1)", "amax", {"dim": (1,)}),
    ("accum.sum(1)", "sum", {"dim": (1,)}),
    ("mean(accum, dim=1)", "mean", {"dim": (1,)}),
])
def test_max_and_min_elementwise_or_reduction(text, name, params):
    expr = only_expr(body(text, "accum, C"))
    assert expr.value == name
    assert dict(expr.params) == params


def binary_max_epilogue(accum, C):
    D = ops.max(accum, C)
    return D


def clamp_operand_epilogue(accum, lo):
    D = ops.clamp(accum, lo, 1.0)
    return D


def test_binary_max_and_operand_clamp_parse_as_elementwise():
    assert op_names(only_expr(binary_max_epilogue)) == ["maximum"]
    assert op_names(only_expr(clamp_operand_epilogue)) == ["minimum", "maximum"]


@pytest.mark.parametrize("fn, expected", [
    (binary_max_epilogue, lambda x, y: torch.maximum(x, y)),
    (clamp_operand_epilogue, lambda x, y: torch.minimum(torch.maximum(x, y), torch.tensor(1.0))),
], ids=["max", "clamp"])
def test_elementwise_max_and_clamp_functions_are_their_own_reference(fn, expected):
    x, y = torch.randn(4, 5), torch.randn(5)
    assert torch.equal(fn(x, y), expected(x, y))


def test_elementwise_max_end_to_end(AB):
    A, B = AB
    C = integer_tensor(M, N, dtype=torch.float32)
    D = epifuse.gemm(A, B, body("max(accum, C)", "accum, C"), C=C)
    assert torch.equal(D.double(), torch.maximum(accum_of(A, B), C.double()))
    args = GemmArguments(A, B, epilogue=EpilogueArguments(body("max(accum, C)", "accum, C"),
                                                          C=C, D=torch.empty(M, N)))
    assert args.reductions == {}


def test_max_reduction_end_to_end():
    A = integer_tensor(M, K, dtype=torch.float32)
    B = integer_tensor(K, 12, dtype=torch.float32)
    source = "def epi(accum):\n    r = max(accum, dim=1)\n    return r\n"
    r = torch.empty(M)
    args = GemmArguments(A, B, epilogue=EpilogueArguments(source, r=r))
    assert args.reductions == {"r": "max"}
    get_kernels(args)[0].run(args)
    assert torch.equal(r.double(), accum_of(A, B).amax(dim=1))
    r2 = epifuse.gemm(A, B, source)
    assert r2.shape == (M,)
    assert torch.equal(r2, r)


def test_max_reduction_in_a_batched_gemm():
    A = integer_tensor(2, M, K, dtype=torch.float32)
    B = integer_tensor(2, K, N, dtype=torch.float32)
    r = epifuse.gemm(A, B, "def epi(accum):\n    r = accum.max(dim=2)\n    return r\n")
    assert torch.equal(r.double(), (A.double() @ B.double()).amax(dim=2))


# ---- casts, unary minus, **, comparisons, where -------------------------------------------------

@pytest.mark.parametrize("text, dtype", [
    ("accum.to(torch.float16)", "float16"), ("accum.half()", "float16"),
    ("accum.to(dtype=torch.float16)", "float16"), ("accum.to(torch.bfloat16)", "bfloat16"),
    ("accum.bfloat16()", "bfloat16"), ("accum.float()", "float32"),
])
def test_casts(text, dtype):
    expr = only_expr(body(text))
    assert expr.value == "to"
    assert dict(expr.params) == {"dtype": dtype}


def test_to_and_half_are_the_same_expr():
    assert strip(only_expr(body("accum.to(torch.float16)"))) == strip(only_expr(body("accum.half()")))


def test_cast_rounds_through_fp16_end_to_end(AB):
    A, B = AB
    D = epifuse.gemm(A, B, body("(accum * 0.1).half() * 3.0"))
    rounded = (accum_of(A, B).float() * 0.1).half().double() * 3.0
    assert D.dtype == torch.float32
    assert torch.allclose(D.double(), rounded, rtol=1e-6, atol=1e-6)
    unrounded = accum_of(A, B) * 0.1 * 3.0
    assert not torch.allclose(D.double(), unrounded, rtol=1e-7, atol=0)


def test_unary_operators():
    assert strip(only_expr(body("-accum"))) == ("call", "neg", (("name", "accum", (), ()),), ())
    assert strip(only_expr(body("+accum"))) == ("name", "accum", (), ())
    assert op_names(only_expr(body("-(accum * 2.0)"))) == ["neg", "mul"]
    assert op_names(only_expr(body("~(accum > 0.0)"))) == ["logical_not", "gt"]


def test_power():
    assert strip(only_expr(body("accum ** 3.0"))) == \
        ("call", "pow", (("name", "accum", (), ()), ("const", 3.0, (), ())), ())
    assert op_names(only_expr(body("accum ** e", "accum, e"))) == ["pow"]


def test_unary_minus_and_square_end_to_end(AB):
    A, B = AB
    D = epifuse.gemm(A, B, body("-accum ** 2.0 + (-accum) * accum ** 2 - accum * -2"))
    acc = accum_of(A, B)
    assert torch.equal(D.double(), -acc ** 2 + (-acc) * acc ** 2 - acc * -2)


@pytest.mark.parametrize("text", ["accum ** 3.0", "(-accum) ** 3.0", "accum ** p", "accum ** -2.0"])
def test_general_power_end_to_end(AB, text):
    A, B = AB
    D = epifuse.gemm(A, B, body(text, "accum, p"), p=3.0)
    acc = accum_of(A, B)
    expected = eval(text.replace("accum", "acc").replace("p", "3.0"), {"acc": acc})
    assert torch.allclose(D.double(), expected, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_chained_comparison_is_a_conjunction():
    expr = only_expr(body("lo < accum <= 1.0", "accum, lo"))
    assert strip(expr) == ("call", "logical_and", (
        ("call", "lt", (("name", "lo", (), ()), ("name", "accum", (), ())), ()),
        ("call", "le", (("name", "accum", (), ()), ("const", 1.0, (), ())), ())), ())
    three = only_expr(body("0.0 < accum < 4.0 != accum"))
    assert op_names(three) == ["logical_and", "logical_and", "lt", "lt", "ne"]
    assert strip(three.args[1]) == ("call", "ne", (("const", 4.0, (), ()), ("name", "accum", (), ())), ())


@pytest.mark.parametrize("text, name", [("accum < 1.0", "lt"), ("accum <= 1.0", "le"),
                                        ("accum > 1.0", "gt"), ("accum >= 1.0", "ge"),
                                        ("accum == 1.0", "eq"), ("accum != 1.0", "ne")])
def test_comparisons(text, name):
    assert only_expr(body(text)).value == name


def test_where_and_chained_comparison_end_to_end(AB):
    A, B = AB
    D = epifuse.gemm(A, B, body("where(0.0 < accum < 4.0, accum, -1.0)"))
    acc = accum_of(A, B)
    assert torch.equal(D.double(), torch.where((acc > 0) & (acc < 4), acc, -1.0))
    mask = epifuse.gemm(A, B, body("(accum > 0.0) & (accum < 4.0) | (accum == -1.0)"))
    assert torch.equal(mask.double(), ((acc > 0) & (acc < 4) | (acc == -1)).double())


def test_where_spellings():
    for text in ("where(accum > 0.0, accum, C)", "torch.where(accum > 0.0, accum, C)"):
        expr = only_expr(body(text, "accum, C"))
        assert op_names(expr) == ["where", "gt"]


def where_epilogue(accum, C):
    D = where(accum > 0.0, accum, C)
    return D


def test_where_function_is_its_own_reference(AB):
    A, B = AB
    C = integer_tensor(M, N, dtype=torch.float32)
    D = epifuse.gemm(A, B, where_epilogue, C=C)
    assert torch.equal(D, where_epilogue(A @ B, C))


# ---- statements ---------------------------------------------------------------------------------

def documented(accum, alpha):
    """A docstring is allowed, and so is pass."""
    pass
    D = accum * alpha
    pass
    return D


def test_docstring_and_pass_are_allowed():
    program = parse(documented)
    assert [s.target for s in program.statements] == ["D"]
    assert op_names(program.statements[0].expr) == ["mul"]
    source = 'def epi(accum):\n    """Doc."""\n    pass\n    D = accum\n    return D\n'
    assert [s.target for s in parse(source).statements] == ["D"]


def ssa_chain(accum, alpha, C):
    x = accum * alpha
    y = x + C
    z = relu(y)
    D = z * x
    return D


def test_ssa_statements_refer_to_earlier_names():
    program = parse(ssa_chain)
    assert [s.target for s in program.statements] == ["x", "y", "z", "D"]
    assert strip(program.statements[3].expr) == \
        ("call", "mul", (("name", "z", (), ()), ("name", "x", (), ())), ())
    source = ("def e(accum, alpha, C):\n    x = accum * alpha\n    y = x + C\n    z = relu(y)\n"
              "    D = z * x\n    return D\n")
    assert shape_of(parse(source)) == shape_of(program)
    graph = bound(source, C=("M", "N"))
    node = output_node(graph)  # D = mul(relu(add(x, C)), x): x is one shared node
    assert node.op.name == "mul" and node.src[1] is node.src[0].src[0].src[0]


def test_ssa_end_to_end(AB):
    A, B = AB
    C = integer_tensor(M, N, dtype=torch.float32)
    D = epifuse.gemm(A, B, ssa_chain, alpha=2.0, C=C)
    x = accum_of(A, B) * 2.0
    assert torch.equal(D.double(), torch.relu(x + C.double()) * x)


def test_return_accum_needs_an_accum_output():
    program = parse("def epi(accum):\n    return accum\n")
    assert program.statements == ()
    assert [name for name, _ in program.outputs] == ["accum"]
    with pytest.raises(epifuse.EpilogueError,
                       match="Argument accum is not provided in the kwargs of the EpilogueArguments constructor"):
        EpilogueArguments("def epi(accum):\n    return accum\n")


def test_return_accum_end_to_end(AB):
    A, B = AB
    out = torch.empty(M, N)
    args = GemmArguments(A, B, epilogue=EpilogueArguments("def epi(accum):\n    return accum\n", accum=out))
    get_kernels(args)[0].run(args)
    assert torch.equal(out.double(), accum_of(A, B))
    D, acc = epifuse.gemm(A, B, "def epi(accum):\n    D = relu(accum)\n    return D, accum\n")
    assert torch.equal(acc.double(), accum_of(A, B))
    assert torch.equal(D.double(), torch.relu(accum_of(A, B)))


def three_outputs(accum, bias):
    F = accum + bias
    D = relu(F)
    G = F * F
    return G, D, F


def test_several_outputs_come_back_in_return_order(AB):
    A, B = AB
    bias = integer_tensor(N, dtype=torch.float32)
    program = parse(three_outputs)
    assert [name for name, _ in program.outputs] == ["G", "D", "F"]
    G, D, F_ = epifuse.gemm(A, B, three_outputs, bias=bias)
    F_ref = accum_of(A, B) + bias.double()
    assert torch.equal(F_.double(), F_ref)
    assert torch.equal(D.double(), torch.relu(F_ref))
    assert torch.equal(G.double(), F_ref * F_ref)


def test_several_outputs_with_given_tensors_and_dtypes(AB):
    A, B = AB
    bias = integer_tensor(N, dtype=torch.float32)
    G, D, F_ = torch.empty(M, N), torch.empty(M, N, dtype=torch.float16), torch.empty(M, N)
    args = GemmArguments(A, B, epilogue=EpilogueArguments(three_outputs, bias=bias, G=G, D=D, F=F_))
    get_kernels(args)[0].run(args)
    F_ref = accum_of(A, B) + bias.double()
    assert torch.equal(D.double(), torch.relu(F_ref).half().double())
    assert torch.equal(F_.double(), F_ref)
