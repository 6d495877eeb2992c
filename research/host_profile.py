"""Where the host time of a call goes: cProfile of N calls of one path at 256x256x256 fp16 on
the GPU, top functions by own time. Paths: `build` (kernel.run on new GemmArguments each call),
`run` (kernel.run on the same arguments), `gemm` (a repeated epifuse.gemm).

    PYTHONPATH=src:. python research/host_profile.py build [N]
"""
from __future__ import annotations

import cProfile
import pstats
import sys

import torch

import epifuse


def main(path: str, n: int) -> None:
    dev = "cuda"
    A = torch.randn(256, 256, device=dev, dtype=torch.float16)
    B = torch.randn(256, 256, device=dev, dtype=torch.float16)
    bias = torch.randn(256, device=dev, dtype=torch.float16)
    D = torch.empty(256, 256, device=dev, dtype=torch.float16)
    src = "def epi(accum, bias, alpha):\n    D = relu(accum * alpha + bias)\n    return D\n"
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, bias=bias, alpha=2.0, D=D))
    kernel = epifuse.get_kernels(args)[0]
    kernel.compile(args)
    call = {
        "build": lambda: kernel.run(epifuse.GemmArguments(
            A, B, epilogue=epifuse.EpilogueArguments(src, bias=bias, alpha=2.0, D=D))),
        "run": lambda: kernel.run(args),
        "gemm": lambda: epifuse.gemm(A, B, src, bias=bias, alpha=2.0, D=D),
    }[path]
    for _ in range(50):
        call()
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    profile.disable()
    stats = pstats.Stats(profile)
    print(f"{path}: {stats.total_tt / n * 1e6:.1f} us per call under the profiler ({kernel!r})")
    stats.sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 500)
