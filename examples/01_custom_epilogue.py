"""Step 1 of CUTLASS's epilogue notebook, with epifuse: a custom epilogue, EpilogueArguments,
GemmArguments, get_kernels and kernel.run.

Runs on a GPU, or on a CPU at a small size (through Triton's interpreter when
TRITON_INTERPRET=1 is set, else with epifuse's reference kernel).
"""
import torch

import epifuse
from epifuse import EpilogueArguments, GemmArguments, get_kernels

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(2025)
L, M, N, K = (1, 1024, 1024, 1024) if device == "cuda" else (1, 64, 64, 32)
A = torch.randn(L, M, K, device=device, dtype=torch.float16)
B = torch.randn(L, K, N, device=device, dtype=torch.float16)
C = torch.randn(L, M, N, device=device, dtype=torch.float16)


def my_epilogue(accum, C, alpha, beta, extra_scalar):
    Aux = (alpha * accum) + (beta * C)
    D = extra_scalar * Aux
    return D, Aux


# The epilogue is a plain function over tensors, so torch runs it too: that is the reference.
alpha, beta, extra_scalar = 1.0, 2.0, 0.5
D_ref, Aux_ref = my_epilogue(A.float() @ B.float(), C.float(), alpha, beta, extra_scalar)

# Name a tensor (or a number) for every operand and every output of the epilogue.
D = torch.empty((L, M, N), device=device, dtype=torch.float16)
Aux = torch.empty((L, M, N), device=device, dtype=torch.float16)
epi_args = EpilogueArguments(my_epilogue, C=C, alpha=alpha, beta=beta,
                             extra_scalar=extra_scalar, D=D, Aux=Aux)

# The GEMM and its epilogue; get_kernels lists every kernel that supports them, best first.
args = GemmArguments(A=A, B=B, out=D, accumulator_type=torch.float32, epilogue=epi_args)
kernels = get_kernels(args)
assert len(kernels) > 0
for kernel, status in epifuse.kernel_statuses(args):
    print(f"{kernel!r}: {status}")

# Compile (on first use) and run the best one.
kernels[0].run(args)
torch.testing.assert_close(D.float(), D_ref, rtol=2e-3, atol=2e-3)
torch.testing.assert_close(Aux.float(), Aux_ref, rtol=2e-3, atol=2e-3)

# Or in one call, with the outputs allocated and a tuned kernel picked:
D2, Aux2 = epifuse.gemm(A, B, my_epilogue, C=C, alpha=alpha, beta=beta, extra_scalar=extra_scalar)
torch.testing.assert_close(D2.float(), D_ref, rtol=2e-3, atol=2e-3)

# Which kernel ran: a fused one, or the unfused reference kernel and why (on a CPU, unless
# TRITON_INTERPRET=1 is set); without a kernel, the one epifuse.gemm runs for such arguments.
print("kernels[0] matches torch:", epifuse.debug.which_kernel(args, kernels[0]))
print("epifuse.gemm matches torch:", epifuse.debug.which_kernel(args))
