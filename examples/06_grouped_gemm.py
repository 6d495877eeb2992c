"""Grouped GEMM, mixture-of-experts style: every expert multiplies its own tokens by its own
weights (a different M, N, K per group), with one epilogue, in one kernel launch.
"""
import torch

import epifuse
from epifuse.ops import gelu

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
K = 512 if device == "cuda" else 32
sizes = [(300, 1024), (0, 1024), (77, 512), (1, 1024)] if device == "cuda" else [(40, 24), (0, 24), (17, 50), (1, 8)]


def expert_epilogue(accum, bias, scale):
    F = accum * scale + bias
    D = gelu(F)
    return D, F


problems = []
for tokens, width in sizes:                       # tokens routed to this expert, its output width
    A = torch.randn(tokens, K, device=device, dtype=torch.float16)
    W = torch.randn(K, width, device=device, dtype=torch.float16) / K ** 0.5
    epi = epifuse.EpilogueArguments(
        expert_epilogue,
        bias=torch.randn(width, device=device),                # a row, per expert
        scale=torch.rand(tokens, 1, device=device) + 0.5,      # a column: one scale per token
        D=torch.empty(tokens, width, device=device, dtype=torch.float16),
        F=torch.empty(tokens, width, device=device))
    problems.append(epifuse.GemmArguments(A, W, epilogue=epi))

grouped = epifuse.GroupedGemmArguments(problems)
for kernel, status in epifuse.kernel_statuses(grouped):
    print(f"{kernel!r}: {status}")
kernel = epifuse.get_kernels(grouped)[0]          # the grouped Triton kernel: one launch
kernel.run(grouped)

for p in grouped:
    D, F = expert_epilogue(p.A.double() @ p.B.double(), p.operands["bias"].double(),
                           p.operands["scale"].double())
    torch.testing.assert_close(p.outputs["F"].double(), F, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(p.outputs["D"].double(), D, rtol=2e-3, atol=2e-3)
print("every expert matches torch:", epifuse.debug.which_kernel(grouped, kernel))
