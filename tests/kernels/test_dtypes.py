"""Every input and output dtype: int8 and fp8 GEMMs, integer and fp8 outputs with their
rounding and saturation, the W8A8 pattern, and what falls back to the reference kernel.

Integer-valued inputs keep every product exact. Conversions are compared bit for bit, in the
interpreter as on a GPU: every family's stores, loads and `x.to(dtype)` against the reference
(reference.saturate) and torch's casts, at ties, beside them, past the range, at infinities, NaN
and signed zeros.
"""
import math

import pytest
import torch

import epifuse
import epifuse.verify
from epifuse.backends.triton.device import interpreter_requested
from epifuse.reference import saturate
from helpers import integer_tensor, reference_outputs

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
        assert torch.equal(D.float(), refs["D"].to(out_dtype).float()), kernel


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


U8_MIXES = [(torch.uint8, torch.uint8), (torch.uint8, torch.int8), (torch.int8, torch.uint8)]


def _full_range(*shape, dtype, device):
    low, high = (0, 256) if dtype == torch.uint8 else (-128, 128)
    return torch.randint(low, high, shape, device=device).to(dtype)


def _chosen_kernels(monkeypatch):
    """The (kernel, A dtype, B dtype) of every kernel epifuse.gemm chooses from here on."""
    from epifuse import api
    from epifuse.runtime import callsite
    callsite.clear()   # a kept launch of an earlier test would serve the call without a choice
    chosen, choose = [], api.choose_kernel

    def recording(args):
        kernel = choose(args)
        chosen.append((kernel.name, args.A.dtype, args.B.dtype))
        return kernel
    monkeypatch.setattr(api, "choose_kernel", recording)
    return chosen


@pytest.mark.parametrize("a_dtype,b_dtype", U8_MIXES, ids=str)
def test_uint8_gemms_run_on_the_int8_kernels_exactly(a_dtype, b_dtype, device, monkeypatch):
    """Full-range uint8 (and int8) values, K not a multiple of any tile: A @ B exact in int32
    and through an epilogue (every partial sum below 2**24), computed by a Triton kernel on
    int8 inputs with the offsets' corrections."""
    chosen = _chosen_kernels(monkeypatch)
    K_ = 70
    A, B = _full_range(37, K_, dtype=a_dtype, device=device), _full_range(K_, 45, dtype=b_dtype, device=device)
    exact = A.double().cpu() @ B.double().cpu()
    D = epifuse.gemm(A, B, out_dtype=torch.int32)
    assert torch.equal(D.double().cpu(), exact)
    C = integer_tensor(37, 45, dtype=torch.float32, device=device)
    E = epifuse.gemm(A, B, "def e(accum, C):\n    E = accum * 2.0 - C\n    return E\n", C=C)
    assert torch.equal(E.double().cpu(), exact * 2 - C.double().cpu())
    if device == "cuda" or interpreter_requested():
        assert chosen and all(name != "reference" and (a, b) == (torch.int8, torch.int8) for name, a, b in chosen), chosen


@pytest.mark.parametrize("batched", ["A", "B", "both"])
def test_uint8_batched_and_column_major(batched, device):
    L, M_, N_, K_ = 3, 20, 24, 40
    A = _full_range(*((L,) if batched in ("A", "both") else ()), M_, K_, dtype=torch.uint8, device=device)
    B = _full_range(*((L,) if batched in ("B", "both") else ()), N_, K_, dtype=torch.uint8, device=device).transpose(-1, -2)
    bias = integer_tensor(N_, dtype=torch.float32, device=device)
    D = epifuse.gemm(A, B, "def e(accum, bias):\n    D = accum + bias\n    return D\n", bias=bias)
    assert torch.equal(D.double().cpu(), torch.matmul(A.double().cpu(), B.double().cpu()) + bias.double().cpu())


