"""The long GPU fuzz run, in parallel: one pytest process per core, each with its own seed.

    python tests/fuzz/gpu_fuzz.py                          # 3000 examples, 14 processes, 8 minutes at most
    python tests/fuzz/gpu_fuzz.py --examples 6000 --budget 600
    python tests/fuzz/gpu_fuzz.py --cpu --processes 2 --examples 6 --budget 120   # CPU smoke run

Each example of tests/test_fuzz_kernels.py compiles new kernels (about a second each on a GPU),
and Hypothesis runs examples one after another, so one process reaches a few hundred examples in
8 minutes. This driver starts --processes pytest processes running test_fuzz_gpu (with --cpu:
test_fuzz_against_float64_reference), each with EPIFUSE_FUZZ_SEED = seed + its index (its own
examples, no shared example database), EPIFUSE_FUZZ_EXAMPLES = its share of --examples, one
shared EPIFUSE_CACHE_DIR, and EPIFUSE_FUZZ_DEADLINE, after which examples are no longer run, so
the whole run ends within --budget seconds. Every process writes a JSON report of the examples it
ran; the driver prints one summary line and exits with 1 on any failure, a missing report, or
when no example ran at all.
Logs and reports go to --out (default $OUT/gpu-fuzz when $OUT is set, else a new temporary
directory); a failing process's log holds Hypothesis's falsifying example and its
@reproduce_failure blob, and `--seed` with the same --processes and --examples repeats a run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GPU_TEST = "tests/fuzz/test_fuzz_kernels.py::test_fuzz_gpu"
CPU_TEST = "tests/fuzz/test_fuzz_kernels.py::test_fuzz_against_float64_reference"
# Time left after the deadline for the example in flight and pytest's exit, before processes
# are killed.
FINISH_MARGIN_S = 30.0
KILL_GRACE_S = 90.0


@dataclass
class Worker:
    index: int
    process: subprocess.Popen
    log: Path
    report: Path
    timed_out: bool = False

    def result(self) -> dict | None:
        try:
            return json.loads(self.report.read_text())
        except (OSError, ValueError):
            return None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--examples", type=int, default=3000, help="in total, over all processes")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run")
    parser.add_argument("--seed", type=int, default=None, help="base seed (default: random)")
    parser.add_argument("--cpu", action="store_true", help="run the CPU fuzz test (a smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="logs and reports")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="the shared EPIFUSE_CACHE_DIR (default: <out>/cache)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    return parser.parse_args(argv)


def output_dir(requested: Path | None) -> Path:
    if requested is None:
        requested = Path(os.environ["OUT"]) / "gpu-fuzz" if os.environ.get("OUT") \
            else Path(tempfile.mkdtemp(prefix="epifuse-gpu-fuzz-"))
    requested.mkdir(parents=True, exist_ok=True)
    return requested


def worker_env(opts, index: int, share: int, deadline: float, cache_dir: Path, report: Path) -> dict:
    paths = [str(REPO / "src"), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ,
                PYTHONPATH=os.pathsep.join(p for p in paths if p),
                EPIFUSE_FUZZ_SEED=str(opts.seed + index),
                EPIFUSE_FUZZ_EXAMPLES=str(share),
                EPIFUSE_FUZZ_DEADLINE=repr(deadline),
                EPIFUSE_FUZZ_REPORT=str(report),
                EPIFUSE_CACHE_DIR=str(cache_dir),
                EPIFUSE_QUIET="1",
                OMP_NUM_THREADS="1")  # torch's CPU threads: one per process, the cores are taken


def start_workers(opts, out: Path, cache_dir: Path, deadline: float) -> list[Worker]:
    share = math.ceil(opts.examples / opts.processes)
    target = [CPU_TEST] if opts.cpu else [GPU_TEST, "-m", "gpu"]
    workers = []
    for index in range(opts.processes):
        log, report = out / f"log-{index}.txt", out / f"report-{index}.json"
        report.unlink(missing_ok=True)
        # -m "": the fuzz tests are marked slow, which the default selection leaves out
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", *target,
                   *opts.pytest_args]
        with open(log, "w") as sink:
            process = subprocess.Popen(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                       env=worker_env(opts, index, share, deadline, cache_dir, report))
        workers.append(Worker(index, process, log, report))
    return workers


def wait_for(workers: list[Worker], kill_at: float) -> None:
    for worker in workers:
        try:
            worker.process.wait(timeout=max(1.0, kill_at - time.time()))
        except subprocess.TimeoutExpired:
            worker.timed_out = True
            worker.process.kill()
            worker.process.wait()


def summarize(opts, workers: list[Worker], elapsed: float) -> dict:
    reports = [w.result() for w in workers]
    missing = [w.index for w, r in zip(workers, reports) if r is None]
    errors = [w.index for w, r in zip(workers, reports)
              if w.process.returncode != 0 and (r is None or not r["failures"])]
    return {
        "test": CPU_TEST if opts.cpu else GPU_TEST,
        "processes": len(workers),
        "seed": opts.seed,
        "examples": sum(r["examples"] for r in reports if r),
        "failures": sum(r["failures"] for r in reports if r),
        "skipped_after_deadline": sum(r["skipped_after_deadline"] for r in reports if r),
        "kernels": {name: sum(r.get("kernels", {}).get(name, 0) for r in reports if r)
                    for name in sorted({n for r in reports if r for n in r.get("kernels", {})})},
        "failed_processes": [w.index for w, r in zip(workers, reports) if r and r["failures"]],
        "processes_without_report": missing,
        "processes_with_errors": errors,
        "timed_out": [w.index for w in workers if w.timed_out],
        "seconds": round(elapsed, 1),
    }


def summary_line(summary: dict) -> str:
    line = (f"gpu fuzz: {summary['examples']} examples run in {summary['processes']} processes, "
            f"{summary['failures']} failures, {summary['seconds']:.0f} s (seed {summary['seed']}")
    if summary["skipped_after_deadline"]:
        line += f"; {summary['skipped_after_deadline']} examples not run: time budget spent"
    if summary["processes_without_report"]:
        line += f"; no report from processes {summary['processes_without_report']}"
    if summary["processes_with_errors"]:
        line += f"; errors in processes {summary['processes_with_errors']}"
    line += ")"
    if summary.get("kernels"):
        line += "; kernels run: " + ", ".join(f"{n} {c}" for n, c in summary["kernels"].items())
    return line


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.seed is None:
        opts.seed = int.from_bytes(os.urandom(3), "little")
    out = output_dir(opts.out)
    cache_dir = opts.cache_dir or out / "cache"
    start = time.time()
    deadline = start + max(1.0, opts.budget - FINISH_MARGIN_S)
    workers = start_workers(opts, out, cache_dir, deadline)
    wait_for(workers, kill_at=start + opts.budget + KILL_GRACE_S)
    summary = summarize(opts, workers, time.time() - start)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for index in sorted(set(summary["failed_processes"] + summary["processes_with_errors"]
                            + summary["processes_without_report"])):
        print(f"process {index}: see {workers[index].log}")
    print(summary_line(summary))
    print(f"logs and reports: {out}")
    bad = (summary["failures"] or summary["processes_without_report"] or summary["processes_with_errors"]
           or not summary["examples"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
