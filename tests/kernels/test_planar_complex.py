"""Planar complex GEMMs (issue 37): accum = (Ar + i Ai) @ (Br + i Bi) in one kernel with two
accumulators, and epilogues over complex values, against torch's complex128 matmul.

Integer-valued planes make every product and sum exact in fp32, so the kernel's results are
compared for equality where the epilogue is +, -, * and sums; ops that round (exp, abs, /)
are compared within fp32's rounding."""
import pytest
import torch

import epifuse
from epifuse.epilogues import LinearCombinationPlanarComplex, ScaleType
from epifuse.errors import EpilogueArgumentError, EpilogueError, EpilogueSyntaxError, ShapeError, UnsupportedError
from helpers import integer_tensor

AFFINE = "def affine(accum, alpha, beta, C):\n    D = alpha * accum + beta * C\n    return D\n"


def planes(*shape, dtype=torch.float32, device="cpu"):
    return integer_tensor(*shape, dtype=dtype, device=device), integer_tensor(*shape, dtype=dtype, device=device)


def exact_accum(Ar, Ai, Br, Bi) -> torch.Tensor:
    return torch.complex(Ar.double(), Ai.double()) @ torch.complex(Br.double(), Bi.double())


def as_complex(value) -> torch.Tensor:
    if isinstance(value, tuple):
        return torch.complex(value[0].double(), value[1].double())
    return value.to(torch.complex128)


def kernel_of(Ar, Ai, Br, Bi, epilogue, **tensors):
    args = LinearCombinationPlanarComplex().arguments(Ar, Ai, Br, Bi, **tensors) if epilogue is None else \
        epifuse.planar.planar_arguments(Ar, Ai, Br, Bi, epilogue, **tensors)[0]
    return epifuse.get_kernels(args), args


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batched", [False, True])
def test_accumulator_is_exact_in_the_planar_kernel(dtype, batched):
    """Ragged M, N, K over several interpreter tiles (32): both parts equal the complex128
    product, batched A against a shared B too."""
    M, N, K = 45, 70, 75
    lead = (2,) if batched else ()
    Ar, Ai = planes(*lead, M, K, dtype=dtype)
    Br, Bi = planes(K, N, dtype=dtype)
    args, (D,) = epifuse.planar.planar_arguments(Ar, Ai, Br, Bi, None, precision="highest")
    kernels = epifuse.get_kernels(args)
    assert [k.name for k in kernels] == ["triton_planar", "reference"]
    expected = exact_accum(Ar, Ai, Br, Bi)
    for kernel in kernels:
        D[0].fill_(float("nan"))
        D[1].fill_(float("nan"))
        kernel.run(args)
        assert D[0].dtype == dtype and torch.equal(D[0].double(), expected.real), kernel
        assert torch.equal(D[1].double(), expected.imag), kernel


def test_every_form_of_operand_and_output():
    """alpha a Python complex, beta a one-element complex tensor (read at run time), C a torch
    complex tensor read in place through its strided planes, a real bias row, a planar pair
    operand; D written into a given complex tensor, E into a given pair, F allocated."""
    M, N, K = 40, 66, 50
    Ar, Ai = planes(M, K)
    Br, Bi = planes(K, N)
    C = torch.complex(*planes(M, N))
    G = planes(M, 1)
    bias = integer_tensor(N, dtype=torch.float32)
    beta = torch.tensor([2.0 - 1.0j], dtype=torch.complex64)
    src = ("def epi(accum, alpha, beta, C, G, bias):\n"
           "    D = alpha * accum + beta * C + bias\n"
           "    E = conj(accum) * G - accum.imag\n"
           "    F = accum * accum.real\n"
           "    return D, E, F\n")
    D = torch.empty(M, N, dtype=torch.complex64)
    E = (torch.empty(M, N), torch.empty(M, N))
    d, e, f = epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, src, alpha=3 + 1j, beta=beta, C=C, G=G, bias=bias,
                                          D=D, E=E, precision="highest")
    assert d is D and e[0] is E[0] and e[1] is E[1] and isinstance(f, tuple)
    acc = exact_accum(Ar, Ai, Br, Bi)
    assert torch.equal(D.to(torch.complex128), (3 + 1j) * acc + (2 - 1j) * C.to(torch.complex128) + bias.double())
    assert torch.equal(as_complex(e), acc.conj() * as_complex(G) - acc.imag)
    assert torch.equal(as_complex(f), acc * acc.real)


