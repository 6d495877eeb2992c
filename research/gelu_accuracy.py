"""How accurate is cuBLASLt's fused bias+GELU (torch._addmm_activation, the benchmark's
`cublaslt` baseline for bias_gelu) against epifuse's, per range of the pre-activation x?
Both against float64 tanh-GELU of the same fp16 A @ B + bias, with x spread over about [-9, 9]
(A randn, B randn * 3 / sqrt(K)), S1's shape. Where GELU is near zero (x below -3) a cheaper
formula shows: that is where the two differ.

    PYTHONPATH=src:. python -m research.gelu_accuracy
"""
from __future__ import annotations

import math
import sys

import torch

from bench.workloads import bias_gelu

BINS = ((-8, -5), (-5, -4), (-4, -3), (-3, -2), (-2, -1), (-1, -0.25), (-0.25, 0.25), (0.25, 2), (2, 8))


def main() -> int:
    import epifuse
    if not torch.cuda.is_available():
        print("gelu_accuracy: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    M = N = K = 4096
    A = torch.randn(M, K, device="cuda", dtype=torch.float16)
    B = (torch.randn(K, N, device="cuda") * 3 / math.sqrt(K)).half()
    bias = (torch.randn(N, device="cuda") * 0.5).half()
    x = A.double() @ B.double() + bias.double()
    tanh_ref = torch.nn.functional.gelu(x, approximate="tanh")
    erf_ref = torch.nn.functional.gelu(x)
    outputs = {"cuBLASLt": torch._addmm_activation(bias, A, B, use_gelu=True),
               "epifuse": epifuse.gemm(A, B, bias_gelu, bias=bias)}
    torch.cuda.synchronize()
    for name, ref in (("tanh", tanh_ref), ("erf", erf_ref)):
        print(f"norm-wise relative error against {name}-GELU: " + ", ".join(
            f"{k} {((o.double() - ref).norm() / ref.norm()).item():.2e}" for k, o in outputs.items()))
    print(f"{'x range':>14} {'count':>9}  " + "  ".join(f"{k + ' median/max':>24}" for k in outputs)
          + "  (relative error against tanh-GELU; fp16 rounding alone is up to 4.9e-4)")
    for lo, hi in BINS:
        inside = (x >= lo) & (x < hi) & (tanh_ref.abs() > 1e-30)
        cells = []
        for out in outputs.values():
            rel = (out.double()[inside] - tanh_ref[inside]).abs() / tanh_ref[inside].abs()
            cells.append(f"{rel.median().item():11.2e} {rel.max().item():11.2e}")
        print(f"{lo:>6}..{hi:<6} {int(inside.sum()):9d}  " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
