"""String epilogues are parsed, never run: hostile sources, huge sources, odd names.

- Every hostile construct (imports, dunders, attribute chains, builtins, f-strings, lambdas,
  comprehensions, :=, global/nonlocal, decorators, classes, ...) is rejected with an
  EpilogueError by parse, by EpilogueArguments and by epifuse.gemm, and a marker file that a
  successful injection would create never appears, through any channel (the source, op
  parameters, dtype strings, keyword names, the cache directory's name).
- Deeply nested and very long sources raise an EpilogueError or work, never a RecursionError,
  a crash or a hang (each is timed).
- Names that collide with the generator's identifiers, Triton's and Python's work exactly like
  any other name: generated code only uses identifiers it made, which the generated files show.
"""
from __future__ import annotations

import io
import re
import time
import tokenize

import pytest
import torch

import epifuse
from epifuse import EpilogueArguments, EpilogueError, GemmArguments
from epifuse.frontend import IDENTIFIER, parse
from epifuse.runtime.cache import cache_dir
from helpers import integer_tensor, reference_outputs, run_python

M, N, K = 9, 11, 5


def src(*lines: str, params: str = "accum") -> str:
    return f"def epi({params}):\n" + "".join(f"    {line}\n" for line in lines)


def ints(*shape, device="cpu", dtype=torch.float32):
    return integer_tensor(*shape, device=device, dtype=dtype)


def run_all_kernels(source, device, shape=(M, N, K), **tensors):
    """Every kernel on integer-valued inputs; each output must equal the float64 reference."""
    m, n, k = shape
    A, B = ints(m, k, device=device), ints(k, n, device=device)
    for name, _ in parse(source).outputs:
        tensors.setdefault(name, torch.empty(m, n, device=device))
    args = GemmArguments(A, B, epilogue=EpilogueArguments(source, **tensors), precision="highest")
    refs = reference_outputs(args)
    kernels = epifuse.get_kernels(args)
    assert any(kr.name.startswith("triton_") for kr in kernels), epifuse.kernel_statuses(args)
    for kernel in kernels:
        for dest in args.outputs.values():
            dest.fill_(float("nan"))
        kernel.run(args)
        for name, ref in refs.items():
            assert_same(args.outputs[name], ref, (kernel, name))
    return args


def assert_same(out: torch.Tensor, ref: torch.Tensor, what) -> None:
    got, want = out.double().nan_to_num(7e300), ref.to(out.dtype).double().nan_to_num(7e300)
    assert torch.equal(got, want), (what, float((got - want).abs().max()))


# ---- hostile sources ----------------------------------------------------------------------------

