"""Reduction elimination (epifuse.graph_reductions, issue 33): each rule on aten graphs traced with
Inductor's decompositions, the rewritten graph against the function in float64 on fresh random
inputs; the cases a rule must leave alone; and the compile backend reporting what it replaced in
the graphs Inductor hands it."""
import pytest
import torch
import torch.nn.functional as F

from epifuse.graph_reductions import eliminate_reductions

aten = torch.ops.aten


def _traced(fn, *inputs):
    """fn traced to an aten graph with Inductor's decompositions (fake tensors), the rules run:
    (graph module, what they replaced)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*inputs)
    done = eliminate_reductions(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm, done


def _same(got, want, tol=1e-12):
    for g, w in zip(got if isinstance(got, (tuple, list)) else (got,), want if isinstance(want, (tuple, list)) else (want,)):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.allclose(g, w, rtol=tol, atol=tol, equal_nan=True), (g, w)


def _sums(gm, shape):
    """The sum nodes left in `gm` that read a tensor of `shape`."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.sum.dim_IntList
            and tuple(n.args[0].meta["val"].shape) == shape]


def test_cross_entropy_and_softmax_gradients_lose_their_full_size_sums():
    """An LM head's cross-entropy (an ignored token among them) and a softmax's row sum, forward
    and backward: the one-hot row sum of the cross-entropy backward, the softmax's sum and the
    softmax backward's sum of a row-constant gradient times the softmax are replaced; the loss
    and both gradients are the function's."""
    torch.manual_seed(1)
    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(32, 16, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 32, (8,))
    target[2] = -100

    def step(x, w, target):
        logits = x @ w.t()
        loss = F.cross_entropy(logits, target) + torch.softmax(logits, -1).sum(-1).mean()
        return (loss, *torch.autograd.grad(loss, (x, w)))

    gm, done = _traced(step, x, w, target)
    rules = sorted(rule for _, rule in done)
    assert len(done) == 3 and any(r.startswith("the row sum of a one-hot matrix") for r in rules), done
    assert sum(r.startswith("the row sum of a softmax") for r in rules) == 2, done
    assert len(_sums(gm, (8, 32))) == 2   # the logsumexp's and the softmax's denominator
    _same(gm(x, w, target), step(x, w, target))


@pytest.mark.parametrize("a,b", [(-1.0, 0.0), (2.5, 0.5)])
def test_a_one_hot_row_sum_with_an_index_out_of_range_counts_no_hit(a, b):
    """where(index == iota, a, b) summed over the row: a + (n - 1) b where the index is in the
    row, n b where it is not (negative or past the end), times a per-row factor."""
    torch.manual_seed(2)
    index = torch.tensor([[0], [5], [-1], [6], [3]])
    scale = torch.randn(5, 1, dtype=torch.float64)

    def fn(index, scale):
        hot = torch.where(index == torch.arange(6), a, b).to(torch.float64)
        return (hot * scale).sum(1), (scale * hot).sum(-1, keepdim=True)

    gm, done = _traced(fn, index, scale)
    assert [rule for _, rule in done] == ["the row sum of a one-hot matrix times factors constant along it"] * 2
    assert not _sums(gm, (5, 6))
    _same(gm(index, scale), fn(index, scale))


def test_a_scattered_one_hot_row_sum_is_replaced_and_a_narrower_index_is_not():
    torch.manual_seed(3)
    full = torch.randint(0, 7, (4, 1))
    part = torch.randint(0, 7, (2, 1))

    def fn(full, part):
        whole = torch.zeros(4, 7, dtype=torch.float64).scatter(1, full, 3.0).sum(1)
        rows = torch.zeros(4, 7, dtype=torch.float64).scatter(1, part, 3.0).sum(1)   # rows 2 and 3 have no hit
        return whole, rows

    gm, done = _traced(fn, full, part)
    assert len(done) == 1 and len(_sums(gm, (4, 7))) == 1
    _same(gm(full, part), fn(full, part))


def test_a_softmax_row_sum_is_s_over_s_nan_where_the_sum_of_shares_is():
    """sum(softmax(y), d) is S / S: 1 exactly for finite rows, NaN for a row of -inf, one
    holding +inf or NaN, as the sum of the shares is. A share of another sum, a softmax summed
    over the other dim, and a plain E / sum(E) (whose sum can overflow or cancel) stay."""
    torch.manual_seed(6)
    y = torch.randn(6, 5, dtype=torch.float64) * 30
    y[1] = float("-inf")
    y[2, 3] = float("inf")
    y[3, 0] = float("nan")
    e = torch.randn(6, 5, dtype=torch.float64)

    def fn(y, e):
        return (torch.softmax(y, 1).sum(1), torch.softmax(y, 0).sum(1), (e / e.sum(1, keepdim=True)).sum(1),
                (torch.exp(y) / e.sum(1, keepdim=True)).sum(1))

    gm, done = _traced(fn, y, e)
    assert [rule for _, rule in done] == ["the row sum of a softmax"], done
    got, want = gm(y, e), fn(y, e)
    assert torch.isnan(got[0][1:4]).all() and torch.isnan(want[0][1:4]).all()
    assert torch.equal(got[0][[0, 4, 5]], torch.ones(3, dtype=torch.float64))
    _same(got, want)


