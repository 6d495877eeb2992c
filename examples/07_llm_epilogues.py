"""Three epilogues of LLM training and of signal processing, each one kernel: SwiGLU over a merged
[gate | up] weight, a planar complex GEMM with CUTLASS's LinearCombinationPlanarComplex, and a
linear layer + cross-entropy whose logits are never written.
"""
import torch
import torch.nn.functional as F

import epifuse
from epifuse.epilogues import LinearCombinationPlanarComplex
from epifuse.ops import silu

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
tokens, hidden, inner = (4096, 1024, 2816) if device == "cuda" else (48, 32, 40)


# SwiGLU: the two halves of B's columns are the gate and the up projections
def swiglu(accum):
    gate, up = accum.chunk(2, dim=-1)
    D = silu(gate) * up
    return D


x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
w_gate_up = torch.randn(hidden, 2 * inner, device=device, dtype=torch.bfloat16) / hidden ** 0.5
D = epifuse.gemm(x, w_gate_up, swiglu)                       # (tokens, inner): no (tokens, 2 * inner) tensor
h = x.double() @ w_gate_up.double()
expected = F.silu(h[:, :inner]) * h[:, inner:]
print("SwiGLU matches torch:", torch.allclose(D.double(), expected, rtol=2e-2, atol=2e-2))
args = epifuse.GemmArguments(x, w_gate_up, epilogue=epifuse.EpilogueArguments(swiglu, D=D))
print("  SwiGLU:", epifuse.debug.which_kernel(args))


# A planar complex GEMM: D = alpha * (Ar + i Ai) @ (Br + i Bi) + beta * C, complex alpha and beta
Ar, Ai = (torch.randn(tokens, hidden, device=device) for _ in range(2))
Br, Bi = (torch.randn(hidden, inner, device=device) / hidden ** 0.5 for _ in range(2))
C = torch.randn(tokens, inner, device=device, dtype=torch.complex64)
epi = LinearCombinationPlanarComplex()
Dr, Di = epi(Ar, Ai, Br, Bi, alpha=2 - 1j, beta=0.5j, C=C, precision="highest")
want = (2 - 1j) * (torch.complex(Ar, Ai).to(torch.complex128) @ torch.complex(Br, Bi).to(torch.complex128)) \
    + 0.5j * C.to(torch.complex128)
got = torch.complex(Dr.double(), Di.double())
print("planar complex matches torch:", torch.allclose(got, want, rtol=1e-4, atol=1e-4))
args = epi.arguments(Ar, Ai, Br, Bi, alpha=2 - 1j, beta=0.5j, C=C, precision="highest")
print("  planar complex:", epifuse.debug.which_kernel(args))


# The LM head's loss without its logits: forward and backward
vocab = 32000 if device == "cuda" else 100
head = torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
states = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
target = torch.randint(0, vocab, (tokens,), device=device)
loss = epifuse.linear_cross_entropy(states, head, target, label_smoothing=0.1)
loss.backward()
reference = F.cross_entropy(F.linear(states, head).float(), target, label_smoothing=0.1)
print("linear cross-entropy matches torch:", abs(loss.item() - reference.item()) < 1e-2 * reference.item())
