"""User errors: each phrase of DESIGN.md's "Errors" section, places in the source, and the
guarantee that nothing in an epilogue's source is ever executed.

Every error here must be an `epifuse.EpilogueError` (a `ValueError`) raised before any kernel
compiles or any output is written.
"""
from __future__ import annotations

import inspect
import re

import pytest
import torch

import epifuse
from epifuse import EpilogueArguments, EpilogueError, GemmArguments
from epifuse.frontend import parse

M = N = K = 16


def src(*lines: str, params: str = "accum") -> str:
    """A string epilogue: `def epi(params):` then the lines, indented."""
    return f"def epi({params}):\n" + "".join(f"    {line}\n" for line in lines)


def raises(phrase: str):
    return pytest.raises(EpilogueError, match=re.escape(phrase))


def AB(m=M, k=K, n=N):
    return torch.randn(m, k), torch.randn(k, n)


ALPHA = src("D = accum * alpha", "return D", params="accum, alpha")
BIAS = src("D = accum + bias", "return D", params="accum, bias")


def gemm_args(source, A=None, B=None, **tensors):
    if A is None:
        A, B = AB()
    return GemmArguments(A, B, epilogue=EpilogueArguments(source, **tensors))


def out():
    return torch.empty(M, N)


def outputs_for(source) -> dict:
    """A (M, N) tensor for every name the epilogue returns (enough to reach binding)."""
    return {name: out() for name, _ in parse(source).outputs}


# ---- the phrases of DESIGN.md ------------------------------------------------------------------

