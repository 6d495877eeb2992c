"""The generated tiled kernel end to end: operand roles, ragged tiles, batches, layouts, dtypes.

On CPU these run through Triton's interpreter (32-wide tiles, so 100x72x50 leaves ragged
edges in M, N and K); the same tests run on the GPU with `-m gpu` via test_gpu.py. Integer-
valued inputs make the float32 result exact, so most checks are equality.
"""
import os

import numpy
import pytest
import torch

import epifuse
from epifuse.ops import gelu, relu, sigmoid, silu
from helpers import integer_tensor, reference_outputs, rel_error

M, N, K = 100, 72, 50


def run_checked(A, B, source, exact=True, tol=1e-6, **tensors):
    """Run every Triton kernel that takes these arguments (the persistent TMA one where the
    layout allows, the tiled one always); compare every output with the float64 reference."""
    epi = epifuse.EpilogueArguments(source, **tensors)
    args = epifuse.GemmArguments(A, B, epilogue=epi, precision="highest")
    kernels = [k for k in epifuse.get_kernels(args) if k.name != "reference"]
    assert any(k.name == "triton_tiled" for k in kernels), epifuse.kernel_statuses(args)
    refs = reference_outputs(args)
    for kernel in kernels:
        for dest in args.outputs.values():
            dest.fill_(float("nan"))  # poison: every element must be written
        kernel.run(args)
        for name, ref in refs.items():
            out = args.outputs[name]
            expected = ref.to(out.dtype)
            if exact:
                assert torch.equal(out, expected), (kernel, name, (out.double() - ref).abs().max())
            else:
                assert rel_error(out, ref) < tol, (kernel, name, rel_error(out, ref))
    return args


def ints(*shape, device, dtype=torch.float16):
    return integer_tensor(*shape, device=device, dtype=dtype)


ROLE_CASES = {
    "scalar_number": (lambda d: 3.0),
    "scalar_tensor_0d": (lambda d: torch.tensor(-2.0, device=d)),
    "scalar_tensor_1elem": (lambda d: torch.tensor([2.0], device=d)),
    "row_N": (lambda d: ints(N, device=d, dtype=torch.float32)),
    "row_1N": (lambda d: ints(1, N, device=d, dtype=torch.float32)),
    "col_M1": (lambda d: ints(M, 1, device=d, dtype=torch.float32)),
    "tile_MN": (lambda d: ints(M, N, device=d, dtype=torch.float32)),
    "tile_fp16": (lambda d: ints(M, N, device=d, dtype=torch.float16)),
    "tile_bf16": (lambda d: ints(M, N, device=d, dtype=torch.bfloat16)),
}


@pytest.mark.parametrize("role", sorted(ROLE_CASES))
def test_operand_roles(role, device):
    A, B = ints(M, K, device=device), ints(K, N, device=device)
    X = ROLE_CASES[role](device)
    D = torch.empty(M, N, device=device)
    run_checked(A, B, "def epi(accum, X):\n    D = accum * X + X\n    return D\n", X=X, D=D)


BATCHED_ROLES = {
    "row_L1N": lambda d: ints(2, 1, N, device=d, dtype=torch.float32),
    "col_LM1": lambda d: ints(2, M, 1, device=d, dtype=torch.float32),
    "tile_LMN": lambda d: ints(2, M, N, device=d, dtype=torch.float32),
    "tile_MN_shared": lambda d: ints(M, N, device=d, dtype=torch.float32),
    "batch_scalar_L11": lambda d: ints(2, 1, 1, device=d, dtype=torch.float32),
    "row_N_shared": lambda d: ints(N, device=d, dtype=torch.float32),
    "number": lambda d: -1.5,
}


@pytest.mark.parametrize("role", sorted(BATCHED_ROLES))
def test_batched_operand_roles(role, device):
    A, B = ints(2, M, K, device=device), ints(2, K, N, device=device)
    X = BATCHED_ROLES[role](device)
    D = torch.empty(2, M, N, device=device)
    run_checked(A, B, "def epi(accum, X):\n    D = accum - X * 2.0\n    return D\n", X=X, D=D)