def hostile_sources(marker) -> list[tuple[str, str]]:
    """(id, source): each would touch `marker` if any part of it ran."""
    cmd = f"__import__('os').system('touch {marker}')"
    opener = f"open('{marker}', 'w')"
    return [
        ("import", src("import os", f"D = os.system('touch {marker}')", "return D")),
        ("import-module-level", "import os\n" + src("D = accum", "return D")),
        ("from-import", src("from os import system", f"D = system('touch {marker}')", "return D")),
        ("import-in-semicolon", src(f"D = accum; import os; os.system('touch {marker}')", "return D")),
        ("dunder-import-call", src(f"D = {cmd}", "return D")),
        ("dunder-attribute", src("D = accum.__class__", "return D")),
        ("dunder-globals-chain", src(f"D = accum.__class__.__init__.__globals__['os'].system('touch {marker}')", "return D")),
        ("dunder-subclasses", src("D = ().__class__.__base__.__subclasses__()", "return D")),
        ("dunder-builtins-of-torch", src(f"D = torch.__builtins__['eval']('{cmd}')", "return D")),
        ("module-attribute-chain", src(f"D = torch.os.system('touch {marker}')", "return D")),
        ("op-attribute-chain", src("D = torch.relu.__call__(accum)", "return D")),
        ("op-object-attribute", src("D = epifuse.ops.OPS", "return D")),
        ("torch-load", src(f"D = torch.load('{marker}')", "return D")),
        ("method-on-literal", src(f"D = 'touch {marker}'.join(accum)", "return D")),
        ("builtin-open", src(f"D = {opener}", "return D")),
        ("builtin-eval", src(f"D = eval(\"{cmd}\")", "return D")),
        ("builtin-exec", src(f"D = exec(\"{cmd}\")", "return D")),
        ("builtin-compile", src(f"D = compile(\"{cmd}\", 'x', 'exec')", "return D")),
        ("builtin-getattr", src("D = getattr(accum, '__class__')", "return D")),
        ("builtin-setattr", src("D = setattr(accum, 'x', 1)", "return D")),
        ("builtin-globals", src("D = globals()", "return D")),
        ("builtin-vars", src("D = vars(accum)", "return D")),
        ("builtin-breakpoint", src("D = breakpoint()", "return D")),
        ("builtin-input", src("D = input()", "return D")),
        ("builtin-print-statement", src(f"print({cmd})", "D = accum", "return D")),
        ("f-string", src(f'D = f"{{{cmd}}}"', "return D")),
        ("f-string-in-op-parameter", src(f"D = F.gelu(accum, approximate=f'{{{cmd}}}')", "return D")),
        ("string-op-parameter", src(f"D = F.gelu(accum, approximate=\"{cmd}\")", "return D")),
        ("dtype-string", src(f"D = accum.to('float16); {cmd}')", "return D")),
        ("dtype-expression", src(f"D = accum.to({cmd})", "return D")),
        ("number-parameter-expression", src(f"D = F.leaky_relu(accum, {cmd})", "return D")),
        ("dim-expression", src(f"r = sum(accum, dim={cmd})", "return r")),
        ("keyword-expression", src(f"D = clamp(accum, min={cmd})", "return D")),
        ("lambda", src(f"f = lambda: {cmd}", "D = accum", "return D")),
        ("lambda-called", src(f"D = (lambda: {cmd})()", "return D")),
        ("list-comprehension", src(f"D = [{cmd} for _ in [0]]", "return D")),
        ("set-comprehension", src(f"D = {{{cmd} for _ in [0]}}", "return D")),
        ("dict-comprehension", src(f"D = {{0: {cmd} for _ in [0]}}", "return D")),
        ("generator", src(f"D = sum({cmd} for _ in [0])", "return D")),
        ("walrus", src(f"D = (x := {cmd})", "return D")),
        ("walrus-in-call", src(f"D = relu(x := {cmd})", "return D")),
        ("global", src("global os", f"D = os.system('touch {marker}')", "return D")),
        ("nonlocal", src("nonlocal x", "D = accum", "return D")),
        ("decorator", f"@{cmd}\n" + src("D = accum", "return D")),
        ("decorator-name", "@staticmethod\n" + src("D = accum", "return D")),
        ("class-def", f"class X:\n    y = {cmd}\n" + src("D = accum", "return D")),
        ("class-in-body", src("class X:", f"    y = {cmd}", "D = accum", "return D")),
        ("nested-def", src("def g():", f"    return {cmd}", "D = g()", "return D")),
        ("default-argument", src("D = accum", "return D", params=f"accum, x={cmd}")),
        ("keyword-only-default", src("D = accum", "return D", params=f"accum, *, x={cmd}")),
        ("statement-after-def", src("D = accum", "return D") + cmd + "\n"),
        ("statement-before-def", cmd + "\n" + src("D = accum", "return D")),
        ("if", src(f"if {cmd}:", "    pass", "D = accum", "return D")),
        ("for", src(f"for _ in [{cmd}]:", "    pass", "D = accum", "return D")),
        ("while", src(f"while {cmd}:", "    break", "D = accum", "return D")),
        ("with", src(f"with {opener}:", "    pass", "D = accum", "return D")),
        ("try", src("try:", f"    {cmd}", "except Exception:", "    pass", "D = accum", "return D")),
        ("raise", src(f"raise {cmd}", "D = accum", "return D")),
        ("assert", src(f"assert {cmd}", "D = accum", "return D")),
        ("delete", src("del accum", "D = 1.0", "return D")),
        ("match", src(f"match {cmd}:", "    case _:", "        pass", "D = accum", "return D")),
        ("yield", src(f"D = yield {cmd}", "return D")),
        ("await", src(f"D = await {cmd}", "return D")),
        ("async-def", "async " + src(f"D = {cmd}", "return D")),
        ("starred-call", src(f"D = relu(*[{cmd}])", "return D")),
        ("double-starred-call", src(f"D = relu(**{{'x': {cmd}}})", "return D")),
        ("subscript", src(f"D = accum[{cmd}]", "return D")),
        ("slice", src(f"D = accum[:{cmd}]", "return D")),
        ("conditional-expression", src(f"D = accum if {cmd} else accum", "return D")),
        ("boolean-operators", src(f"D = accum and {cmd}", "return D")),
        ("call-a-call", src(f"D = relu(accum)({cmd})", "return D")),
        ("call-a-value", src(f"D = accum({cmd})", "return D")),
        ("tuple-unpacking", src(f"D, E = accum, {cmd}", "return D")),
        ("augmented", src("D = accum", f"D += {cmd}", "return D")),
        ("annotated-assignment", src(f"D: int = {cmd}", "return D")),
        ("return-expression", src(f"return {cmd}")),
        ("ellipsis", src("D = ...", "return D")),
        ("none", src("D = None", "return D")),
        ("bytes", src("D = b'x'", "return D")),
        ("list-literal", src("D = [accum]", "return D")),
        ("dunder-name", src("__builtins__ = accum", "return __builtins__")),
        ("dunder-parameter", src("D = accum", "return D", params="accum, __class__")),
        ("fullwidth-dunder-import", src(f"D = __ｉｍｐｏｒｔ__('os').system('touch {marker}')", "return D")),
        ("null-byte", src("D = accum\x00", "return D")),
        ("lone-surrogate", src("D = accum  # \ud800", "return D")),
        ("byte-order-mark", "\ufeff" + src("D = accum", "return D")),
        ("comment-hidden-code", src("D = accum  # \x0c" + cmd, "return D")),
    ]


