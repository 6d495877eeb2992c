"""Epilogues whose reductions feed later math, run by epifuse.gemm as passes of the same GEMM
(epifuse.staging, issue 36) where N is wider than any tile (300 here; a narrower N runs in one
kernel: test_one_pass_reductions.py) or the reduction is not over N: softmax and log-softmax over N through logsumexp (two passes), the
max / sum-of-exp softmax and a layer norm (three), a returned reduction that later math also
reads, reductions over M and over everything, batches, gradients; how a program splits."""
import re

import pytest
import torch

import epifuse
from epifuse import staging
from epifuse.errors import EpilogueArgumentError, EpilogueError
from epifuse.frontend import parse

SOFTMAX = "def softmax(accum, bias):\n    z = accum + bias\n    P = exp(z - logsumexp(z, dim=1))\n    return P\n"
LOG_SOFTMAX = "def log_softmax(accum):\n    L = accum - logsumexp(accum, dim=-1)\n    return L\n"
SAFE_SOFTMAX = ("def safe_softmax(accum):\n    m = max(accum, dim=1)\n    s = sum(exp(accum - m), dim=1)\n"
                "    P = exp(accum - m) / s\n    return P, m\n")
LAYER_NORM = ("def layer_norm(accum, eps):\n    mu = mean(accum, dim=1)\n    var = mean((accum - mu) ** 2, dim=1)\n"
              "    D = (accum - mu) * rsqrt(var + eps)\n    return D\n")
COLUMN_SOFTMAX = "def column_softmax(accum):\n    P = exp(accum - logsumexp(accum, dim=0))\n    return P\n"
GLOBAL_SCALE = "def scaled(accum):\n    D = accum / amax(accum)\n    return D\n"


def _inputs(device, shape=(70, 24, 300), batch=(), dtype=torch.float32, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    M, K, N = shape
    A = torch.randn(*batch, M, K, generator=gen, dtype=dtype).to(device)
    B = torch.randn(*batch, K, N, generator=gen, dtype=dtype).to(device)
    return A, B


def test_the_passes_a_program_splits_into():
    assert [sorted(p.computes) for p in staging.passes(parse(SOFTMAX))] == [["_stat1"], []]
    safe = staging.passes(parse(SAFE_SOFTMAX))
    assert [sorted(p.computes) for p in safe] == [["_stat1"], ["_stat2"], []]
    assert safe[0].returns == {"m": "_stat1"}   # m is returned from the pass that computes it
    assert len(staging.passes(parse(LAYER_NORM))) == 3
    one = parse("def e(accum):\n    D = relu(accum)\n    r = sum(D, dim=1)\n    return D, r\n")
    assert not staging.needs_passes(one) and len(staging.passes(one)) == 1
    taken = parse("def e(accum, _stat1):\n    D = accum - max(accum, dim=1) + _stat1\n    return D\n")
    assert sorted(staging.passes(taken)[0].computes) == ["_stat2"]   # no clash with the user's names


@pytest.mark.parametrize("src, reference", [
    (SOFTMAX, lambda z: torch.softmax(z, dim=1)),
    (LOG_SOFTMAX, lambda z: torch.log_softmax(z, dim=-1)),
    (COLUMN_SOFTMAX, lambda z: torch.softmax(z, dim=0)),
    (GLOBAL_SCALE, lambda z: z / z.abs().max()),
    (LAYER_NORM, lambda z: torch.nn.functional.layer_norm(z, z.shape[-1:], eps=1e-5)),
], ids=["softmax", "log_softmax", "column_softmax", "global_scale", "layer_norm"])
@pytest.mark.slow   # among the longest of the README's run (2-3 s or more each): CI runs it with -m slow
def test_passes_match_torch_on_the_kernels(src, reference, device):
    """float32 through the generated kernels (Triton's interpreter on a CPU), several tiles
    each way; against torch in float64."""
    A, B = _inputs(device)
    operands = {"bias": torch.randn(300, device=device)} if "bias" in src else {}
    operands.update({"eps": 1e-5} if "eps" in src else {})
    out = epifuse.gemm(A, B, src, **operands)
    z = A.double() @ B.double() + (operands["bias"].double() if "bias" in operands else 0.0)
    expected = reference(z)
    assert torch.allclose(out.double(), expected, rtol=2e-5, atol=2e-5 * float(expected.abs().max())), \
        float((out.double() - expected).abs().max())


@pytest.mark.slow   # among the longest of the README's run (2-3 s or more each): CI runs it with -m slow
def test_a_returned_reduction_that_later_math_reads_comes_back_too(device):
    A, B = _inputs(device)
    P, m = epifuse.gemm(A, B, SAFE_SOFTMAX)
    z = A.double() @ B.double()
    assert m.shape == (70,) and torch.allclose(m.double(), z.amax(dim=1), rtol=1e-6, atol=1e-6)
    assert torch.allclose(P.double(), torch.softmax(z, dim=1), atol=1e-6)


def test_batches_and_a_passed_output(device):
    A, B = _inputs(device, shape=(40, 16, 50), batch=(3,))
    P = torch.empty(3, 40, 50, device=device)
    returned = epifuse.gemm(A, B, LOG_SOFTMAX, L=P)
    assert returned is P
    assert torch.allclose(P.double(), torch.log_softmax(A.double() @ B.double(), dim=-1), atol=2e-5)


def test_gradients_through_the_passes(device):
    """The statistic is an output of one pass and an operand of the next: autograd carries
    the gradient through both, so the softmax's backward is torch's."""
    A, B = _inputs(device, shape=(6, 5, 7), dtype=torch.float64, seed=3)
    bias = torch.randn(7, dtype=torch.float64, device=device)
    A.requires_grad_(), B.requires_grad_(), bias.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b, c: epifuse.gemm(a, b, SOFTMAX, bias=c), (A, B, bias))
    assert torch.autograd.gradcheck(lambda a, b: epifuse.gemm(a, b, LAYER_NORM, eps=1e-5), (A, B))


