"""Where do a GEMM's bytes go? One launch each of cuBLAS (A @ B, and addmm with a C tile) and of
chosen epifuse kernels at one shape, profiled by Nsight Compute: time, L2 and DRAM traffic and
throughput, the share of reads L2's request coalescer merged (coal%), tensor-pipe activity, each kernel's name (cuBLAS's says its tile and cluster), and
what its warps were stalled on (the WarpStateStats section: warps per issued instruction, all
warps together, so a warp-specialized kernel's producer, which mostly waits, counts too).

    PYTHONPATH=src:. python -m research.ncu_probe --out DIR [--shape 16384 4096 1024]
        [--runs "identity=<kernel repr>;two_outputs=<kernel repr>"]

The driver runs ncu on this module (`--inner`), which warms each launch up (compiling it) and
brackets one more launch with cudaProfilerStart/Stop, so ncu profiles exactly the listed
launches in order. Writes DIR/ncu_raw.csv and prints a table; `table(csv_text, labels)` reads
the CSV back.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

from epifuse.debug import ncu_csv_rows

SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "LaunchStats", "WarpStateStats")
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
# The L2 request coalescer merges SMs' reads of one sector that arrive together: the share it
# merged (1 - sectors read from L2 / sectors delivered) decides how busy L2 is for the same
# tiles (NOTEBOOK.md, 2026-11-26 12:32-12:54: 13 % for cute_probe's kernel launched as a (1, 1, 1)
# cluster, 43 % for the same kernel launched plainly).
LRC_TO_SMS, LRC_FROM_L2 = "lrc__xbar2gpc_sectors_op_read.sum", "lrc__lts2lrc_sectors_op_read.sum"
COALESCED = "coalesced %"
EXTRA_METRICS = ("lts__t_bytes.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
                 "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
                 LRC_TO_SMS, LRC_FROM_L2)
COLUMNS = [  # (header, metric, scale)
    ("us", "gpu__time_duration.sum", 1e-3),
    ("MHz", "gpc__cycles_elapsed.avg.per_second", 1e-6),
    ("tensor%", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed", 1),
    ("L2%", "lts__throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("L2 MB", "lts__t_bytes.sum", 1e-6),
    ("coal%", COALESCED, 1),
    ("DRAM%", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("rd MB", "dram__bytes_read.sum", 1e-6),
    ("wr MB", "dram__bytes_write.sum", 1e-6),
    ("grid", "launch__grid_size", 1),
    ("cluster", "launch__cluster_size", 1),
]
DEFAULT_RUNS = ";".join([
    "identity=<gluon_pingpong 128x128x64 group 8, 4 warps, 4 stages>",
    "identity=<gluon_cooperative 128x256x64 group 8, 8 warps, 3 stages>",
    "tile_C=<gluon_pingpong 128x128x64 group 8, 4 warps, 5 stages, epilogue in 2>",
    "two_outputs=<gluon_pingpong 128x128x64 group 8, 4 warps, 5 stages, epilogue in 2>",
    "two_outputs=<gluon_cooperative 128x256x64 group 8, 8 warps, 3 stages>",
])


def _launches(ns):
    """[(label, fn)]: cuBLAS's two, then each requested epifuse kernel."""
    import torch

    import epifuse
    from research.probe import make_args, make_operands
    M, N, K = ns.shape
    A, B, operands = make_operands(M, N, K)
    D = torch.empty(M, N, device="cuda", dtype=torch.float16)
    C = operands["C"]
    launches = [("cublas A@B", lambda: torch.matmul(A, B, out=D)),
                ("cublas addmm 1.5*A@B+0.5*C", lambda: torch.addmm(C, A, B, beta=0.5, alpha=1.5, out=D))]
    for item in filter(None, ns.runs.split(";")):
        name, _, wanted = item.partition("=")
        args = make_args(name, A, B, operands)
        kernel = next((k for k in epifuse.get_kernels(args) if repr(k) == wanted), None)
        if kernel is None:
            print(f"ncu_probe: no supported kernel {wanted} for {name}", file=sys.stderr)
            continue
        launches.append((f"{name} {wanted}", lambda kernel=kernel, args=args: kernel.run(args)))
    return launches