MARKER_IDS = [case_id for case_id, _ in hostile_sources("m")]


@pytest.mark.parametrize("case_id", MARKER_IDS)
def test_hostile_source_is_rejected_and_never_runs(case_id, tmp_path, device):
    marker = tmp_path / "MARKER"
    source = dict(hostile_sources(marker))[case_id]
    A, B = ints(M, K, device=device), ints(K, N, device=device)
    expected_error = case_id != "comment-hidden-code"  # a comment is a comment: it parses, and is ignored
    for attempt in (lambda: parse(source),
                    lambda: EpilogueArguments(source, D=torch.empty(M, N, device=device),
                                              r=torch.empty(M, device=device)),
                    lambda: epifuse.gemm(A, B, source)):
        try:
            attempt()
        except EpilogueError:
            pass
        else:
            assert not expected_error, f"{case_id} was accepted"
        assert not marker.exists(), case_id
    assert not marker.exists()


def test_accepted_code_in_docstrings_comments_and_annotations_never_runs(tmp_path, device):
    marker = tmp_path / "MARKER"
    cmd = f"__import__('os').system('touch {marker}')"
    sources = [
        src(f'"""{cmd}"""', "D = accum * 2.0", "return D"),
        src(f"# {cmd}", "D = accum * 2.0  # " + cmd, "return D"),
        f"def epi(accum: {cmd}) -> {cmd}:\n    D = accum * 2.0\n    return D\n",
        src("D = accum * 2.0", "pass", "return D"),
    ]
    for source in sources:
        try:
            run_all_kernels(source, device)
        except EpilogueError:
            pass  # annotations may be refused; either way nothing runs
        assert not marker.exists(), source