DESIGN_PHRASES = [
    # no accum parameter
    ("no-accum", lambda: parse(src("D = x * 2.0", "return D", params="x")),
     "accum must be an input to the epilogue function"),
    ("no-accum-no-params", lambda: parse("def epi():\n    D = 1.0\n    return D\n"),
     "accum must be an input to the epilogue function"),
    ("no-accum-api", lambda: EpilogueArguments(src("D = x", "return D", params="x"), x=1.0, D=out()),
     "accum must be an input to the epilogue function"),
    # a name assigned twice
    ("assigned-twice", lambda: parse(src("tmp = accum * 2.0", "tmp = accum + 1.0", "D = tmp", "return D")),
     "Variable 'tmp' cannot be defined twice."),
    ("augmented-assignment", lambda: parse(src("tmp = accum", "tmp += 1.0", "D = tmp", "return D")),
     "Variable 'tmp' cannot be defined twice."),
    ("augmented-multiply", lambda: parse(src("tmp = accum", "tmp *= 2.0", "D = tmp", "return D")),
     "Variable 'tmp' cannot be defined twice."),
    ("parameter-reassigned", lambda: parse(src("tmp = accum", "return tmp", params="accum, tmp")),
     "Variable 'tmp' cannot be defined twice."),
    ("accum-reassigned", lambda: parse(src("accum = accum * 2.0", "return accum")),
     "Variable 'accum' cannot be defined twice."),
    # an operand or output without a kwarg
    ("missing-operand", lambda: EpilogueArguments(ALPHA, D=out()),
     "Argument alpha is not provided in the kwargs of the EpilogueArguments constructor"),
    ("missing-output", lambda: EpilogueArguments(ALPHA, alpha=2.0),
     "Argument D is not provided in the kwargs of the EpilogueArguments constructor"),
    ("missing-second-output", lambda: EpilogueArguments(
        src("F = accum * alpha", "D = F + 1.0", "return D, F", params="accum, alpha"), alpha=1.0, D=out()),
     "Argument F is not provided in the kwargs of the EpilogueArguments constructor"),
    ("missing-accum-output", lambda: EpilogueArguments(src("return accum")),
     "Argument accum is not provided in the kwargs of the EpilogueArguments constructor"),
    ("missing-operand-gemm", lambda: epifuse.gemm(*AB(), ALPHA),
     "Argument alpha is not provided in the kwargs of the EpilogueArguments constructor"),
    # an extra kwarg
    ("extra-kwarg", lambda: EpilogueArguments(ALPHA, alpha=2.0, D=out(), gamma=1.0),
     "Unexpected keyword argument 'gamma'"),
    ("extra-tensor-kwarg", lambda: EpilogueArguments(ALPHA, alpha=2.0, D=out(), gamma=out()),
     "Unexpected keyword argument 'gamma'"),
    ("extra-kwarg-gemm", lambda: epifuse.gemm(*AB(), ALPHA, alpha=2.0, gamma=1.0),
     "Unexpected keyword argument 'gamma'"),
    # an unknown function
    ("unknown-function", lambda: parse(src("D = foo(accum)", "return D")), "Unsupported operation 'foo'"),
    ("unknown-torch-function", lambda: parse(src("D = torch.foo(accum)", "return D")),
     "Unsupported operation 'foo'"),
    ("unknown-F-function", lambda: parse(src("D = F.foo(accum)", "return D")), "Unsupported operation 'foo'"),
    ("unknown-method", lambda: parse(src("D = accum.foo()", "return D")), "Unsupported operation 'foo'"),
    ("unknown-function-api", lambda: EpilogueArguments(src("D = foo(accum)", "return D"), D=out()),
     "Unsupported operation 'foo'"),
    ("unknown-function-gemm", lambda: epifuse.gemm(*AB(), src("D = foo(accum)", "return D")),
     "Unsupported operation 'foo'"),
    # a shape that does not broadcast against accum
    ("shape-row", lambda: gemm_args(BIAS, bias=torch.zeros(3), D=out()),
     "Operand bias with shape (3,) does not broadcast against accum (16, 16)"),
    ("shape-column", lambda: gemm_args(BIAS, bias=torch.zeros(3, 1), D=out()),
     "Operand bias with shape (3, 1) does not broadcast against accum (16, 16)"),
    ("shape-tile", lambda: gemm_args(BIAS, bias=torch.zeros(16, 3), D=out()),
     "Operand bias with shape (16, 3) does not broadcast against accum (16, 16)"),
    ("shape-too-many-dims", lambda: gemm_args(BIAS, bias=torch.zeros(2, 16, 16), D=out()),
     "Operand bias with shape (2, 16, 16) does not broadcast against accum (16, 16)"),
    ("shape-batch", lambda: gemm_args(BIAS, torch.randn(2, M, K), torch.randn(2, K, N),
                                      bias=torch.zeros(3, 1, 16), D=torch.empty(2, M, N)),
     "Operand bias with shape (3, 1, 16) does not broadcast against accum (2, 16, 16)"),
    ("shape-empty", lambda: gemm_args(BIAS, bias=torch.zeros(0), D=out()),
     "Operand bias with shape (0,) does not broadcast against accum (16, 16)"),
    ("shape-gemm", lambda: epifuse.gemm(*AB(), BIAS, bias=torch.zeros(3)),
     "Operand bias with shape (3,) does not broadcast against accum (16, 16)"),
]


@pytest.mark.parametrize("make, phrase", [c[1:] for c in DESIGN_PHRASES], ids=[c[0] for c in DESIGN_PHRASES])
def test_design_phrase(make, phrase):
    with raises(phrase) as info:
        make()
    assert isinstance(info.value, ValueError)


def test_epilogue_error_is_a_value_error():
    assert issubclass(EpilogueError, ValueError)
    with pytest.raises(ValueError):
        parse(src("D = foo(accum)", "return D"))


def test_shape_phrase_has_the_documented_form():
    with pytest.raises(EpilogueError) as info:
        gemm_args(BIAS, bias=torch.zeros(5, 7), D=out())
    assert re.search(r"Operand bias with shape \(.*\) does not broadcast against accum \(.*\)",
                     str(info.value))


