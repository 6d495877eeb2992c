"""The log-sum-exp reduction (issue 36): stable where exp overflows fp32, exact across tiles
(each tile's log-sum-exp folds with the others' by a log-sum-exp), infinities and NaN as torch,
accumulate=True by logaddexp, gradients, and a cross-entropy whose logits are never written.
The generic reduction tests (test_reductions.py: every axis and destination, batches, keepdim,
NaN, padding lanes, deterministic mode) run it too."""
import pytest
import torch

import epifuse
from helpers import check_reductions, lm_head

LSE_ROWS = "def epi(accum, C):\n    x = accum + C\n    r = logsumexp(x, dim=1)\n    c = logsumexp(x, dim=0)\n    return r, c\n"


def _run(A, B, src, **tensors):
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, **tensors))
    kernels = [k for k in epifuse.get_kernels(args) if k.name.startswith("triton_")]
    assert kernels, epifuse.kernel_statuses(args)
    return args, kernels


@pytest.mark.slow   # among the longest of the README's run (2-3 s or more each): CI runs it with -m slow
@pytest.mark.parametrize("scale", [1.0, 60.0])
def test_stable_where_exp_overflows_and_exact_across_tiles(scale, device):
    """Values up to about 60 * 12: exp overflows fp32 from 88.7, so a fold without the max shift
    gives inf; N of 200 spans several tiles (interpreter tiles are 32 wide), M of 90 several
    rows of tiles, and every Triton kernel that takes the problem is run."""
    gen = torch.Generator(device="cpu").manual_seed(7)
    A = (torch.randn(90, 24, generator=gen) * scale).to(device)
    B = torch.randn(24, 200, generator=gen).to(device)
    C = torch.randn(90, 200, generator=gen).to(device)
    for_each = _run(A, B, LSE_ROWS, C=C, r=torch.empty(90, device=device), c=torch.empty(200, device=device))
    args, kernels = for_each
    for kernel in kernels:
        args.outputs["r"].fill_(float("nan"))
        args.outputs["c"].fill_(float("nan"))
        kernel.run(args)
        assert torch.isfinite(args.outputs["r"]).all() and torch.isfinite(args.outputs["c"]).all(), kernel
        check_reductions(args, "logsumexp")


def test_infinities_and_nan_fold_as_torch(device):
    """A row of -inf gives -inf (nothing to sum), one +inf gives +inf, one NaN gives NaN; the
    other rows are unchanged by them."""
    gen = torch.Generator(device="cpu").manual_seed(3)
    A, B = torch.randn(40, 8, generator=gen).to(device), torch.randn(8, 70, generator=gen).to(device)
    C = torch.zeros(40, 70, device=device)
    C[1, :] = float("-inf")
    C[2, 33] = float("inf")
    C[3, 50] = float("nan")
    C[4, :69] = float("-inf")   # one finite element left in the row
    args, kernels = _run(A, B, LSE_ROWS, C=C, r=torch.empty(40, device=device), c=torch.empty(70, device=device))
    expected = torch.logsumexp(A.double() @ B.double() + C.double(), dim=1)
    for kernel in kernels:
        kernel.run(args)
        r = args.outputs["r"]
        assert r[1] == float("-inf") and r[2] == float("inf") and torch.isnan(r[3])
        assert torch.isfinite(r[4]) and torch.isclose(r[4].double(), expected[4], rtol=1e-6)
        check_reductions(args, "logsumexp")


def test_accumulate_folds_by_logaddexp(device):
    gen = torch.Generator(device="cpu").manual_seed(5)
    A, B = torch.randn(33, 16, generator=gen).to(device), torch.randn(16, 45, generator=gen).to(device)
    before = torch.randn(33, generator=gen).to(device)
    r = before.clone()
    src = "def epi(accum):\n    r = logsumexp(accum, dim=1)\n    return r\n"
    epifuse.gemm(A, B, src, r=r, accumulate=True)
    expected = torch.logaddexp(before.double(), torch.logsumexp(A.double() @ B.double(), dim=1))
    assert torch.allclose(r.double(), expected, rtol=2e-6, atol=2e-6)


def test_gradients_are_softmax_weighted(device):
    """d lse / d accum = softmax(accum) along the folded dim: gradcheck in float64 through the
    op, and against torch.logsumexp's backward in float32 on the kernels."""
    gen = torch.Generator(device="cpu").manual_seed(11)
    src = "def epi(accum, bias):\n    r = logsumexp(accum + bias, dim=1)\n    return r\n"
    A = torch.randn(6, 5, dtype=torch.float64, generator=gen).to(device).requires_grad_()
    B = torch.randn(5, 7, dtype=torch.float64, generator=gen).to(device).requires_grad_()
    bias = torch.randn(7, dtype=torch.float64, generator=gen).to(device).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b, c: epifuse.gemm(a, b, src, bias=c), (A, B, bias))
    a, b, c = (t.detach().float().requires_grad_() for t in (A, B, bias))
    epifuse.gemm(a, b, src, bias=c).sum().backward()
    x, y, z = (t.detach().double().requires_grad_() for t in (A, B, bias))
    torch.logsumexp(x @ y + z, dim=1).sum().backward()
    for mine, theirs in ((a, x), (b, y), (c, z)):
        assert torch.allclose(mine.grad.double(), theirs.grad, rtol=1e-4, atol=1e-5)


def test_cross_entropy_without_writing_the_logits(device):
    """Cross-entropy of logits = x @ W.T + b against class targets, from two (tokens,) outputs:
    the log-sum-exp of each row and the target logit (picked by a one-hot operand), neither of
    them (tokens, vocab); their mean difference is torch's cross_entropy."""
    tokens, hidden, vocab = 48, 16, 150
    x, W, b, target = lm_head(device, tokens, hidden, vocab, seed=13)
    onehot = torch.nn.functional.one_hot(target, vocab).float()
    src = ("def ce(accum, bias, T):\n    z = accum + bias\n    lse = logsumexp(z, dim=1)\n"
           "    picked = sum(z * T, dim=1)\n    return lse, picked\n")
    lse, picked = epifuse.gemm(x, W.t(), src, bias=b, T=onehot)
    assert lse.shape == picked.shape == (tokens,)
    loss = (lse - picked).mean()
    expected = torch.nn.functional.cross_entropy(x.double() @ W.double().t() + b.double(), target)
    assert torch.isclose(loss.double(), expected, rtol=1e-5)


def test_gluon_kernels_refuse_it_by_name():
    """Its lines run under the interpreter, which cannot run the Gluon kernels: they refuse it
    until a GPU has checked them."""
    from epifuse.backends.triton.families import gluon_problem_check
    from epifuse.backends.triton import configs
    A = torch.empty(256, 64, dtype=torch.float16, device="meta")
    B = torch.empty(64, 256, dtype=torch.float16, device="meta").t().contiguous().t()
    src = "def epi(accum):\n    r = logsumexp(accum, dim=1)\n    return r\n"
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, r=torch.empty(256, device="meta")))
    refusal = gluon_problem_check("pingpong", args, configs.PINGPONG[0], 90)
    assert refusal is not None and "do not take logsumexp yet" in str(refusal.reason)