def test_injection_through_keyword_names_and_numbers(tmp_path, device):
    marker = tmp_path / "MARKER"
    cmd = f"__import__('os').system('touch {marker}')"
    A, B = ints(M, K, device=device), ints(K, N, device=device)
    with pytest.raises(EpilogueError, match="Unexpected keyword argument"):
        EpilogueArguments(src("D = accum", "return D"), D=torch.empty(M, N, device=device), **{cmd: 1.0})
    with pytest.raises(EpilogueError):
        epifuse.gemm(A, B, src("D = accum * alpha", "return D", params="accum, alpha"), alpha=cmd)
    # numbers reach generated code only as numbers: inf, huge and tiny literals
    for literal in ("1e400", "-1e400", "1e-400", "3.4028236e38", "0x10", "1_000", "0.0", "-0.0"):
        run_all_kernels(src(f"D = accum * 0.0 + {literal}", "return D"), device)
    with pytest.raises(EpilogueError, match="too large for a float"):
        parse(src("D = accum * 1" + "0" * 400, "return D"))
    assert not marker.exists()


def test_cache_directory_name_is_only_a_path(tmp_path, monkeypatch, device):
    marker = tmp_path / "MARKER"
    weird = tmp_path / f"a'b\"c; touch {marker}; $(touch {marker}) `touch {marker}`"
    monkeypatch.setenv("EPIFUSE_CACHE_DIR", str(weird))
    constant = 1.0 + time.time_ns() % 1000 / 1024  # a new graph (a new kernel file), exact in fp32
    run_all_kernels(src(f"D = accum * {constant!r}", "return D"), device)
    assert not marker.exists()
    assert any((weird / "kernels").glob("*.py"))


# ---- size: nesting and length -------------------------------------------------------------------

BIG_SOURCES = {
    "parentheses-50": src("D = " + "(" * 50 + "accum" + ")" * 50, "return D"),
    "parentheses-5000": src("D = " + "(" * 5000 + "accum" + ")" * 5000, "return D"),
    "nested-calls-150": src("D = " + "relu(" * 150 + "accum" + ")" * 150, "return D"),
    "nested-calls-3000": src("D = " + "relu(" * 3000 + "accum" + ")" * 3000, "return D"),
    "nested-methods-2000": src("D = accum" + ".relu()" * 2000, "return D"),
    "unary-minus-10000": src("D = " + "-" * 10000 + "accum", "return D"),
    "invert-10000": src("D = " + "~" * 10000 + "(accum > 0.0)", "return D"),
    "not-10000": src("D = " + "not " * 10000 + "accum", "return D"),
    "sum-200-terms": src("D = " + " + ".join(["accum"] * 200), "return D"),
    "sum-20000-terms": src("D = " + " + ".join(["accum"] * 20000), "return D"),
    "power-tower-3000": src("D = " + " ** ".join(["accum"] * 3000), "return D"),
    "comparison-chain-5000": src("D = " + " < ".join(["accum"] * 5000), "return D"),
    "where-nest-300": src("D = " + "where(accum > 0.0, " * 300 + "accum" + ", 1.0)" * 300, "return D"),
    "list-nest-1000": src("D = " + "[" * 1000 + "accum" + "]" * 1000, "return D"),
    "statements-3000": src("t0 = accum", *[f"t{i} = t{i - 1} + 1.0" for i in range(1, 3000)], "D = t2999", "return D"),
    "statements-times-one-3000": src("t0 = accum", *[f"t{i} = t{i - 1} * 1.0" for i in range(1, 3000)], "D = t2999", "return D"),
    "parameters-300": src("D = accum + " + " + ".join(f"p{i}" for i in range(300)), "return D",
                          params="accum, " + ", ".join(f"p{i}" for i in range(300))),
    "outputs-200": src(*[f"o{i} = accum * {i}.0" for i in range(200)], "return " + ", ".join(f"o{i}" for i in range(200))),
    "long-name": src(f"{'x' * 5000} = accum", f"return {'x' * 5000}"),
    "long-literal": src("D = accum * " + "1" * 4000, "return D"),
    "huge-literal-digits": src("D = accum * 1" + "0" * 5000, "return D"),
    "long-line-of-literals": src("D = accum + " + " + ".join(["1.0"] * 3000), "return D"),
    "over-the-size-limit": src("D = accum", "return D") + "#" * 200_000,
}
SMALL_ENOUGH_TO_RUN = {"parentheses-50", "nested-calls-150", "sum-200-terms", "statements-3000",
                       "statements-times-one-3000", "where-nest-300", "parameters-300", "outputs-200",
                       "long-name", "long-line-of-literals", "nested-methods-2000", "unary-minus-10000",
                       "invert-10000", "power-tower-3000", "comparison-chain-5000", "sum-20000-terms"}


