"""Reductions over N that feed later math, in one kernel where a tile spans N (issue 36):
softmax, log-softmax, exp(accum - max), accum / sum, a log-sum-exp with a bias that is also
returned, a layer norm (two chained means), at N of 8, 37, 128 and 256, fp32 and bf16 inputs,
batched; rows of -inf, +inf and NaN; that one launch ran and the statuses say so; that an N
wider than any tile (600) still runs as passes with the same answer. Against torch in float64:
the kernel's error within a small multiple of a same-dtype torch computation's."""
import pytest
import torch

import epifuse
import helpers
from epifuse.api import _gemm_in_passes
from epifuse.arguments import epilogue_program
from epifuse.backends.triton.kernels import TritonKernel
from epifuse.runtime import callsite

M, K = 32, 16

FORMS = {
    "softmax": ("def epi(accum):\n    P = softmax(accum, dim=1)\n    return P\n",
                lambda z: torch.softmax(z, dim=1)),
    "log_softmax": ("def epi(accum):\n    P = log_softmax(accum, dim=-1)\n    return P\n",
                    lambda z: torch.log_softmax(z, dim=-1)),
    "exp_minus_max": ("def epi(accum):\n    m = max(accum, dim=-1)\n    P = exp(accum - m)\n    return P\n",
                      lambda z: torch.exp(z - z.amax(dim=-1, keepdim=True))),
    # a sum of squares, not of values: a row of random values can sum to near 0, where any
    # change of summation order moves the quotient by more than the bound allows
    "over_sum_of_squares": ("def epi(accum):\n    P = accum / sum(accum * accum, dim=-1)\n    return P\n",
                            lambda z: z / (z * z).sum(dim=-1, keepdim=True)),
    "over_amax": ("def epi(accum):\n    P = accum / amax(accum, dim=-1)\n    return P\n",
                  lambda z: z / z.abs().amax(dim=-1, keepdim=True)),
    "layer_norm": ("def epi(accum):\n    mu = mean(accum, dim=-1)\n    var = mean((accum - mu) ** 2, dim=-1)\n"
                   "    P = (accum - mu) * rsqrt(var + 1e-5)\n    return P\n",
                   lambda z: torch.nn.functional.layer_norm(z, z.shape[-1:], eps=1e-5)),
}
LSE_BIAS = ("def epi(accum, bias):\n    lse = logsumexp(accum + bias, dim=1)\n    P = exp(accum + bias - lse)\n"
            "    return P, lse\n")


def _generator():
    """Fresh inputs each run, replayed by EPIFUSE_TEST_SEED (conftest seeds torch)."""
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))


def _inputs(device, n, dtype=torch.float32, batch=()):
    gen = _generator()
    A = torch.randn(*batch, M, K, generator=gen).to(device=device, dtype=dtype)
    B = torch.randn(*batch, K, n, generator=gen).to(device=device, dtype=dtype)
    return A, B


def _launches(monkeypatch) -> list:
    """The Triton kernels launched from now on (one entry per launch); the kept launches of
    earlier calls are dropped, so none serves a call without going through the kernel."""
    callsite.clear()
    launched = []
    original = TritonKernel._launch

    def counting(self, args, plan):
        launched.append(self)
        return original(self, args, plan)
    monkeypatch.setattr(TritonKernel, "_launch", counting)
    return launched


def _check(out, expected, same_dtype, slack=4.0):
    """`out` against float64 `expected`: NaN and infinities where torch has them; elsewhere an
    error within `slack` times that of `same_dtype` (torch in the kernel's dtypes)."""
    out = out.double().cpu()
    expected = expected.cpu()
    same_dtype = same_dtype.double().cpu()
    assert torch.equal(out.isnan(), expected.isnan())
    finite = expected.isfinite()
    assert torch.equal(out[~finite & ~expected.isnan()], expected[~finite & ~expected.isnan()])
    error = (out - expected)[finite].abs().max() if finite.any() else 0.0
    bound = (same_dtype - expected)[finite].abs().max() if finite.any() else 0.0
    scale = expected[finite].abs().max() if finite.any() else 1.0
    assert error <= slack * bound + 1e-6 * scale, (float(error), float(bound))


def _torch_same_dtype(A, B, reference, dtype):
    """The epilogue in torch, accum in fp32, the result rounded to the output's dtype."""
    return reference(A.float() @ B.float()).to(dtype)


