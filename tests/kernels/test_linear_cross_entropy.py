"""epifuse.linear_cross_entropy (issue 36): a linear layer and cross-entropy whose logits are
never written, forward and backward, against torch's F.cross_entropy(F.linear(...).float())
in float64 (the reference kernel, exact to roundoff) and in float32 through the interpreted
Triton kernels."""
import pytest
import torch
import torch.nn.functional as F

import epifuse
from epifuse import losses
from epifuse.errors import EpilogueArgumentError, ShapeError
from helpers import fast


def torch_loss(x, weight, target, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
               z_loss=0.0, softcap=None):
    logits = F.linear(x, weight, bias).float() if x.dtype != torch.float64 else F.linear(x, weight, bias)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    flat, t = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    loss = F.cross_entropy(flat, t, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    valid = t != ignore_index
    loss = loss + torch.where(valid, z_loss * torch.logsumexp(flat, -1) ** 2, 0.0)
    if reduction == "mean":
        return loss.sum() / valid.sum()
    return loss.sum() if reduction == "sum" else loss.reshape(target.shape)


def problem(tokens=(6, 7), hidden=24, vocab=70, dtype=torch.float64, bias=True, ignored=3):
    x = torch.randn(*tokens, hidden, dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, hidden, dtype=dtype) / hidden ** 0.5).requires_grad_()
    b = torch.randn(vocab, dtype=dtype, requires_grad=True) if bias else None
    target = torch.randint(0, vocab, tokens)
    target.view(-1)[torch.randperm(target.numel())[:ignored]] = -100
    return x, weight, b, target


def grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("options", [
    {}, {"reduction": "sum"}, {"reduction": "none"}, {"label_smoothing": 0.1},
    {"z_loss": 1e-3}, {"softcap": 5.0}, {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 3.0, "reduction": "sum"},
])
@pytest.mark.parametrize("bias", [True, False])
def test_loss_and_gradients_match_torch_in_float64(options, bias):
    x, weight, b, target = problem(bias=bias)
    ours = epifuse.linear_cross_entropy(x, weight, target, bias=b, **options)
    theirs = torch_loss(x, weight, target, bias=b, **options)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    seed = torch.randn_like(ours) if ours.dim() else torch.tensor(1.7, dtype=ours.dtype)
    for g_ours, g_theirs in zip(grads((ours * seed).sum(), (x, weight, b)), grads((theirs * seed).sum(), (x, weight, b))):
        torch.testing.assert_close(g_ours, g_theirs, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_float32_runs_the_triton_kernels_and_matches_torch(reduction, monkeypatch):
    """Through the interpreted Triton kernels, several tiles each way, in chunks of rows: for
    "mean" the forward's logits with their three row reductions, turned into the gradient in
    place; for "none" the forward's reductions alone and the backward's logit gradient and its
    column sum."""
    x, weight, b, target = problem(tokens=(70,), hidden=40, vocab=90, dtype=torch.float32, ignored=5)
    monkeypatch.setattr(losses, "CHUNK_BYTES", 33 * 90 * 4)   # chunks of 33 rows: three, the last short
    ours = epifuse.linear_cross_entropy(x, weight, target, bias=b, label_smoothing=0.1, z_loss=1e-3,
                                        reduction=reduction)
    seed = torch.rand_like(ours) + 0.5
    got = grads((ours * seed).sum(), (x, weight, b))
    theirs = torch_loss(x.double(), weight.double(), target, b.double(), label_smoothing=0.1, z_loss=1e-3,
                        reduction=reduction)
    want = grads((theirs * seed.double()).sum(), (x, weight, b))
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-4, atol=1e-5)


def test_bfloat16_inputs_give_a_float32_loss_close_to_torch():
    x, weight, b, target = problem(tokens=(40,), hidden=32, vocab=64, dtype=torch.bfloat16, ignored=0)
    ours = epifuse.linear_cross_entropy(x, weight, target, bias=b)
    theirs = torch_loss(x, weight, target, b)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=2e-3, atol=2e-3)
    for g, w in zip(grads(ours, (x, weight, b)), grads(theirs, (x, weight, b))):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g.float(), w.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_every_token_ignored_gives_the_loss_and_gradients_torch_gives(reduction):
    """NaN ("mean") or 0 ("sum") as the loss, and zero gradients, as torch."""
    x, weight, b, target = problem(tokens=(5,), ignored=5)
    ours = epifuse.linear_cross_entropy(x, weight, target, bias=b, reduction=reduction)
    theirs = torch_loss(x, weight, target, b, reduction=reduction)
    assert torch.isnan(ours) == torch.isnan(theirs) == (reduction == "mean")
    for g_ours, g_theirs in zip(grads(ours, (x, weight, b)), grads(theirs, (x, weight, b))):
        assert torch.equal(g_ours, g_theirs) and not g_ours.any()


