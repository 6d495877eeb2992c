"""Every input and output dtype: int8 and fp8 GEMMs, integer and fp8 outputs with their
rounding and saturation, the W8A8 pattern, and what falls back to the reference kernel.

Integer-valued inputs keep every product exact. On the CPU the interpreter drops fp8
rounding carries, so fp8 *outputs* get a tolerance there and are compared exactly on a GPU.
"""
import pytest
import torch

import epifuse
import epifuse.verify
from epifuse.reference import saturate
from helpers import integer_tensor, reference_outputs, rel_error

M, N, K = 64, 48, 32
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _run_all(A, B, src, accumulator_type=None, **tensors):
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, **tensors),
                                 accumulator_type=accumulator_type)
    kernels = [k for k in epifuse.get_kernels(args) if k.name != "reference"]
    assert kernels, epifuse.kernel_statuses(args)
    refs = {n: saturate(r, args.outputs[n].dtype) for n, r in reference_outputs(args).items()}
    for kernel in kernels:
        for t in args.outputs.values():
            t.zero_()
        kernel.run(args)
        yield kernel, args, refs


def _ints(*shape, dtype, device, low=-3, high=4):
    return torch.randint(low, high, shape, device=device).to(dtype)


@pytest.mark.parametrize("a_dtype,b_dtype", [(torch.int8, torch.int8), *[(a, b) for a in FP8 for b in FP8]])
def test_low_precision_inputs(a_dtype, b_dtype, device):
    A, B = _ints(M, K, dtype=a_dtype, device=device), _ints(K, N, dtype=b_dtype, device=device)
    C = integer_tensor(M, N, dtype=torch.float32, device=device)
    D = torch.empty(M, N, device=device)
    for kernel, args, refs in _run_all(A, B, "def e(accum, C):\n    D = accum * 2.0 - C\n    return D\n", C=C, D=D):
        assert torch.equal(D.double(), refs["D"]), kernel


def test_k_major_fp8_b_as_for_scaled_mm(device):
    A = _ints(M, K, dtype=torch.float8_e4m3fn, device=device)
    B = _ints(N, K, dtype=torch.float8_e4m3fn, device=device).t()
    D = torch.empty(M, N, device=device, dtype=torch.bfloat16)
    for kernel, args, refs in _run_all(A, B, "def e(accum):\n    D = accum\n    return D\n", D=D):
        assert torch.equal(D.double(), refs["D"]), kernel


HALF_ACCUMULATING = [(torch.float16, torch.float16), *[(a, b) for a in FP8 for b in FP8]]


@pytest.mark.parametrize("a_dtype,b_dtype", HALF_ACCUMULATING)
def test_fp16_accumulator_is_exact_on_small_integers(a_dtype, b_dtype, device):
    """Every partial sum of these (|sum| <= 288) is an fp16 integer: exact in every kernel."""
    A, B = _ints(M, K, dtype=a_dtype, device=device), _ints(K, N, dtype=b_dtype, device=device)
    bias = integer_tensor(N, dtype=torch.float32, device=device)
    D = torch.empty(M, N, device=device, dtype=torch.float16)
    ran = set()
    for kernel, args, refs in _run_all(A, B, "def e(accum, bias):\n    D = accum * 2.0 + bias\n    return D\n",
                                       accumulator_type=torch.float16, bias=bias, D=D):
        assert torch.equal(D.double(), refs["D"]), kernel
        ran.add(kernel.name)
    assert "triton_tiled" in ran