@pytest.mark.parametrize("case_id", sorted(BIG_SOURCES))
def test_big_sources_fail_cleanly_or_work(case_id, device):
    source = BIG_SOURCES[case_id]
    start = time.perf_counter()
    try:
        program = parse(source)
    except EpilogueError as error:
        assert "RecursionError" not in str(error)
        assert time.perf_counter() - start < 10
        return
    tensors = {name: torch.empty(2, 3, device=device) for name, _ in program.outputs}
    tensors.update({p: 1.0 for p in program.operands})
    A, B = ints(2, 4, device=device), ints(4, 3, device=device)
    try:
        args = GemmArguments(A, B, epilogue=EpilogueArguments(source, **tensors))
    except EpilogueError:
        return
    if case_id in SMALL_ENOUGH_TO_RUN:
        refs = reference_outputs(args)
        for kernel in epifuse.get_kernels(args):
            kernel.run(args)
            for name, ref in refs.items():
                assert_same(args.outputs[name], ref, (case_id, kernel, name))
    assert time.perf_counter() - start < 120, "too slow"


_SMALL_STACK_SCRIPT = """
import sys, threading
from epifuse import EpilogueError
from epifuse.frontend import parse
sources = {sources!r}
results = []

def work():
    for case_id, source in sources.items():
        try:
            parse(source)
            results.append("parsed")
        except EpilogueError:
            results.append("rejected")
        except BaseException as error:
            results.append(case_id + ": " + repr(error))

threading.stack_size(256 * 1024)
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(results)
sys.exit(0 if all(r in ("parsed", "rejected") for r in results) else 1)
"""


def test_nesting_in_a_thread_with_a_small_stack():
    """Threads may have small C stacks (256 KiB here), where CPython's parser crashes the process
    on a few thousand nested operators before raising anything: epifuse must refuse such
    sources first. Run in a subprocess, so that a crash fails this test, not the whole run."""
    wanted = ["parentheses-5000", "nested-calls-3000", "nested-methods-2000", "unary-minus-10000",
              "invert-10000", "not-10000", "list-nest-1000", "sum-20000-terms", "power-tower-3000",
              "where-nest-300", "comparison-chain-5000"]
    result = run_python(_SMALL_STACK_SCRIPT.format(sources={k: BIG_SOURCES[k] for k in wanted}), timeout=300)
    assert result.returncode == 0, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])


# ---- names --------------------------------------------------------------------------------------