# STYLE.md: error tests compare the whole message (place, source line, caret, fix).
WHOLE_MESSAGES = [
    ("assigned-twice", lambda: parse(src("tmp = accum", "tmp = accum * 2.0", "return tmp")), """\
Variable 'tmp' cannot be defined twice.
  File "<epilogue string>", line 3, column 5
    tmp = accum * 2.0
    ^
Epilogues are in SSA form: give the new value a new name."""),
    ("no-accum", lambda: parse(src("D = x", "return D", params="x")), """\
accum must be an input to the epilogue function
  File "<epilogue string>", line 1, column 1
    def epi(x):
    ^
Write `def epi(accum, ...)`."""),
    ("unsupported-in-expression", lambda: parse(src("x = accum * 2.0", "D = relu(x) + xyzzy(x)", "return D")), """\
Unsupported operation 'xyzzy'
  File "<epilogue string>", line 3, column 19
    D = relu(x) + xyzzy(x)
                  ^
See the op reference (epifuse.ops.OPS) for the supported operations."""),
    ("reduction-used", lambda: gemm_args(src("r = sum(accum, dim=0)", "D = accum + r", "return D, r"),
                                         D=out(), r=torch.empty(N)), """\
The result of sum() is used by add(); one kernel runs a reduction that feeds later math only over accum's last dimension (N), whose rows a tile can span, not over M.
  File "<epilogue string>", line 3, column 9
    D = accum + r
        ^
epifuse.gemm runs such an epilogue as passes of the GEMM (a statistics pass, then one reading it: epifuse.staging), outside torch.compile. Or return the reduced value and finish the computation after the GEMM."""),
    ("missing-operand", lambda: EpilogueArguments(ALPHA, D=out()), """\
Argument alpha is not provided in the kwargs of the EpilogueArguments constructor
  File "<epilogue string>", line 1, column 16
    def epi(accum, alpha):
                   ^
Pass alpha=... (an operand)."""),
    ("shape", lambda: gemm_args(BIAS, bias=torch.zeros(3), D=out()), """\
Operand bias with shape (3,) does not broadcast against accum (16, 16)
Operands must be scalars, rows (N,), columns (M, 1), tiles (M, N) or their batched forms \
(L, 1, N), (L, M, 1), (L, M, N), (L, 1, 1)."""),
]


@pytest.mark.parametrize("make, message", [c[1:] for c in WHOLE_MESSAGES], ids=[c[0] for c in WHOLE_MESSAGES])
def test_whole_message(make, message):
    with pytest.raises(EpilogueError) as info:
        make()
    assert str(info.value) == message


# ---- suggestions ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, misspelled, suggestion", [
    ("reluu(accum)", "reluu", "relu"),
    ("torch.reluu(accum)", "reluu", "relu"),
    ("accum.sigmod()", "sigmod", "sigmoid"),
    ("F.gleu(accum)", "gleu", "gelu"),
    ("tanhh(accum)", "tanhh", "tanh"),
    ("maximun(accum, 1.0)", "maximun", "maximum"),
])
def test_unknown_function_lists_close_names(text, misspelled, suggestion):
    with raises(f"Unsupported operation '{misspelled}'") as info:
        parse(src(f"D = {text}", "return D"))
    assert f"'{suggestion}'" in str(info.value)
    assert info.value.hint is not None and suggestion in info.value.hint


def test_unknown_function_without_close_names_points_at_the_op_list():
    with raises("Unsupported operation 'xyzzy'") as info:
        parse(src("D = xyzzy(accum)", "return D"))
    assert "epifuse.ops" in str(info.value)


def test_a_misspelled_operand_is_reported():
    # a misspelled operand is both missing and extra; either phrase may be reported
    with pytest.raises(EpilogueError) as info:
        EpilogueArguments(ALPHA, alpah=2.0, D=out())
    message = str(info.value)
    assert ("Argument alpha is not provided in the kwargs of the EpilogueArguments constructor" in message
            or "Unexpected keyword argument 'alpah'" in message)
    assert "alpha" in message