def test_uint8_inputs_that_cannot_run_say_why(device):
    A, B = _full_range(8, 16, dtype=torch.uint8, device=device), _full_range(16, 12, dtype=torch.uint8, device=device)
    with pytest.raises(epifuse.errors.UnsupportedError, match="gated"):
        epifuse.gemm(A, B, "def e(accum):\n    gate, up = accum.chunk(2, dim=-1)\n    D = gate * up\n    return D\n")
    with pytest.raises(epifuse.errors.UnsupportedError, match="accum itself returned"):
        epifuse.gemm(A, B, "def e(accum):\n    return accum\n")
    with pytest.raises(epifuse.errors.ShapeError, match="both must be floating point or both integer"):
        epifuse.gemm(A, B.half())


def test_accumulator_type_mismatch_is_an_error(device):
    A, B = _ints(M, K, dtype=torch.int8, device=device), _ints(K, N, dtype=torch.int8, device=device)
    with pytest.raises(epifuse.EpilogueError, match="accumulator_type"):
        epifuse.GemmArguments(A, B, out=torch.empty(M, N, device=device), accumulator_type=torch.float32)


# ---- conversions bit for bit -----------------------------------------------------------------
# The dtypes the generated kernels store, and how a value of each is compared bit for bit.
STORED = [torch.float32, torch.float16, torch.bfloat16, *FP8, torch.int32, torch.int8, torch.uint8]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _beside(v: torch.Tensor) -> torch.Tensor:
    """v and the fp32 values one ulp below and above each."""
    v = v.float()
    return torch.cat([v, torch.nextafter(v, torch.full_like(v, -math.inf)),
                      torch.nextafter(v, torch.full_like(v, math.inf))])