CASES = [(form, n, dtype) for dtype in (torch.float32, torch.bfloat16) for n in (8, 37, 128, 256) for form in FORMS]
# the README run: every form at N = 37 in fp32, softmax at N = 8 and 256 in fp32 and 37 in
# bf16, log_softmax at 128 in bf16; -m slow the rest
KEEP = {i for i, (form, n, dtype) in enumerate(CASES)
        if (n == 37 and dtype == torch.float32)
        or (form == "softmax" and (n in (8, 256)) == (dtype == torch.float32) and n in (8, 37, 256))
        or (form == "log_softmax" and n == 128 and dtype == torch.bfloat16)}


@pytest.mark.parametrize("form, n, dtype", helpers.fast(
    CASES, KEEP, ids=[f"{form}-N{n}-{str(dtype)[6:]}" for form, n, dtype in CASES]))
def test_one_pass_matches_torch(form, n, dtype, device, monkeypatch):
    src, reference = FORMS[form]
    A, B = _inputs(device, n, dtype)
    launched = _launches(monkeypatch)
    P = epifuse.gemm(A, B, src)
    if device == "cpu":   # one launch of the tiled kernel, its tile as wide as N
        assert [k.name for k in launched] == ["triton_tiled"]
    assert P.dtype == dtype and P.shape == (M, n)
    _check(P, reference(A.double() @ B.double()), _torch_same_dtype(A, B, reference, dtype))


@pytest.mark.parametrize("n", helpers.fast([8, 37, 256], keep={1}))
def test_logsumexp_with_a_bias_returned_and_read(n, device, monkeypatch):
    """The log-sum-exp is both returned and read by later math: one launch writes both."""
    A, B = _inputs(device, n)
    bias = torch.randn(n, generator=_generator()).to(device)
    launched = _launches(monkeypatch)
    P, lse = epifuse.gemm(A, B, LSE_BIAS, bias=bias)
    if device == "cpu":
        assert len(launched) == 1
    z = A.double() @ B.double() + bias.double()
    z32 = A.float() @ B.float() + bias
    _check(lse, torch.logsumexp(z, dim=1), torch.logsumexp(z32, dim=1))
    _check(P, torch.softmax(z, dim=1), torch.exp(z32 - torch.logsumexp(z32, dim=1, keepdim=True)))


@pytest.mark.parametrize("shared_b", helpers.fast([False, True], keep={0}))
def test_batched(shared_b, device, monkeypatch):
    """A (L, M, K) batch, with B batched too or shared; softmax over the last dim."""
    gen = _generator()
    A = torch.randn(3, M, K, generator=gen).to(device)
    B = torch.randn(*(() if shared_b else (3,)), K, 37, generator=gen).to(device)
    launched = _launches(monkeypatch)
    P = epifuse.gemm(A, B, "def epi(accum):\n    P = softmax(accum, dim=-1)\n    return P\n")
    if device == "cpu":
        assert len(launched) == 1
    assert P.shape == (3, M, 37)
    _check(P, torch.softmax(A.double() @ B.double(), dim=-1), torch.softmax(A.float() @ B.float(), dim=-1))


WITH_C = {
    "softmax": "def epi(accum, C):\n    z = accum + C\n    P = softmax(z, dim=1)\n    return P\n",
    "exp_minus_max": "def epi(accum, C):\n    z = accum + C\n    P = exp(z - max(z, dim=1))\n    return P\n",
    "over_sum_of_squares": "def epi(accum, C):\n    z = accum + C\n    P = z / sum(z * z, dim=1)\n    return P\n",
}


# softmax as the parser writes it, exp(z - logsumexp(z)): in a row with a +inf that is 0
# where z is finite and NaN at the inf (torch.softmax, which shifts by the max, gives NaN for
# the whole row); the passes and the float64 reference backend compute the same
WRITTEN = {"softmax": lambda z: torch.exp(z - torch.logsumexp(z, dim=1, keepdim=True))}


@pytest.mark.parametrize("form", list(WITH_C))
def test_infinities_and_nan_as_torch(form, device):
    """A row of -inf, one with a +inf, one with a NaN, one all but one element -inf, through a
    tile operand C; N of 37 leaves masked columns in the tile, which must not count."""
    reference = WRITTEN.get(form, FORMS[form][1])
    A, B = _inputs(device, 37)
    C = torch.randn(M, 37, generator=_generator())
    C[1, :] = float("-inf")
    C[2, 5] = float("inf")
    C[3, 30] = float("nan")
    C[4, 1:] = float("-inf")
    C = C.to(device)
    P = epifuse.gemm(A, B, WITH_C[form], C=C)
    z = A.double() @ B.double() + C.double()
    _check(P, reference(z), reference(A.float() @ B.float() + C))


