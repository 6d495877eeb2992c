"""Gated MLP epilogues (issue 36): SwiGLU over a merged [gate | up] weight, forward only.

    PYTHONPATH=src:. python -m bench.gated [--tokens 16384,128] [--hidden 4096] [--inner 11008]

D = silu(x @ Wg) * (x @ Wu), x (tokens, hidden) and W = [Wg | Wu] (hidden, 2 * inner), bf16,
timed alternately in one process (do_bench medians, L2 flushed):
  epifuse   epifuse.gemm(x, W, swiglu): one kernel, two accumulators, D of width inner
  gemm      x @ W alone (cuBLAS): the floor, what a fused kernel cannot beat by much
  eager     h = x @ W; silu(h[:, :inner]) * h[:, inner:]
  compiled  the eager function under torch.compile (default mode)
  liger     as Liger-Kernel's LigerSwiGLUMLP: x @ Wg and x @ Wu, then its SiLU-mul kernel
            (LigerSiLUMulFunction), when Liger-Kernel is importable (carry its wheel)
Token counts: a training batch (16384) and a decode step (128).
`--device cpu` runs the plumbing at a tiny size under Triton's interpreter (for the tests).
"""
from __future__ import annotations

import json
import sys
import time

import torch

SWIGLU = "def swiglu(accum):\n    gate, up = accum.chunk(2, dim=-1)\n    D = silu(gate) * up\n    return D\n"


def measure(tokens: int, hidden: int, inner: int, device: str, warmup: float, rep: float, rounds: int) -> dict:
    import epifuse
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16)
    w = (torch.randn(hidden, 2 * inner, generator=g, device=device) / hidden ** 0.5).to(torch.bfloat16)

    def eager(x, w):
        h = x @ w
        return torch.nn.functional.silu(h[:, :inner]) * h[:, inner:]

    calls = {"epifuse": lambda: epifuse.gemm(x, w, SWIGLU), "gemm": lambda: x @ w,
             "eager": lambda: eager(x, w)}
    skipped = {}
    if device == "cuda":
        compiled = torch.compile(eager)
        calls["compiled"] = lambda: compiled(x, w)
        try:
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            def liger(x, w):   # as LigerSwiGLUMLP: gate and up projections, then its SiLU-mul kernel
                return LigerSiLUMulFunction.apply(x @ w[:, :inner], x @ w[:, inner:])
            calls["liger"] = lambda: liger(x, w)
        except Exception as error:   # not installed, or an import that fails here
            skipped["liger"] = f"not available: {type(error).__name__}: {error}"
    first, results = {}, {}
    for name, call in calls.items():
        start = time.perf_counter()
        results[name] = call()
        if device == "cuda":
            torch.cuda.synchronize()
        first[name] = time.perf_counter() - start
    rows = min(tokens, 256)
    full = x[:rows].double() @ w.double()
    expected = torch.nn.functional.silu(full[:, :inner]) * full[:, inner:]
    error = {name: float(((results[name][:rows].double() - expected).norm() / expected.norm()).item())
             for name in calls if name != "gemm"}
    row = {"tokens": tokens, "hidden": hidden, "inner": inner, "dtype": "bfloat16", "first_call_s": first,
           "rel_error": error, "skipped": skipped}
    if device == "cuda":
        from bench.timing import alternate_ms
        times = alternate_ms(calls, rounds, warmup, rep)
        row["ms"] = {name: min(t) for name, t in times.items()}
        row["ms_rounds"] = times
        flops = 2 * tokens * hidden * 2 * inner
        row["tflops"] = {name: flops / (ms * 1e-3) / 1e12 for name, ms in row["ms"].items()}
        row["kernel"] = epifuse.debug.which_kernel(epifuse.GemmArguments(
            x, w, epilogue=epifuse.EpilogueArguments(SWIGLU, D=torch.empty(tokens, inner, device=device,
                                                                          dtype=torch.bfloat16))))
    return row


def main(argv=None) -> int:
    from bench.timing import parse_small, save_rows, small_parser
    p = small_parser(__doc__)
    p.add_argument("--tokens", default="16384,128", help="comma list of token counts")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inner", type=int, default=11008)
    ns = parse_small(p, argv)
    rows = [measure(int(t), ns.hidden, ns.inner, ns.device, ns.warmup, ns.rep, ns.rounds) for t in ns.tokens.split(",")]
    path = save_rows("gated_swiglu", "gated", rows, ns.out, ns.device)
    for row in rows:
        if "ms" in row:
            print(f"{row['tokens']:6d} tokens: " + " ".join(
                f"{name} {ms:.3f} ms ({row['tflops'][name]:.0f} TFLOP/s)" for name, ms in row["ms"].items()))
        print(f"{row['tokens']:6d} tokens: errors {json.dumps(row['rel_error'])} {json.dumps(row['skipped'])}")
    print(path)
    return 0

if __name__ == "__main__":
    sys.exit(main())
