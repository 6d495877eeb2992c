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
from helpers import fast, integer_tensor


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


# ---- nesting, bounded before CPython's parser sees it -------------------------------------------

def _statement(text: str) -> str:
    return f"def epi(accum, x, c):\n    D = {text}\n    return D\n"


# Every construct that nests, each far past what CPython's parser (and its ast builder) can take
# in a small thread's stack: unchecked, each one kills the process (SIGSEGV) at 128 KiB.
DEEP_SOURCES = {
    "lambdas": _statement("lambda: " * 3000 + "x"),
    "lambdas-with-parameters": _statement("lambda a, b=1: " * 3000 + "x"),
    "attributes": _statement("x" + ".a" * 10000),
    "calls": _statement("x" + "()" * 10000),
    "subscripts": _statement("x" + "[0]" * 10000),
    "methods": _statement("x" + ".relu()" * 10000),
    "unary-minus": _statement("-" * 10000 + "x"),
    "unary-plus": _statement("+" * 10000 + "x"),
    "not": _statement("not " * 10000 + "x"),
    "invert": _statement("~" * 10000 + "x"),
    "sum": _statement(" + ".join(["x"] * 10000)),
    "power-tower": _statement(" ** ".join(["x"] * 10000)),
    "conditional-expressions": _statement("x if c else " * 5000 + "x"),
    "parentheses": _statement("(" * 180 + "x" + ")" * 180),
    "lists": _statement("[" * 180 + "x" + "]" * 180),
    "dicts": _statement("{1: " * 180 + "x" + "}" * 180),
    "calls-nested": _statement("relu(" * 180 + "x" + ")" * 180),
    "comprehensions": _statement("[x for x in " * 180 + "x" + "]" * 180),
    "generators": _statement("(x for x in " * 180 + "x" + ")" * 180),
    "walrus": _statement("(y := " * 180 + "x" + ")" * 180),
    "lambdas-in-parentheses": _statement("(lambda: " * 180 + "x" + ")" * 180),
    "f-string-field": _statement('f"{' + "-" * 5000 + 'x}"'),
    "f-string-parentheses": _statement('f"{' + "(" * 180 + "x" + ")" * 180 + '}"'),
    "blocks-and-a-chain": "def epi(accum):\n" + "".join(" " * (i + 1) + "if accum:\n" for i in range(98))
                          + " " * 99 + "D = " + "-" * 1000 + "accum\n",
    "decorators": "@" + "a." * 10000 + "b\ndef epi(accum):\n    D = accum\n    return D\n",
}

_NESTING_SCRIPT = """
import sys, threading
from epifuse.errors import EpilogueSyntaxError
from epifuse.frontend import parse
sources = {sources!r}
results = []

def work():
    for case_id, source in sources.items():
        try:
            parse(source)
            results.append(case_id + ": parsed")
        except EpilogueSyntaxError as error:
            if "nesting limit" not in error.message:
                results.append(case_id + ": " + error.message[:200])
        except BaseException as error:
            results.append(case_id + ": " + repr(error)[:200])

threading.stack_size({stack} * 1024)
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(results)
sys.exit(1 if results else 0)
"""


@pytest.mark.parametrize("stack", fast([256, 128], keep={1}))
def test_every_nesting_construct_is_refused_before_it_can_crash_a_small_stack(stack):
    """In a thread with a 256 or 128 KiB stack, each deep construct is refused by the nesting
    limit (an EpilogueSyntaxError that names it) before CPython's parser recurses into it. Run
    in a subprocess: a crash fails this test (exit status -11), not the whole run."""
    from helpers import run_python
    result = run_python(_NESTING_SCRIPT.format(sources=DEEP_SOURCES, stack=stack), timeout=300)
    assert result.returncode == 0, (result.returncode, result.stdout[-3000:], result.stderr[-3000:])


def test_the_nesting_error_names_the_limit_and_the_place():
    from epifuse.errors import EpilogueSyntaxError
    from epifuse.nesting import NESTING_LIMIT
    with pytest.raises(EpilogueSyntaxError) as info:
        parse(_statement("(" * 40 + "x" + ")" * 40))
    error = info.value
    assert f"nesting limit is {NESTING_LIMIT}" in error.message and error.hint
    assert error.loc.filename == "<epilogue string>" and error.loc.line == 2


# Large epilogues that ordinary code writes: long sums and products, nested calls and
# brackets, long method chains; each still parses, runs, and gives the float64 answer.
REASONABLE = {
    "sum-of-300-terms": (" + ".join(["accum"] * 150 + ["x"] * 150),
                         lambda acc, x: acc * 150 + x * 150),
    "nested-brackets-24": ("(" * 24 + "accum + x" + ")" * 24, lambda acc, x: acc + x),
    "nested-calls-20": ("relu(" * 10 + "abs(" * 10 + "accum - x" + ")" * 20, lambda acc, x: (acc - x).abs()),
    "method-chain-60": ("(accum - x)" + ".relu()" * 30 + ".abs()" * 30, lambda acc, x: (acc - x).relu()),
    "where-nest-12": ("where(accum > x, " * 12 + "accum" + ", x)" * 12, lambda acc, x: torch.maximum(acc, x)),
    "unary-minus-200": ("-" * 200 + "accum + x", lambda acc, x: acc + x),
    "polynomial": (" + ".join(f"{i}.0 * accum ** {1 + i % 2}" for i in range(1, 60)),
                   lambda acc, x: sum(i * acc ** (1 + i % 2) for i in range(1, 60))),
}


