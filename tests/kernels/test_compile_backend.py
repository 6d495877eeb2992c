"""torch.compile(model, backend="epifuse") and epifuse.explain (issue 33, first stage): the
fusion pass (epifuse.graph_fusion) on the post-grad forward and backward graphs, Inductor for
the rest, the fused kernels run through the interpreter; values and gradients against eager."""
import subprocess
import sys
import types
import warnings

import pytest
import torch

import epifuse


def _mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16), torch.nn.ReLU())


def _fused_by_the_pass(fn, *inputs):
    """fn traced to an aten graph (make_fx on fake tensors), fuse_gemms run on it, the graph
    run on `inputs` (the fused kernels through the interpreter): (outputs, report)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from epifuse import graph_fusion
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    report = graph_fusion.fuse_gemms(gm.graph)
    gm.recompile()
    return gm(*inputs), report


def _close(a, b, what, tol=2e-5):
    error = float((a.double() - b.double()).abs().max() / (b.double().abs().max() + 1e-30))
    assert error <= tol, (what, error)


@pytest.mark.slow   # Inductor compiles the forward and the backward on the CPU (about 5 s)
def test_explain_shows_the_fused_forward_and_backward_epilogues():
    model = _mlp()
    x = torch.randn(48, 32)
    found = epifuse.explain(model, x)
    sources = "\n".join(found.fused)
    # forward: each Linear's bias and activation in its GEMM (the pre-activation saved as an output)
    assert "erf(" in sources and "relu(" in sources, sources
    # backward: the GELU derivative times the incoming gradient, and the bias gradient as a
    # column sum, in the epilogue of the GEMM that produces that gradient
    assert "sum(" in sources and "dim=(0,)" in sources, sources
    assert len(found.fused) >= 3, found
    assert all(isinstance(name, str) and why for name, why in found.left), found.left
    assert "epifuse fused" in str(found)


@pytest.mark.slow   # three Inductor compiles on the CPU (about 20 s)
def test_an_mlp_trains_as_eager_under_the_backend():
    """Three SGD steps of the compiled model and of an eager copy from the same weights: the
    losses and every parameter agree to fp32 rounding; a new batch size (a recompile) and
    inference under no_grad too."""
    eager, fused = _mlp(), _mlp()
    compiled = torch.compile(fused, backend="epifuse")
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_f = torch.optim.SGD(fused.parameters(), lr=0.05)
    for step, rows in enumerate((48, 48, 40)):
        x = torch.randn(rows, 32)
        target = torch.randn(rows, 16)
        losses = []
        for model, opt in ((eager, opt_e), (compiled, opt_f)):
            opt.zero_grad()
            loss = ((model(x) - target) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        _close(losses[1], losses[0], ("loss", step))
        for (name, a), b in zip(eager.named_parameters(), fused.parameters()):
            _close(b.detach(), a.detach(), (name, step))
    with torch.no_grad():
        x = torch.randn(8, 32)
        _close(compiled(x), eager(x), "no_grad")


@pytest.mark.slow   # Inductor compiles on the CPU (about 3 s)
def test_functions_without_a_gemm_compile_unchanged():
    compiled = torch.compile(lambda x: torch.relu(x) * 2.0 + 1.0, backend="epifuse")
    x = torch.randn(5, 3)
    assert torch.equal(compiled(x), torch.relu(x) * 2.0 + 1.0)


@pytest.mark.slow   # among the longest of the README's run (2-3 s or more each): CI runs it with -m slow
@pytest.mark.parametrize("order", ["epifuse first", "dynamo first"])
def test_import_epifuse_registers_the_name_with_torchs_registry(order):
    """From a source tree (no entry point needed): `import epifuse` registers "epifuse" when
    torch's backend registry loads later, or at once where it is loaded already; either way
    without importing torch._dynamo itself."""
    first = ("import sys, epifuse\nassert 'torch._dynamo' not in sys.modules\nimport torch._dynamo\n"
             if order == "epifuse first" else "import torch._dynamo, epifuse\n")
    code = first + ("import epifuse.backend\n"
                    "from torch._dynamo.backends import registry\n"
                    "assert registry._COMPILER_FNS['epifuse'] is epifuse.backend.backend\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_backend_is_found_by_name_without_import_epifuse_loading_dynamo():
    """`backend="epifuse"` resolves through the installed package's entry point; `import
    epifuse` itself does not import torch._dynamo (the start-up budget)."""
    code = ("import sys, epifuse\n"
            "assert 'torch._dynamo' not in sys.modules\n"
            "from importlib.metadata import entry_points\n"
            "(ep,) = [e for e in entry_points(group='torch_dynamo_backends') if e.name == 'epifuse']\n"
            "assert ep.load() is epifuse.backend.backend\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.slow   # two Inductor compiles (about 4 s)
def test_addmm_with_beta_and_alpha_is_left_to_inductor_and_stays_right():
    """addmm(bias, x, w, beta=, alpha=) scales its terms: the pass leaves it as it is (and says
    so) rather than fuse the bias as a plain add; the result is eager's."""
    x, w, bias = torch.randn(12, 8), torch.randn(8, 6), torch.randn(6)

    def fn(x, w, bias):
        return torch.relu(torch.addmm(bias, x, w, beta=0.5, alpha=2.0))

    found = epifuse.explain(fn, x, w, bias)
    assert any("scales by beta or alpha" in why for _, why in found.left), found.left
    compiled = torch.compile(fn, backend="epifuse")
    _close(compiled(x, w, bias), fn(x, w, bias), "addmm beta alpha", tol=1e-6)


@pytest.mark.slow   # Inductor compiles the forward and the backward on the CPU (about 5 s)
def test_a_relu_mask_saved_for_the_backward_joins_the_gradient_gemm():
    """ReLU's backward reads the bool mask the forward saved: the mask is read as its bytes
    (as uint8 0 and 1) and its where() joins the epilogue of the GEMM producing the incoming
    gradient, with the bias gradient's column sum; values and gradients are eager's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    x = torch.randn(48, 32)
    found = epifuse.explain(model, x)
    assert any("where(gt(" in source and "sum(" in source for source in found.fused), found
    for p in model.parameters():
        p.grad = None
    (model(x) ** 2).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    torch._dynamo.reset()
    (torch.compile(model, backend="epifuse")(x) ** 2).sum().backward()
    for p, want in zip(model.parameters(), expected):
        _close(p.grad, want, "relu mlp gradient")


@pytest.mark.parametrize("batched", [False, True], ids=["mm", "bmm"])
def test_the_pass_fuses_a_gemm_with_operands_of_every_broadcast_and_a_reduction(batched):
    """mm and bmm regions: a bias row, a per-row (per-batch for bmm) scale, a full tile and a
    reduction over the last dim join one epilogue; integer-valued inputs, so the fused graph's
    outputs equal eager's exactly."""
    from helpers import integer_tensor
    lead = (3,) if batched else ()
    M, K, N = 10, 8, 12
    a, b = integer_tensor(*lead, M, K, dtype=torch.float32), integer_tensor(*lead, K, N, dtype=torch.float32)
    bias, scale = integer_tensor(N, dtype=torch.float32), integer_tensor(*lead, M, 1, dtype=torch.float32)
    tile = integer_tensor(*lead, M, N, dtype=torch.float32)

    def fn(a, b, bias, scale, tile):
        h = torch.bmm(a, b) if batched else a @ b
        y = torch.relu(h + bias) * scale - tile
        return y, y.sum(dim=-1)

    got, report = _fused_by_the_pass(fn, a, b, bias, scale, tile)
    (fused,) = report.fused
    assert "relu(" in fused.source and "sum(" in fused.source and fused.source.count("x") >= 3
    for g, want in zip(got, fn(a, b, bias, scale, tile)):
        assert torch.equal(g, want)


def test_an_operand_that_would_grow_a_bmm_accum_stays_outside_the_epilogue():
    """A (2, L, M, N) operand broadcasts the (L, M, N) product up a dimension: the add stays
    outside (the region ends before it) and the result is still eager's."""
    L, M, K, N = 2, 4, 3, 5
    a, b = torch.randn(L, M, K), torch.randn(L, K, N)
    big = torch.randn(2, L, M, N)

    def fn(a, b, big):
        return torch.sigmoid(torch.bmm(a, b)) + big

    got, report = _fused_by_the_pass(fn, a, b, big)
    (fused,) = report.fused
    assert "sigmoid(" in fused.source and "add(" not in fused.source
    _close(got, fn(a, b, big), "bmm + growing operand", tol=1e-6)


@pytest.mark.parametrize("batched", [False, True], ids=["mm", "bmm"])
def test_a_value_read_after_a_reduction_of_the_region_stays_outside(batched):
    """softmax over a GEMM (amax, sub, exp, sum, div): the region ends at the row maximum, as
    what reads it would need a second pass; the rest is left to Inductor and the values are
    eager's."""
    lead = (2,) if batched else ()
    q, k = torch.randn(*lead, 16, 8), torch.randn(*lead, 8, 16)

    def fn(q, k):
        return torch.softmax(torch.bmm(q, k) if batched else q @ k, dim=-1)

    got, report = _fused_by_the_pass(fn, q, k)
    for fused in report.fused:
        assert "sub(" not in fused.source and "div(" not in fused.source
    _close(got, fn(q, k), "softmax", tol=1e-6)


@pytest.mark.parametrize("batched", [False, True], ids=["mm", "bmm"])
def test_a_keepdim_reduction_joins_and_comes_back_with_its_ones(batched):
    """relu(A @ B).sum(-1, keepdim=True) * c, with M == N so a dropped dim would still
    broadcast: the fused row sum is viewed back to (.., M, 1)."""
    lead = (2,) if batched else ()
    q, k, c = torch.randn(*lead, 16, 8), torch.randn(*lead, 8, 16), torch.randn(*lead, 16, 16)

    def fn(q, k, c):
        return torch.relu(torch.bmm(q, k) if batched else q @ k).sum(-1, keepdim=True) * c

    got, report = _fused_by_the_pass(fn, q, k, c)
    (fused,) = report.fused
    assert "sum(" in fused.source and "keepdim=True" in fused.source
    _close(got, fn(q, k, c), "keepdim row sum", tol=1e-5)


def test_a_loss_over_every_dim_joins_and_its_operand_math_is_inlined():
    """BCE-with-logits over a GEMM, as AOTAutograd's decomposition writes it: the mean over
    every dim joins the epilogue (a 0-d output, as torch.mean's), and `1 - target`, computed
    from a graph input and read by nothing else, is computed in the epilogue from target rather
    than passed whole; the loss is eager's."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from epifuse import graph_fusion
    from helpers import integer_tensor
    x, w = integer_tensor(12, 8, dtype=torch.float32), integer_tensor(8, 10, dtype=torch.float32)
    bias = torch.randn(10)
    target = torch.randint(0, 2, (12, 10)).float()

    def fn(x, w, bias, target):
        z = x @ w + bias
        return (((1 - target) * z) - (torch.minimum(torch.zeros(()), z) - torch.log1p(torch.exp(-z.abs())))).mean()

    got, report = _fused_by_the_pass(fn, x, w, bias, target)
    (fused,) = report.fused
    assert "mean(" in fused.source and "sub(1.0, x" in fused.source, fused.source
    gm = make_fx(fn, tracing_mode="fake")(x, w, bias, target)
    graph_fusion.fuse_gemms(gm.graph)
    assert not any(n.target in (torch.ops.aten.sub.Tensor, torch.ops.aten.rsub.Scalar, torch.ops.aten.mean.default)
                   for n in gm.graph.nodes if n.op == "call_function"), gm.graph   # no pass left for them
    want = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + bias, target)
    assert got.shape == () and want.shape == ()
    _close(got, want, "bce mean", tol=1e-6)


def test_an_operand_computed_for_another_user_too_stays_an_operand():
    """`s = 2 * c` read by the epilogue and returned as well: inlining it would compute it
    twice, so it stays an operand; values are eager's."""
    a, b, c = torch.randn(6, 4), torch.randn(4, 5), torch.randn(6, 5)

    def fn(a, b, c):
        s = c * 2.0
        return torch.relu(a @ b) + s, s

    got, report = _fused_by_the_pass(fn, a, b, c)
    (fused,) = report.fused
    assert "mul(" not in fused.source, fused.source
    for g, want in zip(got, fn(a, b, c)):
        _close(g, want, "shared operand", tol=1e-6)


def test_an_inlined_operand_read_twice_by_one_op_is_removed_once():
    """`s = c * 2.0` read twice by `s * s` (one user node): the epilogue computes s from c (the
    same expression at both reads), and the rewrite removes its node once; values are eager's."""
    a, b, c = torch.randn(6, 4), torch.randn(4, 5), torch.randn(6, 5)

    def fn(a, b, c):
        s = c * 2.0
        return torch.relu(a @ b) + s * s

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, report = _fused_by_the_pass(fn, a, b, c)
    assert not [w for w in caught if "already erased" in str(w.message)], [str(w.message) for w in caught]
    (fused,) = report.fused
    assert fused.source.startswith("def fused_mm(accum, x0):") and "mul(x0, 2.0)" in fused.source, fused.source
    _close(got, fn(a, b, c), "operand read twice", tol=1e-6)


def test_an_op_that_cannot_join_leaves_no_operand_behind():
    """`where(m, y, k)` with k an int64 tensor cannot join (the kernels read float or bool
    operands), after its mask m was already named: the mask must not stay an operand of the
    epilogue that the other user (`y * 3`) gets; values are eager's."""
    a, b = torch.randn(6, 4), torch.randn(4, 5)
    m, k = torch.rand(6, 5) > 0.5, torch.randint(-3, 3, (6, 5))

    def fn(a, b, m, k):
        y = torch.relu(a @ b)
        return torch.where(m, y, k), y * 3.0

    got, report = _fused_by_the_pass(fn, a, b, m, k)
    (fused,) = report.fused
    assert fused.source.splitlines()[0].endswith("(accum):"), fused.source
    for g, want in zip(got, fn(a, b, m, k)):
        _close(g, want, "left out", tol=1e-6)


def test_fp32_values_computed_from_a_bf16_tensor_are_computed_in_the_epilogue_from_it():
    """A GELU backward as AOTAutograd writes it: fp32 values computed from the bf16
    pre-activation h, h's fp32 copy read by several of them. The epilogue reads h itself (2
    bytes an element, not three fp32 tensors), nothing computes the fp32 ones any more, and
    the values are eager's."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from epifuse import graph_fusion
    g, w = torch.randn(12, 8), torch.randn(8, 10)
    h = torch.randn(12, 10).to(torch.bfloat16)

    def fn(g, w, h):
        hf = h.float()
        slope = 0.5 * (1 + torch.erf(hf * 0.7071067811865476)) + hf * torch.exp(-0.5 * hf * hf) * 0.3989422804014327
        return (g @ w) * slope

    got, report = _fused_by_the_pass(fn, g, w, h)
    (fused,) = report.fused
    assert fused.source.startswith("def fused_mm(accum, x0):"), fused.source
    gm = make_fx(fn, tracing_mode="fake")(g, w, h)
    graph_fusion.fuse_gemms(gm.graph)
    left = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.erf.default not in left and torch.ops.aten.exp.default not in left, gm.graph
    _close(got, fn(g, w, h), "gelu backward", tol=1e-6)


def test_an_operand_read_elsewhere_stays_whole_where_its_inputs_are_no_narrower():
    """`s = c * 2.0` (fp32 from fp32) read by the epilogue and by a second GEMM: computing it
    in the epilogue would read as many bytes, so it stays an operand of both."""
    a, b, c = torch.randn(6, 4), torch.randn(4, 5), torch.randn(6, 5)

    def fn(a, b, c):
        s = c * 2.0
        return torch.relu(a @ b) + s, torch.relu(s @ b.t())

    got, report = _fused_by_the_pass(fn, a, b, c)
    assert all("mul(" not in f.source for f in report.fused), [f.source for f in report.fused]
    for g, want in zip(got, fn(a, b, c)):
        _close(g, want, "kept operand", tol=1e-6)


def test_a_gemm_below_min_elements_is_left_with_its_reason():
    """fuse_gemms(min_elements=...): a GEMM writing fewer elements is left to Inductor, said
    why; one at the bound is fused (the backend passes MIN_FUSED_ELEMENTS on a GPU, 0 on CPU)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from epifuse import backend, graph_fusion
    a, b = torch.randn(6, 4), torch.randn(4, 5)

    def fn(a, b):
        return torch.relu(a @ b)
    for bound, fused in ((31, False), (30, True)):
        gm = make_fx(fn, tracing_mode="fake")(a, b)
        report = graph_fusion.fuse_gemms(gm.graph, min_elements=bound)
        assert bool(report.fused) is fused, report
        if not fused:
            assert "30 output elements are fewer than 31" in report.skipped[0][1], report.skipped
    graph = make_fx(fn, tracing_mode="fake")(a, b).graph
    assert not backend._on_gpu(graph)
    next(iter(graph.nodes)).meta["val"] = types.SimpleNamespace(device=torch.device("cuda"))   # as on a GPU
    assert backend._on_gpu(graph) and graph_fusion.MIN_FUSED_ELEMENTS > 0


def test_a_reduction_of_the_whole_gated_result_stays_outside_and_the_halves_still_fuse():
    """The whole result of a chunked GEMM exists in a gated epilogue only as an output: a
    reduction (or any op) reading it whole is left to Inductor, reading that output, and the
    halves' math still fuses."""
    x, w = torch.randn(24, 16, dtype=torch.float64), torch.randn(16, 40, dtype=torch.float64)

    def fn(x, w):
        y = x @ w
        gate, up = y.chunk(2, dim=-1)
        return torch.relu(gate) * up, y.sum(0), y.amax(0, keepdim=True)
    got, report = _fused_by_the_pass(fn, x, w)
    (fused,) = report.fused
    assert "accum.chunk(2, dim=-1)" in fused.source and "cat((gate, up), dim=-1)" in fused.source, fused.source
    assert "sum(" not in fused.source and "max(" not in fused.source, fused.source
    for a, b in zip(got, fn(x, w)):
        _close(a, b, "gated", tol=1e-12)


@pytest.mark.parametrize("whole_read", [False, True], ids=["halves", "halves-and-whole"])
def test_a_gemm_chunked_in_two_gets_a_gated_epilogue(whole_read):
    """`gate, up = (x @ W).chunk(2, dim=-1)` over a merged weight, then silu(gate) * up: one
    gated epilogue (accum chunked), its values N / 2 wide; where the whole result is read too
    (the backward saves it), it is the output cat((gate, up), dim=-1). Values against eager in
    float64, fresh random inputs."""
    x, w = torch.randn(24, 16, dtype=torch.float64), torch.randn(16, 40, dtype=torch.float64)

    def fn(x, w):
        y = x @ w
        gate, up = y.chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
        return (h, y * 1) if whole_read else (h,)
    got, report = _fused_by_the_pass(fn, x, w)
    (fused,) = report.fused
    assert "gate, up = accum.chunk(2, dim=-1)" in fused.source, fused.source
    assert ("cat((gate, up), dim=-1)" in fused.source) is whole_read, fused.source
    for a, b in zip(got, fn(x, w)):
        _close(a, b, "gated", tol=1e-12)


def test_a_split_that_is_not_two_equal_column_halves_is_not_gated():
    """A split into three, or along the rows, is not the gated epilogue's chunk: left alone
    (the GEMM's other consumers still fuse), values unchanged."""
    x, w = torch.randn(24, 16, dtype=torch.float64), torch.randn(16, 36, dtype=torch.float64)

    def thirds(x, w):
        a, b, c = (x @ w).chunk(3, dim=-1)
        return torch.relu(a) * b + c

    def rows(x, w):   # a square result: row halves have the shape column halves would
        a, b = (x @ w).chunk(2, dim=0)
        return torch.relu(a) * b + 1.0
    for fn, x, w in ((thirds, x, w), (rows, torch.randn(24, 16, dtype=torch.float64),
                                      torch.randn(16, 24, dtype=torch.float64)[:, :12].repeat(1, 2))):
        got, report = _fused_by_the_pass(fn, x, w)
        assert not any("chunk" in f.source for f in report.fused), report
        _close(got, fn(x, w), fn.__name__, tol=1e-12)


def test_gate_and_up_gemms_over_separate_weights_are_reported_not_merged():
    """silu(x @ Wg) * (x @ Wu) with two weights: explained (merging would copy both weights
    every step), and the values stay right."""
    x, wg, wu = (torch.randn(*s, dtype=torch.float64) for s in ((24, 16), (16, 20), (16, 20)))

    def fn(x, wg, wu):
        return torch.nn.functional.silu(x @ wg) * (x @ wu)
    got, report = _fused_by_the_pass(fn, x, wg, wu)
    ((names, why),) = report.notes
    assert names == "mm and mm_1" and "one gated GEMM needs the two weights merged" in why, report.notes
    assert not [name for name, _ in report.skipped if " and " in name], report.skipped   # not a GEMM left
    _close(got, fn(x, wg, wu), "separate", tol=1e-12)
    unrelated, report = _fused_by_the_pass(lambda x, wg, wu: (torch.relu(x @ wg), x @ wu), x, wg, wu)
    assert not report.notes, report.notes


@pytest.mark.slow   # Inductor compiles the forward and the backward on the CPU (about 6 s)
def test_a_merged_gate_up_block_trains_as_eager_under_the_backend():
    """A LLaMA-style MLP over a merged gate/up weight, float64: the backend's forward runs the
    gated epilogue (saving the whole GEMM result as the halves' cat for the backward), and the
    loss and every gradient match eager over two SGD steps."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up = torch.nn.Linear(16, 48, bias=False)
            self.down = torch.nn.Linear(24, 16, bias=False)

        def forward(self, x):
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(torch.nn.functional.silu(gate) * up).pow(2).mean()
    torch.manual_seed(0)
    eager = Block().double()
    fused = Block().double()
    fused.load_state_dict(eager.state_dict())
    compiled = torch.compile(fused, backend="epifuse")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, fused)]
    from epifuse.backend import recorded
    with recorded() as found:
        for _ in range(2):
            x = torch.randn(8, 16, dtype=torch.float64)
            losses = [eager(x), compiled(x)]
            for loss, opt in zip(losses, opts):
                opt.zero_grad()
                loss.backward()
            _close(losses[1].detach(), losses[0].detach(), "loss", tol=1e-12)
            for (name, a), b in zip(fused.named_parameters(), eager.parameters()):
                _close(a.grad, b.grad, name, tol=1e-12)
            for opt in opts:
                opt.step()
    assert any("accum.chunk(2, dim=-1)" in s and "cat((gate, up), dim=-1)" in s for s in found.fused), found


def test_a_region_the_judge_declines_is_left_to_inductor_with_its_reason():
    """fuse_gemms(judge=...): the judge sees the GEMM's op and inputs, the fused call's
    arguments, accum, the operands and the outputs (fake values); where it gives a reason the
    graph is left as it was (no epifuse call) and the reason is reported; a judge that raises
    leaves the region too, saying so; a judge returning None lets it fuse."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from epifuse import graph_fusion
    a, b, bias = torch.randn(12, 8, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)

    def fn(a, b, bias):
        return torch.relu(torch.addmm(bias, a, b)) * 2.0
    seen = []

    def declines(target, inputs, call_args, accum, operands, outputs):
        seen.append((target, [tuple(v.shape) for v in inputs], tuple(accum.shape), len(operands), len(outputs),
                     call_args[1] is inputs[1]))
        return "slower, measured"

    def raises(*args):
        raise RuntimeError("out of memory")
    for judge, fused, why in ((declines, False, "slower, measured"),
                              (raises, False, "measuring the fused call failed: RuntimeError: out of memory"),
                              (lambda *args: None, True, None)):
        gm = make_fx(fn, tracing_mode="fake")(a, b, bias)
        report = graph_fusion.fuse_gemms(gm.graph, judge=judge)
        gm.recompile()
        calls = [n for n in gm.graph.nodes if n.target is torch.ops.epifuse.gemm.default]
        assert bool(calls) is fused and bool(report.fused) is fused, report
        if why is not None:
            assert (report.skipped[0][1]) == why, report.skipped
        _close(gm(a, b, bias), fn(a, b, bias), "judged", tol=1e-12)
    assert seen == [(torch.ops.aten.addmm.default, [(6,), (12, 8), (8, 6)], (12, 6), 1, 1, True)], seen


def test_the_payoff_estimate_counts_the_pass_bytes_and_compares_the_sum():
    """graph_payoff's arithmetic: the pass reads accum and the operands and writes the outputs
    other than accum; a fused call pays when no slower than the GEMM plus that pass."""
    from epifuse.graph_payoff import Timing, pass_bytes
    accum, row, out = torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(32), torch.empty(64, 32, dtype=torch.bfloat16)
    assert pass_bytes(accum, [row], [out, accum]) == 64 * 32 * 2 + 32 * 4 + 64 * 32 * 2
    assert Timing(110.0, 100.0, 10.0).pays and not Timing(110.5, 100.0, 10.0).pays
    assert Timing(105.0, 100.0, 10.0, 30.0, 25.0).pays and not Timing(105.0, 100.0, 10.0, 31.0, 25.0).pays
    assert Timing(110.0, 100.0, 10.0, 10.0, 25.0).pays   # less host time than the GEMM's gains nothing
    assert "110 us (and 0 us more host time than the GEMM's call) against 100 us" in Timing(110.4, 100.0, 10.0).why_not()


@pytest.mark.parametrize("fused_us, fuses", [(41.0, True), (41.5, False), (60.0, False)])
def test_the_payoff_judge_runs_both_sides_on_real_inputs_drawn_from_the_fakes(monkeypatch, fused_us, fuses):
    """graph_payoff.slower as fuse_gemms' judge, its timer replaced (do_bench needs a GPU) by
    one that runs each call once and returns set times: the fused call, torch's GEMM and the
    copy all run on real tensors drawn with the graph's shapes and strides (a transposed
    weight, a broadcast bias), outside the fake mode; the region is fused exactly when the
    fused time is within the GEMM's plus the estimated pass."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from epifuse import graph_fusion, graph_payoff
    times = iter([fused_us, 40.0, 4.0])   # fused call, addmm, copy of accum's size
    ran = []

    def timer(fn):
        out = fn()
        ran.append(out[0] if isinstance(out, (tuple, list)) else out)
        return next(times)
    monkeypatch.setattr(graph_payoff, "_time_us", timer)
    host = iter([13.0, 10.0])   # host time of a fused call, of an addmm: 3 us more
    monkeypatch.setattr(graph_payoff, "_host_us", lambda fn: (fn(), next(host))[1])
    a, w, bias = torch.randn(12, 8), torch.randn(6, 8), torch.randn(6)

    def fn(a, w, bias):
        return torch.relu(torch.nn.functional.linear(a, w, bias))
    gm = make_fx(fn, tracing_mode="fake")(a, w, bias)
    report = graph_fusion.fuse_gemms(gm.graph, judge=graph_payoff.slower)
    gm.recompile()
    assert [tuple(t.shape) for t in ran] == [(12, 6), (12, 6), (72,)] and all(not isinstance(t, torch._subclasses.FakeTensor) for t in ran)
    # the pass reads accum and the bias and writes the output, 12*6*4 * 2 + 6*4 bytes: 4 us * 600 / 576 = 4.17 us;
    # fused pays up to 40 + 4.17 - 3 (its extra host time) = 41.17 us
    assert bool(report.fused) is fuses, report
    if not fuses:
        assert report.skipped[-1][1].startswith(f"measured on the GPU, the fused call takes {fused_us:.0f} us (and 3 us "
                                                "more host time than the GEMM's call) against 40 us"), report.skipped
    _close(gm(a, w, bias), fn(a, w, bias), "judged", tol=1e-6)


def test_a_region_passes_through_views_of_accums_rows_and_back():
    """A Linear over (B, S, features) runs as an mm over (B * S, features) viewed back to three
    dims: the region follows the view (and a view back to 2-D), reads operands of the 3-D
    shape as views of accum's rows (a row, a full tile, a column), maps reductions over the
    leading dims to accum's rows; an operand broadcast along some leading dims only, and a
    reduction over some of them, stay outside. Values against eager in float64."""
    B, S, H, N = 2, 3, 8, 10
    x, w, bias = (torch.randn(*s, dtype=torch.float64) for s in ((B, S, H), (H, N), (N,)))
    tile, col, part = (torch.randn(*s, dtype=torch.float64) for s in ((B, S, N), (B, S, 1), (1, S, N)))

    def fn(x, w, bias, tile, col, part):
        y = (x.reshape(B * S, H) @ w).view(B, S, N)
        z = torch.relu(y + bias) * tile - col
        flat = (z * 2.0).view(B * S, N)
        return z, flat.sum(0), z.sum((0, 1)), z.amax(-1), (z * part), z.sum(0)
    got, report = _fused_by_the_pass(fn, x, w, bias, tile, col, part)
    (fused,) = report.fused
    assert "relu(" in fused.source and "dim=(0,)" in fused.source and "dim=(1,)" in fused.source, fused.source
    assert fused.source.count("sum(") == 2, fused.source   # flat.sum(0) and z.sum((0, 1)); z.sum(0) stays out
    for k, (a, b) in enumerate(zip(got, fn(x, w, bias, tile, col, part))):
        assert a.shape == b.shape, (k, a.shape, b.shape)
        _close(a, b, f"output {k}", tol=1e-12)


@pytest.mark.parametrize("layout", ["transposed", "expanded"])
def test_a_rows_view_operand_whose_strides_do_not_merge_stays_outside(layout):
    """A (B, S, N) operand whose leading dims no view merges (a transpose of (S, B, N), or
    (1, S, N) expanded over B) is not read as accum's rows: it stays outside, the rest of the
    region fuses, values right."""
    B, S, H, N = 2, 3, 5, 4
    x, w = torch.randn(B * S, H, dtype=torch.float64), torch.randn(H, N, dtype=torch.float64)
    t = torch.randn(*((S, B, N) if layout == "transposed" else (1, S, N)), dtype=torch.float64)

    def fn(x, w, t):
        other = t.transpose(0, 1) if layout == "transposed" else t.expand(B, S, N)
        return torch.relu((x @ w).view(B, S, N)) * other
    got, report = _fused_by_the_pass(fn, x, w, t)
    (fused,) = report.fused
    assert "relu(" in fused.source and "mul(" not in fused.source, fused.source
    _close(got, fn(x, w, t), layout, tol=1e-12)


@pytest.mark.slow   # Inductor compiles the forward and the backward on the CPU (about 8 s)
@pytest.mark.parametrize("gated", [False, True], ids=["mlp", "merged-gate-up"])
def test_blocks_over_three_dim_activations_fuse_and_train_as_eager(gated):
    """Linears over (B, S, H) under the backend: the bias and activation (or the gated SwiGLU
    over a merged weight), the backward's activation derivative and bias gradient fuse through
    the views, and the loss and every gradient match eager's in float64."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(16, 48 if gated else 32, bias=not gated)
            self.down = torch.nn.Linear(24 if gated else 32, 16)

        def forward(self, x):
            if gated:
                gate, up = self.up(x).chunk(2, dim=-1)
                h = torch.nn.functional.silu(gate) * up
            else:
                h = torch.nn.functional.gelu(self.up(x))
            return torch.relu(self.down(h)).pow(2).mean()
    torch.manual_seed(0)
    eager = Block().double()
    fused = Block().double()
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    from epifuse.backend import recorded
    with recorded() as found:
        loss = torch.compile(fused, backend="epifuse")(x2)
        loss.backward()
    want = eager(x)
    want.backward()
    _close(loss.detach(), want.detach(), "loss", tol=1e-12)
    for (name, a), b in zip(fused.named_parameters(), eager.parameters()):
        _close(a.grad, b.grad, name, tol=1e-12)
    _close(x2.grad, x.grad, "x", tol=1e-12)
    sources = "\n".join(found.fused)
    assert ("accum.chunk(2, dim=-1)" if gated else "erf(") in sources, found
    if not gated:   # the up layer's bias gradient in the epilogue of the GEMM producing its incoming gradient
        assert "dim=(0,)" in sources, found
    assert len(found.fused) >= 3, found