def test_batched_with_shared_operand_matrix(device):
    """A 2-D B is shared across the batch of A (batch stride 0)."""
    A, B = ints(2, M, K, device=device), ints(K, N, device=device)
    D = torch.empty(2, M, N, device=device)
    run_checked(A, B, "def epi(accum):\n    D = accum\n    return D\n", D=D)


LAYOUTS = {
    "row_major": lambda t: t,
    "column_major": lambda t: t.t().contiguous().t(),
    "sliced": lambda t: torch.cat([t, t], dim=1)[:, : t.shape[1]],
    "strided_rows": lambda t: torch.stack([t, t], dim=1).reshape(-1, t.shape[1])[::2],
}


@pytest.mark.parametrize("layout_a", sorted(LAYOUTS))
@pytest.mark.parametrize("layout_c", ["row_major", "column_major", "sliced"])
def test_strided_inputs_and_operands(layout_a, layout_c, device):
    A = LAYOUTS[layout_a](ints(M, K, device=device))
    B = LAYOUTS["column_major"](ints(K, N, device=device))
    C = LAYOUTS[layout_c](ints(M, N, device=device, dtype=torch.float32))
    D = LAYOUTS[layout_c](torch.empty(M, N, device=device))
    run_checked(A, B, "def epi(accum, C):\n    D = accum + C\n    return D\n", C=C, D=D)


def test_transposed_views(device):
    A = ints(K, M, device=device).t()
    B = ints(N, K, device=device).t()
    D = torch.empty(N, M, device=device).t()
    run_checked(A, B, "def epi(accum):\n    D = accum * 2.0\n    return D\n", D=D)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes(in_dtype, out_dtype, device):
    A, B = ints(M, K, device=device, dtype=in_dtype), ints(K, N, device=device, dtype=in_dtype)
    C = ints(M, N, device=device, dtype=torch.float32)
    D = torch.empty(M, N, device=device, dtype=out_dtype)
    # integer results stay exact in every output dtype up to 256 (bf16's integer limit)
    run_checked(A, B, "def epi(accum, C):\n    D = clamp(accum + C, -256.0, 256.0)\n    return D\n",
                C=C, D=D)


def test_bf16_output_rounding(device):
    """Non-integer bf16 outputs: exact on the GPU; the interpreter truncates, so a tolerance there."""
    A, B = torch.randn(M, K, device=device), torch.randn(K, N, device=device)
    D = torch.empty(M, N, device=device, dtype=torch.bfloat16)
    run_checked(A, B, "def epi(accum):\n    D = accum * 0.3\n    return D\n", exact=False, tol=1e-2, D=D)


def test_several_outputs_in_their_own_dtypes(device):
    A, B = ints(M, K, device=device), ints(K, N, device=device)
    C = ints(M, N, device=device, dtype=torch.float32)
    D = torch.empty(M, N, device=device, dtype=torch.float16)
    F = torch.empty(M, N, device=device, dtype=torch.float32)
    G = torch.empty(M, N, device=device, dtype=torch.bfloat16)
    src = ("def epi(accum, C, alpha):\n    F = accum * alpha + C * 2.0\n    D = relu(F)\n"
           "    G = where(F > 0, F, -F)\n    return D, F, G\n")
    run_checked(A, B, src, C=C, alpha=2.0, D=D, F=F, G=G)


def test_return_accum(device):
    A, B = ints(M, K, device=device), ints(K, N, device=device)
    D = torch.empty(M, N, device=device)
    acc = torch.empty(M, N, device=device)
    src = "def epi(accum, alpha):\n    D = relu(accum) * alpha\n    return D, accum\n"
    run_checked(A, B, src, alpha=0.5, D=D, accum=acc)


