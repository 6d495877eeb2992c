"""torch.compile(model, backend="epifuse") on a GPU: bench.models' blocks at small sizes, each
trained a step under the backend, against the same block run eagerly in float64. The fused
kernels are the real ones (Gluon or Triton, as tuning picks them), which the CPU tests of the
pass run through the interpreter only."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import epifuse.backend

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.models import build  # noqa: E402

pytestmark = pytest.mark.gpu


def _loss_and_grads(module, inputs):
    for p in module.parameters():
        p.grad = None
    inputs = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
    loss = module(*inputs)
    loss.backward()
    return loss.detach(), [p.grad for p in module.parameters()] + [t.grad for t in inputs if t.requires_grad]


@pytest.mark.parametrize("model", ["mlp", "bert_ffn", "llama_mlp", "llama_merged", "linear_bce", "gcn"])
def test_a_block_under_the_backend_matches_float64_eager(model, monkeypatch):
    """bf16 block, fused by the backend, within bf16's rounding of the float64 block (the
    relative error of the loss and of every gradient, as a norm), and the pass fused at least
    one GEMM: a backend that fused nothing would pass the values trivially. At these sizes
    every GEMM is below the size the backend fuses from, which is lifted here."""
    monkeypatch.setattr(epifuse.graph_fusion, "MIN_FUSED_ELEMENTS", 0)
    monkeypatch.setattr(epifuse.backend, "MEASURE_PAYOFF", False)   # the fused kernels themselves, every region
    torch._dynamo.reset()
    module, inputs, _ = build(model, 1 / 32, "cuda", torch.bfloat16, seed=1)
    exact, exact_inputs, _ = build(model, 1 / 32, "cuda", torch.bfloat16, seed=1)
    exact = exact.double()
    exact_inputs = [t.double() if t.is_floating_point() else t for t in exact_inputs]
    compiled = torch.compile(module, backend=epifuse.backend.backend)
    with epifuse.backend.recorded() as explanation:
        loss, grads = _loss_and_grads(compiled, inputs)
    assert explanation.fused, explanation
    if model == "llama_merged":   # the merged gate/up GEMM runs the gated epilogue
        assert any("accum.chunk(2, dim=-1)" in source for source in explanation.fused), explanation
    want_loss, want_grads = _loss_and_grads(exact, exact_inputs)
    assert abs(float(loss) - float(want_loss)) <= 2e-2 * abs(float(want_loss)) + 1e-6, (float(loss), float(want_loss))
    for got, want in zip(grads, want_grads):
        error = float((got.double() - want).norm() / want.norm().clamp(min=1e-30))
        assert error <= 3e-2, (model, error)


class _LMHead(torch.nn.Module):
    """A last layer and an LM head: what the backend's head rewrite takes (graph_heads)."""

    def __init__(self, hidden=256, vocab=4000, bias=False):
        super().__init__()
        self.body = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=bias)

    def forward(self, x, target):
        logits = self.head(torch.nn.functional.gelu(self.body(x)))
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), target.view(-1),
                                                 label_smoothing=0.1)


@pytest.mark.parametrize("bias", [False, True])
def test_an_lm_head_under_the_backend_runs_the_linear_cross_entropy_and_matches_float64(bias):
    """bf16 head on the GPU: the backend turns it into one linear cross-entropy call (the
    training op, its gradients computed in the forward) and the loss and gradients lie within
    bf16's rounding of the float64 module's; an ignored token among the targets."""
    torch.manual_seed(2)
    module = _LMHead(bias=bias).cuda().bfloat16()
    exact = _LMHead(bias=bias).cuda().double()
    exact.load_state_dict({k: v.double() for k, v in module.state_dict().items()})
    x = torch.randn(4, 96, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 4000, (4, 96), device="cuda")
    target[1, 5] = -100
    torch._dynamo.reset()
    with epifuse.backend.recorded() as explanation:
        loss, grads = _loss_and_grads(torch.compile(module, backend=epifuse.backend.backend), [x, target])
    assert any("linear_cross_entropy(" in source for source in explanation.fused), explanation
    want_loss, want_grads = _loss_and_grads(exact, [x.double(), target])
    assert abs(float(loss) - float(want_loss)) <= 1e-2 * abs(float(want_loss)), (float(loss), float(want_loss))
    for got, want in zip(grads, want_grads):
        error = float((got.double() - want).norm() / want.norm().clamp(min=1e-30))
        assert error <= 3e-2, error


