"""Does the power cap decide the gap to cuBLAS? Times cuBLAS and epifuse's chosen kernel from an
idle GPU, back to back for a few seconds, reading the board's energy counter and SM clock
through NVML: the fastest call of the first 0.3 s (before the power limit bites, as tuning
sees it) and, over the last half, ms per call, clock, power and energy per GEMM.

    PYTHONPATH=src:. python -m research.power_probe [--cases identity:S1,relu_aux:S2] [--out DIR]

Each case measures cublas, epifuse, epifuse, cublas (the order cancels the GPU's warming) and
reports per baseline the mean of its two measurements. A device copy's energy per DRAM byte
(less the idle board power over its time) then predicts what each case's extra DRAM bytes
(its (M, N) operands and outputs beyond cuBLAS's D) cost: `model` is that energy ratio. A
copy's average price includes its SMs' work and the memory's constant power, so it charges
more than a further byte costs (research.byte_energy measures that: NOTEBOOK.md, 2026-11-26
15:46-15:57).

`--candidates` ranks every candidate kernel as tuning times it and sustained; `--timeline`
prints, per candidate, its time per call in windows of time since back-to-back calls began
(the first 15 ms are what tuning sees); `--bench-alike` times chosen candidates as the
benchmark times a row, alternating with cuBLAS (back-to-back calls do not rank every pair as
the benchmark's L2-flushed ones do: NOTEBOOK.md, 2026-11-26 15:59).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from bench.run import _epifuse_call
from bench.timing import collect_env
from bench.workloads import SHAPES, WORKLOADS

DEFAULT_CASES = "identity:S1,identity:S2,bias_gelu:S1,relu_aux:S2"
NVML_CLOCK_SM = 1


class Nvml:
    """The NVML calls the probe needs, through ctypes (no Python binding is required)."""

    def __init__(self, index: int = 0):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2())
        self.handle = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)))

    @staticmethod
    def _check(code: int) -> None:
        if code != 0:
            raise RuntimeError(f"NVML call failed with code {code}")

    def energy_mj(self) -> int:
        value = ctypes.c_ulonglong()
        self._check(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(value)))
        return value.value

    def sm_mhz(self) -> int:
        value = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM, ctypes.byref(value)))
        return value.value

    def power_w(self) -> float:
        value = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(value)))
        return value.value / 1000

    def power_limit_w(self) -> float:
        value = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetEnforcedPowerLimit(self.handle, ctypes.byref(value)))
        return value.value / 1000


def _chunk_times_ms(fn, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def measure(fn, nvml: Nvml, idle_s: float, sustain_s: float, chunk: int = 10) -> dict:
    """After `idle_s` of idleness, chunks of `chunk` calls for `sustain_s`: the fastest chunk's
    ms per call in the first 0.3 s, the first chunk left out (burst), and over the second half,
    ms per call (median chunk), mean SM clock, mean power and energy per call."""
    torch.cuda.synchronize()
    time.sleep(idle_s)
    clocks, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            clocks.append((time.perf_counter(), nvml.sm_mhz()))
            time.sleep(0.01)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    chunks, t0 = [], time.perf_counter()
    half_at, energy0, calls_after_half = None, None, 0
    while time.perf_counter() - t0 < sustain_s:
        ms = _chunk_times_ms(fn, chunk)
        now = time.perf_counter()
        chunks.append((now, ms))
        if half_at is None and now - t0 >= sustain_s / 2:
            half_at, energy0 = now, nvml.energy_mj()
        elif half_at is not None:
            calls_after_half += chunk
    energy1, t1 = nvml.energy_mj(), time.perf_counter()
    stop.set()
    poller.join()
    late = [ms for t, ms in chunks if half_at is not None and t > half_at]
    burst = min(ms for t, ms in chunks[1:] if t - t0 < 0.3) if len(chunks) > 1 else float("nan")
    mhz = [m for t, m in clocks if half_at is not None and t > half_at]
    joules = (energy1 - energy0) / 1000 if energy0 is not None else float("nan")
    return {"burst_ms": burst, "sustained_ms": statistics.median(late) if late else float("nan"),
            "sustained_mhz": statistics.fmean(mhz) if mhz else float("nan"),
            "power_w": joules / (t1 - half_at) if half_at else float("nan"),
            "mj_per_call": 1000 * joules / calls_after_half if calls_after_half else float("nan")}


def _mean(a: dict, b: dict) -> dict:
    return {k: (a[k] + b[k]) / 2 for k in a}


def idle_power_w(nvml: Nvml, seconds: float = 3.0) -> float:
    torch.cuda.synchronize()
    time.sleep(seconds)
    samples = []
    for _ in range(20):
        samples.append(nvml.power_w())
        time.sleep(0.05)
    return statistics.fmean(samples)


def dram_mj_per_byte(nvml: Nvml, idle_w: float, idle_s: float, sustain_s: float, mib: int = 1024) -> dict:
    """A device copy of `mib` MiB: its energy per byte moved (read and written) beyond the idle
    board power over its time."""
    src = torch.randn(mib * 2**20 // 2, device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    m = measure(lambda: dst.copy_(src), nvml, idle_s, sustain_s, chunk=2)
    moved = 2 * src.numel() * src.element_size()
    m["mj_per_byte"] = dynamic_mj(m, idle_w) / moved
    m["tb_per_s"] = moved / m["sustained_ms"] / 1e9
    return m


def dynamic_mj(m: dict, static_w: float) -> float:
    """A measurement's energy per call (mJ) less `static_w` over its time (ms)."""
    return m["mj_per_call"] - static_w * m["sustained_ms"]