def test_extra_kwarg_with_everything_given_suggests_the_close_name():
    with raises("Unexpected keyword argument 'alpah'") as info:
        EpilogueArguments(ALPHA, alpha=1.0, alpah=2.0, D=out())
    assert "'alpha'" in str(info.value)


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_a_misspelled_keyword_reads_the_same_with_and_without_autograd(grad):
    """epifuse.gemm checks its keywords with EpilogueArguments' check on both paths: the
    missing operand, where it is declared, and the keyword that looks like it."""
    bias_epilogue = src("D = accum + bias", "return D", params="accum, bias")
    A = torch.randn(8, 4, requires_grad=grad)
    with raises("Argument bias is not provided in the kwargs of the EpilogueArguments constructor") as info:
        epifuse.gemm(A, torch.randn(4, 8), bias_epilogue, bais=torch.randn(8))
    assert "'bais' you passed looks like a misspelling" in info.value.hint
    with raises("Unexpected keyword argument 'biass'") as info:
        epifuse.gemm(A, torch.randn(4, 8), bias_epilogue, bias=torch.randn(8), biass=torch.randn(8))
    assert "'bias'" in str(info.value)


def test_undefined_name_suggests_the_close_name():
    with raises("Variable 'alpah' is not defined.") as info:
        parse(src("D = accum * alpah", "return D", params="accum, alpha"))
    assert "'alpha'" in str(info.value)


def test_unexpected_op_keyword_suggests_the_close_name():
    with raises("leaky_relu() got an unexpected keyword argument 'negative_slop'") as info:
        parse(src("D = F.leaky_relu(accum, negative_slop=0.2)", "return D"))
    assert "'negative_slope'" in str(info.value)


# ---- places: every source error has its line and column ------------------------------------------

@pytest.mark.parametrize("lines, phrase, line, column", [
    (["tmp = accum", "tmp = accum * 2.0", "return tmp"], "Variable 'tmp' cannot be defined twice.", 3, 5),
    (["tmp = accum", "tmp += 1.0", "return tmp"], "Variable 'tmp' cannot be defined twice.", 3, 5),
    (["x = accum * 2.0", "D = relu(foo(x))", "return D"], "Unsupported operation 'foo'", 3, 14),
    (["D = accum + accum.shape", "return D"], "Attribute access '.shape'", 2, 17),
    (["r = sum(accum, dim=0)", "D = accum + r", "return D, r"], "feeds later math only over", 3, 9),
])
def test_source_errors_carry_line_and_column(lines, phrase, line, column):
    source = src(*lines)
    with raises(phrase) as info:
        # the reduction case is only found when binding, so go through the whole API each time
        kwargs = outputs_for(source) if "sum(" in source else {"D": out()}
        gemm_args(source, **kwargs)
    error = info.value
    assert error.loc is not None
    assert (error.loc.line, error.loc.col + 1) == (line, column)
    assert f"line {line}" in str(error) and f"column {column}" in str(error)
    assert error.loc.source_line.strip() in str(error)
    assert "^" in str(error)


def epilogue_with_a_second_definition(accum):
    tmp = accum * 2.0
    tmp = tmp + 1.0
    return tmp


def epilogue_with_an_unknown_op(accum):
    D = accum * 2.0
    E = not_an_op(D)  # noqa: F821  (parsed, never run)
    return E


@pytest.mark.parametrize("fn, needle, phrase", [
    (epilogue_with_a_second_definition, "tmp = tmp + 1.0", "Variable 'tmp' cannot be defined twice."),
    (epilogue_with_an_unknown_op, "E = not_an_op(D)", "Unsupported operation 'not_an_op'"),
])
def test_function_errors_point_into_this_file(fn, needle, phrase):
    lines, first = inspect.getsourcelines(fn)
    line = first + next(i for i, text in enumerate(lines) if needle in text)
    with raises(phrase) as info:
        parse(fn)
    assert info.value.loc.line == line
    assert info.value.loc.filename.endswith("test_errors.py")
    assert f"line {line}" in str(info.value)
    assert needle in str(info.value)


def test_missing_output_error_points_at_the_return():
    with raises("Argument D is not provided in the kwargs of the EpilogueArguments constructor") as info:
        EpilogueArguments(ALPHA, alpha=1.0)
    assert "D=" in str(info.value)  # the suggestion says what to pass


def test_missing_output_error_has_a_place():
    with pytest.raises(EpilogueError) as info:
        EpilogueArguments(ALPHA, alpha=1.0)
    assert "line 3" in str(info.value)


# ---- string epilogues: only the supported subset parses -----------------------------------------