@pytest.mark.parametrize("in_dtype", [torch.float16, *FP8])
def test_fp16_accumulator_rounds_to_fp16(in_dtype, device):
    """accum = 2048 + t (t in 1..3) needs 12 bits: an fp16 accumulator rounds 2049 to 2048 and
    2051 to 2052 (nearest even), in one rounding whatever the order of the sums."""
    A = torch.zeros(M, K, device=device)
    A[:, 0], A[:, 1] = 256.0, torch.randint(1, 4, (M,), device=device).float()
    B = torch.zeros(K, N, device=device)
    B[0], B[1] = 8.0, 1.0
    A, B = A.to(in_dtype), B.to(in_dtype)
    exact = 2048.0 + A[:, 1].double().cpu()[:, None].expand(M, N)
    D = torch.empty(M, N, device=device)
    for kernel, args, refs in _run_all(A, B, "def e(accum):\n    D = accum\n    return D\n",
                                       accumulator_type=torch.float16, D=D):
        assert torch.equal(D.double().cpu(), exact.half().double()), kernel
        assert torch.equal(D.double(), refs["D"]), kernel
    assert not torch.equal(exact.half().double(), exact)  # some row did round


@pytest.mark.parametrize("out_dtype", [torch.int32, torch.int8, torch.uint8])
def test_integer_outputs_round_to_even_and_saturate(out_dtype, device):
    A, B = _ints(M, K, dtype=torch.float16, device=device), _ints(K, N, dtype=torch.float16, device=device)
    # accum * 0.5 hits .5 ties (round to even), * 40 overflows int8/uint8, NaN becomes 0
    X = integer_tensor(M, N, dtype=torch.float32, device=device)
    X[0, 0] = float("nan")
    D = torch.empty(M, N, device=device, dtype=out_dtype)
    src = "def e(accum, X):\n    D = accum * 0.5 + X * 40.0\n    return D\n"
    for kernel, args, refs in _run_all(A, B, src, X=X, D=D):
        assert torch.equal(D, refs["D"].to(out_dtype)), kernel
        assert D[0, 0] == 0


@pytest.mark.parametrize("out_dtype", [torch.int32, torch.int8, torch.bool])
def test_verify_converts_the_reference_as_the_kernels_convert(out_dtype, device):
    """run(verify=True) passes on integer outputs with a NaN (written 0) and on bool outputs
    (any nonzero, NaN too, is true), where a check that compared them raw failed or raised."""
    A, B = _ints(M, K, dtype=torch.float16, device=device), _ints(K, N, dtype=torch.float16, device=device)
    X = integer_tensor(M, N, dtype=torch.float32, device=device)
    X[0, 0] = float("nan")
    D = torch.empty(M, N, device=device, dtype=out_dtype)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
        "def e(accum, X):\n    D = accum * 0.5 + X * 40.0\n    return D\n", X=X, D=D))
    for kernel in epifuse.get_kernels(args):
        D.zero_()
        assert kernel.run(args, verify=True).ok, kernel
        assert D[0, 0] == (out_dtype == torch.bool)
    D[1, 1] = not bool(D[1, 1]) if out_dtype == torch.bool else D[1, 1] + 2  # ints may be one off
    report = epifuse.debug.check(args, epifuse.debug.reference_outputs(args), None, None, "edited")
    assert not report.ok


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fnuz, torch.float8_e8m0fnu])
def test_operands_no_triton_kernel_loads_run_in_the_reference_kernel(dtype, device):
    """An fp8 variant Triton has no type for (KeyError, or 'fail to convert fp8e4b8' in the
    interpreter, before): the Triton kernels say why, the reference kernel runs; so does the
    backward of an output of that dtype, whose incoming gradient has it."""
    A, B = _ints(M, K, dtype=torch.float32, device=device), _ints(K, N, dtype=torch.float32, device=device)
    C = torch.full((M, N), 2.0, device=device).to(dtype)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
        "def e(accum, C):\n    D = accum * C\n    return D\n", C=C, D=torch.empty(M, N, device=device)))
    statuses = epifuse.kernel_statuses(args)
    assert all(f"operand C has dtype {dtype}, which this kernel cannot load" in s.reason
               for k, s in statuses if k.name.startswith(("triton", "gluon")))
    D = epifuse.gemm(A, B, "def e(accum, C):\n    D = accum * C\n    return D\n", C=C)
    assert torch.equal(D.double(), (A.double() @ B.double()) * 2.0)
    A.requires_grad_()
    epifuse.gemm(A, B, "def e(accum):\n    D = accum\n    return D\n", out_dtype=dtype).float().sum().backward()
    assert A.grad is not None and torch.isfinite(A.grad).all()


