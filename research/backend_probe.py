"""Where the epifuse backend's fused GEMMs spend their time (issue 33).

    PYTHONPATH=src:. python -m research.backend_probe [--models linear_bce,bert_ffn] [--scale 1.0]
        [--full] [--out DIR]

Compiles each bench.models model with the epifuse backend, runs one training step and records
every epifuse::gemm call the compiled graphs make (the epilogue, and the sizes, strides and
dtypes of A, B, operands and outputs). Each distinct call is then replayed alone on fresh
random tensors laid out the same way, and timed (do_bench medians) as:
  as_called   the kernel the default tuning policy picks for it, at the graph's layouts
  contiguous  the same epilogue with A, B and every operand made contiguous
  plain       epifuse.gemm(A, B) without an epilogue, at the graph's layouts
  cublas      torch.mm / torch.bmm of the same A and B
  full        (--full) every candidate timed, as EPIFUSE_TUNE=full: the fastest and its kernel
--host profiles 20 compiled training steps on the host (cProfile, functions by own time) and
gives the step's wall time against its GPU kernels' sum: where a step waits on Python.
The table says whether a slow fused GEMM is slow for its layouts, its epilogue, or its kernel
choice. `--device cpu` runs the plumbing on tiny sizes through the interpreter (no timing).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def _layout(t):
    return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype).removeprefix("torch.")}


def record_calls(model_name: str, scale: float, device: str, host: dict | None = None):
    """(calls, explanation) of one training step of `model_name` under the epifuse backend;
    with `host` (a dict), 20 more steps profiled on the host into it."""
    import epifuse.backend
    import epifuse.torch_ops as ops
    from bench.models import build
    calls, real = [], ops._run

    def spy(key, program, A, B, values, outputs, compute_dtype, deterministic, precision, accumulate):
        calls.append({"key": key, "program": program, "A": A, "B": B, "values": dict(values),
                      "outputs": dict(outputs), "compute_dtype": compute_dtype, "deterministic": deterministic,
                      "precision": precision})
        return real(key, program, A, B, values, outputs, compute_dtype, deterministic, precision, accumulate)

    module, inputs, _ = build(model_name, scale, device, torch.bfloat16)
    compiled = torch.compile(module, backend=epifuse.backend.backend)
    ops._run = spy
    try:
        with epifuse.backend.recorded() as explanation:
            compiled(*inputs).backward()
    finally:
        ops._run = real
    if host is not None:
        host.update(_host_profile(compiled, inputs, device))
    return calls, explanation


def _host_profile(compiled, inputs, device: str, steps: int = 20) -> dict:
    import cProfile
    import io
    import pstats

    def step():
        compiled(*inputs).backward()
    for _ in range(3):
        step()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    sync()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
    return {"step_ms": wall_ms, "profile": [line for line in text.getvalue().splitlines() if line.strip()][-22:]}


def _fresh(t):
    from epifuse.runtime.tune import _Layout, _fresh_tensor
    return _fresh_tensor(_Layout(tuple(t.shape), tuple(t.stride()), t.dtype, t.device))


def _args(call, A, B, values):
    from epifuse.arguments import EpilogueArguments, GemmArguments
    outputs = {n: torch.empty_like(t) for n, t in call["outputs"].items()}
    epi = EpilogueArguments(call["program"], accumulate=False, deterministic=call["deterministic"],
                            compute_dtype=call["compute_dtype"], **values, **outputs)
    return GemmArguments(A, B, epilogue=epi, precision=call["precision"])


def replay(call, full: bool, timed: bool) -> dict:
    """One recorded call on fresh tensors: the kernel picked, and the times named in the docstring."""
    import epifuse
    from epifuse.backends.select import choose_kernel, get_kernels
    from epifuse.runtime import tune
    A, B = _fresh(call["A"]), _fresh(call["B"])
    values = {n: _fresh(v) if isinstance(v, torch.Tensor) else v for n, v in call["values"].items()}
    args = _args(call, A, B, values)
    kernel = choose_kernel(args)
    row = {"A": _layout(A), "B": _layout(B),
           "operands": {n: _layout(v) for n, v in values.items() if isinstance(v, torch.Tensor)},
           "outputs": {n: _layout(t) for n, t in call["outputs"].items()},
           "epilogue": str(call["program"]), "kernel": repr(kernel)}
    contiguous = _args(call, A.contiguous(), B.contiguous(),
                       {n: v.contiguous() if isinstance(v, torch.Tensor) else v for n, v in values.items()})
    contiguous_kernel = choose_kernel(contiguous)
    row["kernel_contiguous"] = repr(contiguous_kernel)
    if not timed:
        kernel.run(args)
        return row
    from triton.testing import do_bench

    def ms(fn):
        fn()
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    row["as_called_us"] = 1e3 * ms(lambda: kernel.run(args))
    row["contiguous_us"] = 1e3 * ms(lambda: contiguous_kernel.run(contiguous))
    row["plain_us"] = 1e3 * ms(lambda: epifuse.gemm(A, B))
    row["cublas_us"] = 1e3 * ms(lambda: torch.matmul(A, B))
    if full:
        best = tune._time_all(args, [k for k in get_kernels(args) if k.name != "reference"], "full")
        timings = tune.HISTORY[-1]["timings_us"]
        row["full_best"] = repr(best)
        row["full_best_us"] = timings[repr(best)]
        row["full_timings_us"] = timings
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="linear_bce,bert_ffn")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--full", action="store_true")
    p.add_argument("--host", action="store_true")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    timed = ns.device == "cuda"
    result = {"gpu": torch.cuda.get_device_name() if timed else "cpu", "models": {}}
    lines = []
    for name in ns.models.split(","):
        start = time.perf_counter()
        host = {} if ns.host else None
        calls, explanation = record_calls(name, ns.scale, ns.device, host)
        seen, rows = set(), []
        for call in calls:
            signature = (call["key"], *(tuple(t.shape) + tuple(t.stride()) for t in (call["A"], call["B"])))
            if signature in seen:
                continue
            seen.add(signature)
            rows.append(replay(call, ns.full, timed))
        result["models"][name] = {"fused": list(explanation.fused), "left": [list(x) for x in explanation.left],
                                  "calls": rows, "seconds": time.perf_counter() - start, "host": host}
        if host:
            lines.append(f"{name:10s} host: {host['step_ms']:.3f} ms a step (wall, 20 steps)")
            lines.extend(f"{name:10s}   {line[:150]}" for line in host["profile"][:14])
        for k, row in enumerate(rows):
            times = " ".join(f"{what} {row[what + '_us']:7.1f}" for what in ("as_called", "contiguous", "plain", "cublas", "full_best")
                             if what + "_us" in row)
            lines.append(f"{name:10s} call {k}: A {row['A']['shape']}{row['A']['stride']} B {row['B']['shape']}{row['B']['stride']} "
                         f"-> {times} us | {row['kernel']}" + (f" | full: {row['full_best']}" if "full_best" in row else ""))
    if ns.out:
        os.makedirs(ns.out, exist_ok=True)
        path = os.path.join(ns.out, f"backend_probe_{time.strftime('%Y%m%d-%H%M%S')}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(path)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