# The generator's own identifiers, Triton's, and Python builtins: all fine as user names.
COLLIDING_NAMES = ["tl", "triton", "acc", "acc_e", "mask", "mask_m", "mask_n", "rm", "rn", "rk", "pid",
                   "pid_l", "pid_m", "pid_n", "pid_en", "offs_m", "offs_en", "v0", "v1", "v2", "x0", "x1",
                   "x0_ptr", "x0_sm", "y0", "y1", "y0_ptr", "r_y0", "a_ptr", "b_ptr", "a", "b", "k",
                   "M", "N", "K", "L", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "EVEN_K", "EVEN_M", "EVEN_N", "UPCAST",
                   "PRECISION", "EPI_N", "NUM_SMS", "_INF", "_NAN", "_pow", "_clamp", "_max_nan",
                   "_sigmoid", "epifuse_kernel", "libdevice", "math", "os", "sys", "self", "cls",
                   "print", "len", "range", "float", "int", "str", "type", "match", "case", "_",
                   "max", "min", "sum", "abs", "where", "exp", "Tensor", "x0_desc", "batch", "tile_id"]


@pytest.mark.parametrize("i", range(len(COLLIDING_NAMES)), ids=COLLIDING_NAMES)
def test_colliding_names_work_as_operands_temporaries_and_outputs(i, device):
    """Each name once as an operand, once as a temporary, once as an output (with its neighbours)."""
    names = COLLIDING_NAMES
    operand, temporary, output = names[i], names[(i + 1) % len(names)], names[(i + 2) % len(names)]
    source = src(f"{temporary} = relu(accum * {operand}) + {operand}", f"{output} = {temporary} - 1.0",
                 f"return {output}", params=f"accum, {operand}")
    run_all_kernels(source, device, **{operand: ints(N, device=device)})


def test_an_operand_named_like_an_op_is_a_value_not_a_function(device):
    run_all_kernels(src("D = accum * relu + sum", "return D", params="accum, relu, sum"), device,
                    relu=2.0, sum=ints(N, device=device))
    with pytest.raises(EpilogueError, match="'relu' is a value of the epilogue, not a function."):
        parse(src("D = relu(accum)", "return D", params="accum, relu"))


def test_an_operand_named_like_a_module_prefix_is_a_clear_error():
    with pytest.raises(EpilogueError):
        parse(src("D = torch.relu(accum)", "return D", params="accum, torch"))


@pytest.mark.parametrize("name", ["accumulate", "deterministic", "compute_dtype"])
def test_names_of_options_cannot_be_operands_or_outputs(name):
    with pytest.raises(EpilogueError, match=f"The name '{name}' cannot be an operand or output"):
        parse(src(f"D = accum * {name}", "return D", params=f"accum, {name}"))
    with pytest.raises(EpilogueError, match=f"The name '{name}' cannot be an operand or output"):
        parse(src(f"{name} = accum * 2.0", f"return {name}"))
    parse(src(f"{name} = accum * 2.0", f"D = {name}", "return D"))  # a temporary is fine


@pytest.mark.parametrize("source, accepted", [
    (src("é = accum", "return é"), False),                  # non-ASCII identifiers are refused
    (src("变量 = accum", "return 变量"), False),
    (src("а = accum", "return а"), False),                   # Cyrillic a, looks like ASCII a
    (src("D = accum * α", "return D", params="accum, α"), False),
    (src("D = accum\u200b", "return D"), False),             # a zero-width space
    (src("D = ｒｅｌｕ(accum)", "return D"), True),          # NFKC: Python reads relu
    (src("𝐃 = accum * 2.0", "return D"), True),              # NFKC: Python reads D
    (src("D = accum  # café ☕", "return D"), True),          # comments and docstrings may be anything
    (src('"""Ünïcödé docstring ☃"""', "D = accum", "return D"), True),
    ("def epi(accum):\r\n    D = accum * 2.0\r\n    return D\r\n", True),   # CRLF
    ("def epi(accum):\r    D = accum * 2.0\r    return D\r", True),         # old Mac line ends
    ("def epi(accum):\n\tD = accum * 2.0\n\treturn D\n", True),             # tabs
    ("def epi(accum):\n    D = accum\n\treturn D\n", False),                # mixed indentation
    (src("D = accum", "'doc\u2028string'", "return D"), False),             # a docstring only if first
    (src("'doc\u2028string'", "D = accum", "return D"), True),              # \u2028 is not a line break
])
def test_unicode_and_line_ends(source, accepted, device):
    if accepted:
        names = parse(source)
        run_all_kernels(source, device, **{n: torch.empty(M, N, device=device) for n, _ in names.outputs})
    else:
        with pytest.raises(EpilogueError):
            parse(source)