REJECTED = [
    ("import-at-top", "import os\n" + src("D = accum", "return D"), "exactly one function definition", None),
    ("import-inside", src("import os", "D = accum", "return D"), "'Import' is not supported", 2),
    ("from-import", src("from os import system", "D = accum", "return D"), "'ImportFrom' is not supported", 2),
    ("import-after-semicolon", src("D = accum; import os", "return D"), "'Import' is not supported", 2),
    ("attribute-shape", src("D = accum.shape", "return D"), "Attribute access '.shape'", 2),
    ("attribute-dunder-class", src("D = accum.__class__", "return D"), "Attribute access '.__class__'", 2),
    ("call-dunder-class", src("D = accum.__class__()", "return D"), "Unsupported operation '__class__'", 2),
    ("attribute-chain", src("D = accum.T.relu()", "return D"), "Attribute access '.T'", 2),
    ("module-attribute", src("D = torch.pi * accum", "return D"), "Attribute access '.pi'", 2),
    ("subscript", src("D = accum[0]", "return D"), "Subscripts (x[...]) are not supported", 2),
    ("subscript-slice", src("D = accum[:, 1:]", "return D"), "Subscripts (x[...]) are not supported", 2),
    ("lambda", src("f = lambda y: y", "D = accum", "return D"), "Lambdas are not supported", 2),
    ("for-loop", src("for i in range(3):", "    pass", "D = accum", "return D"), "Loops are not supported", 2),
    ("while-loop", src("while True:", "    pass", "D = accum", "return D"), "Loops are not supported", 2),
    ("if", src("if accum:", "    pass", "D = accum", "return D"), "'if' is not supported", 2),
    ("if-expression", src("D = accum if 1.0 else 0.0", "return D"), "Conditional expressions", 2),
    ("unknown-name-call", src("D = eval('1')", "return D"), "Unsupported operation 'eval'", 2),
    ("unknown-module-call", src("D = os.system('true')", "return D"), "Unsupported operation 'os.system'", 2),
    ("open-call", src("D = open('x')", "return D"), "Unsupported operation 'open'", 2),
    ("print-statement", src("print(accum)", "D = accum", "return D"), "'Expr' is not supported", 2),
    ("f-string", src("D = f'{accum}'", "return D"), "'JoinedStr' is not supported", 2),
    ("list-comprehension", src("D = [x for x in accum]", "return D"), "'ListComp' is not supported", 2),
    ("generator", src("D = sum(x for x in accum)", "return D"), "'GeneratorExp' is not supported", 2),
    ("dict-comprehension", src("D = {k: k for k in accum}", "return D"), "'DictComp' is not supported", 2),
    ("walrus", src("D = (y := accum)", "return D"), "'NamedExpr' is not supported", 2),
    ("global", src("global g", "D = accum", "return D"), "'Global' is not supported", 2),
    ("nonlocal", src("nonlocal g", "D = accum", "return D"), "'Nonlocal' is not supported", 2),
    ("decorator", "@decorate\n" + src("D = accum", "return D"), "Decorators are not allowed", 1),
    ("with", src("with open('x') as f:", "    pass", "D = accum", "return D"), "'With' is not supported", 2),
    ("try", src("try:", "    pass", "except Exception:", "    pass", "D = accum", "return D"),
     "'Try' is not supported", 2),
    ("del", src("del accum", "D = 1.0", "return D"), "'Delete' is not supported", 2),
    ("assert", src("assert accum", "D = accum", "return D"), "'Assert' is not supported", 2),
    ("nested-def", src("def g():", "    pass", "D = accum", "return D"), "'FunctionDef' is not supported", 2),
    ("class-def", "class X:\n    pass\n" + src("D = accum", "return D"), "exactly one function definition", None),
    ("two-defs", src("D = accum", "return D") + src("D = accum", "return D"), "exactly one function definition", None),
    ("trailing-statement", src("D = accum", "return D") + "x = 1\n", "exactly one function definition", None),
    ("async-def", "async " + src("D = accum", "return D"), "exactly one function definition", None),
    ("string-literal", src("D = 'abc'", "return D"), "The literal 'abc' is not a number.", 2),
    ("bool-literal", src("D = accum * True", "return D"), "The literal True is not a number.", 2),
    ("tuple-target", src("a, b = accum, accum", "return a"), "Assign exactly one name per statement", 2),
    ("attribute-target", src("accum.x = 1.0", "D = accum", "return D"), "Assign exactly one name per statement", 2),
    ("chained-assignment", src("a = b = accum", "return a"), "Assign exactly one name per statement", 2),
    ("floor-division", src("D = accum // 2.0", "return D"), "The operator '//' is not supported", 2),
    ("modulo", src("D = accum % 2.0", "return D"), "The operator '%' is not supported", 2),
    ("matmul", src("D = accum @ accum", "return D"), "The operator '@' is not supported", 2),
    ("not", src("D = not accum", "return D"), "'not' is not supported", 2),
    ("and", src("D = accum and accum", "return D"), "'and'/'or' are not supported", 2),
    ("is", src("D = accum is accum", "return D"), "The comparison 'Is' is not supported.", 2),
    ("in", src("D = accum in accum", "return D"), "The comparison 'In' is not supported.", 2),
    ("starred-call", src("D = relu(*accum)", "return D"), "*args and **kwargs are not supported", 2),
    ("call-of-call", src("D = relu(accum)(1.0)", "return D"), "Only named ops can be called", 2),
    ("call-a-value", src("D = accum(1.0)", "return D"), "'accum' is a value of the epilogue, not a function.", 2),
    ("undefined-name", src("D = accum * beta", "return D"), "Variable 'beta' is not defined.", 2),
    ("use-before-definition", src("D = accum * y", "y = accum", "return D"), "Variable 'y' is not defined.", 2),
    ("dunder-name", src("__x = accum", "return __x"), "names may not start with '__'", 2),
    ("non-ascii-name", src("é = accum", "return é"), "is not allowed: epilogue names must match", 2),
    ("vararg", src("D = accum", "return D", params="accum, *rest"), "plain names without defaults", 1),
    ("kwarg", src("D = accum", "return D", params="accum, **rest"), "plain names without defaults", 1),
    ("default", src("D = accum", "return D", params="accum, a=1.0"), "plain names without defaults", 1),
    ("keyword-only", src("D = accum", "return D", params="accum, *, a"), "plain names without defaults", 1),
    ("no-return", src("D = accum"), "The epilogue returns nothing.", 1),
    ("bare-return", src("D = accum", "return"), "Return names, not expressions.", 3),
    ("return-expression", src("return accum * 2.0"), "Return names, not expressions.", 2),
    ("return-undefined", src("D = accum", "return E"), "Variable 'E' is not defined.", 3),
    ("return-twice", src("D = accum", "return D, D"), "Output 'D' is returned twice.", 3),
    ("return-not-last", src("D = accum", "return D", "E = accum"), "must be the last statement", 3),
    ("yield", src("D = yield accum", "return D"), "'Yield' is not supported", 2),
    ("await", src("D = await accum", "return D"), "'Await' is not supported", 2),
    ("syntax-error", src("D = accum +", "return D"), "The epilogue is not valid Python", 2),
    ("dtype-not-a-dtype", src("D = accum.to(accum)", "return D"), "needs a dtype such as torch.float16", 2),
    ("parameter-not-literal", src("D = F.leaky_relu(accum, s)", "return D", params="accum, s"),
     "needs 'negative_slope' to be a number literal", 2),
    ("approximate-value", src("D = F.gelu(accum, approximate='exact')", "return D"),
     "needs approximate to be 'none' or 'tanh'", 2),
    ("too-few-arguments", src("D = where(accum > 0.0, accum)", "return D"), "takes 3 tensor argument(s), got 2", 2),
    ("too-many-arguments", src("D = relu(accum, accum)", "return D"), "relu() takes at most 1", 2),
    ("unexpected-op-keyword", src("D = relu(accum, inplace=True)", "return D"),
     "relu() got an unexpected keyword argument 'inplace'", 2),
    ("dim-not-int", src("r = sum(accum, dim=1.5)", "return r"), "needs dim to be an int or a tuple of ints", 2),
    ("invert-a-number", src("D = ~accum", "return D"), "'~' applies to conditions", 2),
    ("and-a-number", src("c = accum > 0.0", "D = where(c & accum, accum, 0.0)", "return D"),
     "'&' applies to conditions", 3),
    ("or-numbers", src("D = accum | 4", "return D"), "'|' applies to conditions", 2),
    ("invert-a-where-of-numbers", src("D = ~where(accum > 0.0, accum, accum > 1.0)", "return D"),
     "'~' applies to conditions", 2),
    ("dim-float", src("r = sum(accum, dim=1.0)", "return r"), "needs dim to be an int or a tuple of ints", 2),
    ("keyword-repeated", src("D = leaky_relu(accum, negative_slope=0.1, negative_slope=0.2)", "return D"),
     "keyword argument repeated: negative_slope", 2),
    ("dim-infinite", src("r = sum(accum, dim=(1, -1e999))", "return r"), "needs dim to be an int or a tuple of ints", 2),
    ("keepdim-not-bool", src("r = sum(accum, dim=1, keepdim=1)", "return r"), "needs keepdim to be True or False", 2),
]