def charged_ratio(read_bytes: int, written_bytes: int, e_read: float, e_written: float,
                  cublas: dict, static_w: float = 0.0) -> float:
    """1 + the energy of a case's extra bytes at `e_read` / `e_written` mJ per byte over
    cuBLAS's energy per GEMM less `static_w` over its time."""
    return 1 + (read_bytes * e_read + written_bytes * e_written) / dynamic_mj(cublas, static_w)


def extra_dram_split(w, s, M: int, N: int) -> tuple[int, int]:
    """The bytes a case's epilogue moves beyond cuBLAS's D: its (M, N) operands read, and its
    outputs written less D (negative where it writes no D)."""
    operands = sum(t.numel() * t.element_size() for t in s.operands.values()
                   if torch.is_tensor(t) and t.dim() == 2)
    itemsizes = [torch.empty((), dtype=d).element_size() for d in s.out_dtypes]
    outputs = sum(math.prod(shape) * size for shape, size in zip(w.expected_shapes(M, N), itemsizes))
    return operands, outputs - M * N * s.A.element_size()


def extra_dram_bytes(w, s, M: int, N: int) -> int:
    return sum(extra_dram_split(w, s, M, N))


def run_case(epifuse, nvml, workload: str, shape: str, idle_s: float, sustain_s: float) -> dict:
    w = WORKLOADS[workload]
    M, N, K = SHAPES[shape]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    s = w.build(M, N, K, torch.float16, "cuda", gen)
    cublas = w.cublas(s)
    fused = _epifuse_call(epifuse, w, s, False)[0]
    fused()   # tunes, or takes the cached choice
    kernel = epifuse.runtime.tune.HISTORY[-1]["choice"] if epifuse.runtime.tune.HISTORY else "cached"
    first = {"cublas": measure(cublas, nvml, idle_s, sustain_s), "epifuse": measure(fused, nvml, idle_s, sustain_s)}
    second = {"epifuse": measure(fused, nvml, idle_s, sustain_s), "cublas": measure(cublas, nvml, idle_s, sustain_s)}
    read, written = extra_dram_split(w, s, M, N)
    return {"workload": workload, "shape": shape, "kernel": kernel, "extra_bytes": read + written,
            "read_bytes": read, "written_bytes": written,
            "cublas": _mean(first["cublas"], second["cublas"]),
            "epifuse": _mean(first["epifuse"], second["epifuse"]), "passes": [first, second]}


