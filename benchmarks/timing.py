"""Timing and machine facts for the benchmark driver.

``bench_ms`` is the median of ``triton.testing.do_bench`` (which flushes L2 before every call),
with a CUDA-event fallback when triton is missing; ``first_call_s`` times one call between two
synchronizations (compile + run). ``gpu_clocks`` reads the SM clock through nvidia-smi (None where
that is not possible); ``collect_env`` records GPU, clocks, versions and the relevant environment.
"""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone

import torch


def bench_ms(fn, warmup: float, rep: float) -> float:
    """Median ms of fn() by triton.testing.do_bench; CUDA events if triton is missing."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return _event_bench(fn, warmup, rep)
    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _event_bench(fn, warmup, rep):
    def once():
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(), fn(), e.record()
        return s, e
    fn(), torch.cuda.synchronize()
    s, e = once()
    torch.cuda.synchronize()
    est = max(s.elapsed_time(e), 1e-3)
    for _ in range(max(1, int(warmup / est))):
        fn()
    pairs = [once() for _ in range(max(5, int(rep / est)))]
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def first_call_s(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def gpu_clocks(uuid: str = ""):
    """SM clock and max SM clock (MHz) from nvidia-smi, or None where it cannot be had."""
    cmd = ["nvidia-smi", "--query-gpu=uuid,clocks.sm,clocks.max.sm", "--format=csv,noheader,nounits"]
    try:
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.count(",") >= 2]
    pick = next((r for r in rows if uuid and uuid in r[0]), rows[0] if rows else None)
    if pick is None:
        return None
    mhz = [int(float(x)) if x.replace(".", "", 1).isdigit() else None for x in pick[1:3]]
    return {"sm_mhz": mhz[0], "max_sm_mhz": mhz[1]}


def collect_env(epifuse=None) -> dict:
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    prefixes = ("EPIFUSE_", "TRITON_", "TORCHINDUCTOR_", "CUDA_VISIBLE_DEVICES")
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": p.name, "capability": f"{p.major}.{p.minor}", "sm_count": p.multi_processor_count,
        "memory_gib": round(p.total_memory / 2**30, 1), "l2_bytes": getattr(p, "L2_cache_size", None),
        "uuid": str(getattr(p, "uuid", "") or "") or None, "clocks_start": None, "clocks_end": None,
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
        "epifuse": getattr(epifuse, "__version__", None) if epifuse else None,
        "python": platform.python_version(), "platform": platform.platform(),
        "fp16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "env_vars": {k: v for k, v in os.environ.items() if k.startswith(prefixes)},
    }
