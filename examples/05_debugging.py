"""Debugging an epilogue: verify a kernel against the float64 reference, trace every
intermediate value of one tile, check alignment, and draw the DAG.
"""
import os
import tempfile

import torch

import epifuse
from epifuse import debug
from epifuse.ops import amax, gelu, sigmoid

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
M, N, K = (512, 512, 256) if device == "cuda" else (48, 40, 16)
A = torch.randn(M, K, device=device)
B = torch.randn(K, N, device=device) / K ** 0.5
C = torch.randn(M, N, device=device)
bias = torch.randn(N, device=device)


def epi(accum, alpha, C, bias):
    F = accum * alpha + C
    G = gelu(F + bias)
    D = G * sigmoid(F)
    amax_row = amax(D, dim=1)
    return D, amax_row


D = torch.empty(M, N, device=device)
amax_row = torch.empty(M, device=device)
args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
    epi, alpha=2.0, C=C, bias=bias, D=D, amax_row=amax_row))

# Run the best kernel and check every output against the reference (raises on a mismatch).
kernel = epifuse.get_kernels(args)[0]
report = debug.run(kernel, args, verify=True)
print(report)
print("verified:", debug.which_kernel(args, kernel))   # a fused kernel, or the reference and why

# Every value the epilogue computes, on one tile (the kernel's tile size unless given).
t = debug.trace(args, tile=(1, 0), tile_shape=(16, 16))
print(t)
torch.testing.assert_close(t["D"].float(), D[16:32, 0:16], rtol=1e-4, atol=1e-5)
print("F on the tile's first row:", t["F"][0, :4].tolist())

# What TMA-based kernels need from each tensor's layout.
for name, ok, text in debug.alignment_report(args):
    print(("ok " if ok else "bad"), name, text)

# The optimized DAG, as text and as a picture (DOT always; SVG when graphviz is installed).
print(args.graph)
with tempfile.TemporaryDirectory() as tmp:
    path = debug.draw(args.graph, os.path.join(tmp, "epi.dot"), "epi")
    print("DOT source:", os.path.getsize(path), "bytes")
    if debug.dot_available():
        print("picture:", debug.draw(args.graph, os.path.join(tmp, "epi.svg"), "epi"))
