"""Named epilogues (CUTLASS's LinearCombination family) with epifuse.epilogues: scale types,
activations, bias, a user activation function, alpha/beta in every form, and D = C in place.
"""
import torch
import torch.nn.functional as F

import epifuse
from epifuse import epilogues
from epifuse.epilogues import (BiasElementwise, Generic, LinearCombination, LinearCombinationGELU,
                               LinearCombinationLeakyRelu, LinearCombinationRelu, ScaleType)
from epifuse.ops import sigmoid

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
L, M, N, K = (4, 512, 512, 256) if device == "cuda" else (2, 32, 32, 16)
A = torch.randn(L, M, K, device=device)
B = torch.randn(L, K, N, device=device) / K ** 0.5
C = torch.randn(L, M, N, device=device)
accum = A.double() @ B.double()


def check(out, ref):
    torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)


# A named epilogue is its own source: print it, or pass it wherever an epilogue goes.
relu_epi = LinearCombinationRelu()
print(repr(relu_epi))
print(relu_epi)

# Call it like a function of A and B (alpha and beta default to 1.0, as in torch.addmm) ...
D = relu_epi(A, B, alpha=2.0, beta=0.5, C=C)
check(D, torch.relu(2.0 * accum + 0.5 * C.double()))

# ... or use it like any epilogue.
D = epifuse.gemm(A, B, relu_epi, alpha=2.0, beta=0.5, C=C)
check(D, torch.relu(2.0 * accum + 0.5 * C.double()))
args = relu_epi.arguments(A, B, alpha=2.0, beta=0.5, C=C)     # GemmArguments, D allocated
epifuse.get_kernels(args)[0].run(args)
check(args.outputs["D"], torch.relu(2.0 * accum + 0.5 * C.double()))
# Which kernel epifuse.gemm runs for them: a fused one, or the unfused reference and why.
print("LinearCombinationRelu matches torch:", epifuse.debug.which_kernel(args))

# Scale types: which of alpha, beta and C take part.
check(LinearCombination(ScaleType.NO_BETA_SCALING)(A, B, alpha=3.0, C=C), 3.0 * accum + C.double())
check(LinearCombination(ScaleType.ONLY_ALPHA_SCALING)(A, B, alpha=3.0), 3.0 * accum)
check(LinearCombination("nothing")(A, B), accum)

# Activations, with their parameters.
D = LinearCombinationGELU(approximate="tanh")(A, B, alpha=1.0, beta=1.0, C=C)
check(D, F.gelu(accum + C.double(), approximate="tanh"))
D = LinearCombinationLeakyRelu(0.2)(A, B, alpha=1.0, beta=1.0, C=C)
check(D, F.leaky_relu(accum + C.double(), 0.2))

# alpha and beta: a number, a one-element tensor (read when the kernel runs), a per-channel
# vector, or one value per batch ((L,) is reshaped to (L, 1, 1) for you).
alpha_t = torch.tensor([1.5], device=device)
per_channel = torch.rand(N, device=device)
per_batch = torch.arange(1.0, L + 1.0, device=device)
lc = LinearCombination()
check(lc(A, B, alpha=alpha_t, beta=0.0, C=C), 1.5 * accum)
check(lc(A, B, alpha=per_channel, beta=1.0, C=C), per_channel.double() * accum + C.double())
check(lc(A, B, alpha=per_batch, beta=1.0, C=C), per_batch.double().view(L, 1, 1) * accum + C.double())

# Bias and an activation, keeping the pre-activation Z too.
bias = torch.randn(N, device=device)
D, Z = BiasElementwise("silu", store_preactivation=True)(A, B, alpha=1.0, beta=1.0, C=C, bias=bias)
check(Z, accum + C.double() + bias.double())
check(D, F.silu(accum + C.double() + bias.double()))


# Your own activation: parsed (never called) and inlined into the epilogue.
def quick_gelu(x):
    y = x * sigmoid(1.702 * x)
    return y


quick = Generic(quick_gelu)
print(quick)
pre = accum + C.double()
check(quick(A, B, alpha=1.0, beta=1.0, C=C), pre * torch.sigmoid(1.702 * pre))

# In place: D may be the very tensor C.
C_before = C.clone()
out = relu_epi(A, B, alpha=1.0, beta=1.0, C=C, D=C)
assert out is C
check(C, torch.relu(accum + C_before.double()))
print("named epilogues match torch:", ", ".join(epilogues.NAMED))
