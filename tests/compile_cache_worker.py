"""A process that compiles a training step through epifuse.gemm with inductor, for
tests/test_torch_integration.py: run twice over one TORCHINDUCTOR_CACHE_DIR, the second process
loads the forward and backward graphs from inductor's FX graph and AOTAutograd caches, so it
never traces the backward that registers the backward epilogues. Prints one JSON line."""
import json
import sys

import torch
from torch._dynamo.utils import counters

import epifuse
from epifuse.ops import relu, sum  # noqa: A004  (names the epilogue uses)


def relu_aux_loss(accum, alpha, C, bias):
    F = (accum * alpha) + (C * 2.0) + bias
    D = relu(F)
    r = sum(D, dim=1)
    return D, F, r


def step(A, B, C, bias):
    D, F, r = epifuse.gemm(A, B, relu_aux_loss, alpha=0.5, C=C, bias=bias, compute_dtype=torch.float64)
    return (D * F).sum() + r.square().sum()


def main(device: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randint(-3, 4, shape, generator=g).to(device, torch.float64).requires_grad_()
              for shape in [(40, 24), (24, 36), (40, 36), (36,)]]
    got = torch.compile(step, fullgraph=True)(*inputs)
    got_grads = torch.autograd.grad(got, inputs)
    expected = step(*inputs)
    expected_grads = torch.autograd.grad(expected, inputs)
    print(json.dumps({
        "equal": bool(torch.equal(got, expected)),
        "grads_close": all(torch.allclose(a, b, rtol=1e-12, atol=1e-9) for a, b in zip(got_grads, expected_grads)),
        "cache": {k: v for k, v in {**counters["inductor"], **counters["aot_autograd"]}.items() if "cache" in k},
    }))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