def test_a_form_feed_does_not_end_a_comment():
    """Python reads `# x\\x0c D = ...` as one comment; so must epifuse (or it would see code
    that the function, called eagerly, never runs)."""
    with pytest.raises(EpilogueError, match="Variable 'D' is not defined."):
        parse("def epi(accum):\n    # note\x0c    D = accum * 2.0\n    return D\n")


# ---- generated code holds only generated identifiers ----------------------------------------------

def _kernel_files(key: str) -> list:
    return sorted(cache_dir().glob(f"*{key}*.py"))


def test_generated_source_holds_none_of_the_users_names(device):
    names = ["zqSecretOperand", "zqSecretTemp", "zqSecretOut", "zqSecretRow", "zqSecretRed"]
    source = ("def zqSecretFunction(accum, zqSecretOperand, zqSecretRow):\n"
              "    '''zqSecretDocstring'''\n"
              "    # zqSecretComment\n"
              "    zqSecretTemp = relu(accum * zqSecretOperand) + zqSecretRow * 1.25\n"
              "    zqSecretOut = torch.abs(zqSecretTemp)\n"
              "    zqSecretRed = sum(zqSecretTemp, dim=1)\n"
              "    return zqSecretOut, zqSecretRed\n")
    args = run_all_kernels(source, device, zqSecretOperand=ints(M, N, device=device), zqSecretRow=2.5,
                           zqSecretRed=torch.empty(M, device=device))
    files = _kernel_files(args.key)
    assert files, f"no kernel file for {args.key} in {cache_dir()}"
    for path in files:
        text = path.read_text()
        assert "zq" not in text.lower(), (path, [n for n in names if n in text])
        assert "Secret" not in text
        tokens = tokenize.generate_tokens(io.StringIO(text).readline)
        identifiers = {t.string for t in tokens if t.type == tokenize.NAME}
        assert all(IDENTIFIER.match(i) for i in identifiers)
        assert not identifiers & {"epi", "zqSecretFunction", *names}
    # the same epilogue under other names is the same kernel, byte for byte
    renamed = re.sub(r"zqSecret(\w+)", lambda m: f"other{m.group(1)}", source)
    other = GemmArguments(ints(M, K, device=device), ints(K, N, device=device),
                          epilogue=EpilogueArguments(renamed, otherOperand=ints(M, N, device=device),
                                                     otherRow=2.5, otherOut=torch.empty(M, N, device=device),
                                                     otherRed=torch.empty(M, device=device)))
    assert other.key == args.key


def test_parsing_never_imports_or_opens(monkeypatch, tmp_path):
    """A spy on the import machinery and open(): parsing hostile sources calls neither."""
    import builtins
    calls = []
    real_import, real_open = builtins.__import__, builtins.open

    def spy_import(name, *a, **k):
        if name in ("os", "subprocess", "shutil", "socket"):
            calls.append(("import", name))
        return real_import(name, *a, **k)

    def spy_open(file, *a, **k):
        if "MARKER" in str(file):
            calls.append(("open", file))
        return real_open(file, *a, **k)

    monkeypatch.setattr(builtins, "__import__", spy_import)
    monkeypatch.setattr(builtins, "open", spy_open)
    for _, source in hostile_sources(tmp_path / "MARKER"):
        try:
            parse(source + "\n")
        except EpilogueError:
            pass
    monkeypatch.undo()
    assert calls == []