def test_allocated_outputs_planar_by_default_and_complex_on_request():
    M, N, K = 33, 34, 35
    Ar, Ai = planes(M, K, dtype=torch.float16)
    Br, Bi = planes(K, N, dtype=torch.float16)
    acc = exact_accum(Ar, Ai, Br, Bi)
    re, im = epifuse.gemm_planar_complex(Ar, Ai, Br, Bi)
    assert re.dtype == im.dtype == torch.float16 and torch.equal(torch.complex(re.double(), im.double()), acc)
    whole = epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, None, out_dtype=torch.complex64)
    assert whole.dtype == torch.complex64 and torch.equal(whole.to(torch.complex128), acc)
    src = "def epi(accum):\n    D = accum\n    m = abs(accum)\n    s = sum(accum, dim=1)\n    return D, m, s\n"
    D, m, s = epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, src, out_dtype=torch.complex128)
    assert D.dtype == torch.complex128 and m.dtype == torch.float64 and s.dtype == torch.complex64
    assert torch.equal(D, acc) and torch.equal(s.to(torch.complex128), acc.sum(1))
    torch.testing.assert_close(m, acc.abs(), rtol=3e-7, atol=0)   # sqrt(re^2 + im^2) in fp32, stored in float64


def test_ops_that_round_match_torch_complex():
    """exp, abs, division, reciprocal, square, where, mean, casts: within fp32's rounding of the
    complex128 results (the planes are scaled so exp stays in range)."""
    M, N, K = 40, 40, 40
    Ar, Ai = (p / 16 for p in planes(M, K))
    Br, Bi = (p / 16 for p in planes(K, N))
    C = torch.complex(*(p + 5.0 for p in planes(M, N)))    # no zero divisor
    src = ("def epi(accum, C):\n"
           "    P = exp(accum) / C\n"
           "    Q = reciprocal(C) + square(accum)\n"
           "    R = where(accum.real > 0, accum, -accum)\n"
           "    m = abs(accum - C)\n"
           "    s = mean(accum * C, dim=0)\n"
           "    T = accum.to(torch.float16)\n"
           "    return P, Q, R, m, s, T\n")
    P, Q, R, m, s, T = epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, src, C=C, precision="highest")
    acc, c = exact_accum(Ar, Ai, Br, Bi), C.to(torch.complex128)
    close = dict(rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(as_complex(P), torch.exp(acc) / c, **close)
    torch.testing.assert_close(as_complex(Q), 1 / c + acc * acc, **close)
    torch.testing.assert_close(as_complex(R), torch.where(acc.real > 0, acc, -acc), rtol=0, atol=0)
    torch.testing.assert_close(m.double(), (acc - c).abs(), **close)
    torch.testing.assert_close(as_complex(s), (acc * c).mean(0), **close)
    rounded = torch.complex(acc.real.half().double(), acc.imag.half().double())
    torch.testing.assert_close(as_complex(T), rounded, rtol=0, atol=0)


def test_float64_planes_compute_in_float64():
    """float64 planes run in the reference kernel in float64 (no Triton kernel computes in
    float64): the result is complex128's to the last bit for integer inputs."""
    Ar, Ai = planes(20, 30, dtype=torch.float64)
    Br, Bi = planes(30, 10, dtype=torch.float64)
    D = epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, AFFINE, alpha=0.5 - 0.25j, beta=3.0, C=(Ar[:, :10], Ai[:, :10]),
                                    out_dtype=torch.complex128)
    expected = (0.5 - 0.25j) * exact_accum(Ar, Ai, Br, Bi) + 3.0 * torch.complex(Ar[:, :10], Ai[:, :10])
    assert torch.equal(D, expected)


def test_a_real_factor_drops_the_zero_imaginary_terms():
    """x * z with x real is (x z.re) + i (x z.im), as C99's mixed arithmetic: an infinite real
    part of accum gives no NaN in the imaginary part of x * accum where x is real."""
    Ar = torch.tensor([[1e30, 1e30]])
    Ai = torch.tensor([[0.0, 0.0]])
    Br = torch.tensor([[1e30], [1e30]])
    Bi = torch.tensor([[1.0], [1.0]])
    src = "def epi(accum, x):\n    D = x * accum\n    return D\n"
    re, im = epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, src, x=2.0, precision="highest")
    assert re.item() == float("inf") and im.item() == torch.tensor(4e30).item()   # 2 * 2e30 in fp32