def test_a_non_finite_factor_gives_the_nan_of_the_sum():
    """A one-hot's zeros times an infinite or NaN per-row factor make the row sum NaN: so does the
    replacement (not -inf)."""
    index = torch.tensor([[1], [2], [0]])
    scale = torch.tensor([[float("inf")], [float("nan")], [2.0]], dtype=torch.float64)

    def fn(index, scale):
        return (torch.where(index == torch.arange(4), -1.0, 0.0).to(torch.float64) * scale).sum(1)

    gm, done = _traced(fn, index, scale)
    assert len(done) == 1
    got, want = gm(index, scale), fn(index, scale)
    assert torch.isnan(want[:2]).all()
    _same(got, want)


def test_integer_one_hots_zero_d_sums_and_expanded_kept_dims_are_left_alone():
    """A one-hot made or converted in an integer dtype (its a and b rounded as the rule does not),
    a sum over a 0-d tensor's dim, and a mean whose kept dims were expanded too: unchanged."""
    index = torch.tensor([[1], [5], [3]])
    scale = torch.randn(3, 1, dtype=torch.float64)
    v = torch.randn(1, 1, dtype=torch.float64)
    s = torch.randn((), dtype=torch.float64)

    def fn(index, scale, v, s):
        return ((torch.where(index == torch.arange(6), 2.5, 0.5).long() * scale).sum(1),
                (torch.ones(3, 6, dtype=torch.int64).scatter(1, index, -2.5) * scale).sum(1),
                s.sum(0), s.mean(-1), v.expand(3, 5).mean(1))

    gm, done = _traced(fn, index, scale, v, s)
    assert done == []
    _same(gm(index, scale, v, s), fn(index, scale, v, s))


def test_the_mean_of_a_broadcast_or_a_constant_is_the_value():
    torch.manual_seed(4)
    v = torch.randn(3, 1, dtype=torch.float64)
    u = torch.randn(3, 4, dtype=torch.float64)

    def fn(v, u):
        return (v.expand(3, 5).mean(1), v.expand(2, 3, 5).mean((0, 2), keepdim=True),
                torch.full((3, 4), 2.5, dtype=torch.float64).mean(), u.expand(2, 3, 4).mean(2))

    gm, done = _traced(fn, v, u)
    assert [rule for _, rule in done] == ["the mean of a broadcast value"] * 3, done   # not u's: not constant along 2
    _same(gm(v, u), fn(v, u))


@pytest.mark.slow   # Inductor compiles the forward and the backward on the CPU
def test_the_backend_reports_what_it_eliminated_in_inductors_graphs_and_trains_as_eager():
    """Under torch.compile(backend="epifuse") the rules see Inductor's post-grad graphs (its
    one-hot is where(index == iota) there, not a scatter); the loss and gradients are eager's."""
    import epifuse
    torch.manual_seed(5)
    x = torch.randn(16, 24, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 24, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 40, (16,))

    def step(x, w, target):
        return F.cross_entropy(x @ w.t(), target)

    want = step(x, w, target)
    want_grads = torch.autograd.grad(want, (x, w))
    torch._dynamo.reset()
    with epifuse.backend.recorded() as result:
        got = torch.compile(step, backend="epifuse")(x, w, target)
        got_grads = torch.autograd.grad(got, (x, w))
    assert any(rule.startswith("the row sum of a one-hot matrix") for _, rule in result.eliminated), result
    assert "eliminated" in str(result)
    _same((got, *got_grads), (want, *want_grads), tol=1e-10)


@pytest.mark.slow   # Inductor compiles the forward and the backward on the CPU
def test_dynamic_shapes_compile_and_train_as_eager():
    """With dynamic=True the sizes are symbolic: the rules leave those graphs alone, no error."""
    import epifuse  # noqa: F401 - registers backend="epifuse"
    torch.manual_seed(7)

    def step(x, w, target):
        return F.cross_entropy(x @ w.t(), target) + (x * x.shape[1]).sum(1).mean()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="epifuse", dynamic=True)
    for rows in (8, 12):
        x = torch.randn(rows, 6, dtype=torch.float64, requires_grad=True)
        w = torch.randn(10, 6, dtype=torch.float64, requires_grad=True)
        target = torch.randint(0, 10, (rows,))
        got = compiled(x, w, target)
        got_grads = torch.autograd.grad(got, (x, w))
        want = step(x, w, target)
        _same((got, *got_grads), (want, *torch.autograd.grad(want, (x, w))), tol=1e-10)