def test_verify_lets_tf32_flip_a_few_conditions_only(monkeypatch, device):
    """Under tf32 a bool output may differ from float64 in 1e-3 of its elements (conditions
    near their threshold), not more: an inverted mask fails."""
    A, B = torch.randn(64, 32, device=device), torch.randn(32, 48, device=device)
    D = torch.empty(64, 48, device=device, dtype=torch.bool)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
        "def e(accum):\n    D = accum > 0.5\n    return D\n", D=D))
    references = epifuse.debug.reference_outputs(args)
    D.copy_(references["D"].bool())
    monkeypatch.setattr(epifuse.verify, "_tf32", lambda args: True)
    D[0, :3] = ~D[0, :3]                    # 3 of 3072: within 1e-3
    report = epifuse.debug.check(args, references)
    assert report.ok and "3 of 3072 flipped" in str(report)
    D[1, :] = ~D[1, :]                      # 51 of 3072
    assert not epifuse.debug.check(args, references).ok
    monkeypatch.setattr(epifuse.verify, "_tf32", lambda args: False)
    D.copy_(references["D"].bool())
    D[0, 0] = ~D[0, 0]
    assert not epifuse.debug.check(args, references).ok


@pytest.mark.parametrize("out_dtype", FP8)
def test_fp8_outputs_saturate(out_dtype, device):
    A, B = _ints(M, K, dtype=torch.float16, device=device), _ints(K, N, dtype=torch.float16, device=device)
    D = torch.empty(M, N, device=device, dtype=out_dtype)
    src = "def e(accum):\n    D = accum * 1000.0\n    return D\n"
    for kernel, args, refs in _run_all(A, B, src, D=D):
        limit = 448.0 if out_dtype == torch.float8_e4m3fn else 57344.0
        assert D.float().abs().max() <= limit and not torch.isinf(D.float()).any()
        tol = 0.0 if device == "cuda" else 0.25  # the interpreter drops fp8 rounding carries
        assert rel_error(D.float(), refs["D"].to(out_dtype).float()) <= tol, kernel


def test_w8a8_int8_gemm_with_int32_bias_and_float_scale(device):
    A = _ints(M, K, dtype=torch.int8, device=device, low=-20, high=21)
    B = _ints(K, N, dtype=torch.int8, device=device, low=-20, high=21)
    bias = torch.randint(-1000, 1000, (N,), device=device, dtype=torch.int32)
    scale = torch.rand(N, device=device) * 0.05
    D = torch.empty(M, N, device=device, dtype=torch.int8)
    src = "def w8a8(accum, bias, scale):\n    D = (accum + bias) * scale\n    return D\n"
    for kernel, args, refs in _run_all(A, B, src, bias=bias, scale=scale, D=D):
        # float32 scaling vs the float64 reference can differ by one at a .5 boundary
        assert (D.int() - refs["D"].int()).abs().max() <= 1, kernel


def test_uint8_inputs_run_in_the_reference_kernel_and_say_why(device):
    A, B = _ints(M, K, dtype=torch.uint8, device=device, low=0), _ints(K, N, dtype=torch.uint8, device=device, low=0)
    D = torch.empty(M, N, device=device, dtype=torch.int32)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments("def e(accum):\n    D = accum\n    return D\n", D=D))
    statuses = {k.name: s for k, s in epifuse.kernel_statuses(args)}
    assert not statuses["triton_tiled"].ok and "uint8" in statuses["triton_tiled"].reason
    epifuse.get_kernels(args)[0].run(args)
    assert torch.equal(D.long().cpu(), A.long().cpu() @ B.long().cpu())


def test_accumulator_type_mismatch_is_an_error(device):
    A, B = _ints(M, K, dtype=torch.int8, device=device), _ints(K, N, dtype=torch.int8, device=device)
    with pytest.raises(epifuse.EpilogueError, match="accumulator_type"):
        epifuse.GemmArguments(A, B, out=torch.empty(M, N, device=device), accumulator_type=torch.float32)