def _candidate_calls(epifuse, epilogue: str, shape: str, kernels=()) -> dict:
    """{name: a call} for cuBLAS's A @ B and each candidate kernel of one probe epilogue
    (research.probe.EPILOGUES) at `shape` (those named in `kernels`, by repr, or all), compiled."""
    from .probe import make_args, make_operands
    M, N, K = SHAPES[shape]
    A, B, operands = make_operands(M, N, K)
    args = make_args(epilogue, A, B, operands)
    calls = {"cublas": lambda: A @ B}
    for kernel in epifuse.get_kernels(args):
        if kernel.name != "reference" and (not kernels or repr(kernel) in kernels):
            calls[repr(kernel)] = (lambda k: lambda: k.run(args))(kernel)
    for name in kernels:
        if name not in calls:
            print(f"power_probe: no candidate {name} for {epilogue} at {shape}", file=sys.stderr)
    for name, call in list(calls.items()):  # compiles the kernels, sets cuBLAS up
        try:
            call()
        except Exception as error:  # noqa: BLE001 - as tuning does, a kernel that fails is left out
            print(f"power_probe: {name} failed ({type(error).__name__}: {error}); left out", file=sys.stderr)
            del calls[name]
    torch.cuda.synchronize()
    return calls


def rank_candidates(epifuse, nvml: Nvml, epilogue: str, shape: str, idle_s: float, sustain_s: float) -> dict:
    """Every candidate kernel of one probe epilogue (research.probe.EPILOGUES), timed as
    tuning times it (do_bench, 15 ms, after `idle_s` idle) and sustained (measure), in order and
    in reverse order (each kernel's two times averaged), with cuBLAS's A @ B the same ways."""
    from triton.testing import do_bench

    from epifuse.runtime.tune import TUNE_REP_MS, TUNE_WARMUP_MS
    calls = _candidate_calls(epifuse, epilogue, shape)
    times: dict = {name: [] for name in calls}
    for order in (list(calls), list(reversed(calls))):
        for name in order:
            torch.cuda.synchronize()
            time.sleep(idle_s)
            tuning = do_bench(calls[name], warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS, return_mode="median")
            sustained = measure(calls[name], nvml, idle_s, sustain_s)["sustained_ms"]
            times[name].append((tuning, sustained))
    mean = {name: tuple(sum(t[i] for t in ts) / len(ts) for i in (0, 1)) for name, ts in times.items()}
    return {"epilogue": epilogue, "shape": shape, "ms": mean}


def bench_alike(epifuse, epilogue: str, shape: str, kernels: list[str], rounds: int) -> dict:
    """The candidate kernels named in `kernels` (by repr; all when empty) and cuBLAS's A @ B
    timed as the benchmark times a row (do_bench medians, L2 flushed before each call, warm-up
    25 ms, 200 ms of calls), in turn, `rounds` times over (timing.alternate_ms); per kernel its
    ratio to cuBLAS in each round."""
    from bench.timing import alternate_ms
    calls = _candidate_calls(epifuse, epilogue, shape, kernels)
    ms = alternate_ms(calls, rounds, warmup=25, rep=200)
    ratios = {name: [t / c for t, c in zip(ms[name], ms["cublas"])] for name in ms if name != "cublas"}
    return {"epilogue": epilogue, "shape": shape, "ms": ms, "ratios": ratios}


def print_bench_alike(result: dict) -> None:
    print(f"{result['epilogue']} {result['shape']}: ratios to cuBLAS, timed as the benchmark does, "
          "median and range over the rounds")
    for name, ratios in sorted(result["ratios"].items(), key=lambda kv: statistics.median(kv[1])):
        print(f"  {statistics.median(ratios):6.3f} ({min(ratios):.3f}-{max(ratios):.3f})  {name}")


