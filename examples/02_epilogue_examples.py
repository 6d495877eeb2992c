"""The example epilogues of CUTLASS's notebook, with epifuse: auxiliary inputs and outputs,
returning the accumulator, an epilogue given as a string, and what fails (and how it says so).
"""
import torch

from epifuse import EpilogueArguments, EpilogueError, GemmArguments, get_kernels
from epifuse.debug import which_kernel
from epifuse.ops import relu

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(2025)
L, M, N, K = (1, 1024, 1024, 1024) if device == "cuda" else (1, 64, 64, 32)
A = torch.randn(L, M, K, device=device, dtype=torch.float16)
B = torch.randn(L, K, N, device=device, dtype=torch.float16)
accum_ref = A.float() @ B.float()


def check(out, ref):
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-3, atol=2e-3)


# -- Auxiliary input and output tensors --------------------------------------------------------
def relu_aux_store(accum, alpha, C):
    F = (accum * alpha) + (C * 2.0)  # constant beta
    D = relu(F)
    return D, F


C = torch.randn((L, M, N), device=device, dtype=torch.float16)
alpha = 3.0
D = torch.empty((L, M, N), device=device, dtype=torch.float16)
F = torch.empty((L, M, N), device=device, dtype=torch.float16)

epi_args = EpilogueArguments(relu_aux_store, alpha=alpha, C=C, D=D, F=F)
args = GemmArguments(A=A, B=B, out=D, accumulator_type=torch.float32, epilogue=epi_args)
kernels = get_kernels(args)
kernels[0].run(args)

D_ref, F_ref = relu_aux_store(accum_ref, alpha, C.float())
check(D, D_ref)
check(F, F_ref)
print("relu_aux_store matches torch:", which_kernel(args, kernels[0]))   # fused, or the reference


# -- Keyword functions and returning the accumulator -------------------------------------------
def relu_scale_return_acc(accum, alpha, beta, C, scale):
    F = relu((accum * alpha) + (C * beta))
    D = F * scale
    return D, F, accum


alpha, beta, scale = 1.0, 2.0, 0.5
D = torch.empty((L, M, N), device=device, dtype=torch.float16)
F = torch.empty((L, M, N), device=device, dtype=torch.float16)
accum = torch.empty((L, M, N), device=device, dtype=torch.float32)

epi_args = EpilogueArguments(relu_scale_return_acc, alpha=alpha, beta=beta, C=C, scale=scale,
                             D=D, F=F, accum=accum)
args = GemmArguments(A=A, B=B, out=D, accumulator_type=torch.float32, epilogue=epi_args)
kernel = get_kernels(args)[0]
kernel.run(args)

D_ref, F_ref, accum_ref2 = relu_scale_return_acc(accum_ref, alpha, beta, C.float(), scale)
check(D, D_ref)
check(F, F_ref)
check(accum, accum_ref2)
print("relu_scale_return_acc matches torch:", which_kernel(args, kernel))


# -- A string holding the function -------------------------------------------------------------
epi_str = "def epi(accum, alpha, beta, C): F = (accum * alpha) + (C * beta); D = relu(F); return D, F"

alpha, beta = 1.0, 0.5
D = torch.empty((L, M, N), device=device, dtype=torch.float16)
F = torch.empty((L, M, N), device=device, dtype=torch.float16)
epi_args = EpilogueArguments(epi_str, alpha=alpha, beta=beta, C=C, D=D, F=F)
args = GemmArguments(A=A, B=B, out=D, accumulator_type=torch.float32, epilogue=epi_args)
kernel = get_kernels(args)[0]
kernel.run(args)

F_ref = accum_ref * alpha + C.float() * beta
check(D, torch.relu(F_ref))
check(F, F_ref)
print("the string epilogue matches torch:", which_kernel(args, kernel))


# -- What fails, and how ----------------------------------------------------------------------
def fail_missing_accum(alpha, beta, C):
    D = C * beta
    return D


def fail_ssa(accum):
    tmp = accum * 2.0
    tmp = tmp - 1.0  # redefines tmp: epilogues are in SSA form
    D = tmp / 4.0
    return D, tmp


def my_epi(accum, alpha, beta, C):
    F = (accum * alpha) + (C * beta)
    D = relu(F)
    return D


failures = [
    lambda: EpilogueArguments(fail_missing_accum, alpha=alpha, beta=beta, C=C, D=D),
    lambda: EpilogueArguments(fail_ssa, D=D, tmp=F),
    lambda: EpilogueArguments(my_epi, alpha=alpha, beta=beta, C=C),   # no D
    lambda: EpilogueArguments(my_epi, beta=beta, C=C, D=D),           # no alpha
    lambda: EpilogueArguments(my_epi, alpha=alpha, beta=beta, C=C, D=D, gamma=1.0),
    lambda: EpilogueArguments("def e(accum):\n    D = gleu(accum)\n    return D", D=D),
]
for make in failures:
    try:
        make()
    except EpilogueError as error:
        print(error.message)          # the first line; str(error) adds the place and a hint
    else:
        raise AssertionError("expected an EpilogueError")


# Unlike CUTLASS, an epilogue needs no output named D: any returned name is an output.
def only_aux(accum, alpha, beta, C):
    F = (accum * alpha) + (C * beta)
    return F


F = torch.empty((L, M, N), device=device, dtype=torch.float16)
args = GemmArguments(A=A, B=B, accumulator_type=torch.float32,
                     epilogue=EpilogueArguments(only_aux, alpha=alpha, beta=beta, C=C, F=F))
kernel = get_kernels(args)[0]
kernel.run(args)
check(F, accum_ref * alpha + C.float() * beta)
print("only_aux matches torch:", which_kernel(args, kernel))
print("all notebook examples match torch")