def test_accumulate_is_refused_by_name(device):
    A, B = _inputs(device, shape=(8, 4, 8))
    with pytest.raises(EpilogueArgumentError, match="accumulate=True with an epilogue whose reductions feed later math"):
        epifuse.gemm(A, B, LOG_SOFTMAX, L=torch.zeros(8, 8, device=device), accumulate=True)


@pytest.mark.parametrize("n, launches", [(300, 2), (24, 1)])
def test_a_repeated_call_runs_every_pass_from_a_kept_launch(n, launches, device):
    """The passes of a program are kept (staging.passes is cached per program), so a repeated
    call launches each pass's kept launch (the one kernel's, where a tile spans N), and gives
    the same result."""
    from epifuse.runtime import callsite
    A, B = _inputs(device, shape=(16, 8, n))
    first = epifuse.gemm(A, B, LOG_SOFTMAX)
    hits = callsite.HITS[0]
    again = epifuse.gemm(A, B, LOG_SOFTMAX)
    assert callsite.HITS[0] - hits == launches and torch.equal(first, again)


@pytest.mark.parametrize("spelling, reference", [
    ("softmax(z, dim=1)", lambda z: torch.softmax(z, dim=1)),
    ("F.softmax(z, dim=0)", lambda z: torch.softmax(z, dim=0)),
    ("z.log_softmax(-1)", lambda z: torch.log_softmax(z, dim=-1)),
    ("torch.log_softmax(z, dim=1) * 2.0", lambda z: torch.log_softmax(z, dim=1) * 2.0),
])
@pytest.mark.slow   # among the longest of the README's run (2-3 s or more each): CI runs it with -m slow
def test_softmax_and_log_softmax_are_written_through_logsumexp(spelling, reference, device):
    """The composite ops: the parser writes softmax as exp(z - logsumexp(z, dim)), so they run
    as the passes above; every spelling of a call takes them."""
    A, B = _inputs(device)
    bias = torch.randn(300, device=device)
    src = f"def epi(accum, bias):\n    z = accum + bias\n    P = {spelling}\n    return P\n"
    program = parse(src)
    assert "logsumexp" in repr(program.statements[-1].expr) and len(staging.passes(program)) == 2
    out = epifuse.gemm(A, B, src, bias=bias)
    expected = reference(A.double() @ B.double() + bias.double())
    assert torch.allclose(out.double(), expected, rtol=2e-5, atol=2e-5 * float(expected.abs().max()))
    assert torch.allclose(epifuse.ops.softmax(torch.tensor([[1.0, 2.0]])), torch.softmax(torch.tensor([[1.0, 2.0]]), -1))


@pytest.mark.parametrize("spelling, written", [
    ("softmax(accum, dim=2)", "softmax(dim=2)"),
    ("F.log_softmax(accum, dim=-3)", "log_softmax(dim=-3)"),
    ("accum.softmax(5)", "softmax(dim=5)"),
])
def test_a_composite_s_dim_out_of_range_names_the_op_written(spelling, written, device):
    """The composite ops are written as logsumexp; a dim that names no dimension of accum is
    reported as the op the user wrote, at its call, by every entry point."""
    A, B = _inputs(device, shape=(12, 8, 10))
    src = f"def epi(accum):\n    P = {spelling}\n    return P\n"
    message = "^" + re.escape(written) + " is out of range: accum has 2 dimensions"
    with pytest.raises(EpilogueError, match=message) as info:
        epifuse.gemm(A, B, src)
    assert info.value.loc.line == 2 and "logsumexp" not in str(info.value)
    with pytest.raises(EpilogueError, match=message):
        epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, P=torch.empty(12, 10, device=device)))


def test_a_composite_s_dim_in_range_of_a_batched_accum_runs(device):
    """dim=2 is N for a batched accum, as for torch; the op's name travels with its call but
    changes nothing else."""
    A, B = _inputs(device, shape=(12, 8, 10), batch=(2,), seed=3)
    out = epifuse.gemm(A, B, "def epi(accum):\n    P = softmax(accum, dim=2)\n    return P\n")
    assert torch.allclose(out.double(), torch.softmax(A.double() @ B.double(), dim=2), atol=2e-6)