def test_function_epilogue_and_gemm_convenience(device):
    def relu_aux_store(accum, alpha, C):
        F = (accum * alpha) + (C * 2.0)
        D = relu(F)
        return D, F

    A, B = ints(M, K, device=device), ints(K, N, device=device)
    C = ints(M, N, device=device)
    D, F = epifuse.gemm(A, B, relu_aux_store, alpha=3.0, C=C)
    assert D.dtype == torch.float16 and D.shape == (M, N)
    acc = A.double() @ B.double()
    Fr = acc * 3.0 + C.double() * 2.0
    assert torch.equal(F, Fr.half()) and torch.equal(D, torch.relu(Fr).half())
    # the epilogue function is its own eager reference
    D2, F2 = relu_aux_store(acc, 3.0, C.double())
    assert torch.equal(D, D2.half()) and torch.equal(F, F2.half())


def test_scalar_tensor_read_at_run_time(device):
    """A one-element tensor operand is read by the kernel, so changing it needs no rebuild."""
    A, B = ints(M, K, device=device), ints(K, N, device=device)
    alpha = torch.tensor([2.0], device=device)
    src = "def epi(accum, alpha):\n    D = accum * alpha\n    return D\n"
    first = epifuse.gemm(A, B, src, alpha=alpha, out_dtype=torch.float32)
    alpha.fill_(-1.0)
    second = epifuse.gemm(A, B, src, alpha=alpha, out_dtype=torch.float32)
    assert torch.equal(first, -2.0 * second)


