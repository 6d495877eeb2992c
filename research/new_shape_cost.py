"""Host cost of epifuse.gemm at an M it has not seen, in a warm process: the kernel choice is
remembered per argument signature (exact shape), tuning per power-of-two shape bucket.

Warms up at M = 1040 and 1152 (one M per EVEN_M specialization of 128-row tiles), then calls
once at each of 30 new M (multiples of 16 in 1056..1520, the same tuning bucket and Triton
specializations) and again at each: prints the median first-call and repeat-call times (us).
Run on a GPU from either tree: PYTHONPATH=src python research/new_shape_cost.py
"""
import statistics
import time

import torch

import epifuse

SOURCE = "def epi(accum, bias):\n    D = relu(accum + bias)\n    return D\n"
N = K = 1024


def timed_call(A, B, bias) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    epifuse.gemm(A, B, SOURCE, bias=bias)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6


def main():
    B = torch.randn(K, N, device="cuda", dtype=torch.float16)
    bias = torch.randn(N, device="cuda", dtype=torch.float16)
    for M in (1040, 1152):
        A = torch.randn(M, K, device="cuda", dtype=torch.float16)
        for _ in range(3):
            timed_call(A, B, bias)
    new_ms = [m for m in range(1056, 1536, 16) if m != 1152]
    inputs = {M: torch.randn(M, K, device="cuda", dtype=torch.float16) for M in new_ms}
    first = [timed_call(inputs[M], B, bias) for M in new_ms]
    repeat = [timed_call(inputs[M], B, bias) for M in new_ms]
    print(f"new M: median first call {statistics.median(first):.0f} us (max {max(first):.0f}), "
          f"repeat {statistics.median(repeat):.0f} us, over {len(new_ms)} shapes")


if __name__ == "__main__":
    main()
