"""The fastest a fused kernel could be under the power limit, from what its extra DRAM bytes cost.

At S1-S3 every kernel here runs at the board's power limit, so its time is its energy divided by
that power (RESULTS.md, the power-cap section). A fused epilogue that reads C or writes a second
output must move those bytes between DRAM and the chip, whatever its schedule. This probe
measures the part of a byte's energy that only DRAM traffic costs, and from it a floor for each
case's ratio to cuBLAS:

    floor = 1 + (read_bytes * e_read + written_bytes * e_written) / E_dyn(cuBLAS)

- e_read / e_written: the energy per byte of one Triton streaming kernel run over a 2 GiB
  buffer (every byte from or to DRAM) less that of the same kernel over an 8 MiB buffer (every
  byte from L2, same instructions, same byte count), each less a static power over its time;
- E_dyn(cuBLAS): cuBLAS's sustained energy per GEMM less that static power over its time;
- the static power is taken two ways: the idle board, and the board while a one-thread sleep
  kernel holds the clocks up; the floor is the smaller of the two estimates.

It assumes that the fused kernel's GEMM costs at least cuBLAS's energy and that the bytes its
epilogue adds cost at least their DRAM part; the SM and L2 work of moving them is left out, so
the floor is below what any kernel can reach. `--cases` also measures epifuse's sustained ratio
for each case (as benchmarks.power_probe does), so each miss reads against its floor.

    PYTHONPATH=src:. python -m benchmarks.energy_floor [--cases relu_aux:S2,lincomb:S2] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from .power_probe import extra_dram_split, idle_power_w, measure, nvml_handle, run_case
from .timing import collect_env

DEFAULT_CASES = "lincomb:S1,lincomb:S2,relu_aux:S1,relu_aux:S2"
DRAM_ELEMENTS = 2 ** 30      # fp16: 2 GiB, forty times an H100's or H200's L2
L2_ELEMENTS = 2 ** 22        # fp16: 8 MiB, a sixth of their L2
PER_PROGRAM = 2 ** 18
BLOCK = 4096


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def stream_read(src, sink, wrap, per_program, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        for i in range(0, per_program, BLOCK):
            acc += tl.load(src + ((pid * per_program + i + offs) & wrap)).to(tl.float32)
        tl.store(sink + pid * BLOCK + offs, acc)

    @triton.jit
    def stream_write(dst, wrap, per_program, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        value = (offs + pid).to(tl.float16)
        for i in range(0, per_program, BLOCK):
            tl.store(dst + ((pid * per_program + i + offs) & wrap), value)

    return stream_read, stream_write


def stream_calls(buffer_elements: int) -> dict:
    """{"read": fn, "write": fn}: each moves DRAM_ELEMENTS fp16 elements (2 GiB) per call,
    wrapping around a buffer of `buffer_elements`, in the same programs and instructions
    whatever the buffer's size."""
    stream_read, stream_write = _kernels()
    grid = (DRAM_ELEMENTS // PER_PROGRAM,)
    buffer = torch.randn(buffer_elements, device="cuda", dtype=torch.float16)
    sink = torch.empty(grid[0] * BLOCK, device="cuda", dtype=torch.float32)
    wrap = buffer_elements - 1
    return {"read": lambda: stream_read[grid](buffer, sink, wrap, PER_PROGRAM, BLOCK=BLOCK, num_warps=8),
            "write": lambda: stream_write[grid](buffer, wrap, PER_PROGRAM, BLOCK=BLOCK, num_warps=8)}


def dynamic_mj(m: dict, static_w: float) -> float:
    """A measurement's energy per call (mJ) less `static_w` over its time."""
    return m["mj_per_call"] - static_w * m["sustained_ms"]


def dram_part_mj_per_byte(dram: dict, l2: dict, static_w: float, nbytes: int) -> float:
    """The energy per byte that serving it from DRAM adds to serving it from L2."""
    return (dynamic_mj(dram, static_w) - dynamic_mj(l2, static_w)) / nbytes


def floor_ratio(read_bytes: int, written_bytes: int, e_read: float, e_written: float,
                cublas: dict, static_w: float) -> float:
    return 1 + (read_bytes * e_read + written_bytes * e_written) / dynamic_mj(cublas, static_w)


def measure_bytes(nvml, idle_s: float, sustain_s: float) -> dict:
    """The static powers and the four streams' sustained measurements."""
    idle_w = idle_power_w(nvml, idle_s)
    clocked = measure(lambda: torch.cuda._sleep(1_000_000), nvml, idle_s, sustain_s)
    streams = {}
    for where, elements in (("dram", DRAM_ELEMENTS), ("l2", L2_ELEMENTS)):
        calls = stream_calls(elements)
        for op, call in calls.items():
            call()
            torch.cuda.synchronize()
            streams[f"{op}_{where}"] = measure(call, nvml, idle_s, sustain_s, chunk=2)
        del calls
        torch.cuda.empty_cache()
    nbytes = DRAM_ELEMENTS * 2
    statics = {"idle": idle_w, "clocked": clocked["power_w"]}
    per_byte = {name: {op: dram_part_mj_per_byte(streams[f"{op}_dram"], streams[f"{op}_l2"], w, nbytes)
                       for op in ("read", "write")} for name, w in statics.items()}
    return {"static_w": statics, "streams": streams, "bytes_per_call": nbytes, "dram_mj_per_byte": per_byte}


def case_floor(case: dict, energy: dict) -> dict:
    """The floor of one power_probe case under each static power, and the smaller of the two."""
    read, written = case["read_bytes"], case["written_bytes"]
    floors = {name: floor_ratio(read, written, e["read"], e["write"], case["cublas"], energy["static_w"][name])
              for name, e in energy["dram_mj_per_byte"].items()}
    return {**floors, "floor": min(floors.values())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma list of workload:shape (fp16)")
    p.add_argument("--idle", type=float, default=2.0, help="seconds idle before each measurement")
    p.add_argument("--sustain", type=float, default=3.0, help="seconds of back-to-back calls")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import epifuse
    import epifuse.runtime.tune  # noqa: F401  (its HISTORY names the chosen kernel)
    nvml = nvml_handle()
    env = collect_env(epifuse)
    energy = measure_bytes(nvml, args.idle, args.sustain)
    cases = []
    for spec in filter(None, args.cases.split(",")):
        workload, shape = spec.split(":")
        case = run_case(epifuse, nvml, workload, shape, args.idle, args.sustain)
        case.update(case_floor(case, energy))
        cases.append(case)
    s, e = energy["streams"], energy["dram_mj_per_byte"]
    print(f"{env.get('gpu')}  power limit {nvml.power_limit_w():.0f} W; static: idle "
          f"{energy['static_w']['idle']:.0f} W, clocked {energy['static_w']['clocked']:.0f} W")
    for name, m in s.items():
        print(f"  {name:<11} {energy['bytes_per_call'] / m['sustained_ms'] / 1e9:6.2f} TB/s at "
              f"{m['power_w']:4.0f} W, {m['sustained_mhz']:5.0f} MHz")
    for name, by_op in e.items():
        print(f"  DRAM part, static as {name}: read {by_op['read'] * 1e9:5.1f} pJ/B, "
              f"written {by_op['write'] * 1e9:5.1f} pJ/B")
    print(f"{'case':<13} {'sustained':>9} {'energy':>7} {'floor':>6}  (floor with idle / clocked static)  kernel")
    for c in cases:
        cb, ep = c["cublas"], c["epifuse"]
        print(f"{c['workload'] + ' ' + c['shape']:<13} {ep['sustained_ms'] / cb['sustained_ms']:9.3f} "
              f"{ep['mj_per_call'] / cb['mj_per_call']:7.3f} {c['floor']:6.3f}  ({c['idle']:.3f} / "
              f"{c['clocked']:.3f})  {c['kernel']}")
    if args.out:
        stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
        path = Path(args.out) / f"energy_floor_{stamp}.json"
        path.write_text(json.dumps({"env": env, "power_limit_w": nvml.power_limit_w(), "energy": energy,
                                    "cases": cases}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
