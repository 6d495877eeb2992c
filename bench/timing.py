"""Timing and machine facts for the benchmark driver.

``bench_ms`` is the median of ``triton.testing.do_bench`` (which flushes L2 before every call),
with a CUDA-event fallback when triton is missing; ``alternate_ms`` times several calls in turn,
round after round, so that a GPU's drift under its power limit falls on each; ``first_call_s`` times one call between two
synchronizations (compile + run). ``gpu_clocks`` reads the SM clock through nvidia-smi (None where
that is not possible); ``ClockSampler`` samples the SM clock, power and throttle reasons while a
baseline is timed; ``collect_env`` records GPU, clocks, versions and the relevant environment.
"""
from __future__ import annotations

import functools
import operator
import os
import platform
import statistics
import subprocess
import threading
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


def alternate_ms(calls: dict, rounds: int, warmup: float, rep: float, return_mode: str = "median") -> dict:
    """{name: [ms of each round]} for `calls` ({name: fn}), each timed by do_bench in turn,
    `rounds` times over."""
    from triton.testing import do_bench
    times: dict = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(float(do_bench(call, warmup=warmup, rep=rep, return_mode=return_mode)))
    return times


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


# What ClockSampler asks nvidia-smi for, first set first: newer drivers call the throttle
# reasons clock events; a driver that knows neither name still gives clock, power and heat.
FIELD_SETS = (("uuid", "clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active"),
              ("uuid", "clocks.sm", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active"),
              ("uuid", "clocks.sm", "power.draw", "temperature.gpu"))


class ClockSampler:
    """``with ClockSampler(uuid) as s: ...``: nvidia-smi samples the GPU every `period_ms`
    while the block runs; ``s.summary`` is then the mean SM clock (MHz), board power (W: on
    recent drivers power.draw is a one-second average, so it lags) and temperature (C), the
    throttle-reason bits seen in any sample (OR-ed: 0x4 power cap, 0x20/0x40 thermal), and the
    sample count; None where nvidia-smi cannot run or gave no sample. The block starts after
    the first sample has arrived, so the samples cover all of it."""

    _working: dict = {}   # command -> the field set that sampled, or None: none did (not asked again)

    def __init__(self, uuid: str = "", period_ms: int = 20, command: str = "nvidia-smi"):
        self.uuid, self.period_ms, self.command = uuid, period_ms, command
        self.lines: list[str] = []
        self.summary = None
        self._process = self._reader = None

    def __enter__(self):
        known = ClockSampler._working.get(self.command, ...)
        for fields in FIELD_SETS if known is ... else [known] if known else []:
            if self._start(fields):
                ClockSampler._working[self.command] = fields
                break
        else:   # none answered: remembered after a first probe; a set that worked is probed anew
            if known is ...:
                ClockSampler._working[self.command] = None
            else:
                ClockSampler._working.pop(self.command, None)
        return self

    def _start(self, fields) -> bool:
        """Start sampling `fields`; False (nothing left running) unless a sample of that many
        columns came (an unknown field is a line of text on stdout, then exit 2)."""
        cmd = [self.command, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
               "-lms", str(self.period_ms)]
        try:
            process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return False
        lines: list[str] = []
        first = threading.Event()

        def read():
            for line in process.stdout:
                lines.append(line.strip())
                if line.count(",") == len(fields) - 1:
                    first.set()
            first.set()  # it exited: stop waiting

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            first.wait(timeout=5.0)
        except BaseException:
            _stop(process, reader)
            raise
        if process.poll() is not None or not any(ln.count(",") == len(fields) - 1 for ln in lines):
            _stop(process, reader)
            return False
        self.lines, self._process, self._reader = lines, process, reader
        return True

    def __exit__(self, *exc):
        if self._process is not None:
            _stop(self._process, self._reader)
            self.summary = summarize_samples(self.lines, self.uuid)
        return False


def _stop(process, reader) -> None:
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    reader.join(timeout=5)
    process.stdout.close()


def summarize_samples(lines, uuid: str = ""):
    """ClockSampler's summary of nvidia-smi's CSV lines (a FIELD_SETS set, one GPU per line)."""
    def number(text):
        try:
            return float(text)
        except ValueError:
            return None

    rows = [[c.strip() for c in line.split(",")] for line in lines]
    rows = [r for r in rows if len(r) in (4, 5)]
    uuids = list(dict.fromkeys(r[0] for r in rows))
    pick = next((u for u in uuids if uuid and uuid in u), uuids[0] if uuids else None)
    rows = [r for r in rows if r[0] == pick]
    if not rows:
        return None
    summary = {"samples": len(rows)}
    for key, column in (("sm_mhz", 1), ("power_w", 2), ("temp_c", 3)):
        values = [v for v in (number(r[column]) for r in rows) if v is not None]
        summary[key] = round(statistics.fmean(values), 1) if values else None
    reasons = [int(r[4], 16) for r in rows if len(r) == 5 and r[4].lower().startswith("0x")]
    summary["throttle"] = hex(functools.reduce(operator.or_, reasons, 0)) if reasons else None
    return summary


def merge_summaries(summaries):
    """One summary of several samplings (None ones dropped): means weighted by sample count,
    throttle bits OR-ed; None if none sampled."""
    summaries = [s for s in summaries if s]
    if not summaries:
        return None
    total = sum(s["samples"] for s in summaries)
    merged = {"samples": total}
    for key in ("sm_mhz", "power_w", "temp_c"):
        weighted = [(s[key], s["samples"]) for s in summaries if s.get(key) is not None]
        weight = sum(n for _, n in weighted)
        merged[key] = round(sum(v * n for v, n in weighted) / weight, 1) if weight else None
    bits = [int(s["throttle"], 16) for s in summaries if s.get("throttle")]
    merged["throttle"] = hex(functools.reduce(operator.or_, bits, 0)) if bits else None
    return merged


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


def save_rows(benchmark: str, stem: str, rows: list, out_dir, device: str):
    """Write a small benchmark's rows as JSON under `out_dir` (named by stem, time and GPU), with
    the GPU and the torch and Triton versions; returns the path."""
    import json
    from pathlib import Path
    import triton
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    when = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = {"benchmark": benchmark, "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
           "rows": rows, "when": when}
    path = Path(out_dir) / f"{stem}_{when}_{gpu.replace(' ', '-')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    return path


def small_parser(doc: str, do_bench: bool = True):
    """The options every small benchmark (bench.lce, bench.gated, bench.planar) takes: --device
    and --out, and with `do_bench` do_bench's --warmup and --rep (ms) and --rounds; the caller
    adds its own. Parse with parse_small."""
    import argparse
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", default="bench/results")
    if do_bench:
        p.add_argument("--warmup", type=float, default=50.0)
        p.add_argument("--rep", type=float, default=200.0)
        p.add_argument("--rounds", type=int, default=3)
    return p


def parse_small(p, argv):
    """The parsed options; on the CPU (the plumbing at a tiny size) Triton's interpreter runs the kernels."""
    ns = p.parse_args(argv)
    if ns.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return ns
