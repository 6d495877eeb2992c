"""GPU checks at realistic sizes (marker `gpu`): run with `pytest -m gpu` on the GPU machine.

Integer-valued inputs are checked exactly (bf16 and fp16 outputs included: on the GPU the
conversions round to nearest even); random inputs by relative error against float64.
"""
import math

import pytest
import torch

import epifuse
from epifuse.ops import OPS
from helpers import integer_tensor, reference_outputs, rel_error
from op_cases import ELEMENTWISE, source_for

pytestmark = pytest.mark.gpu

SIZES = [(1024, 1024, 1024), (1000, 744, 520), (64, 4096, 2048)]


def _run(A, B, src, **tensors):
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, **tensors))
    kernel = epifuse.get_kernels(args)[0]
    assert kernel.name != "reference", epifuse.kernel_statuses(args)
    for t in args.outputs.values():
        t.fill_(float("nan"))
    kernel.run(args)
    torch.cuda.synchronize()
    return args, reference_outputs(args)


@pytest.mark.parametrize("M,N,K", SIZES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_exact_multi_output(M, N, K, dtype):
    A = integer_tensor(M, K, dtype=dtype, device="cuda")
    B = integer_tensor(K, N, low=-1, high=2, dtype=dtype, device="cuda")
    C = integer_tensor(M, N, dtype=torch.float32, device="cuda")
    bias = integer_tensor(N, dtype=torch.float32, device="cuda")
    src = ("def epi(accum, alpha, C, bias):\n    F = accum * alpha + C * 2.0 + bias\n"
           "    D = clamp(relu(F), 0.0, 200.0)\n    return D, F\n")
    D = torch.empty(M, N, device="cuda", dtype=dtype)
    F = torch.empty(M, N, device="cuda", dtype=torch.float32)
    args, refs = _run(A, B, src, alpha=2.0, C=C, bias=bias, D=D, F=F)
    assert torch.equal(F, refs["F"].float())
    assert torch.equal(D, refs["D"].to(dtype))


# Ops whose result jumps where accum crosses C or 0: on random floats the GPU's fp32 accum and
# the float64 one fall on different sides now and then (eq failed so on 2026-11-23), so they
# run on integers, where both are exact and the check is equality.
DISCONTINUOUS = {n for n in ELEMENTWISE if OPS[n].kind in ("compare", "logical")} | {"sign", "where"}


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_every_op_large(name):
    M, N, K = 512, 384, 256
    D = torch.empty(M, N, device="cuda")
    if name in DISCONTINUOUS:
        A = integer_tensor(M, K, device="cuda")
        B = integer_tensor(K, N, low=-1, high=2, device="cuda")
        C = integer_tensor(M, N, low=-6, high=7, dtype=torch.float32, device="cuda")
        args, refs = _run(A, B, source_for(name), C=C, D=D)
        assert torch.equal(D.double(), refs["D"]), name
        return
    A = torch.randn(M, K, device="cuda", dtype=torch.float16) / math.sqrt(K)
    B = torch.randn(K, N, device="cuda", dtype=torch.float16)
    C = torch.rand(M, N, device="cuda") + 0.5
    args, refs = _run(A, B, source_for(name), C=C, D=D)
    tol = 2e-3 if name == "to" else 2e-5
    assert rel_error(D, refs["D"]) < tol, (name, rel_error(D, refs["D"]))
    assert name in OPS


def test_log_of_clamped_values_large():
    """The special-case-free log on the GPU (where its multiply-adds fuse), 2**18 values."""
    from test_kernels import _log_of_clamped_values
    _log_of_clamped_values("cuda", 512, 512)


def test_log1p_of_a_bounded_excess_on_the_gpu():
    """_log1p_of_excess compiled for the GPU (its multiply-adds fused), within an ulp or two."""
    from test_kernels import test_log1p_of_a_bounded_excess_within_an_ulp
    test_log1p_of_a_bounded_excess_within_an_ulp("cuda")


def test_batched_roles_large():
    L, M, N, K = 3, 640, 320, 256
    A = integer_tensor(L, M, K, device="cuda")
    B = integer_tensor(K, N, low=-1, high=2, device="cuda")
    row = integer_tensor(L, 1, N, dtype=torch.float32, device="cuda")
    col = integer_tensor(M, 1, dtype=torch.float32, device="cuda")
    per_batch = integer_tensor(L, 1, 1, dtype=torch.float32, device="cuda")
    D = torch.empty(L, M, N, device="cuda")
    src = "def epi(accum, row, col, s):\n    D = accum * s + row - col\n    return D\n"
    args, refs = _run(A, B, src, row=row, col=col, s=per_batch, D=D)
    assert torch.equal(D, refs["D"].float())


def test_fp32_inputs_tf32_and_highest():
    M, N, K = 768, 512, 1024
    A, B = torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda") / math.sqrt(K)
    ref = (A.double() @ B.double())
    tf32 = epifuse.gemm(A, B)
    full = epifuse.gemm(A, B, precision="highest")
    assert rel_error(full, ref) < 1e-5
    assert rel_error(tf32, ref) < 5e-3


def test_strided_views_large():
    M, N, K = 1536, 1024, 768
    A = integer_tensor(K, M, device="cuda").t()
    B = integer_tensor(N, K, low=-1, high=2, device="cuda").t()
    C = integer_tensor(2 * M, N, dtype=torch.float32, device="cuda")[::2]
    D = torch.empty(N, M, device="cuda").t()
    args, refs = _run(A, B, "def epi(accum, C):\n    D = accum - C\n    return D\n", C=C, D=D)
    assert torch.equal(D, refs["D"].float())


@pytest.mark.parametrize("kernel_index", [0, 1, -2])
def test_repeated_runs_take_the_direct_launch_and_see_new_data(kernel_index):
    """The second and later kernel.run(args) calls skip Triton's argument binding (a direct
    launch of the compiled kernel); each must still read the operands' current contents and
    write every output, including on a side stream."""
    M, N, K = 384, 512, 256
    A = integer_tensor(M, K, dtype=torch.float16, device="cuda")
    B = integer_tensor(K, N, low=-1, high=2, dtype=torch.float16, device="cuda")
    bias = integer_tensor(N, dtype=torch.float32, device="cuda")
    D = torch.empty(M, N, device="cuda", dtype=torch.float32)
    F = torch.empty(M, N, device="cuda", dtype=torch.float16)
    src = "def epi(accum, bias):\n    F = accum + bias\n    D = relu(F) * 2.0\n    return D, F\n"
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, bias=bias, D=D, F=F))
    kernel = epifuse.get_kernels(args)[kernel_index]
    assert kernel.name != "reference"
    stream = torch.cuda.Stream()
    for step in range(4):
        A.copy_(integer_tensor(M, K, dtype=torch.float16, device="cuda"))
        bias.copy_(integer_tensor(N, dtype=torch.float32, device="cuda"))
        D.fill_(float("nan"))
        F.fill_(float("nan"))
        stream.wait_stream(torch.cuda.current_stream())   # the copies and fills above
        with torch.cuda.stream(stream if step % 2 else torch.cuda.current_stream()):
            kernel.run(args)
        torch.cuda.synchronize()
        expected = reference_outputs(args)
        assert torch.equal(D.double(), expected["D"]), (kernel, step)
        assert torch.equal(F.double(), expected["F"]), (kernel, step)
    assert args._plans[kernel].fast is not None, "the direct launch was not taken"


