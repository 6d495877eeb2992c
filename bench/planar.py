"""Planar complex GEMMs (issue 37): CUTLASS's LinearCombinationPlanarComplex,
D = alpha * accum + beta * C in complex arithmetic, at M = N = K = 4096 by default.

    PYTHONPATH=src:. python -m bench.planar [--size 4096] [--dtypes fp16,fp32] [--out DIR]

For each plane dtype, in the same process, timed alternately (do_bench medians, L2 flushed):
  epifuse        epifuse.gemm_planar_complex: one kernel, four real MMAs per K step into two
                 accumulators, the epilogue fused; D stored planar in the planes' dtype
  torch_complex  torch.matmul on complex64 tensors (cuBLAS's complex GEMM), then the
                 epilogue in eager complex64 ops (the planes packed into complex64 first: not
                 timed, a user holding planes would pay that too)
  four_real      four real cuBLAS GEMMs on the planes (Ar Br, Ai Bi, Ar Bi, Ai Br), the parts
                 summed and the epilogue applied in eager real ops, as a user would write it
fp32 planes: epifuse multiplies them in tf32 (precision="default"), and torch in full fp32 unless
told otherwise, so fp32 rows also time both torch ways with tf32 allowed (`*_tf32`).
Each row also gives the TFLOP/s of 8 M N K real flops (four real GEMMs) and the largest
error of each result against a float64 reference on a 256 x 256 corner. `--device cpu`
runs the plumbing at a tiny size under Triton's interpreter (for the tests).
"""
from __future__ import annotations

import json
import sys
import time

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
ALPHA, BETA = 1.5 - 0.5j, 0.25 + 1.0j


def _inputs(size: int, dtype: torch.dtype, device: str):
    g = torch.Generator(device=device).manual_seed(0)

    def plane(*shape):
        return torch.randn(*shape, generator=g, device=device).div_(8).to(dtype)
    return [plane(size, size) for _ in range(4)] + [plane(size, size), plane(size, size)]


def _with_tf32(call):
    def tf32():
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            return call()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before
    return tf32


def _reference(Ar, Ai, Br, Bi, Cr, Ci, corner: int) -> torch.Tensor:
    A = torch.complex(Ar[:corner].double(), Ai[:corner].double())
    B = torch.complex(Br[:, :corner].double(), Bi[:, :corner].double())
    C = torch.complex(Cr[:corner, :corner].double(), Ci[:corner, :corner].double())
    return ALPHA * (A @ B) + BETA * C


def _error(result, expected, corner: int) -> float:
    got = torch.complex(result[0][:corner, :corner].double(), result[1][:corner, :corner].double()) \
        if isinstance(result, tuple) else result[:corner, :corner].to(torch.complex128)
    return float(((got - expected).abs().max() / expected.abs().max()).item())


def measure(size: int, dtype: torch.dtype, device: str, warmup: float, rep: float, rounds: int) -> dict:
    import epifuse
    from epifuse.epilogues import LinearCombinationPlanarComplex
    from bench.timing import alternate_ms
    Ar, Ai, Br, Bi, Cr, Ci = _inputs(size, dtype, device)
    epi = LinearCombinationPlanarComplex()
    Dr, Di = torch.empty_like(Cr), torch.empty_like(Ci)

    def fused():
        return epi(Ar, Ai, Br, Bi, alpha=ALPHA, beta=BETA, C=(Cr, Ci), D=(Dr, Di))

    A64, B64, C64 = (torch.complex(r.float(), i.float()) for r, i in ((Ar, Ai), (Br, Bi), (Cr, Ci)))

    def torch_complex():
        return ALPHA * torch.matmul(A64, B64) + BETA * C64

    a, b = complex(ALPHA), complex(BETA)

    def four_real():
        re = Ar @ Br - Ai @ Bi
        im = Ar @ Bi + Ai @ Br
        return (a.real * re - a.imag * im + b.real * Cr - b.imag * Ci,
                a.real * im + a.imag * re + b.real * Ci + b.imag * Cr)

    calls = {"epifuse": fused, "torch_complex": torch_complex, "four_real": four_real}
    if dtype == torch.float32:   # epifuse multiplies fp32 planes in tf32 by default: so may cuBLAS
        calls["torch_complex_tf32"] = _with_tf32(torch_complex)
        calls["four_real_tf32"] = _with_tf32(four_real)
    first = {}
    for name, call in calls.items():   # each once untimed: compiles, tunes, checks
        start = time.perf_counter()
        result = call()
        if device == "cuda":
            torch.cuda.synchronize()
        first[name] = time.perf_counter() - start
        if name == "epifuse":
            result = (Dr, Di)
        first[name + "_result"] = result
    corner = min(size, 256)
    expected = _reference(Ar, Ai, Br, Bi, Cr, Ci, corner)
    errors = {name: _error(first.pop(name + "_result"), expected, corner) for name in calls}
    row = {"size": size, "dtype": str(dtype).replace("torch.", ""), "first_call_s": first, "rel_error": errors}
    if device == "cuda":
        times = alternate_ms(calls, rounds, warmup, rep)
        row["ms"] = {name: min(t) for name, t in times.items()}
        row["ms_rounds"] = times
        flops = 8 * size ** 3
        row["tflops"] = {name: flops / (ms * 1e-3) / 1e12 for name, ms in row["ms"].items()}
        row["speedup_vs_torch_complex"] = row["ms"]["torch_complex"] / row["ms"]["epifuse"]
        row["speedup_vs_four_real"] = row["ms"]["four_real"] / row["ms"]["epifuse"]
        args = epi.arguments(Ar, Ai, Br, Bi, alpha=ALPHA, beta=BETA, C=(Cr, Ci), D=(Dr, Di))
        row["kernel"] = epifuse.debug.which_kernel(args)
    return row


def main(argv=None) -> int:
    from bench.timing import parse_small, save_rows, small_parser
    p = small_parser(__doc__)
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--dtypes", default="fp16,fp32")
    ns = parse_small(p, argv)
    rows = []
    for name in ns.dtypes.split(","):
        rows.append(measure(ns.size, DTYPES[name], ns.device, ns.warmup, ns.rep, ns.rounds))
        print(json.dumps(rows[-1].get("ms", rows[-1]["rel_error"])), flush=True)
    path = save_rows("planar_complex", "planar", rows, ns.out, ns.device)
    print(f"{'dtype':6} {'epifuse ms':>11} {'complex64 ms':>13} {'4 real ms':>10} {'vs cplx':>8} {'vs 4 real':>9}")
    for r in rows:
        if "ms" in r:
            m = r["ms"]
            print(f"{r['dtype']:6} {m['epifuse']:11.3f} {m['torch_complex']:13.3f} {m['four_real']:10.3f} "
                  f"{r['speedup_vs_torch_complex']:8.2f} {r['speedup_vs_four_real']:9.2f}")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
