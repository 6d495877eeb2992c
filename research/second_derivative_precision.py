"""How close epifuse's second derivatives (create_graph=True through torch_ops.gemm) come to
float64 torch, beside torch's own fp32 on the same GPU, with and without recompute and at each
precision: the scale the GPU test's tolerance is set against.

    PYTHONPATH=src:. python research/second_derivative_precision.py
"""
from __future__ import annotations

import torch

from epifuse import torch_ops

SRC = "def e(accum, bias):\n    D = tanh(accum + bias)\n    r = sum(D * D, dim=1)\n    return D, r\n"


def second(fn, leaves):
    D, r = fn(*leaves)
    firsts = torch.autograd.grad(D.sum() + r.sum(), leaves, create_graph=True)
    return torch.autograd.grad(torch.stack([(g.double() ** 2).sum() for g in firsts]).sum(), leaves)


def torch_reference(a, b, c):
    D = torch.tanh(a @ b + c)
    return D, (D * D).sum(dim=1)


def errors(got, want):
    return [float((g.double() - w).norm() / w.norm()) for g, w in zip(got, want)]


def main():
    torch.manual_seed(0)
    M, N, K = 300, 264, 200
    A = torch.randn(M, K, device="cuda") / K ** 0.5
    B = torch.randn(K, N, device="cuda")
    bias = torch.randn(N, device="cuda")
    want = second(torch_reference, [t.double().requires_grad_() for t in (A, B, bias)])
    print("torch.backends.cuda.matmul.allow_tf32 =", torch.backends.cuda.matmul.allow_tf32)
    rows = [("torch fp32", errors(second(torch_reference, [t.clone().requires_grad_() for t in (A, B, bias)]), want))]
    for recompute in (False, True):
        for precision in ("highest", "default"):
            leaves = [t.clone().requires_grad_() for t in (A, B, bias)]
            got = second(lambda a, b, c: torch_ops.gemm(a, b, SRC, bias=c, recompute=recompute,
                                                         precision=precision), leaves)
            rows.append((f"epifuse recompute={recompute} precision={precision}", errors(got, want)))
    print(f"{'':45s} {'d2/dA':>10s} {'d2/dB':>10s} {'d2/dbias':>10s}")
    for name, errs in rows:
        print(f"{name:45s} " + " ".join(f"{e:10.2e}" for e in errs))


if __name__ == "__main__":
    main()