def inner(ns) -> None:
    import torch
    labels = []
    for label, fn in _launches(ns):
        fn(), fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        labels.append(label)
    print("NCU_PROBE_LABELS " + json.dumps(labels), flush=True)


def table(text: str, labels: list[str]) -> str:
    """The raw CSV (one row per profiled kernel) as a short table, one line per launch."""
    rows = ncu_csv_rows(text)
    if not rows:
        return "no kernels in the ncu output"
    header, rows = rows[0], [r for r in rows[2:] if len(r) == len(rows[0])]  # rows[1]: units
    col = {h: i for i, h in enumerate(header)}
    out = ["  ".join(f"{h:>8}" for h, _, _ in COLUMNS) + "  launch / kernel"]
    for n, row in enumerate(rows):
        cells = []
        for _, metric, scale in COLUMNS:
            try:
                cells.append(f"{_value(row, col, metric) * scale:8.1f}")
            except (KeyError, ValueError, ZeroDivisionError):
                cells.append(f"{'-':>8}")
        label = labels[n] if n < len(labels) else "?"
        out.append("  ".join(cells) + f"  {label} / {row[col.get('Kernel Name', 0)][:70]}")
    stalls = [stall_line(header, row) for row in rows]
    if any(stalls):
        out += ["", "stalls (warps per issued instruction, the four largest)"]
        out += [f"  {labels[n] if n < len(labels) else '?'}: {line or '-'}" for n, line in enumerate(stalls)]
    return "\n".join(out)


def _value(row: list[str], col: dict, metric: str) -> float:
    if metric == COALESCED:
        return 100 * (1 - _value(row, col, LRC_FROM_L2) / _value(row, col, LRC_TO_SMS))
    return float(row[col[metric]].replace(",", ""))


def stall_line(header: list[str], row: list[str], top: int = 4) -> str:
    """'long_scoreboard 3.1, barrier 1.2, ...': the largest stall reasons of one CSV row."""
    reasons = []
    for name, cell in zip(header, row):
        match = STALL.match(name)
        if match and match.group(1) == "selected":  # the warp issued: 1.0 by definition, no stall
            continue
        try:
            value = float(cell.replace(",", "")) if match else None
        except ValueError:
            value = None
        if value:
            reasons.append((value, match.group(1)))
    return ", ".join(f"{reason} {value:.2f}" for value, reason in sorted(reasons, reverse=True)[:top])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m research.ncu_probe")
    p.add_argument("--shape", type=int, nargs=3, default=(16384, 4096, 1024))
    p.add_argument("--runs", default=DEFAULT_RUNS, help="';'-separated probe-epilogue=kernel-repr")
    p.add_argument("--out", default=".")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.inner:
        inner(ns)
        return 0
    ncu = shutil.which("ncu")
    if ncu is None:
        print("ncu_probe: ncu is not on PATH", file=sys.stderr)
        return 2
    os.makedirs(ns.out, exist_ok=True)
    target = [sys.executable, "-m", "research.ncu_probe", "--inner", "--shape", *map(str, ns.shape),
              "--runs", ns.runs]
    base = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--target-processes", "all",
            "--csv", "--page", "raw", *(a for s in SECTIONS for a in ("--section", s))]
    for extra in (["--metrics", ",".join(EXTRA_METRICS)], []):  # without the extras if one is unknown
        done = subprocess.run([*base, *extra, *target], capture_output=True, text=True)
        if done.returncode == 0:
            break
        print(f"ncu_probe: ncu exit {done.returncode}: {done.stderr[-2000:]}{done.stdout[-2000:]}",
              file=sys.stderr)
    labels = next((json.loads(ln.split(" ", 1)[1]) for ln in done.stdout.splitlines()
                   if ln.startswith("NCU_PROBE_LABELS ")), [])
    with open(os.path.join(ns.out, "ncu_raw.csv"), "w") as f:
        f.write(done.stdout)
    print(table(done.stdout, labels))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
