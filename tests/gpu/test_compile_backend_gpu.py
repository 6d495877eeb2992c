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


@pytest.mark.parametrize("model", ["mlp", "bert_ffn", "llama_mlp", "linear_bce", "gcn"])
def test_a_block_under_the_backend_matches_float64_eager(model, monkeypatch):
    """bf16 block, fused by the backend, within bf16's rounding of the float64 block (the
    relative error of the loss and of every gradient, as a norm), and the pass fused at least
    one GEMM: a backend that fused nothing would pass the values trivially. At these sizes
    every GEMM is below the size the backend fuses from, which is lifted here."""
    monkeypatch.setattr(epifuse.graph_fusion, "MIN_FUSED_ELEMENTS", 0)
    torch._dynamo.reset()
    module, inputs, _ = build(model, 1 / 32, "cuda", torch.bfloat16, seed=1)
    exact, exact_inputs, _ = build(model, 1 / 32, "cuda", torch.bfloat16, seed=1)
    exact = exact.double()
    exact_inputs = [t.double() if t.is_floating_point() else t for t in exact_inputs]
    compiled = torch.compile(module, backend=epifuse.backend.backend)
    with epifuse.backend.recorded() as explanation:
        loss, grads = _loss_and_grads(compiled, inputs)
    assert explanation.fused, explanation
    want_loss, want_grads = _loss_and_grads(exact, exact_inputs)
    assert abs(float(loss) - float(want_loss)) <= 2e-2 * abs(float(want_loss)) + 1e-6, (float(loss), float(want_loss))
    for got, want in zip(grads, want_grads):
        error = float((got.double() - want).norm() / want.norm().clamp(min=1e-30))
        assert error <= 3e-2, (model, error)
