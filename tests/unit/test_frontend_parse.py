"""The frontend: function and string epilogues, every spelling of an op, op parameters.

Parsing is checked on `epifuse.frontend.parse` directly; end-to-end checks run the generated
Triton kernel through the interpreter (conftest sets TRITON_INTERPRET=1) on small, integer-valued
inputs, so most results are exact.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import epifuse
from epifuse import EpilogueArguments, GemmArguments, get_kernels, ops
from epifuse.frontend import parse
from epifuse.ops import relu

from frontend_helpers import M, N, accum_of, body, cpu_ab, only_expr, op_names, shape_of, strip
from helpers import integer_tensor


@pytest.fixture
def AB():
    return cpu_ab()


# ---- functions and strings ----------------------------------------------------------------------

def relu_aux_store(accum, alpha, C):
    F = (accum * alpha) + (C * 2.0)
    D = relu(F)
    return D, F


RELU_AUX_STORE = '''
def relu_aux_store(accum, alpha, C):
    F = (accum * alpha) + (C * 2.0)
    D = relu(F)
    return D, F
'''


def test_function_and_string_parse_to_the_same_program():
    from_function = parse(relu_aux_store)
    from_string = parse(RELU_AUX_STORE)
    assert shape_of(from_function) == shape_of(from_string)
    assert from_function.params == ("accum", "alpha", "C")
    assert from_function.operands == ("alpha", "C")
    assert [name for name, _ in from_function.outputs] == ["D", "F"]
    assert [s.target for s in from_function.statements] == ["F", "D"]
    assert from_function.filename == __file__
    assert from_string.filename == "<epilogue string>"


def test_function_places_are_lines_of_this_file():
    import inspect
    lines, first = inspect.getsourcelines(relu_aux_store)
    program = parse(relu_aux_store)
    d_line = first + next(i for i, text in enumerate(lines) if "D = relu(F)" in text)
    assert program.statements[1].loc.line == d_line
    assert "D = relu(F)" in program.statements[1].loc.source_line


def test_string_with_surrounding_indentation_and_blank_lines():
    source = "\n\n        def epi(accum):\n            D = accum * 2.0\n\n            return D\n\n"
    assert shape_of(parse(source)) == shape_of(parse(body("accum * 2.0")))


def test_nested_function_epilogue():
    def epi(accum, alpha):
        D = accum * alpha
        return D
    assert shape_of(parse(epi)) == shape_of(parse(body("accum * alpha", "accum, alpha")))


def test_nested_function_with_a_column_zero_comment():
    def epi(accum):
# a comment at column 0, as some editors write them
        D = accum * 2.0
        return D
    assert [s.target for s in parse(epi).statements] == ["D"]


def test_function_and_string_give_the_same_results(AB):
    A, B = AB
    C = integer_tensor(M, N, dtype=torch.float32)
    D1, F1 = epifuse.gemm(A, B, relu_aux_store, alpha=3.0, C=C)
    D2, F2 = epifuse.gemm(A, B, RELU_AUX_STORE, alpha=3.0, C=C)
    F_ref = accum_of(A, B) * 3.0 + C.double() * 2.0
    assert torch.equal(F1.double(), F_ref)
    assert torch.equal(D1.double(), torch.relu(F_ref))
    assert torch.equal(D1, D2) and torch.equal(F1, F2)


def test_the_epilogue_function_is_its_own_reference():
    accum, C = torch.randn(4, 5), torch.randn(4, 5)
    D, F_ = relu_aux_store(accum, 3.0, C)
    assert torch.equal(F_, accum * 3.0 + C * 2.0)
    assert torch.equal(D, torch.relu(F_))


def test_the_documented_flow_with_get_kernels(AB):
    A, B = AB
    C = integer_tensor(M, N, dtype=torch.float32)
    D, F_ = torch.empty(M, N), torch.empty(M, N)
    epi = EpilogueArguments(relu_aux_store, alpha=3.0, C=C, D=D, F=F_)
    args = GemmArguments(A=A, B=B, out=D, accumulator_type=torch.float32, epilogue=epi)
    kernels = get_kernels(args)
    assert kernels, "no kernel supports a plain fp32 GEMM"
    kernels[0].run(args)
    F_ref = accum_of(A, B) * 3.0 + C.double() * 2.0
    assert torch.equal(F_.double(), F_ref)
    assert torch.equal(D.double(), torch.relu(F_ref))


# ---- every spelling of an op is the same op ------------------------------------------------------

def spelled_bare(accum):
    D = relu(accum)
    return D


def spelled_torch(accum):
    D = torch.relu(accum)
    return D


def spelled_F(accum):
    D = F.relu(accum)
    return D


def spelled_torch_nn_functional(accum):
    D = torch.nn.functional.relu(accum)
    return D


def spelled_method(accum):
    D = accum.relu()
    return D


def spelled_epifuse_ops(accum):
    D = epifuse.ops.relu(accum)
    return D


def spelled_ops(accum):
    D = ops.relu(accum)
    return D


SPELLINGS = [spelled_bare, spelled_torch, spelled_F, spelled_torch_nn_functional, spelled_method,
             spelled_epifuse_ops, spelled_ops]


@pytest.mark.parametrize("fn", SPELLINGS, ids=lambda f: f.__name__)
def test_every_spelling_parses_to_relu(fn):
    expr = only_expr(fn)
    assert op_names(expr) == ["relu"]
    assert strip(expr) == strip(only_expr(spelled_bare))
    assert strip(expr) == ("call", "relu", (("name", "accum", (), ()),), ())


@pytest.mark.parametrize("spelling", ["relu(accum)", "torch.relu(accum)", "F.relu(accum)",
                                      "torch.nn.functional.relu(accum)", "nn.functional.relu(accum)",
                                      "accum.relu()", "epifuse.ops.relu(accum)", "ops.relu(accum)"])
def test_every_string_spelling_parses_to_relu(spelling):
    assert strip(only_expr(body(spelling))) == strip(only_expr(spelled_bare))


@pytest.mark.parametrize("fn", SPELLINGS, ids=lambda f: f.__name__)
def test_every_spelling_runs_eagerly_on_torch_tensors(fn):
    x = torch.randn(3, 4)
    assert torch.equal(fn(x), torch.relu(x))


def test_every_spelling_gives_identical_outputs(AB):
    A, B = AB
    results = [epifuse.gemm(A, B, fn) for fn in SPELLINGS]
    expected = torch.relu(accum_of(A, B))
    assert torch.equal(results[0].double(), expected)
    for fn, out in zip(SPELLINGS, results):
        assert torch.equal(out, results[0]), fn.__name__


def test_every_spelling_has_the_same_key(AB):
    A, B = AB
    keys = {GemmArguments(A, B, epilogue=EpilogueArguments(fn, D=torch.empty(M, N))).key
            for fn in SPELLINGS}
    assert len(keys) == 1


@pytest.mark.parametrize("text, name", [
    ("torch.sigmoid(accum)", "sigmoid"), ("F.sigmoid(accum)", "sigmoid"),
    ("torch.special.expit(accum)", "sigmoid"), ("accum.sigmoid()", "sigmoid"),
    ("torch.multiply(accum, 2.0)", "mul"), ("torch.mul(accum, 2.0)", "mul"),
    ("torch.true_divide(accum, 2.0)", "div"), ("torch.clip(accum, 0.0, 1.0)", "clamp"),
    ("F.silu(accum)", "silu"), ("F.hardswish(accum)", "hardswish"), ("torch.abs(accum)", "abs"),
    ("accum.exp()", "exp"), ("torch.maximum(accum, 1.0)", "maximum"),
])
def test_aliases_and_module_spellings(text, name):
    assert op_names(only_expr(body(text)))[0] == name


# ---- parameters ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, name, params", [
    ("F.leaky_relu(accum, 0.2)", "leaky_relu", {"negative_slope": 0.2}),
    ("F.leaky_relu(accum, negative_slope=0.2)", "leaky_relu", {"negative_slope": 0.2}),
    ("torch.nn.functional.leaky_relu(accum, negative_slope=0.2)", "leaky_relu", {"negative_slope": 0.2}),
    ("F.leaky_relu(accum)", "leaky_relu", {}),
    ('gelu(accum, approximate="tanh")', "gelu", {"approximate": "tanh"}),
    ("F.gelu(accum, approximate='none')", "gelu", {"approximate": "none"}),
    ("clamp(accum, min=0.0, max=6.0)", "clamp", {"min": 0.0, "max": 6.0}),
    ("torch.clamp(accum, 0.0, 6.0)", "clamp", {"min": 0.0, "max": 6.0}),
    ("accum.clamp(min=0.0, max=6.0)", "clamp", {"min": 0.0, "max": 6.0}),
    ("clamp(accum, min=-1)", "clamp", {"min": -1.0}),
    ("clamp(accum, max=6)", "clamp", {"max": 6.0}),
    ("F.elu(accum, alpha=0.5)", "elu", {"alpha": 0.5}),
    ("F.softplus(accum, beta=2.0, threshold=10.0)", "softplus", {"beta": 2.0, "threshold": 10.0}),
])
def test_keyword_and_positional_parameters(text, name, params):
    expr = only_expr(body(text))
    assert expr.value == name
    assert dict(expr.params) == params
    assert [strip(a) for a in expr.args] == [("name", "accum", (), ())]


def test_positional_and_keyword_parameters_are_the_same_expr():
    assert strip(only_expr(body("F.leaky_relu(accum, 0.2)"))) == \
        strip(only_expr(body("F.leaky_relu(accum, negative_slope=0.2)")))
    assert strip(only_expr(body("torch.clamp(accum, 0.0, 6.0)"))) == \
        strip(only_expr(body("clamp(accum, max=6.0, min=0.0)")))


def test_parameters_end_to_end(AB):
    A, B = AB
    acc = accum_of(A, B)
    leaky = epifuse.gemm(A, B, body("F.leaky_relu(accum, negative_slope=0.2)"))
    assert torch.allclose(leaky.double(), F.leaky_relu(acc, 0.2), rtol=1e-6, atol=1e-6)
    clamped = epifuse.gemm(A, B, body("clamp(accum, min=0.0, max=6.0)"))
    assert torch.equal(clamped.double(), acc.clamp(0.0, 6.0))
    scaled = acc / 8.0  # gelu's two forms differ visibly around [-3, 3]
    gelu_tanh = epifuse.gemm(A, B, body('gelu(accum * 0.125, approximate="tanh")'))
    gelu_erf = epifuse.gemm(A, B, body("gelu(accum * 0.125)"))
    assert torch.allclose(gelu_tanh.double(), F.gelu(scaled, approximate="tanh"), rtol=1e-5, atol=1e-5)
    assert torch.allclose(gelu_erf.double(), F.gelu(scaled), rtol=1e-5, atol=1e-5)
    assert not torch.equal(gelu_tanh, gelu_erf)


def test_clamp_with_an_operand_bound_becomes_maximum_and_minimum():
    expr = only_expr(body("clamp(accum, lo, 1.0)", "accum, lo"))
    assert strip(expr) == ("call", "minimum",
                           (("call", "maximum", (("name", "accum", (), ()), ("name", "lo", (), ())), ()),
                            ("const", 1.0, (), ())), ())
    assert op_names(only_expr(body("clamp(accum, lo)", "accum, lo"))) == ["maximum"]
    assert op_names(only_expr(body("clamp(accum, max=hi)", "accum, hi"))) == ["minimum"]
    assert op_names(only_expr(body("clamp(accum, min=None, max=hi)", "accum, hi"))) == ["minimum"]


def test_clamp_with_an_operand_bound_end_to_end(AB):
    A, B = AB
    lo = integer_tensor(N, dtype=torch.float32)
    D = epifuse.gemm(A, B, body("clamp(accum, lo, 1.0)", "accum, lo"), lo=lo)
    expected = torch.minimum(torch.maximum(accum_of(A, B), lo.double()), torch.tensor(1.0).double())
    assert torch.equal(D.double(), expected)