def test_a_second_backward_of_the_same_graph_gives_the_same_gradients():
    """The training path hands the forward's gradients to the first backward; a second backward
    (retain_graph=True) recomputes them, and the first one's results are left as they were."""
    x, weight, b, target = problem()
    loss = epifuse.linear_cross_entropy(x, weight, target, bias=b, label_smoothing=0.1)
    first = torch.autograd.grad(loss * 2.0, (x, weight, b), retain_graph=True)
    kept = [g.clone() for g in first]
    second = torch.autograd.grad(loss * 2.0, (x, weight, b))
    want = grads(torch_loss(x, weight, target, b, label_smoothing=0.1) * 2.0, (x, weight, b))
    for g1, k, g2, w in zip(first, kept, second, want):
        assert torch.equal(g1, k)
        torch.testing.assert_close(g1, w, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(g2, w, rtol=1e-9, atol=1e-12)


def test_the_loss_is_the_same_with_and_without_gradients():
    """Under no_grad the forward runs the statistics alone (no logits, no gradients)."""
    x, weight, b, target = problem()
    with torch.no_grad():
        plain = epifuse.linear_cross_entropy(x, weight, target, bias=b, z_loss=1e-2)
    training = epifuse.linear_cross_entropy(x, weight, target, bias=b, z_loss=1e-2)
    assert training.requires_grad and not plain.requires_grad
    torch.testing.assert_close(plain, training.detach(), rtol=1e-12, atol=0.0)


def test_gradients_only_for_the_inputs_that_need_them():
    """weight frozen (a tied, frozen embedding) and x without a gradient: each path computes
    only what is asked, and agrees with torch."""
    x, weight, b, target = problem()
    weight.requires_grad_(False)
    ours = epifuse.linear_cross_entropy(x, weight, target, bias=b)
    got = grads(ours, (x, b))
    want = grads(torch_loss(x, weight, target, b), (x, b))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
    x.requires_grad_(False)
    weight.requires_grad_(True)
    ours = epifuse.linear_cross_entropy(x, weight, target, bias=None, reduction="sum")
    torch.testing.assert_close(grads(ours, (weight,))[0], grads(torch_loss(x, weight, target, reduction="sum"), (weight,))[0],
                               rtol=1e-9, atol=1e-12)


def test_the_module_is_the_function():
    x, weight, b, target = problem()
    module = epifuse.nn.LinearCrossEntropyLoss(label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(module(x, weight, target, b),
                               epifuse.linear_cross_entropy(x, weight, target, b, label_smoothing=0.1, reduction="sum"))
    assert "label_smoothing=0.1" in repr(module)


def test_a_double_backward_raises():
    x, weight, b, target = problem()
    loss = epifuse.linear_cross_entropy(x, weight, target, bias=b)
    with pytest.raises(epifuse.errors.UnsupportedError, match="differentiable once"):
        torch.autograd.grad(loss, (x,), create_graph=True)


@pytest.mark.parametrize("change, error, message", [
    (dict(reduction="avg"), EpilogueArgumentError, "reduction must be one of"),
    (dict(label_smoothing=1.5), EpilogueArgumentError, "label_smoothing must be in"),
    (dict(z_loss=-1.0), EpilogueArgumentError, "z_loss must be 0 or more"),
    (dict(softcap=0.0), EpilogueArgumentError, "softcap must be a positive number"),
    (dict(target="probabilities"), ShapeError, "target holds class indices outside|must hold class indices"),
    (dict(target="wrong shape"), ShapeError, "target has shape"),
    (dict(target="out of range"), ShapeError, "outside \\[0, 70\\)"),
    (dict(weight="wrong hidden"), ShapeError, "do not multiply"),
    (dict(bias="wrong size"), ShapeError, "bias must be a \\(70,\\) tensor"),
])
def test_bad_arguments_get_clear_errors(change, error, message):
    x, weight, b, target = problem()
    kwargs = dict(bias=b)
    if change.get("target") == "probabilities":
        target = torch.rand(6, 7)
    elif change.get("target") == "wrong shape":
        target = target[:, :3]
    elif change.get("target") == "out of range":
        target = target.clone()
        target[0, 0] = 70
    elif change.get("weight") == "wrong hidden":
        weight = weight[:, :5]
    elif change.get("bias") == "wrong size":
        kwargs["bias"] = b[:3]
    else:
        kwargs.update(change)
    with pytest.raises(error, match=message):
        epifuse.linear_cross_entropy(x, weight, target, **kwargs)


def test_a_vocabulary_past_fp32s_exact_integers_is_refused():
    weight = torch.zeros(1, 4).expand(2 ** 24 + 2, 4)   # no memory: only the size is read
    with pytest.raises(ShapeError, match="at most 2\\*\\*24 classes"):
        epifuse.linear_cross_entropy(torch.randn(3, 4), weight, torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("moved", [slice(5, 10), slice(3, 12)], ids=["one chunk", "across chunks"])
@pytest.mark.parametrize("offset", [400.0, -300.0], ids=["huge logits", "very negative logits"])
def test_rows_whose_exponentials_leave_the_float_range_are_recomputed(offset, moved, monkeypatch):
    """Rows whose log-sum-exp lies outside losses.WINDOW (exp(z - SHIFT) would overflow or
    vanish in float32) count for nothing in their chunk's matmuls and are recomputed after the
    chunks by the gradient's own epilogue, every such valid row and no other. Float64 against
    torch, chunks of 5 rows."""
    x, weight, b, target = problem(tokens=(15,), ignored=0)
    target[[4, 6]] = -100         # an ignored row inside the moved rows, one outside
    with torch.no_grad():
        weight[:, 0] = 1.0        # feature 0 adds x[i, 0] to every logit of row i...
        x[:, 0] = 0.0
        x[moved, 0] = offset      # ...so the moved rows have a log-sum-exp near `offset`
    monkeypatch.setattr(losses, "CHUNK_BYTES", 5 * 70 * 8)
    recomputed = []
    recompute = losses._recompute_rows
    monkeypatch.setattr(losses, "_recompute_rows", lambda index, *a: recomputed.extend(index.tolist()) or recompute(index, *a))
    ours = epifuse.linear_cross_entropy(x, weight, target, bias=b, label_smoothing=0.1, z_loss=1e-4)
    assert recomputed == [i for i in range(15)[moved] if i not in (4, 6)]
    theirs = torch_loss(x, weight, target, b, label_smoothing=0.1, z_loss=1e-4)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    for g, w in zip(grads(ours, (x, weight, b)), grads(theirs, (x, weight, b))):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


@pytest.mark.slow   # among the longest of the README's run (2-3 s or more each): CI runs it with -m slow
def test_bfloat16_gradients_are_closer_to_float64_than_torchs_own():
    """bf16 inputs, confident tokens (targets mostly the largest logit): the gradient held in
    bf16 comes from float32 logits, so dx and dweight sit nearer the float64 truth than eager
    torch's (whose logits are rounded to bf16 first); the target's entry stays accurate where
    softmax - 1 is small."""
    torch.manual_seed(int(torch.randint(0, 2 ** 31, ()).item()))
    x = torch.randn(64, 32).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(300, 32) * 6.0 / 32 ** 0.5).to(torch.bfloat16).requires_grad_()
    target = (x.detach().double() @ weight.detach().double().t()).argmax(1)
    target[::5] = torch.randint(0, 300, target[::5].shape)
    ours = grads(epifuse.linear_cross_entropy(x, weight, target), (x, weight))
    eager = grads(torch_loss(x, weight, target), (x, weight))
    xd, wd = (t.detach().double().requires_grad_() for t in (x, weight))
    truth = grads(torch_loss(xd, wd, target), (xd, wd))
    for o, e, t in zip(ours, eager, truth):
        ours_error = float((o.double() - t).norm() / t.norm())
        eager_error = float((e.double() - t).norm() / t.norm())
        assert ours_error < 0.5 * eager_error, (ours_error, eager_error)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_tokens_gives_torchs_loss_and_zero_gradients(reduction):
    """Zero tokens: NaN ("mean"), 0 ("sum") or an empty tensor ("none") as torch, and weight
    and bias gradients of exactly 0 (nothing uninitialized handed back)."""
    x, weight, b, target = problem(tokens=(0,), ignored=0)
    ours = epifuse.linear_cross_entropy(x, weight, target, bias=b, reduction=reduction)
    theirs = torch_loss(x, weight, target, b, reduction=reduction)
    torch.testing.assert_close(ours, theirs, equal_nan=True)
    got = grads(ours.sum(), (weight, b))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in got)


@pytest.mark.parametrize("dtype", fast([torch.int16, torch.int32, torch.uint8], keep={2}))
def test_targets_of_any_integer_dtype_torch_takes(dtype):
    """Class indices in int16, int32 or uint8 (as torch's cross_entropy takes them) on every
    path: the training path indexes the gradient with them."""
    x, weight, b, target = problem(ignored=0 if dtype == torch.uint8 else 3)
    narrow = target.to(dtype)
    ours = epifuse.linear_cross_entropy(x, weight, narrow, bias=b)
    theirs = torch_loss(x, weight, target, b)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    for g, w in zip(grads(ours, (x, weight, b)), grads(theirs, (x, weight, b))):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("path", ["training", "no grad", "reduction none"])
@pytest.mark.parametrize("index", [70, -5], ids=["past the vocabulary", "negative"])
def test_a_target_out_of_range_is_refused_on_every_path(path, index):
    """The training path reads its range check at the call's one sync, after its kernels ran
    with every target hidden from them; the others check before their GEMM. Either way the
    error names the range, and a correct call right after gives torch's loss."""
    x, weight, b, target = problem()
    bad = target.clone()
    bad[1, 2] = index
    kwargs = dict(bias=b, reduction="none" if path == "reduction none" else "mean")
    with torch.set_grad_enabled(path != "no grad"), pytest.raises(ShapeError, match="outside \\[0, 70\\)"):
        epifuse.linear_cross_entropy(x, weight, bad, **kwargs)
    loss = epifuse.linear_cross_entropy(x, weight, target, bias=b)
    expected = F.cross_entropy(F.linear(x.double(), weight.double(), b.double()).flatten(0, -2), target.flatten())
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