def test_linear_combination_planar_complex_has_cutlass_semantics():
    M, N, K = 36, 40, 44
    Ar, Ai = planes(M, K)
    Br, Bi = planes(K, N)
    Cr, Ci = planes(M, N)
    acc, c = exact_accum(Ar, Ai, Br, Bi), torch.complex(Cr.double(), Ci.double())
    epi = LinearCombinationPlanarComplex()
    assert epi.outputs == ("D",) and "alpha * accum + beta * C" in epi
    D = epi(Ar, Ai, Br, Bi, alpha=1 - 2j, beta=0.5j, C=(Cr, Ci), precision="highest")
    assert torch.equal(as_complex(D), (1 - 2j) * acc + 0.5j * c)
    D = epi(Ar, Ai, Br, Bi, C=(Cr, Ci), precision="highest")   # alpha = beta = 1.0
    assert torch.equal(as_complex(D), acc + c)
    only = LinearCombinationPlanarComplex(scale=ScaleType.ONLY_ALPHA_SCALING)
    assert torch.equal(as_complex(only(Ar, Ai, Br, Bi, alpha=2j, precision="highest")), 2j * acc)
    args = epi.arguments(Ar, Ai, Br, Bi, alpha=1j, C=(Cr, Ci), precision="highest")
    assert args.planar and "planar complex" in repr(args)
    kernels = epifuse.get_kernels(args)
    kernels[0].run(args)
    assert torch.equal(as_complex((args.outputs["D_re"], args.outputs["D_im"])), 1j * acc + c)


# ---- what is refused, and how ----------------------------------------------------------------

def test_an_op_without_a_complex_meaning_names_itself():
    Ar, Ai = planes(8, 8)
    with pytest.raises(EpilogueError, match=r"gelu\(\) has no meaning on complex values") as info:
        epifuse.gemm_planar_complex(Ar, Ai, Ar, Ai, "def epi(accum):\n    D = gelu(accum)\n    return D\n")
    assert "Take .real, .imag or abs()" in str(info.value)
    with pytest.raises(EpilogueError, match=r"lt\(\) has no meaning on complex values"):
        epifuse.gemm_planar_complex(Ar, Ai, Ar, Ai, "def epi(accum):\n    D = where(accum < 0, 0.0, accum)\n    return D\n")
    out = epifuse.gemm_planar_complex(Ar, Ai, Ar, Ai, "def epi(accum):\n    D = gelu(accum.real)\n    return D\n")
    assert isinstance(out, torch.Tensor)   # a real result: one tensor


def test_complex_parts_are_refused_in_a_real_gemm():
    A = integer_tensor(8, 8, dtype=torch.float32)
    with pytest.raises(EpilogueError, match=r"real\(\) takes a part of a complex value") as info:
        epifuse.gemm(A, A, "def epi(accum):\n    D = accum.real\n    return D\n")
    assert "gemm_planar_complex" in str(info.value)
    with pytest.raises(EpilogueError, match=r"complex literal 1j has no meaning in a real GEMM"):
        epifuse.gemm(A, A, "def epi(accum):\n    D = accum * 1j\n    return D\n")
    with pytest.raises(EpilogueSyntaxError, match="'accum_imag' is reserved"):
        epifuse.gemm(A, A, "def epi(accum, accum_imag):\n    D = accum\n    return D\n", accum_imag=1.0)


def test_bad_planes_and_values_get_clear_errors():
    Ar, Ai = planes(8, 6)
    Br, Bi = planes(6, 4)
    with pytest.raises(ShapeError, match="Ar is a complex tensor"):
        epifuse.gemm_planar_complex(torch.complex(Ar, Ai), Ai, Br, Bi)
    with pytest.raises(ShapeError, match="A_imag and A differ in strides"):
        epifuse.gemm_planar_complex(Ar, Ai.t().contiguous().t(), Br, Bi)
    with pytest.raises(ShapeError, match="B_imag and B differ in shape"):
        epifuse.gemm_planar_complex(Ar, Ai, Br, Bi[:, :3])
    with pytest.raises(ShapeError, match="B_imag and B differ in dtype"):
        epifuse.gemm_planar_complex(Ar, Ai, Br, Bi.half())
    with pytest.raises(ShapeError, match="planes of float16, bfloat16, float32 or float64"):
        epifuse.gemm_planar_complex(Ar.int(), Ai.int(), Br.int(), Bi.int())
    with pytest.raises(EpilogueArgumentError, match="A_imag is given and B_imag is not"):
        epifuse.GemmArguments(Ar, Br, out=torch.empty(8, 4), A_imag=Ai)
    with pytest.raises(EpilogueArgumentError, match="needs operand.*C|missing.*C|C"):
        epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, AFFINE, alpha=1.0, beta=1.0)
    with pytest.raises(EpilogueArgumentError, match="Output D is complex, but the tensor passed for it is real"):
        epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, AFFINE, alpha=1.0, beta=1.0, C=1j, D=torch.empty(8, 4))
    with pytest.raises(EpilogueArgumentError, match="pair \\(re, im\\)"):
        epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, AFFINE, alpha=1.0, beta=1.0, C=(1.0, 2.0, 3.0))
    with pytest.raises(EpilogueArgumentError, match="out_dtype must be a floating-point or complex"):
        epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, None, out_dtype=torch.int32)
    with pytest.raises(UnsupportedError, match="no backward"):
        epifuse.gemm_planar_complex(Ar.requires_grad_(), Ai, Br, Bi)