def test_statuses_say_one_pass_or_passes(device):
    """kernel_statuses: the tiled kernel runs N = 37 in one pass; an N wider than every tile
    is refused with the number of passes epifuse.gemm runs instead."""
    src = FORMS["softmax"][0]
    for n, one_pass in ((37, True), (600, False)):
        A, B = _inputs(device, n)
        args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, P=torch.empty(M, n, device=device)))
        statuses = {k.name: status for k, status in epifuse.kernel_statuses(args)}
        tiled = statuses["triton_tiled"]
        if one_pass:
            assert tiled.ok and f"one pass: logsumexp() over each row of N = {n} within its tile" in tiled.reason
        else:
            assert not tiled.ok and f"N = {n} spans tiles" in tiled.reason and "as 2 passes" in tiled.reason
        assert statuses["reference"].ok
    gpu_only = {name: status for name, status in statuses.items() if name.startswith("gluon")}
    assert all(not status for status in gpu_only.values())


def test_a_wide_n_runs_as_passes_with_the_same_answer(device, monkeypatch):
    """N = 600 is wider than the widest tile (256): two passes (statistics, then the
    epilogue), each a launch, matching torch as the one-pass kernel does."""
    A, B = _inputs(device, 600)
    launched = _launches(monkeypatch)
    P = epifuse.gemm(A, B, FORMS["softmax"][0])
    if device == "cpu":
        assert len(launched) == 2
    z = A.double() @ B.double()
    _check(P, torch.softmax(z, dim=1), torch.softmax(A.float() @ B.float(), dim=1))


def test_one_pass_and_passes_agree(device, monkeypatch):
    """N = 256 in one launch and as the two passes a wider N takes (the statistics pass folds
    per-tile partials): the same softmax to fp32 rounding."""
    A, B = _inputs(device, 256)
    launched = _launches(monkeypatch)
    one = epifuse.gemm(A, B, FORMS["softmax"][0])
    program = epilogue_program(FORMS["softmax"][0])
    passes = _gemm_in_passes(program, A, B, {}, False, dict(out_dtype=None, deterministic=False,
                                                            compute_dtype=None, precision="default"))
    if device == "cpu":
        assert len(launched) == 3
    assert torch.allclose(one, passes, rtol=1e-5, atol=1e-6)


def test_reductions_over_m_feeding_later_math_still_run_as_passes(device, monkeypatch):
    """A softmax over M (dim=0) is not one kernel's: epifuse.gemm runs it as passes."""
    A, B = _inputs(device, 37)
    launched = _launches(monkeypatch)
    P = epifuse.gemm(A, B, "def epi(accum):\n    P = softmax(accum, dim=0)\n    return P\n")
    if device == "cpu":
        assert len(launched) == 2
    _check(P, torch.softmax(A.double() @ B.double(), dim=0), torch.softmax(A.float() @ B.float(), dim=0))


def test_the_generated_lines_fold_the_row_in_registers():
    """The tiled kernel's source reduces the row in the tile (tl.reduce over axis 1) and asserts
    that the epilogue sees the whole tile; nothing is stored for the statistic."""
    A, B = _inputs("cpu", 37)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(FORMS["exp_minus_max"][0],
                                                                          P=torch.empty(M, 37)))
    kernel = next(k for k in epifuse.get_kernels(args) if k.name == "triton_tiled")
    text = kernel.source(args, "interpret")
    assert "tl.static_assert(EPI_N == BLOCK_N" in text
    assert "tl.reduce(" in text and "_max_nan)" in text
    assert text.count("tl.store(") == 1


def test_split_k_runs_it_in_one_pass_too(device):
    """The split-K kernel's last program per tile runs the epilogue on the whole tile: it takes
    the in-tile reduction as the tiled kernel does (K = 256 is long enough to split in two)."""
    gen = _generator()
    A = torch.randn(M, 256, generator=gen).to(device)
    B = torch.randn(256, 37, generator=gen).to(device)
    src, reference = FORMS["layer_norm"]
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, P=torch.empty(M, 37, device=device)))
    kernel = next(k for k in epifuse.get_kernels(args) if k.name == "triton_splitk")
    assert kernel.config.block_n >= 37
    kernel.run(args)
    _check(args.outputs["P"], reference(A.double() @ B.double()), reference(A.float() @ B.float()))