def _grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a floating dtype of one or two bytes, ascending, in fp32."""
    codes = torch.arange(2 ** (8 * dtype.itemsize), dtype=torch.int32)
    codes = codes.to(torch.uint8) if dtype.itemsize == 1 else codes.to(torch.int16)
    values = codes.view(dtype).float()
    return values[torch.isfinite(values)].unique()


def conversion_values(dtype: torch.dtype, count: int = 400) -> torch.Tensor:
    """fp32 values that test the conversion to `dtype`: random ones of every magnitude; exact
    ties between neighbouring values of `dtype` (halfway, negative ones too) and the fp32
    values one ulp beside them; the range's edges and beyond; infinities, NaN, signed zeros
    and fp32 subnormals."""
    specials = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e10, -1e10, 3e9, 2.0 ** 31, -(2.0 ** 31),
                2.0 ** 63, 3.4028234663852886e38, 1e-45, -1e-45, 1.1754942e-38]
    scattered = torch.randint(-2 ** 31, 2 ** 31, (count,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    if dtype == torch.float32:
        return torch.cat([scattered, torch.tensor(specials)])
    if dtype.is_floating_point:
        grid = _grid(dtype)
        picked = grid[torch.randint(0, len(grid) - 1, (count,))]
        ties = torch.cat([(picked + grid[torch.searchsorted(grid, picked) + 1]) / 2,  # exact in fp32
                          (grid[:8] + grid[1:9]) / 2, (grid[-9:-1] + grid[-8:]) / 2])
        info = torch.finfo(dtype)
        edges = torch.tensor([info.max, info.tiny, info.tiny * info.eps, info.max * 1.03, info.max * 2.0])
        values = [picked, _beside(ties), _beside(torch.cat([edges, -edges]))]
    else:
        info = torch.iinfo(dtype)
        k = torch.randint(max(info.min, -2 ** 24) - 8, min(info.max, 2 ** 24) + 8, (count,)).float()
        big = torch.randint(2 ** 22, 2 ** 23, (count // 4,)).float()  # fp32 with a half, at most
        ties = torch.cat([k + 0.5, big + 0.5, -(big + 0.5), torch.arange(-8, 8).float() + 0.5])
        edges = torch.tensor([info.max, info.min, info.max + 1.0, info.min - 1.0, info.max + 0.5, info.min - 0.5])
        values = [k, _beside(ties), _beside(edges), torch.randn(count) * 2.0 ** 26]
    return torch.cat([*values, scattered, torch.tensor(specials)]).float()


def assert_same_bits(out: torch.Tensor, ref: torch.Tensor, what="") -> None:
    """out equals ref bit for bit (signed zeros included) where ref is a number, and is NaN
    where ref is NaN (a NaN's payload is no promise)."""
    out, ref = out.cpu(), ref.cpu().to(out.dtype)
    if not out.dtype.is_floating_point:
        bad = out != ref
    else:
        bits = _BITS[out.dtype.itemsize]
        nan = ref.float().isnan()
        bad = torch.where(nan, ~out.float().isnan(), out.view(bits) != ref.view(bits))
    if bad.any():
        shown = [(o, r) for o, r in zip(out[bad][:6].tolist(), ref[bad][:6].tolist())]
        raise AssertionError(f"{what}: {int(bad.sum())} of {out.numel()} differ (got, expected): {shown}")


def generated_kernels(args) -> list:
    """One generated kernel of each family that runs `args`."""
    kernels, names = [], set()
    for kernel in epifuse.get_kernels(args):
        if kernel.name != "reference" and kernel.name not in names:
            names.add(kernel.name)
            kernels.append(kernel)
    assert kernels, epifuse.kernel_statuses(args)
    return kernels


def each_family(make_args, check) -> set:
    """Run one kernel of every family that takes make_args() on it, and the grouped kernel on
    two of them; check(args, kernel name) after each run. Returns the families run."""
    args = make_args()
    ran = set()
    for kernel in generated_kernels(args):
        for t in args.outputs.values():
            t.fill_(77)
        kernel.run(args)
        check(args, kernel.name)
        ran.add(kernel.name)
    grouped = epifuse.GroupedGemmArguments([make_args(), make_args()])
    kernel = epifuse.get_kernels(grouped)[0]
    assert kernel.name == "triton_grouped", epifuse.kernel_statuses(grouped)
    kernel.run(grouped)
    for problem in grouped:
        check(problem, kernel.name)
    return ran | {kernel.name}


def _as_tile(values: torch.Tensor, N: int) -> torch.Tensor:
    """values laid out row by row in an (M, N) tile, the last row filled from the start."""
    rows = -(-len(values) // N)
    return torch.cat([values, values[: rows * N - len(values)]]).reshape(rows, N)


def check_stores(out_dtype, device, K=128, N=48):
    """D = X for X of conversion_values(out_dtype): every family stores what reference.saturate
    and torch's cast give, bit for bit."""
    X = _as_tile(conversion_values(out_dtype), N).to(device)
    expected = saturate(X.double(), out_dtype).to(out_dtype)

    def make_args():
        A = _ints(X.shape[0], K, dtype=torch.float16, device=device, low=1)
        B = _ints(K, N, dtype=torch.float16, device=device, low=1)
        return epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
            "def e(accum, X):\n    D = X\n    return D\n", X=X, D=torch.empty(X.shape, dtype=out_dtype, device=device)))

    return each_family(make_args, lambda args, name: assert_same_bits(args.outputs["D"], expected, name))


@pytest.mark.parametrize("out_dtype", STORED, ids=str)
def test_stores_round_and_saturate_as_the_reference_bit_for_bit(out_dtype, device):
    """Ties round to even, values beside them to nearest, at every scale and sign; past the
    range integers and fp8 saturate (infinities too), NaN is 0 in an integer, NaN in a float;
    -0.0 stays -0.0. In the interpreter bf16 was truncated (513 stored 512), fp8 lost rounding
    carries and stored NaN as 384 or 480, int32 wrapped 3e9 and +inf to -2**31 and truncated the
    halves between 2**22 and 2**23."""
    ran = check_stores(out_dtype, device)
    assert {"triton_tiled", "triton_persistent", "triton_splitk", "triton_grouped"} <= ran