@pytest.mark.parametrize("source, phrase, line", [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED])
def test_string_epilogue_rejects(source, phrase, line):
    with raises(phrase) as info:
        parse(source)
    if line is not None:
        assert f"line {line}" in str(info.value)
        assert info.value.loc is not None and info.value.loc.line == line


def test_a_lambda_is_not_an_epilogue():
    with raises("Lambdas cannot be epilogues."):
        parse(lambda accum: accum)


@pytest.mark.parametrize("value", [42, None, 1.5, b"def epi(accum):\n    return accum\n"])
def test_an_epilogue_must_be_a_function_or_a_string(value):
    with raises("Expected an epilogue function or a string holding one"):
        parse(value)


def test_a_builtin_without_source_is_rejected():
    with raises("Cannot read the source of 'print'"):
        parse(print)


def test_an_overlong_string_is_rejected():
    source = src("D = accum", "return D") + "#" * 200_000
    with raises("characters long; the limit is"):
        parse(source)


@pytest.mark.parametrize("body", ["-" * 3000 + "accum", "(" * 3000 + "accum" + ")" * 3000,
                                  "relu(" * 3000 + "accum" + ")" * 3000])
def test_deeply_nested_strings_are_user_errors(body):
    with pytest.raises(EpilogueError):
        parse(src(f"D = {body}", "return D"))


