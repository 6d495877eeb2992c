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


def test_heads_whose_rewrite_would_change_the_result_are_left():
    """A tensor written in place between the linear and the loss, a downcast of the logits (the
    loss would see rounded logits), a reduction torch only warns about: left, values unchanged.
    The linear's arguments by keyword (x and weight of one shape, tokens == vocab) are read by
    name, and torch.reshape by keyword joins the chain."""
    torch.manual_seed(6)
    x = torch.randn(VOCAB, HIDDEN, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (VOCAB,))
    weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64, requires_grad=True)

    def in_place(x, target):
        logits = F.linear(x, weight)
        x.mul_(2.0)
        return F.cross_entropy(logits, target)

    def downcast(x, target):
        return F.cross_entropy(F.linear(x, weight).to(torch.float16), target)

    for fn, why in ((in_place, "written in place"), (downcast, "not the output of a linear")):
        got, (fused, left) = _rewritten(fn, x.clone(), target)
        assert fused == [] and len(left) == 1 and why in left[0][1], (fn.__name__, left)
        assert torch.equal(got, fn(x.clone(), target))

    def by_keyword(x, target):
        return F.cross_entropy(torch.reshape(input=F.linear(weight=weight, input=x), shape=(-1, VOCAB)), target)

    got, (fused, left) = _rewritten(by_keyword, x, target)
    assert len(fused) == 1 and torch.allclose(got, by_keyword(x, target), rtol=1e-12, atol=1e-12)


def test_a_frozen_head_computes_only_the_gradients_asked_for():
    """x wants a gradient, the head's weight does not: the op computes dx alone (an empty dweight),
    and x's gradient is eager's."""
    torch.manual_seed(7)
    weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64)
    x = torch.randn(6, HIDDEN, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, VOCAB, (6,))
    loss, dx, dweight, dbias = torch.ops.epifuse.linear_cross_entropy_train(x, weight, target, None, -100, "mean",
                                                                            0.0, True, False, False)
    assert dweight.numel() == 0 and dbias.numel() == 0 and dx.shape == x.shape

    def fn(x, target):
        return F.cross_entropy(F.linear(x, weight), target)
    want = fn(x, target)
    (want_dx,) = torch.autograd.grad(want, (x,))
    got, (fused, _) = _rewritten(fn, x, target)
    (got_dx,) = torch.autograd.grad(got, (x,))
    assert len(fused) == 1 and torch.allclose(got_dx, want_dx, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16], ids=str)
def test_the_training_ops_fake_outputs_match_the_real_ones(dtype):
    """torch.library.opcheck: shapes, dtypes and strides of the fake implementation against the
    real one (a transposed float16 weight takes the recomputing path, whose dweight is contiguous)."""
    torch.manual_seed(8)
    x = torch.randn(6, 8, dtype=dtype)
    weight = torch.randn(8, 12, dtype=dtype).t()
    bias = torch.randn(12, dtype=dtype)
    target = torch.randint(0, 12, (6,))
    for b, needs in ((bias, (True, True, True)), (None, (False, True, False))):
        torch.library.opcheck(torch.ops.epifuse.linear_cross_entropy_train.default,
                              (x, weight, target, b, -100, "sum", 0.1, *needs),
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.slow   # Inductor compiles the forward and the backward on the CPU
def test_a_head_under_dynamic_shapes_trains_as_eager():
    model = Head(bias=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="epifuse", dynamic=True)
    for seed, rows in ((9, 3), (10, 5)):
        torch.manual_seed(seed)
        x = torch.randn(2, rows, HIDDEN, dtype=torch.float64)
        target = torch.randint(0, VOCAB, (2, rows))
        want = model(x, target)
        want.backward()
        want_grads = _grads(model)
        got = compiled(x, target)
        got.backward()
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
        for g, w in zip(_grads(model), want_grads):
            assert torch.allclose(g, w, rtol=1e-10, atol=1e-12)
