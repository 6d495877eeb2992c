"""uint8 GEMMs (issue 36): epifuse's uint8 path against its int8 GEMM and cuBLASLt's int8.

    PYTHONPATH=src:. python -m bench.uint8 [--shapes 4096x4096x4096,8192x8192x8192]

A (M, K) row-major and B (K, N) column-major (the layout cuBLASLt's int8 GEMM takes), an
epilogue `D = accum * scale` into bf16 (a dequantizing W8A8-like output), timed alternately in
one process (do_bench medians, L2 flushed):
  u8 x u8   epifuse.gemm on uint8 A and B: the int8 kernel on A ^ 0x80 and B ^ 0x80, the
            offsets' row and column corrections added to accum (unsigned_inputs.py), with the
            conversion and sum passes
  u8 x s8   the same with B int8 (only A converted, only B's column sums)
  s8 x s8   epifuse.gemm on int8 A and B: what the uint8 path adds its passes to
  _int_mm   torch._int_mm (cuBLASLt, int32 out), then the scale in eager: the int8 floor
The uint8 rows' extra time over s8 x s8 is the passes' cost.
`--device cpu` runs the plumbing at a tiny size under Triton's interpreter (for the tests).
"""
from __future__ import annotations

import sys
import time

import torch

SCALED = "def scaled(accum, scale):\n    D = accum * scale\n    return D\n"


def _ints(shape, dtype, g, device, column_major=False):
    low, high = (0, 256) if dtype == torch.uint8 else (-128, 128)
    if column_major:
        return torch.randint(low, high, shape[::-1], generator=g, device=device).to(dtype).t()
    return torch.randint(low, high, shape, generator=g, device=device).to(dtype)


def measure(M: int, N: int, K: int, device: str, warmup: float, rep: float, rounds: int) -> dict:
    import epifuse
    g = torch.Generator(device=device).manual_seed(0)
    a = {dt: _ints((M, K), dt, g, device) for dt in (torch.uint8, torch.int8)}
    b = {dt: _ints((K, N), dt, g, device, column_major=True) for dt in (torch.uint8, torch.int8)}
    scale = 1.0 / K
    out = dict(out_dtype=torch.bfloat16, scale=scale)
    calls = {"u8 x u8": lambda: epifuse.gemm(a[torch.uint8], b[torch.uint8], SCALED, **out),
             "u8 x s8": lambda: epifuse.gemm(a[torch.uint8], b[torch.int8], SCALED, **out),
             "s8 x s8": lambda: epifuse.gemm(a[torch.int8], b[torch.int8], SCALED, **out)}
    if device == "cuda":
        calls["_int_mm"] = lambda: (torch._int_mm(a[torch.int8], b[torch.int8]) * scale).to(torch.bfloat16)
    first, results = {}, {}
    for name, call in calls.items():
        start = time.perf_counter()
        results[name] = call()
        if device == "cuda":
            torch.cuda.synchronize()
        first[name] = time.perf_counter() - start
    rows = min(M, 256)
    error = {}
    for name, (da, db) in {"u8 x u8": (torch.uint8, torch.uint8), "u8 x s8": (torch.uint8, torch.int8),
                           "s8 x s8": (torch.int8, torch.int8)}.items():
        expected = (a[da][:rows].double() @ b[db].double()) * scale
        error[name] = float(((results[name][:rows].double() - expected).norm() / expected.norm()).item())
    row = {"M": M, "N": N, "K": K, "first_call_s": first, "rel_error": error}
    if device == "cuda":
        from bench.timing import alternate_ms
        times = alternate_ms(calls, rounds, warmup, rep)
        row["ms"] = {name: min(t) for name, t in times.items()}
        row["ms_rounds"] = times
        row["tops"] = {name: 2 * M * N * K / (ms * 1e-3) / 1e12 for name, ms in row["ms"].items()}
    return row


def main(argv=None) -> int:
    from bench.timing import parse_small, save_rows, small_parser
    p = small_parser(__doc__)
    p.add_argument("--shapes", default=None, help="comma list of MxNxK (default 4096x4096x4096,8192x8192x8192; "
                                                  "the CPU: 64x48x96)")
    ns = parse_small(p, argv)
    shapes = ns.shapes or ("64x48x96" if ns.device == "cpu" else "4096x4096x4096,8192x8192x8192")
    rows = [measure(*map(int, s.split("x")), ns.device, ns.warmup, ns.rep, ns.rounds) for s in shapes.split(",")]
    path = save_rows("uint8", "uint8", rows, ns.out, ns.device)
    for row in rows:
        shape = f"{row['M']}x{row['N']}x{row['K']}"
        if "ms" in row:
            print(f"{shape}: " + ", ".join(f"{name} {ms:.3f} ms ({row['tops'][name]:.0f} TOPS)"
                                            for name, ms in row["ms"].items()))
        print(f"{shape}: errors " + ", ".join(f"{name} {e:.1e}" for name, e in row["rel_error"].items()))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