TIMELINE_WINDOWS_S = ((0, .015), (.015, .05), (.05, .1), (.1, .2), (.2, .4), (.4, .8), (.8, 1.5))


def timeline(epifuse, epilogue: str, shape: str, kernels: list[str], idle_s: float) -> dict:
    """How soon the power limit bites: after `idle_s` idle, chunks of 10 calls for 1.5 s of each
    candidate kernel named in `kernels` (by repr; all when empty) and of cuBLAS's A @ B, twice
    (in order, then reversed), and each chunk's ms per call by when it ended; per window of
    TIMELINE_WINDOWS_S, the median chunk of each pass. Tuning's timings (TUNE_REP_MS) fall in
    the first window."""
    calls = _candidate_calls(epifuse, epilogue, shape, kernels)
    windows: dict = {name: [] for name in calls}
    for order in (list(calls), list(reversed(calls))):
        for name in order:
            torch.cuda.synchronize()
            time.sleep(idle_s)
            start, chunks = time.perf_counter(), []
            while time.perf_counter() - start < TIMELINE_WINDOWS_S[-1][1]:
                ms = _chunk_times_ms(calls[name], 10)
                chunks.append((time.perf_counter() - start, ms))
            windows[name].append([statistics.median([ms for t, ms in chunks if lo <= t < hi] or [math.nan])
                                  for lo, hi in TIMELINE_WINDOWS_S])
    return {"epilogue": epilogue, "shape": shape, "windows_s": TIMELINE_WINDOWS_S, "ms_by_pass": windows}


def print_timeline(result: dict) -> None:
    print(f"{result['epilogue']} {result['shape']}: us per call (mean of the passes with a chunk there) in each window, "
          "seconds since the calls began: " + " ".join(f"{lo}-{hi}" for lo, hi in result["windows_s"]))
    for name, passes in result["ms_by_pass"].items():
        mean = [statistics.fmean(ms) * 1e3 if (ms := [p[i] for p in passes if not math.isnan(p[i])]) else math.nan
                for i in range(len(result["windows_s"]))]
        print(f"  {name[:64]:64s} " + " ".join(f"{us:6.1f}" for us in mean))


_NVML: list = []


def nvml_handle() -> Nvml:
    if not _NVML:
        _NVML.append(Nvml(torch.cuda.current_device()))
    return _NVML[0]


def gpu_session():
    """(epifuse, its NVML handle, collect_env's record) for a probe's main, or None (said on
    stderr) without a CUDA GPU."""
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return None
    import epifuse
    import epifuse.runtime.tune  # noqa: F401  (its HISTORY names the chosen kernel)
    return epifuse, nvml_handle(), collect_env(epifuse)


def parse_with_session(parser, argv):
    """`parser`'s arguments, with --out added, and gpu_session()'s (epifuse, nvml, env) after
    them; None (said on stderr) without a CUDA GPU."""
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    session = gpu_session()
    return None if session is None else (args, *session)