def test_a_long_sum_binds_or_is_a_user_error():
    source = src("D = " + " + ".join(["accum"] * 600), "return D")
    try:
        gemm_args(source, D=out())
    except EpilogueError:
        pass


def test_duplicate_parameters_are_rejected():
    with raises("Variable 'alpha' cannot be defined twice."):
        parse(src("D = accum * alpha", "return D", params="accum, alpha, alpha"))


# ---- nothing from the source is ever executed --------------------------------------------------

def _side_effect_sources(marker) -> list[str]:
    cmd = f"__import__('os').system('touch {marker}')"
    return [
        src(f"D = {cmd}", "return D"),
        src(f"D = accum + {cmd}", "return D"),
        src(f"D = relu({cmd})", "return D"),
        src("import os", f"D = os.system('touch {marker}')", "return D"),
        "import os\n" + src(f"D = os.system('touch {marker}')", "return D"),
        src(f"D = eval(\"{cmd}\")", "return D"),
        src(f"D = exec(\"{cmd}\")", "return D"),
        src(f"D = open('{marker}', 'w')", "return D"),
        src(f"D = accum.__class__.__init__.__globals__['os'].system('touch {marker}')", "return D"),
        src(f"D = ().__class__.__base__.__subclasses__()[0]('touch {marker}')", "return D"),
        src(f"D = (lambda: {cmd})()", "return D"),
        src(f"D = [{cmd} for _ in [0]]", "return D"),
        src(f'D = f"{{{cmd}}}"', "return D"),
        src(f"D = (x := {cmd})", "return D"),
        src(f"if {cmd}:", "    pass", "D = accum", "return D"),
        src(f"for _ in [{cmd}]:", "    pass", "D = accum", "return D"),
        src(f"with open('{marker}', 'w'):", "    pass", "D = accum", "return D"),
        src(cmd, "D = accum", "return D"),
        src("D = accum", "return D", params=f"accum, x={cmd}"),
        f"@{cmd}\n" + src("D = accum", "return D"),
        src("D = accum", "return D") + cmd + "\n",
        cmd + "\n" + src("D = accum", "return D"),
        f"class X:\n    y = {cmd}\n" + src("D = accum", "return D"),
        src(f"D = torch.{cmd}", "return D"),
        src(f"D = accum.to({cmd})", "return D"),
        src(f"D = F.leaky_relu(accum, {cmd})", "return D"),
        src(f"r = sum(accum, dim={cmd})", "return r"),
    ]