def test_repeated_gemm_calls_reuse_the_launch_with_new_tensors():
    """epifuse.gemm's kept launch (epifuse.callsite) on the GPU kernels: new inputs, fresh
    outputs, a side stream, every call exact."""
    from epifuse.runtime import callsite
    src = "def epi(accum, bias, C):\n    F = accum + bias\n    D = relu(F) + C\n    return D, F\n"
    M, N, K = 640, 384, 512
    B = integer_tensor(K, N, low=-1, high=2, dtype=torch.bfloat16, device="cuda")
    hits = callsite.HITS[0]
    stream = torch.cuda.Stream()
    for step in range(5):
        A = integer_tensor(M, K, dtype=torch.bfloat16, device="cuda")
        bias = integer_tensor(N, dtype=torch.float32, device="cuda")
        C = integer_tensor(M, N, dtype=torch.float16, device="cuda")
        stream.wait_stream(torch.cuda.current_stream())   # A, bias, C were made there
        with torch.cuda.stream(stream if step % 2 else torch.cuda.current_stream()):
            D, F = epifuse.gemm(A, B, src, bias=bias, C=C)
        torch.cuda.synchronize()
        accum = A.double() @ B.double()
        assert torch.equal(F.double(), accum + bias.double()), step
        assert torch.equal(D.double(), torch.relu(accum + bias.double()) + C.double()), step
    assert callsite.HITS[0] - hits == 3   # the first call on each of the two streams is a full one


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tensors_on_a_gpu_that_is_not_the_current_one():
    """Tensors on cuda:1 while cuda:0 is current: every kernel compiles, loads and launches on
    cuda:1 (first call, kept launches, kernel.run, a reduction), and the current device stays."""
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    A = integer_tensor(1000, 520, dtype=torch.float16, device=dev)
    B = integer_tensor(520, 744, low=-1, high=2, dtype=torch.float16, device=dev)
    bias = integer_tensor(744, dtype=torch.float32, device=dev)
    src = "def epi(accum, bias):\n    D = relu(accum + bias)\n    r = sum(D, dim=1)\n    return D, r\n"
    expected = torch.relu(A.double() @ B.double() + bias.double())
    for _ in range(3):  # the first call, then kept launches
        D, r = epifuse.gemm(A, B, src, bias=bias, out_dtype=torch.float32)
        assert D.device == dev and torch.equal(D.double(), expected)
        assert rel_error(r, expected.sum(dim=1)) < 1e-6
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
        "def epi(accum, bias):\n    D = relu(accum + bias)\n    return D\n", bias=bias,
        D=torch.empty(1000, 744, device=dev, dtype=torch.float32)))
    for kernel in epifuse.get_kernels(args):
        if kernel.name == "reference":
            continue
        for _ in range(2):
            args.outputs["D"].fill_(float("nan"))
            kernel.run(args)
            torch.cuda.synchronize(dev)
            assert torch.equal(args.outputs["D"].double(), expected), kernel
    assert torch.cuda.current_device() == 0


@pytest.mark.parametrize("dims", ["", "dim=1", "mean"])
@pytest.mark.parametrize("summand,group", [("(1 - C) * (-f) + log(clamp(sigmoid(f), 0.001, 0.999))", 8),
                                           ("log(clamp(f, 2.0, 2.0 ** 20)) + f", 4),
                                           ("-log(clamp(f, 2.0 ** -20, 0.75))", 4)])
def test_summed_logs_large(summand, group, dims):
    """Sums of logs taken as logs of products (rules.LogSum: shifted, direct above 1 and below)
    in every kernel, the Gluon ones included, on ragged tiles, against float64, in both
    reduction modes."""
    from test_reductions import _check_summed_logs
    names = _check_summed_logs(summand, group, dims, "cuda", 520, (False, True), M=1000, N=744)
    assert any(name.startswith("gluon_") for name in names), names


def test_negation_flips_the_sign_of_zero_large():
    from test_kernels import test_negation_flips_the_sign_of_zero
    test_negation_flips_the_sign_of_zero("cuda")


def test_summed_logs_near_one_keep_their_digits_large():
    from test_reductions import test_summed_logs_near_one_keep_their_digits
    test_summed_logs_near_one_keep_their_digits("cuda")