def print_candidates(result: dict) -> None:
    ms = result["ms"]
    tune_c, sus_c = ms["cublas"]
    kernels = [k for k in ms if k != "cublas"]
    by_tuning = min(kernels, key=lambda k: ms[k][0])
    by_sustained = min(kernels, key=lambda k: ms[k][1])
    print(f"{result['epilogue']} {result['shape']}: ratios to cuBLAS, tuning-style / sustained")
    for k in sorted(kernels, key=lambda k: ms[k][1]):
        mark = ("T" if k == by_tuning else " ") + ("S" if k == by_sustained else " ")
        print(f"  {mark} {ms[k][0] / tune_c:6.3f} {ms[k][1] / sus_c:6.3f}  {k}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma list of workload:shape (fp16)")
    p.add_argument("--idle", type=float, default=3.0, help="seconds idle before each measurement")
    p.add_argument("--sustain", type=float, default=3.0, help="seconds of back-to-back calls")
    p.add_argument("--candidates", default="",
                   help="instead: rank every candidate kernel of these probe epilogue:shape pairs "
                        "(research.probe.EPILOGUES) tuning-style and sustained")
    p.add_argument("--timeline", default="",
                   help="instead: how soon the power limit bites, per candidate kernel of these probe "
                        "epilogue:shape pairs (and cuBLAS)")
    p.add_argument("--bench-alike", default="",
                   help="instead: time candidate kernels of these probe epilogue:shape pairs as the benchmark "
                        "does, alternating with cuBLAS for --rounds rounds")
    p.add_argument("--rounds", type=int, default=4, help="with --bench-alike")
    p.add_argument("--kernels", default="",
                   help="with --timeline or --bench-alike: only these kernels, by repr, ';'-separated")
    opened = parse_with_session(p, argv)
    if opened is None:
        return 2
    args, epifuse, nvml, env = opened
    stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
    def each_case(spec: str, measure, show, stem: str) -> int:
        """measure(epilogue, shape) for each 'epilogue:shape' of `spec`, shown as it comes,
        then all of them as JSON under --out."""
        results = []
        for case in spec.split(","):
            epilogue, shape = case.split(":")
            results.append(measure(epilogue, shape))
            show(results[-1])
        if args.out:
            path = Path(args.out) / f"{stem}_{stamp}.json"
            path.write_text(json.dumps({"env": env, "cases": results}, indent=1))
            print(f"wrote {path}")
        return 0

    if args.bench_alike:
        kernels = [k for k in args.kernels.split(";") if k]
        return each_case(args.bench_alike, lambda e, s: bench_alike(epifuse, e, s, kernels, args.rounds),
                         print_bench_alike, "bench_alike")
    if args.timeline:
        kernels = [k for k in args.kernels.split(";") if k]
        return each_case(args.timeline, lambda e, s: timeline(epifuse, e, s, kernels, args.idle),
                         print_timeline, "sustain_timeline")
    if args.candidates:
        return each_case(args.candidates,
                         lambda e, s: rank_candidates(epifuse, nvml, e, s, args.idle, args.sustain),
                         print_candidates, "candidates_power")
    idle_w = idle_power_w(nvml, args.idle)
    copy = dram_mj_per_byte(nvml, idle_w, args.idle, args.sustain)
    results = []
    for case in args.cases.split(","):
        workload, shape = case.split(":")
        results.append(run_case(epifuse, nvml, workload, shape, args.idle, args.sustain))
    print(f"{env.get('gpu')}  power limit {nvml.power_limit_w():.0f} W, idle {idle_w:.0f} W; copy "
          f"{copy['tb_per_s']:.2f} TB/s at {copy['power_w']:.0f} W: {copy['mj_per_byte'] * 1e9:.1f} pJ per DRAM byte "
          "beyond idle")
    print("ratios epifuse / cublas; model: the energy ratio the extra DRAM bytes alone predict")
    print(f"{'case':<13} {'burst':>6} {'sustained':>9} {'MHz cuBLAS/epifuse':>19} {'W cuBLAS/epifuse':>17} "
          f"{'energy/call':>11} {'model':>6}  kernel")
    for r in results:
        c, e = r["cublas"], r["epifuse"]
        r["model"] = charged_ratio(r["extra_bytes"], 0, copy["mj_per_byte"], 0.0, c)
        print(f"{r['workload'] + ' ' + r['shape']:<13} {e['burst_ms'] / c['burst_ms']:6.3f} "
              f"{e['sustained_ms'] / c['sustained_ms']:9.3f} {c['sustained_mhz']:9.0f}/{e['sustained_mhz']:<9.0f}"
              f" {c['power_w']:8.0f}/{e['power_w']:<8.0f} {e['mj_per_call'] / c['mj_per_call']:11.3f}"
              f" {r['model']:6.3f}  {r['kernel']}")
    if args.out:
        path = Path(args.out) / f"power_probe_{stamp}.json"
        path.write_text(json.dumps({"env": env, "power_limit_w": nvml.power_limit_w(), "idle_w": idle_w,
                                    "copy": copy, "cases": results}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