def test_side_effects_in_string_epilogues_never_run(tmp_path):
    marker = tmp_path / "MARKER"
    A, B = AB()
    for source in _side_effect_sources(marker):
        with pytest.raises(EpilogueError):
            parse(source)
        with pytest.raises(EpilogueError):
            EpilogueArguments(source, D=out(), r=torch.empty(M))
        with pytest.raises(EpilogueError):
            epifuse.gemm(A, B, source)
        assert not marker.exists(), source
    assert not marker.exists()


def test_annotations_are_never_evaluated(tmp_path):
    """Annotations are outside the epilogue subset; whether or not they are rejected, they never run."""
    marker = tmp_path / "MARKER"
    cmd = f"__import__('os').system('touch {marker}')"
    A, B = AB()
    for source in (f"def epi(accum: {cmd}) -> {cmd}:\n    D: {cmd} = accum\n    return D\n",
                   f"def epi(accum: {cmd}) -> {cmd}:\n    D = accum * 2.0\n    return D\n"):
        try:
            args = gemm_args(source, A, B, D=out())
            epifuse.kernel_statuses(args)[-1][0].run(args)  # the reference kernel evaluates the graph
        except EpilogueError:
            pass
    assert not marker.exists()


def evil_function_epilogue(accum):
    D = __import__("os").system("touch /nonexistent-dir/epifuse-marker")
    return D


def test_side_effects_in_function_epilogues_never_run(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("os.system", lambda *a: calls.append(a) or 0)
    with raises("Unsupported operation 'system'"):
        parse(evil_function_epilogue)
    with pytest.raises(EpilogueError):
        epifuse.gemm(*AB(), evil_function_epilogue)
    assert calls == []


def test_a_function_epilogue_body_is_never_called():
    calls = []

    def epi(accum):
        D = accum * 2.0
        calls.append("called")  # would fail to parse if it were looked at as a statement ...
        return D

    # ... so the parser must reject it without running the body.
    with pytest.raises(EpilogueError):
        parse(epi)
    assert calls == []


def test_a_forged_op_key_names_what_the_parser_would_refuse():
    """torch.ops.epifuse.gemm reads its epilogue from the key; a key whose program returns one
    name twice is refused with the parser's reason, not run into a tensor nothing wrote."""
    import base64
    import hashlib
    import json
    import zlib

    from epifuse import torch_ops
    from epifuse.errors import EpilogueArgumentError
    epi = src("D = relu(accum)", "F = D * 2.0", "return D, F")
    tag, save, _, body = torch_ops.entry(torch_ops.register_epilogue(epi)).key.split(":")
    program = json.loads(zlib.decompress(base64.urlsafe_b64decode(body)))
    program[4][1] = program[4][0]
    text = json.dumps(program)
    key = (f"{tag}:{save}:{hashlib.sha256(text.encode()).hexdigest()[:32]}:"
           f"{base64.urlsafe_b64encode(zlib.compress(text.encode())).decode()}")
    A, B = torch.randn(M, K), torch.randn(K, N)
    with pytest.raises(EpilogueArgumentError, match="cannot read \\(the output 'D' is returned twice\\)"):
        torch.ops.epifuse.gemm(key, A, B, [], [], "", "", torch.float32, False, "default")