def check_integer_product_ties(out_dtype, device, K=128, M=64, N=48):
    """D = (accum + C) * s for int8 A and B and an int32 C that makes accum + C = t, where t * s
    is a tie (k + 1/2, either sign) or one beside a tie: s = 0.05, where t * fp32(0.05) rounds
    to the tie (as t * 0.05 does in float64), and s = 0.5 and 0.25, exact. Every family rounds
    the ties to even: the 1.5 * 2**23 trick, contracted into fma(accum + C, s, 1.5 * 2**23) on a
    GPU, rounded the product before its own rounding, ties away from zero."""
    A = _ints(M, K, dtype=torch.int8, device=device, low=-20, high=21)
    B = _ints(N, K, dtype=torch.int8, device=device, low=-20, high=21).t()  # K-major: Gluon takes it
    accum = A.cpu().long() @ B.cpu().long()
    span = min(torch.iinfo(out_dtype).max + 1, 2 ** 15)  # |t * s| up to about the largest value
    ran = set()
    for s in (0.05, 0.5, 0.25):
        unit = round(0.5 / s)  # t = unit * (odd number) is a tie
        odd = 2 * torch.randint(-span, span, (M, N)) + 1
        beside = torch.randint(-1, 2, (M, N)) * (torch.rand(M, N) < 0.3)
        t = unit * odd + beside
        C = (t - accum).to(torch.int32).to(device)
        expected = saturate(t.double() * s, out_dtype)  # float64's product is the tie too
        assert ((t.double() * s).frac().abs() == 0.5).sum() > M * N // 2

        def make_args(C=C, s=s):
            return epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
                "def e(accum, C, s):\n    D = (accum + C) * s\n    return D\n", C=C, s=s,
                D=torch.empty(M, N, dtype=out_dtype, device=device)))

        def check(args, name, expected=expected, s=s):
            assert_same_bits(args.outputs["D"], expected, f"{name}, s = {s}")
            assert_same_bits(args.outputs["D"], saturate(reference_outputs(args)["D"], out_dtype), name)

        ran |= each_family(make_args, check)
    return ran


@pytest.mark.parametrize("out_dtype", [torch.int8, torch.int32, torch.uint8], ids=str)
def test_integer_outputs_round_product_ties_to_even(out_dtype, device):
    ran = check_integer_product_ties(out_dtype, device)
    assert {"triton_tiled", "triton_persistent", "triton_splitk", "triton_grouped"} <= ran


def check_loads(in_dtype, device, K=128, N=48):
    """D = X (fp32) for X of every value of `in_dtype` and random codes: every family widens
    each exactly (bf16 subnormals, fp8 NaN and infinities included)."""
    codes = torch.randint(0, 2 ** (8 * in_dtype.itemsize), (2000,), dtype=torch.int32)
    codes = torch.cat([torch.arange(256, dtype=torch.int32), codes])
    X = _as_tile((codes.to(torch.uint8) if in_dtype.itemsize == 1 else codes.to(torch.int16)).view(in_dtype), N)
    X = X.to(device)

    def make_args():
        A = _ints(X.shape[0], K, dtype=torch.float16, device=device, low=1)
        B = _ints(K, N, dtype=torch.float16, device=device, low=1)
        return epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
            "def e(accum, X):\n    D = X\n    return D\n", X=X, D=torch.empty(X.shape, device=device),
            compute_dtype=torch.float32))

    return each_family(make_args, lambda args, name: assert_same_bits(args.outputs["D"], X.float(), name))


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, *FP8], ids=str)
def test_operands_load_every_value_exactly(in_dtype, device):
    """In the interpreter bf16 subnormals loaded as other numbers or 0, fp8 e4m3 NaN as 480 and
    e5m2 infinities and NaN as 65536 to 114688."""
    check_loads(in_dtype, device)


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, *FP8], ids=str)
def test_gemm_inputs_load_every_value_exactly(in_dtype, device):
    """A of bf16 subnormals (every product and sum exact in fp32), or fp8 with NaN and
    infinities: accum is the float64 GEMM's in every family, NaN where a NaN or inf * 0 met it."""
    Mi, Ki, Ni = 64, 128, 48
    if in_dtype == torch.bfloat16:
        magnitudes = torch.randint(1, 128, (Mi, Ki), dtype=torch.int16)  # the subnormal codes
        A = (magnitudes | (torch.rand(Mi, Ki) < 0.5).to(torch.int16) * -32768).view(torch.bfloat16)
    else:
        A = _ints(Mi, Ki, dtype=torch.float32, device="cpu", low=1)
        A[0, 0] = math.nan
        if in_dtype == torch.float8_e5m2:
            A[1, 1], A[2, 2] = math.inf, -math.inf
        A = A.to(in_dtype)
    A = A.to(device)
    B = _ints(Ki, Ni, dtype=in_dtype, device=device, low=1)

    def make_args():
        return epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
            "def e(accum):\n    D = accum\n    return D\n", D=torch.empty(Mi, Ni, device=device)))

    expected = reference_outputs(make_args())["D"].float()
    assert expected.isnan().any() or in_dtype == torch.bfloat16
    each_family(make_args, lambda args, name: assert_same_bits(args.outputs["D"], expected, name))


