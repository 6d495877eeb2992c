"""Class-based epilogues: subclass epifuse.FusedGemm and define `epilogue`, as in CUTLASS's
CuTe DSL examples (D = alpha * accum + beta * C + x_factor * X, and Y = accum stored too).
"""
import torch

import epifuse
from epifuse.ops import relu

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
L, M, N, K = (2, 512, 512, 256) if device == "cuda" else (2, 32, 32, 16)
A = torch.randn(L, M, K, device=device, dtype=torch.float16)
B = torch.randn(L, K, N, device=device, dtype=torch.float16) / K ** 0.5
C = torch.randn(L, M, N, device=device, dtype=torch.float16)
X = torch.randn(L, M, N, device=device, dtype=torch.float16)


class GemmAlphaBetaX(epifuse.FusedGemm):
    """Y = A @ B (stored), D = alpha * (A @ B) + beta * C + x_factor * X."""

    def epilogue(self, accum, C, X, alpha, beta, x_factor):
        D = alpha * accum + beta * C + x_factor * X
        Y = accum
        return D, Y


op = GemmAlphaBetaX()
print(op)
print(GemmAlphaBetaX.source)
Y = torch.empty(L, M, N, device=device)   # outputs you pass are written; the others allocated
D, Y = op(A, B, C=C, X=X, alpha=1.5, beta=0.5, x_factor=2.0, Y=Y)

# The method is plain torch code, so calling it yourself is the reference.
D_ref, Y_ref = op.epilogue(A.float() @ B.float(), C.float(), X.float(), 1.5, 0.5, 2.0)
torch.testing.assert_close(D.float(), D_ref, rtol=2e-3, atol=2e-3)
torch.testing.assert_close(Y, Y_ref, rtol=1e-4, atol=1e-4)


# Per-channel operands, a reduction output, and options fixed at construction.
class BiasReluRowSum(epifuse.FusedGemm):
    roles = {"bias": "row"}   # how `epifuse show` draws it

    def epilogue(self, accum, bias):
        D = relu(accum + bias)
        row_sum = D.sum(dim=-1)
        return D, row_sum


bias = torch.randn(N, device=device)
D, row_sum = BiasReluRowSum(out_dtype=torch.float32)(A, B, bias=bias)
D_ref = torch.relu(A.float() @ B.float() + bias)
torch.testing.assert_close(D, D_ref, rtol=1e-4, atol=1e-4)
torch.testing.assert_close(row_sum, D_ref.sum(-1), rtol=1e-4, atol=1e-3)

# Kernel selection works as for any epilogue.
args = op.arguments(A, B, C=C, X=X, alpha=1.5, beta=0.5, x_factor=2.0)
for kernel, status in epifuse.kernel_statuses(args):
    print(f"{kernel!r}: {status}")
# ... and which kernel epifuse.gemm runs (op(...) above): a fused one, or the unfused reference.
print("class-based epilogues match torch:", epifuse.debug.which_kernel(args))
