"""What an epilogue's extra DRAM bytes cost in energy, against each case's measured gap.

At S1-S3 every kernel here runs at the board's power limit, and its sustained time ratio to
cuBLAS follows its energy ratio (NOTEBOOK.md, the power-cap section). A fused epilogue that reads
C or writes a second output must move those bytes between DRAM and the chip, whatever its
schedule. This probe measures what one further DRAM byte costs, and charges each case its
extra bytes at that price against cuBLAS's energy per GEMM:

    charged = 1 + (read_bytes * e_read + written_bytes * e_written) / E(cuBLAS)

- e_read / e_written: one Triton streaming kernel runs over a 2 GiB buffer (every byte from or
  to DRAM) and over an 8 MiB one (every byte from L2), same instructions, same byte count. Run
  as fast as they can, the DRAM stream takes 2.4 times as long, and SMs that wait draw power
  too: the difference then counts the wait as DRAM energy (NOTEBOOK.md 2026-11-26 15:47). So
  each element also takes a chain of FMAs, enough that both streams run at the FMA pipe's pace
  in the same time. Their power difference grows with the bandwidth along a line whose
  constant part (6-10 W) any streaming GEMM pays already; its slope is the price of a byte;
- E(cuBLAS): cuBLAS's sustained energy per GEMM, whole (`whole`, which `charged` takes: the
  smaller charge for extra bytes) and less the idle board's power over its time (`idle`).

It is not a floor: the streams run at the full clock, where the chip's own part of moving a
byte costs more than at the lower clock and voltage a fused kernel runs at under the limit,
and a fused kernel's GEMM then costs less than cuBLAS's at its clock too. lincomb at S2 was
charged 1.089 (1.109 less idle) and measured 1.05 (15:57). It says how much of a gap its bytes can
explain; `--cases` measures each case's sustained time and energy ratios beside it (as
research.power_probe does).

    PYTHONPATH=src:. python -m research.byte_energy [--cases relu_aux:S2,lincomb:S2] [--out DIR]
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

from .power_probe import charged_ratio, dynamic_mj, idle_power_w, measure, parse_with_session, run_case

DEFAULT_CASES = "lincomb:S1,lincomb:S2,relu_aux:S1,relu_aux:S2"
DRAM_ELEMENTS = 2 ** 30      # fp16: 2 GiB, forty times an H100's or H200's L2
L2_ELEMENTS = 2 ** 22        # fp16: 8 MiB, a sixth of their L2
PER_PROGRAM = 2 ** 18
BLOCK = 4096


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def stream_read(src, sink, wrap, per_program, BLOCK: tl.constexpr, FMAS: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        for i in range(0, per_program, BLOCK):
            x = tl.load(src + ((pid * per_program + i + offs) & wrap)).to(tl.float32)
            acc += x
            for _ in tl.static_range(FMAS):
                acc = acc * 0.99951171875 + x
        tl.store(sink + pid * BLOCK + offs, acc)

    @triton.jit
    def stream_write(dst, wrap, per_program, BLOCK: tl.constexpr, FMAS: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        value = (offs + pid).to(tl.float32)
        for i in range(0, per_program, BLOCK):
            for _ in tl.static_range(FMAS):
                value = value * 0.99951171875 + 1.0
            tl.store(dst + ((pid * per_program + i + offs) & wrap), value.to(tl.float16))

    return stream_read, stream_write


def stream_calls(buffer_elements: int, fmas: int) -> dict:
    """{"read": fn, "write": fn}: each moves DRAM_ELEMENTS fp16 elements (2 GiB) per call,
    wrapping around a buffer of `buffer_elements`, with `fmas` dependent FMAs per element, in
    the same programs and instructions whatever the buffer's size."""
    stream_read, stream_write = _kernels()
    grid = (DRAM_ELEMENTS // PER_PROGRAM,)
    buffer = torch.randn(buffer_elements, device="cuda", dtype=torch.float16)
    sink = torch.empty(grid[0] * BLOCK, device="cuda", dtype=torch.float32)
    wrap = buffer_elements - 1
    return {"read": lambda: stream_read[grid](buffer, sink, wrap, PER_PROGRAM, BLOCK=BLOCK, FMAS=fmas, num_warps=8),
            "write": lambda: stream_write[grid](buffer, wrap, PER_PROGRAM, BLOCK=BLOCK, FMAS=fmas, num_warps=8)}


def dram_part_mj_per_byte(dram: dict, l2: dict, static_w: float, nbytes: int) -> float:
    """The energy per byte that serving it from DRAM adds to serving it from L2."""
    return (dynamic_mj(dram, static_w) - dynamic_mj(l2, static_w)) / nbytes


FMA_LEVELS = (0, 48, 64, 96, 128, 192)   # FMAs per element: none (each stream as fast as it
                                         # can), then enough that both run at the FMA pipe's pace
MATCHED = 0.02   # a level counts where its DRAM and L2 streams' times differ by at most this


def marginal_fit(points: list) -> tuple[float, float]:
    """Least squares (slope, intercept) of power differences (W) against bandwidth (bytes/ms)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return slope, my - slope * mx


def matched(level: dict, op: str) -> bool:
    return abs(level["time_ratio"][op] - 1) <= MATCHED


def price_fit(levels: list, op: str) -> dict:
    """The line through the matched levels' (bandwidth, DRAM power) points for `op`: its slope
    (mJ per byte), constant (W) and how many levels it rests on; at least two are needed."""
    points = [(lv["bytes_per_ms"][op], lv["dram_w"][op]) for lv in levels if matched(lv, op)]
    if len(points) < 2:
        raise RuntimeError(f"byte_energy: fewer than two levels of matched {op} streams; "
                           f"time ratios {[round(lv['time_ratio'][op], 3) for lv in levels]}")
    slope, intercept = marginal_fit(points)
    return {"mj_per_byte": slope, "constant_w": intercept, "levels": len(points)}


def measure_bytes(nvml, idle_s: float, sustain_s: float) -> dict:
    """The idle board's power, and at each of FMA_LEVELS the four streams' sustained
    measurements. At the levels where the DRAM and L2 streams took the same time (MATCHED), the
    power a busy SM draws whether it waits or works is the same in both and cancels: their
    power difference is then what DRAM traffic at that bandwidth draws. It grows along a line
    with a constant part (the memory's own, paid by any GEMM that streams at all) and a slope:
    the energy each further byte costs, which is what an epilogue's extra bytes add."""
    idle_w = idle_power_w(nvml, idle_s)
    nbytes = DRAM_ELEMENTS * 2
    levels = []
    for fmas in FMA_LEVELS:
        streams = {}
        for where, elements in (("dram", DRAM_ELEMENTS), ("l2", L2_ELEMENTS)):
            calls = stream_calls(elements, fmas)
            for op, call in calls.items():
                call()
                torch.cuda.synchronize()
                streams[f"{op}_{where}"] = measure(call, nvml, idle_s, sustain_s, chunk=2)
            del calls
            torch.cuda.empty_cache()
        level = {"fmas": fmas, "streams": streams, "time_ratio": {}, "bytes_per_ms": {}, "dram_w": {},
                 "average_dram_mj_per_byte": {}}
        for op in ("read", "write"):
            dram, l2 = streams[f"{op}_dram"], streams[f"{op}_l2"]
            ms = (dram["sustained_ms"] + l2["sustained_ms"]) / 2
            level["time_ratio"][op] = dram["sustained_ms"] / l2["sustained_ms"]
            level["bytes_per_ms"][op] = nbytes / ms
            level["dram_w"][op] = (dram["mj_per_call"] - l2["mj_per_call"]) / ms
            level["average_dram_mj_per_byte"][op] = dram_part_mj_per_byte(dram, l2, idle_w, nbytes)
        levels.append(level)
    fits = {op: price_fit(levels, op) for op in ("read", "write")}
    per_byte = {op: fit["mj_per_byte"] for op, fit in fits.items()}
    return {"idle_w": idle_w, "bytes_per_call": nbytes, "levels": levels, "fits": fits, "dram_mj_per_byte": per_byte}


def case_charge(case: dict, energy: dict) -> dict:
    """One power_probe case's charge against cuBLAS's energy less the idle power over its time
    (`idle`), and against all of it (`whole`, the one `charged` takes)."""
    e = energy["dram_mj_per_byte"]
    charges = {name: charged_ratio(case["read_bytes"], case["written_bytes"], e["read"], e["write"], case["cublas"], w)
              for name, w in (("idle", energy["idle_w"]), ("whole", 0.0))}
    return {**charges, "charged": charges["whole"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma list of workload:shape (fp16)")
    p.add_argument("--idle", type=float, default=2.0, help="seconds idle before each measurement")
    p.add_argument("--sustain", type=float, default=3.0, help="seconds of back-to-back calls")
    opened = parse_with_session(p, argv)
    if opened is None:
        return 2
    args, epifuse, nvml, env = opened
    energy = measure_bytes(nvml, args.idle, args.sustain)
    cases = []
    for spec in filter(None, args.cases.split(",")):
        workload, shape = spec.split(":")
        case = run_case(epifuse, nvml, workload, shape, args.idle, args.sustain)
        case.update(case_charge(case, energy))
        cases.append(case)
    print(f"{env.get('gpu')}  power limit {nvml.power_limit_w():.0f} W, idle {energy['idle_w']:.0f} W; "
          "streams of 2 GiB from DRAM or L2 (8 MiB, wrapped):")
    for level in energy["levels"]:
        for name, m in level["streams"].items():
            print(f"  {level['fmas']:3d} FMAs {name:<11} {energy['bytes_per_call'] / m['sustained_ms'] / 1e9:6.2f} TB/s "
                  f"at {m['power_w']:4.0f} W, {m['sustained_mhz']:5.0f} MHz")
        for op in ("read", "write"):
            if matched(level, op):
                print(f"  {level['fmas']:3d} FMAs {op:<5} DRAM/L2 time {level['time_ratio'][op]:.3f}: DRAM draws "
                      f"{level['dram_w'][op]:5.1f} W at {level['bytes_per_ms'][op] / 1e9:.2f} TB/s, "
                      f"{level['average_dram_mj_per_byte'][op] * 1e9:5.1f} pJ/B on average")
            else:
                print(f"  {level['fmas']:3d} FMAs {op:<5} DRAM/L2 time {level['time_ratio'][op]:.3f}: "
                      "not matched, no DRAM price")
    for op, fit in energy["fits"].items():
        print(f"{op}: {fit['mj_per_byte'] * 1e9:.1f} pJ per further byte, {fit['constant_w']:.0f} W constant "
              f"(fit over {fit['levels']} matched levels)")
    print(f"{'case':<13} {'sustained':>9} {'energy':>7} {'charged':>7}  (against cuBLAS less idle / whole)  kernel")
    for c in cases:
        cb, ep = c["cublas"], c["epifuse"]
        print(f"{c['workload'] + ' ' + c['shape']:<13} {ep['sustained_ms'] / cb['sustained_ms']:9.3f} "
              f"{ep['mj_per_call'] / cb['mj_per_call']:7.3f} {c['charged']:7.3f}  ({c['idle']:.3f} / "
              f"{c['whole']:.3f})  {c['kernel']}")
    if args.out:
        stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
        path = Path(args.out) / f"byte_energy_{stamp}.json"
        path.write_text(json.dumps({"env": env, "power_limit_w": nvml.power_limit_w(), "energy": energy,
                                    "cases": cases}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