def check_round_through(name, device, K=128, N=48):
    """D = X.to(torch.<name>) in fp32: every family rounds through the dtype as torch does
    (nearest even at ties, and torch's overflow: inf for e5m2, its own rule for e4m3fn)."""
    dtype = getattr(torch, name)
    X = _as_tile(conversion_values(dtype), N).to(device)
    expected = X.to(dtype).float()

    def make_args():
        A = _ints(X.shape[0], K, dtype=torch.float16, device=device, low=1)
        B = _ints(K, N, dtype=torch.float16, device=device, low=1)
        return epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
            f"def e(accum, X):\n    D = X.to(torch.{name})\n    return D\n", X=X, D=torch.empty(X.shape, device=device)))

    return each_family(make_args, lambda args, name: assert_same_bits(args.outputs["D"], expected, name))


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"])
def test_rounding_through_a_dtype_is_torchs_bit_for_bit(name, device):
    """x.to(dtype) inside an epilogue. In the interpreter bf16 was truncated and fp8 lost its
    rounding carries; on a GPU e5m2 saturated at 57344 where torch overflows to inf."""
    check_round_through(name, device)


@pytest.mark.parametrize("out_dtype", [torch.int64, torch.int16, torch.float64, torch.bool], ids=str)
def test_outputs_only_the_reference_kernel_stores_convert_as_saturate_says(out_dtype, device):
    """int64 saturates at 2**63 - 1 (+inf and 1e30 wrapped to -2**63: float64 has no 2**63 - 1),
    int16 rounds to even and saturates, float64 keeps every fp32 value, bool is x != 0."""
    values = conversion_values(torch.int32 if not out_dtype.is_floating_point else torch.float32)
    X = _as_tile(torch.cat([values, torch.tensor([1e30, -1e30, 2.0 ** 63, 2.0 ** 62 + 2.0 ** 40])]), N).to(device)
    A = _ints(X.shape[0], K, dtype=torch.float16, device=device, low=1)
    B = _ints(K, N, dtype=torch.float16, device=device, low=1)
    D = torch.empty(X.shape, dtype=out_dtype, device=device)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments("def e(accum, X):\n    D = X\n    return D\n", X=X, D=D))
    expected = saturate(X.double(), out_dtype).to(out_dtype)
    for kernel in epifuse.get_kernels(args):
        D.zero_()
        kernel.run(args)
        assert_same_bits(D, expected, kernel.name)
    if out_dtype == torch.int64:
        assert (D[X == math.inf] == torch.iinfo(torch.int64).max).all() and (D[X == 1e30] > 0).all()