def test_on_a_gpu_the_backend_fuses_only_regions_measured_no_slower(monkeypatch):
    """The backend's payoff guard on the GPU (graph_payoff): a bf16 MLP whose GEMMs are all
    above the fusion bound; every region is either fused or left with its measurement (the
    fused call against the GEMM plus the pass), the values stay within bf16's rounding of
    float64, and measure() itself gives positive times at one of the shapes."""
    from epifuse import graph_payoff
    torch._dynamo.reset()
    module, inputs, _ = build("mlp", 1 / 4, "cuda", torch.bfloat16, seed=3)
    exact, exact_inputs, _ = build("mlp", 1 / 4, "cuda", torch.bfloat16, seed=3)
    exact, exact_inputs = exact.double(), [t.double() for t in exact_inputs]
    assert epifuse.backend.MEASURE_PAYOFF
    verdicts = []

    def judged(*args):
        timing = graph_payoff.measure(*args)
        verdicts.append(timing)
        return None if timing is None or timing.pays else timing.why_not()
    monkeypatch.setattr(graph_payoff, "slower", judged)
    with epifuse.backend.recorded() as explanation:
        loss, grads = _loss_and_grads(torch.compile(module, backend=epifuse.backend.backend), inputs)
    measured = [why for _, why in explanation.left if why.startswith("measured on the GPU")]
    # the forward GELU and its backward at least, each timed, each fused exactly where it paid
    assert len(verdicts) >= 2 and all(t is not None for t in verdicts), (verdicts, explanation)
    assert len(explanation.fused) == sum(t.pays for t in verdicts), (verdicts, explanation)
    assert len(measured) == sum(not t.pays for t in verdicts), (verdicts, explanation)
    want_loss, want_grads = _loss_and_grads(exact, exact_inputs)
    assert abs(float(loss) - float(want_loss)) <= 2e-2 * abs(float(want_loss)) + 1e-6
    for got, want in zip(grads, want_grads):
        assert float((got.double() - want).norm() / want.norm().clamp(min=1e-30)) <= 3e-2
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        a = torch.empty(2048, 1024, device="cuda", dtype=torch.bfloat16)
        b = torch.empty(4096, 1024, device="cuda", dtype=torch.bfloat16).t()
        out = torch.empty(2048, 4096, device="cuda", dtype=torch.bfloat16)
    del mode
    key = epifuse.torch_ops.entry(epifuse.torch_ops.register_epilogue(
        "def relu_only(accum):\n    out0 = relu(accum)\n    return out0\n")).key
    timing = graph_payoff.measure(torch.ops.aten.mm.default, [a, b],
                                  (key, a, b, [], [], "", "bfloat16", torch.float32, False, "default"), out, [], [out])
    assert timing is not None and 0 < timing.gemm_us < 1e4 and 0 < timing.fused_us < 1e4 and 0 < timing.pass_us < 1e4, timing


class _Block3d(torch.nn.Module):
    """Linears over (batch, sequence, features): the views around each mm (bias + GELU, or a
    merged gate/up weight with SwiGLU)."""

    def __init__(self, gated: bool, hidden=256, inner=512):
        super().__init__()
        self.gated = gated
        self.up = torch.nn.Linear(hidden, 2 * inner if gated else inner, bias=not gated)
        self.down = torch.nn.Linear(inner, hidden)

    def forward(self, x):
        if self.gated:
            gate, up = self.up(x).chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up
        else:
            h = torch.nn.functional.gelu(self.up(x))
        return (self.down(h).float() ** 2).mean()


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "merged-gate-up"])
def test_three_dim_blocks_fuse_through_their_views_and_match_float64(gated, monkeypatch):
    """bf16 blocks over (4, 96, 256) activations on the GPU, every region fused (the guard and
    the size bound lifted: the fused kernels themselves are under test): the forward epilogue
    (GELU, or the gated SwiGLU) and the backward's fuse through the views, and the loss and
    gradients lie within bf16's rounding of the float64 block's."""
    monkeypatch.setattr(epifuse.graph_fusion, "MIN_FUSED_ELEMENTS", 0)
    monkeypatch.setattr(epifuse.backend, "MEASURE_PAYOFF", False)
    torch.manual_seed(4)
    module = _Block3d(gated).cuda().bfloat16()
    exact = _Block3d(gated).cuda().double()
    exact.load_state_dict({k: v.double() for k, v in module.state_dict().items()})
    x = torch.randn(4, 96, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    with epifuse.backend.recorded() as explanation:
        loss, grads = _loss_and_grads(torch.compile(module, backend=epifuse.backend.backend), [x])
    sources = "\n".join(explanation.fused)
    assert ("accum.chunk(2, dim=-1)" if gated else "erf(") in sources and len(explanation.fused) >= 3, explanation
    want_loss, want_grads = _loss_and_grads(exact, [x.double()])
    assert abs(float(loss) - float(want_loss)) <= 2e-2 * abs(float(want_loss)), (float(loss), float(want_loss))
    for got, want in zip(grads, want_grads):
        error = float((got.double() - want).norm() / want.norm().clamp(min=1e-30))
        assert error <= 3e-2, error
