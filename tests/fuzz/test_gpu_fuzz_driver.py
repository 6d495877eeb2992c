"""tests/fuzz/gpu_fuzz.py, the parallel fuzz driver, on a tiny budget: the CPU fuzz test in two
processes with their own seeds, their reports summed."""
from __future__ import annotations

import json

import pytest

import gpu_fuzz


@pytest.mark.slow
def test_the_driver_runs_seeded_processes_and_sums_their_reports(tmp_path, capsys):
    out = tmp_path / "fuzz"
    code = gpu_fuzz.main(["--cpu", "--processes", "2", "--examples", "4", "--budget", "300",
                          "--seed", "17", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed + "".join(p.read_text()[-3000:] for p in out.glob("log-*.txt"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["examples"] == 4 and summary["failures"] == 0 and summary["processes"] == 2
    reports = [json.loads((out / f"report-{i}.json").read_text()) for i in range(2)]
    assert [r["seed"] for r in reports] == ["17", "18"]
    assert [r["examples"] for r in reports] == [2, 2]
    assert "gpu fuzz: 4 examples run in 2 processes, 0 failures" in printed
    summed = {}
    for r in reports:
        for name, count in r["kernels"].items():
            summed[name] = summed.get(name, 0) + count
    assert summary["kernels"] == summed and all(0 < c <= 4 for c in summed.values())
    assert (out / "cache" / "kernels").is_dir()  # the shared kernel cache


def test_the_summary_counts_missing_reports_and_failures():
    summary = {"examples": 7, "processes": 3, "failures": 1, "seconds": 12.0, "seed": 5,
               "skipped_after_deadline": 2, "processes_without_report": [2], "processes_with_errors": []}
    line = gpu_fuzz.summary_line(summary)
    assert line.startswith("gpu fuzz: 7 examples run in 3 processes, 1 failures, 12 s (seed 5")
    assert "2 examples not run: time budget spent" in line and "no report from processes [2]" in line
