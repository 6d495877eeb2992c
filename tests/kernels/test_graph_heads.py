"""The LM-head rewrite (epifuse.graph_heads, loss_ops; issue 33): F.cross_entropy over a linear's
logits in a dynamo graph becomes one linear cross-entropy call; the rewritten graph's loss and
gradients against eager's in float64 (the kernels through the interpreter), the heads it must
leave alone with their reasons, and the compile backend running it."""
import pytest
import torch
import torch.nn.functional as F

import epifuse
from epifuse.graph_heads import fuse_heads

VOCAB, HIDDEN = 40, 16


class Head(torch.nn.Module):
    def __init__(self, bias=False, **ce):
        super().__init__()
        self.body = torch.nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=bias, dtype=torch.float64)
        self.ce = ce

    def forward(self, x, target):
        logits = self.head(torch.relu(self.body(x)))
        return F.cross_entropy(logits.view(-1, VOCAB), target.view(-1), **self.ce)


def _rewritten(fn, *inputs):
    """fn compiled by dynamo with fuse_heads as the whole backend (the rewritten graph runs
    eagerly, no Inductor): (output, what fuse_heads did)."""
    done = []

    def backend(gm, example_inputs):
        done.append(fuse_heads(gm))
        return gm.forward
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend)(*inputs)
    (result,) = done
    return out, result


def _inputs(seed, ignored=True):
    torch.manual_seed(seed)
    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (2, 5))
    if ignored:
        target[0, 3] = -100
    return x, target


def _grads(model):
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("bias,ce", [(False, {}), (True, {"label_smoothing": 0.2}), (False, {"reduction": "sum"}),
                                     (True, {"ignore_index": 7, "reduction": "sum", "label_smoothing": 0.05})],
                         ids=["plain", "bias-smoothing", "sum", "ignore-7"])
def test_a_head_becomes_one_call_and_trains_as_eager(bias, ce):
    model = Head(bias=bias, **ce)
    x, target = _inputs(1)
    target[0, 3] = ce.get("ignore_index", -100)
    want = model(x, target)
    want.backward()
    want_grads = _grads(model)
    got, (fused, left) = _rewritten(model, x, target)
    got.backward()
    assert len(fused) == 1 and left == [] and "linear_cross_entropy(" in fused[0]
    assert got.dtype == want.dtype and torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(_grads(model), want_grads):
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-12)


def test_without_gradients_the_forward_only_op_serves_every_reduction():
    model = Head(reduction="none")
    x, target = _inputs(2)
    with torch.no_grad():
        want = model(x, target)
        got, (fused, left) = _rewritten(model, x, target)
    assert len(fused) == 1 and "reduction='none'" in fused[0]
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_heads_it_cannot_take_are_left_with_their_reasons():
    x, target = _inputs(3)
    weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64, requires_grad=True)
    classes = torch.rand(VOCAB, dtype=torch.float64)

    def logits_kept(x, target):
        logits = F.linear(x, weight)
        return F.cross_entropy(logits.view(-1, VOCAB), target.view(-1)), logits.amax()

    def weighted(x, target):
        return F.cross_entropy(F.linear(x, weight).view(-1, VOCAB), target.view(-1), weight=classes)

    def per_token(x, target):
        return F.cross_entropy(F.linear(x, weight).view(-1, VOCAB), target.view(-1), reduction="none")

    def scaled(x, target):
        return F.cross_entropy((F.linear(x, weight) * 2.0).view(-1, VOCAB), target.view(-1))

    for fn, why in ((logits_kept, "read elsewhere"), (weighted, "class weights"),
                    (per_token, "known only in the backward"), (scaled, "not the output of a linear")):
        got, (fused, left) = _rewritten(fn, x, target)
        assert fused == [] and len(left) == 1 and why in left[0][1], (fn.__name__, left)
        want = fn(x, target)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(g, w)


@pytest.mark.slow   # Inductor compiles the forward and the backward on the CPU
def test_the_backend_fuses_the_head_and_explain_shows_it():
    model = Head(bias=True)
    x, target = _inputs(4)
    want = model(x, target)
    want.backward()
    want_grads = _grads(model)
    torch._dynamo.reset()
    with epifuse.backend.recorded() as result:
        got = torch.compile(model, backend="epifuse")(x, target)
        got.backward()
    assert any("linear_cross_entropy(x, weight, target, bias" in source for source in result.fused), result
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(_grads(model), want_grads):
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-12)