def test_repeated_run_reuses_parse_bind_and_codegen(device, monkeypatch):
    from epifuse import arguments, frontend
    from epifuse.backends.triton import source
    src = "def epi(accum, beta):\n    D = accum + beta\n    return D\n"
    A, B = ints(M, K, device=device), ints(K, N, device=device)
    epifuse.gemm(A, B, src, beta=1.0)
    calls = {"parse": 0, "bind": 0, "emit": 0}

    def counting(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(frontend, "parse_source", counting("parse", frontend.parse_source))
    monkeypatch.setattr(arguments, "bind", counting("bind", arguments.bind))
    monkeypatch.setattr(source, "render", counting("emit", source.render))
    epifuse.gemm(A, B, src, beta=2.0)
    assert calls == {"parse": 0, "bind": 0, "emit": 0}


def test_zero_sized_problems(device):
    src = "def epi(accum, C):\n    D = accum + C\n    return D\n"
    A, B = ints(0, K, device=device), ints(K, N, device=device)
    D = epifuse.gemm(A, B, src, C=torch.ones(N, device=device))
    assert D.shape == (0, N)
    # K = 0: accum is zero and the epilogue still runs
    A, B = ints(M, 0, device=device), ints(0, N, device=device)
    D = epifuse.gemm(A, B, src, C=torch.ones(N, device=device), out_dtype=torch.float32)
    assert torch.equal(D, torch.ones(M, N, device=device))


def test_sigmoid_gelu_mix_relative_error(device):
    A, B = torch.randn(M, K, device=device), torch.randn(K, N, device=device) / K ** 0.5
    bias = torch.randn(N, device=device)
    D = torch.empty(M, N, device=device)
    src = ("def epi(accum, bias):\n    f = accum + bias\n"
           "    D = gelu(f, approximate='tanh') * sigmoid(f) + F.silu(f)\n    return D\n")
    run_checked(A, B, src, exact=False, tol=1e-5, bias=bias, D=D)


def _log_of_clamped_values(device, M, N):
    """log(clamp(x, 2**-125, 2**125)) over values spread across every binade, against float64:
    the Triton backend lowers it to its special-case-free polynomial (rules.LOG_OF_NORMAL)."""
    from epifuse.backends.triton.rules import LOG_OF_NORMAL, rule_for
    src = "def epi(accum, C):\n    D = log(clamp(accum * C, 2.0 ** -125, 2.0 ** 125))\n    return D\n"
    args = epifuse.GemmArguments(torch.ones(M, 1, device=device), torch.ones(1, N, device=device),
                                 epilogue=epifuse.EpilogueArguments(src, C=torch.ones(M, N, device=device),
                                                                    D=torch.empty(M, N, device=device)))
    assert [rule_for(n) for n in args.graph.nodes() if n.op.name == "log"] == [LOG_OF_NORMAL]
    exponents = torch.randint(-125, 125, (M, N), dtype=torch.float64)
    C = (torch.rand(M, N, dtype=torch.float64) + 1.0) * torch.exp2(exponents)
    C = C.float()
    C[0, :8] = torch.tensor([1.0, 2.0 ** -125, 2.0 ** 125, 1.0 - 2.0 ** -24, 1.0 + 2.0 ** -23, 2 / 3, 4 / 3, 0.75])
    C[0, 8] = float("nan")
    D = epifuse.gemm(torch.ones(M, 1, device=device), torch.ones(1, N, device=device), src, C=C.to(device))
    exact = torch.log(C.double())
    ulp = torch.from_numpy(numpy.spacing(exact.abs().float().numpy())).double()
    error = ((D.double().cpu() - exact).abs() / ulp)
    assert D[0, 8].isnan() and D[0, 0] == 0.0
    error[0, 8] = 0.0
    assert error.max() <= 1.5, error.max()   # within 1.04 ulp without fma (numpy), 0.92 with


@pytest.mark.parametrize("text,flushed", [
    ("1.0 + exp(accum)", True),
    ("exp(accum * 2.0) + 3.0", True),
    ("exp(accum) + 1e-35", False),        # a subnormal would not round away
    ("accum + exp(accum)", False),
    ("exp(accum)", False),
])
def test_exp_added_to_a_number_flushes_subnormal_results(text, flushed):
    """c + exp(y) with |c| >= 2**-100 lowers the exp to one that flushes subnormal results
    (rules.ADD_EXP_FLUSHED, whose CUDA helper is tl.exp2, i.e. ex2.approx.ftz): c plus a
    subnormal rounds to c, so the sum is the same, three instructions cheaper per element."""
    from epifuse.backends.triton.rules import ADD_EXP_FLUSHED, rule_for
    from epifuse.backends.triton.source import SourceSpec, render
    from epifuse.passes import optimize
    from frontend_helpers import body, bound
    graph = optimize(bound(body(text)))
    rules = [rule_for(n) for n in graph.nodes() if n.op.name == "add"]
    assert any(r in ADD_EXP_FLUSHED for r in rules) == flushed, rules
    cuda, interpreted = (render(SourceSpec("pointer", "tiled", zeroes=True), graph, "k", target, False)
                         for target in ("cuda", "interpret"))
    assert ("+ _exp_flushed(" in cuda) == flushed and ("+ _exp_flushed(" in interpreted) == flushed
    if flushed:  # the interpreter keeps tl.exp, which is exact there
        assert "return tl.exp2(x * 1.4426950408889634)" in cuda and "return tl.exp(x)" in interpreted


@pytest.mark.parametrize("text,flushed", [
    ("exp(clamp(accum, -80.0, 80.0))", True),
    ("exp(maximum(accum, -87.0))", True),
    ("exp(clamp(accum, -90.0, 0.0))", False),   # exp(-90) is subnormal
    ("exp(minimum(accum, 0.0))", False),
])
def test_exp_whose_results_are_normal_flushes(text, flushed):
    """An exp whose argument's bounds keep every result a normal number lowers to the exp that
    flushes subnormal results (rules.EXP_FLUSHED): there are none to flush."""
    from epifuse.backends.triton.rules import EXP_FLUSHED, rule_for
    from epifuse.passes import optimize
    from frontend_helpers import body, bound
    graph = optimize(bound(body(text)))
    assert [rule_for(n) is EXP_FLUSHED for n in graph.nodes() if n.op.name == "exp"] == [flushed]


def test_value_bounds_of_deep_shared_chains_are_quick():
    """value_bounds bounds a node once per query: a chain where each step uses the one before
    twice (as minimum and maximum operands) would otherwise take 2**depth steps."""
    import time
    from epifuse.backends.triton.rules import rule_for, value_bounds
    from epifuse.passes import optimize
    from frontend_helpers import bound
    lines = "".join(f"    x{i + 1} = minimum(clamp(x{i}, -1.0, 1.0), maximum(x{i}, 0.0))\n" for i in range(22))
    graph = optimize(bound(f"def epi(accum):\n    x0 = accum\n{lines}    D = exp(x22)\n    return D\n"))
    start = time.perf_counter()
    exp = next(n for n in graph.nodes() if n.op.name == "exp")
    rule_for(exp)
    assert value_bounds(exp.src[0]) == (-1.0, 1.0)
    assert time.perf_counter() - start < 1.0


def test_log1p_of_a_bounded_excess_within_an_ulp(device):
    """log1p(clamp(x, 2**-100, 2**100)) lowers to _log1p_of_excess (rules.LOG1P_OF_EXCESS: the
    log of normal numbers, plus the rounding of 1 + x) and stays within an ulp or two of float64
    across the range, near 0 included."""
    from epifuse.backends.triton.rules import LOG1P_OF_EXCESS, rule_for
    M, N = 32, 40
    src = "def epi(accum, C):\n    D = log1p(clamp(accum * C, 2.0 ** -100, 2.0 ** 100))\n    return D\n"
    args = epifuse.GemmArguments(torch.ones(M, 1, device=device), torch.ones(1, N, device=device),
                                 epilogue=epifuse.EpilogueArguments(src, C=torch.ones(M, N, device=device),
                                                                    D=torch.empty(M, N, device=device)))
    assert [rule_for(n) for n in args.graph.nodes() if n.op.name == "log1p"] == [LOG1P_OF_EXCESS]
    C = ((torch.rand(M, N, dtype=torch.float64) + 1.0)
         * torch.exp2(torch.randint(-100, 100, (M, N), dtype=torch.float64))).float()
    C[0, :6] = torch.tensor([2.0 ** -100, 2.0 ** -24, 2.0 ** -23, 0.5, 1.0, 2.0 ** 100])
    D = epifuse.gemm(torch.ones(M, 1, device=device), torch.ones(1, N, device=device), src, C=C.to(device))
    exact = torch.log1p(C.double())
    ulp = torch.from_numpy(numpy.spacing(exact.abs().float().numpy())).double()
    assert ((D.double().cpu() - exact).abs() / ulp).max() <= 2.0


def test_negation_flips_the_sign_of_zero(device):
    """-x negates as torch does, -(+0.0) being -0.0, where Triton's unary minus (0 - x) gives
    +0.0; the rule multiplies by -1.0, which the CUDA compiler folds into the next operation."""
    A, B = ints(M, K, device=device), ints(K, N, device=device)
    C = torch.where(torch.rand(M, N, device=device) < 0.5, 0.0, ints(M, N, device=device, dtype=torch.float32))
    epi = epifuse.EpilogueArguments("def epi(accum, C):\n    D = -(accum * C)\n    return D\n",
                                    C=C, D=torch.empty(M, N, device=device))
    args = epifuse.GemmArguments(A, B, epilogue=epi, precision="highest")
    expected = reference_outputs(args)["D"].float()
    assert torch.signbit(expected).any() and (~torch.signbit(expected[expected == 0])).any()
    for kernel in (k for k in epifuse.get_kernels(args) if k.name != "reference"):
        args.outputs["D"].fill_(float("nan"))
        kernel.run(args)
        assert torch.equal(args.outputs["D"], expected), kernel
        assert torch.equal(torch.signbit(args.outputs["D"]), torch.signbit(expected)), kernel


def test_log_sigmoid_of_large_values_is_positive_zero(device):
    """log(sigmoid(x)) is rewritten to 0 - softplus(-x), which is +0.0 where softplus(-x)
    underflows (x > ~104), as torch's log(sigmoid(x)) = log(1.0) is; -softplus(-x) gave -0.0."""
    A = integer_tensor(M, K, low=3, high=6, device=device)
    B = integer_tensor(K, N, low=1, high=3, device=device)
    epi = epifuse.EpilogueArguments("def epi(accum):\n    D = log(sigmoid(accum))\n    return D\n",
                                    D=torch.empty(M, N, device=device))
    args = epifuse.GemmArguments(A, B, epilogue=epi, precision="highest")
    assert ((A.double() @ B.double()) > 110).all()
    for kernel in (k for k in epifuse.get_kernels(args) if k.name != "reference"):
        args.outputs["D"].fill_(float("nan"))
        kernel.run(args)
        assert torch.equal(args.outputs["D"], torch.zeros(M, N, device=device)), kernel
        assert not torch.signbit(args.outputs["D"]).any(), kernel


@pytest.mark.parametrize("text,bounds", [
    ("clamp(accum, 0.001, 1.0)", (0.001, 1.0)),
    ("clamp(accum, min=0.001)", (0.001, float("inf"))),
    ("clamp(accum, 2.0, 1.0)", (1.0, 1.0)),                       # min > max gives max, as torch
    ("clamp(accum, 1.0 - 0.999, 1.0 - 0.001)", (0.001, 0.999)),   # folded to minimum / maximum
    ("maximum(minimum(accum, 2.0), 0.5)", (0.5, 2.0)),
    ("clamp(accum * 2.0, 0.5, 2.0) * 2.0", (-float("inf"), float("inf"))),
])
def test_value_bounds(text, bounds):
    from epifuse.backends.triton.rules import value_bounds
    from epifuse.passes import optimize
    from frontend_helpers import body, bound, output_node
    low, high = value_bounds(output_node(optimize(bound(body(text)))))
    assert low == pytest.approx(bounds[0]) and high == pytest.approx(bounds[1])


def test_log_of_clamped_values_within_an_ulp(device):
    _log_of_clamped_values(device, 48, 40)


def test_an_epilogue_function_is_its_own_reference(device):
    """The same mix written as a function of epifuse.ops: called on torch tensors it is the
    reference of the kernel it compiles to."""
    def mix(accum, bias):
        f = accum + bias
        D = gelu(f, approximate="tanh") * sigmoid(f) + silu(f)
        return D

    A, B = torch.randn(M, K, device=device), torch.randn(K, N, device=device) / K ** 0.5
    bias = torch.randn(N, device=device)
    D = epifuse.gemm(A, B, mix, bias=bias, precision="highest")
    assert rel_error(D, mix(A.double() @ B.double(), bias.double())) < 1e-5


def test_persistent_kernel_takes_aligned_layouts_and_says_why_not(device):
    """TMA needs a contiguous K in A, B contiguous along N or K, and 16-byte alignment."""
    src = "def epi(accum, C):\n    D = accum + C\n    return D\n"

    def statuses(A, B):
        C = ints(A.shape[0], B.shape[1], device=device, dtype=torch.float32)
        D = torch.empty(A.shape[0], B.shape[1], device=device)
        args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, C=C, D=D))
        return {k.name: s for k, s in epifuse.kernel_statuses(args)}

    aligned = statuses(ints(64, 48, device=device), ints(48, 40, device=device))
    assert aligned["triton_persistent"].ok
    k_major_b = statuses(ints(64, 48, device=device), ints(40, 48, device=device).t())
    assert k_major_b["triton_persistent"].ok
    ragged_k = statuses(ints(64, 50, device=device), ints(50, 40, device=device))
    assert not ragged_k["triton_persistent"].ok and "16 bytes" in ragged_k["triton_persistent"].reason
    column_major_a = statuses(ints(48, 64, device=device).t(), ints(48, 40, device=device))
    assert "A's last dimension" in column_major_a["triton_persistent"].reason
    assert column_major_a["triton_tiled"].ok