@pytest.mark.parametrize("case", sorted(REASONABLE))
def test_large_but_reasonable_epilogues_still_parse_and_run(case, AB):
    text, expected = REASONABLE[case]
    A, B = AB
    x = integer_tensor(N, dtype=torch.float32)
    D = epifuse.gemm(A, B, body(text, "accum, x"), x=x, out_dtype=torch.float32)
    want = expected(accum_of(A, B), x.double())
    assert torch.allclose(D.double(), want, rtol=1e-6, atol=1e-6), (D.double() - want).abs().max()


def test_large_but_reasonable_epilogues_parse_in_a_small_stack():
    from helpers import run_python
    sources = {case: body(text, "accum, x") for case, (text, _) in REASONABLE.items()}
    script = _NESTING_SCRIPT.replace("parse(source)\n            results.append(case_id + \": parsed\")",
                                     "parse(source)")
    result = run_python(script.format(sources=sources, stack=128), timeout=300)
    assert result.returncode == 0, (result.returncode, result.stdout[-3000:], result.stderr[-3000:])


# ---- names of gemm options: never an operand or output -------------------------------------------

OPTION_NAMES = ["precision", "out_dtype", "recompute", "A", "epilogue", "accumulator_type"]


@pytest.mark.parametrize("name", OPTION_NAMES)
def test_a_name_of_a_gemm_option_is_refused_in_every_form_of_epilogue(name, tmp_path, capsys):
    """A string, a function or a FusedGemm method in a file, and the CLI reading that file: each
    refuses an operand named like a gemm option at its parameter, saying why."""
    import importlib.util

    from epifuse import cli
    from epifuse.errors import EpilogueSyntaxError
    message = f"The name '{name}' cannot be an operand or output: it clashes with the gemm option '{name}'"
    with pytest.raises(EpilogueSyntaxError, match=message) as info:
        parse(f"def epi(accum, {name}):\n    D = accum * {name}\n    return D\n")
    assert info.value.loc.line == 1 and info.value.loc.col == len("def epi(accum, ")
    path = tmp_path / f"epi_{name}.py"
    path.write_text("import epifuse\n\n\n"
                    f"def epi(accum, {name}):\n    D = accum * {name}\n    return D\n\n\n"
                    f"class Op(epifuse.FusedGemm):\n    def epilogue(self, accum, {name}):\n"
                    f"        D = accum + {name}\n        return D\n")
    spec = importlib.util.spec_from_file_location(f"epi_{name}", path)
    with pytest.raises(EpilogueSyntaxError, match=message) as info:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))   # defining Op parses it
    assert info.value.loc.filename == str(path) and info.value.loc.line == 10
    for target, line in ((f"{path}:epi", 4), (f"{path}:Op", 10)):
        assert cli.main(["show", target]) == 2
        err = capsys.readouterr().err
        assert message in err and f"{path}:{line}:" in err, err


def test_an_activation_may_use_the_names_of_options():
    """An activation's argument and result are renamed where it is inlined, never passed by
    keyword: `def act(precision): A = relu(precision); return A` is an ordinary activation."""
    from epifuse.epilogues import LinearCombination
    for source in ("def act(x):\n    epilogue = relu(x)\n    return epilogue\n",
                   "def act(precision):\n    A = relu(precision)\n    return A\n",
                   "def act(accumulate):\n    deterministic = relu(accumulate)\n    return deterministic\n"):
        epilogue = LinearCombination(activation=source)
        assert "    D = relu(F)\n" in str(epilogue)
        A, B = cpu_ab()
        C = integer_tensor(M, N, dtype=torch.float32)
        D = epilogue(A, B, C=C, alpha=2.0, beta=1.0)
        assert torch.equal(D.double(), (2 * accum_of(A, B) + C.double()).relu())


def test_rename_reads_names_under_new_ones_at_any_depth():
    from epifuse.program import rename
    program = parse("def e(accum, b):\n    D = relu(accum" + " + accum" * 300 + " * b)\n    return D\n")
    expr = program.statements[0].expr
    renamed = rename(expr, {"accum": "pre"})
    printed = epifuse.printing.expr_source(renamed)
    assert printed == "relu(pre" + " + pre" * 300 + " * b)"
    assert rename(expr, {"zz": "yy"}) is expr


def test_a_composite_s_ops_carry_its_name_and_print_and_load_as_before():
    """softmax's ops carry the name written at the call (for the binder's errors); the program
    still prints as its ops, and dumps and loads back to an equal program."""
    program = parse("def e(accum):\n    P = accum.softmax(dim=1)\n    return P\n")
    expr = program.statements[0].expr
    assert expr.value == "exp" and expr.loc.op == "softmax" and expr.args[0].args[1].value == "logsumexp"
    text = epifuse.printing.program_source(program)
    assert "P = exp(accum - logsumexp(accum, dim=(1,)))" in text
    loaded = epifuse.printing.load_program(epifuse.printing.dump_program(program))
    assert loaded == program and hash(loaded) == hash(program)
    assert epifuse.printing.program_source(parse(text)) == text