def test_an_output_over_a_plane_is_refused_before_anything_is_written():
    Ar, Ai = planes(8, 8)
    Br, Bi = planes(8, 8)
    before = Bi.clone()
    with pytest.raises(ShapeError, match="Output D_im overlaps the GEMM input B_imag"):
        epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, None, D=(torch.empty(8, 8), Bi))
    assert torch.equal(Bi, before)


def test_real_arguments_never_take_the_planar_kernel_and_planar_ones_take_no_other():
    A = integer_tensor(40, 40, dtype=torch.float32)
    real = epifuse.GemmArguments(A, A, out=torch.empty(40, 40))
    statuses = dict((k.name, s) for k, s in epifuse.kernel_statuses(real))
    assert not statuses.get("triton_planar", False)
    args, _ = epifuse.planar.planar_arguments(A, A.clone(), A.clone(), A.clone())
    for kernel, status in epifuse.kernel_statuses(args):
        assert bool(status) == (kernel.name in ("triton_planar", "reference")), (kernel, status)
    refused = [s for k, s in epifuse.kernel_statuses(args) if k.name == "triton_tiled"]
    assert all("planar kernel only" in s.reason for s in refused)


def test_tuning_times_planar_arguments_on_their_planes():
    """Tuning runs each candidate on scratch outputs of the same problem: for planar arguments
    that problem keeps its imaginary planes (a real copy would be refused)."""
    from epifuse.runtime import tune
    Ar, Ai = planes(40, 50)
    Br, Bi = planes(50, 30)
    args, (D,) = epifuse.planar.planar_arguments(Ar, Ai, Br, Bi, AFFINE, alpha=1j, beta=2.0, C=1 - 1j,
                                                 precision="highest")
    scratch = tune._scratch_args(args)
    assert scratch.planar and scratch.A_imag is Ai and scratch.B_imag is Bi
    assert scratch.signature == args.signature
    kernel = epifuse.get_kernels(scratch)[0]
    kernel.run(scratch)
    expected = 1j * exact_accum(Ar, Ai, Br, Bi) + 2 * (1 - 1j)
    assert torch.equal(as_complex((scratch.outputs["D_re"], scratch.outputs["D_im"])), expected)


def test_review_findings_reductions_of_a_known_zero_part_scaled_abs_and_division_conj_views():
    """A complex reduction whose real part is known to be zero has the reduced shape in both
    parts; abs and / stay finite for |z| near 1e20 and 1e-25 (torch's complex64 does); a
    conjugated complex operand is read as its conjugate, a conjugated output is refused; a gated
    epilogue is refused by name."""
    Ar, Ai = planes(12, 10)
    Br, Bi = planes(10, 14)
    acc = exact_accum(Ar, Ai, Br, Bi)
    s = epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, "def e(accum):\n    s = sum(1j * accum.real, dim=1)\n    return s\n",
                                    precision="highest")
    assert s[0].shape == (12,) and torch.equal(as_complex(s), (1j * acc.real).sum(1))
    C = torch.complex(*(p + 0.5 for p in planes(12, 14)))
    for scale in (1e20, 1e-25):
        src = "def e(accum, C):\n    m = abs(accum)\n    Q = C / accum\n    return m, Q\n"
        m, Q = epifuse.gemm_planar_complex(Ar * scale, Ai * scale, Br, Bi, src, C=C, precision="highest")
        big = acc * scale
        keep = big.abs() > 0
        torch.testing.assert_close(m.double()[keep], big.abs()[keep], rtol=1e-5, atol=0)
        torch.testing.assert_close(as_complex(Q)[keep], (C.to(torch.complex128) / big)[keep], rtol=1e-5, atol=0)
    D = epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, AFFINE, alpha=1.0, beta=1.0, C=C.conj(), precision="highest")
    assert torch.equal(as_complex(D), acc + C.conj().to(torch.complex128))
    with pytest.raises(ShapeError, match="conjugated view"):
        epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, None, D=torch.empty(12, 14, dtype=torch.complex64).conj())
    with pytest.raises(UnsupportedError, match="cannot also chunk"):
        epifuse.gemm_planar_complex(Ar, Ai, Br, Bi, "def e(accum):\n    g, u = accum.chunk(2, dim=-1)\n    D = g\n    return D\n")