@pytest.mark.parametrize("batched_a,batched_b,k_major", [(True, True, False), (True, False, True),
                                                          (False, True, True), (True, True, True)])
def test_persistent_batched_layouts(batched_a, batched_b, k_major, device):
    L_, M_, N_, K_ = 2, 70, 40, 32
    A = ints(*((L_,) if batched_a else ()), M_, K_, device=device)
    B = ints(*((L_,) if batched_b else ()), N_, K_, device=device).transpose(-1, -2) if k_major else \
        ints(*((L_,) if batched_b else ()), K_, N_, device=device)
    D = torch.empty(L_ if (batched_a or batched_b) else 1, M_, N_, device=device)
    args = run_checked(A, B, "def epi(accum):\n    D = accum * 3.0\n    return D\n", D=D)
    assert epifuse.get_kernels(args)[0].name == "triton_persistent"


@pytest.mark.skipif(tuple(int(v) for v in __import__("numpy").__version__.split(".")[:2]) >= (2, 4),
                    reason="Triton 3.6's interpreter needs numpy < 2.4")
def test_cpu_kernels_work_when_triton_was_imported_before_the_interpreter_was_requested():
    """Triton decides compiled-or-interpreted for its own library functions at import; the
    generated kernels call none of them, so the order of imports does not matter."""
    import subprocess
    import sys
    code = ("import triton, torch, os\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "import epifuse\n"
            "A, B = torch.ones(40, 24), torch.ones(24, 36)\n"
            "r = epifuse.gemm(A, B, 'def e(accum):\\n    D = accum * 2.0\\n    s = sum(D, dim=1)\\n    return D, s\\n')\n"
            "assert float(r[0][0, 0]) == 48.0 and float(r[1][0]) == 48.0 * 36, r\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


@pytest.mark.parametrize("source,operand", [
    ("D = X", "number"), ("D = X", "scalar"), ("D = X * 2.0", "number"), ("D = X", "row"),
    ("D = accum + 1.0 / X", "number"), ("D = accum + 1.0 / X", "scalar"), ("D = accum + 1.0 / X", "tile"),
    ("D = 1.0 / tanh(X)", "tile"), ("D = 1.0 / (X * -1e-40)", "ones")])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_signed_zeros_keep_their_sign(source, operand, out_dtype, device):
    """-0.0 stays -0.0, so 1 / x is -inf as in torch: a number or one-element operand broadcast to
    the tile (added to +0.0, it became +0.0), tanh(-0.0), and a negative constant below fp32's
    normal range (the kernel source has it as a zero: -0.0, no longer +0.0)."""
    value = {"number": -0.0, "scalar": torch.tensor(-0.0, device=device),
             "row": torch.full((N,), -0.0, device=device),
             "tile": torch.where(torch.rand(M, N, device=device) < 0.5, -0.0, 0.0),
             "ones": ints(M, N, device=device, dtype=torch.float32).abs() + 1.0}[operand]
    A, B = ints(M, K, device=device), ints(K, N, device=device)
    epi = epifuse.EpilogueArguments(f"def epi(accum, X):\n    {source}\n    return D\n", X=value,
                                    D=torch.empty(M, N, device=device, dtype=out_dtype))
    args = epifuse.GemmArguments(A, B, epilogue=epi, precision="highest")
    expected = reference_outputs(args)["D"].to(out_dtype)
    assert torch.signbit(expected).any()
    bits = torch.int32 if out_dtype == torch.float32 else torch.int16
    for kernel in (k for k in epifuse.get_kernels(args) if k.name != "reference"):
        args.outputs["D"].fill_(float("nan"))
        kernel.run(args)
        assert torch.equal(args.outputs["D"].view(bits), expected.view(bits)), (kernel, args.outputs["D"].flatten()[:4])
