"""Write the shipped table of tuned choices for one GPU model from full benchmark runs on it.

    python -m bench.choices bench/results/bench_<date>_<GPU>.json [more JSONs of the same GPU]

Every row of a benchmark JSON run with full tuning (`python -m bench`, which sets
EPIFUSE_TUNE=full) records the time of every candidate kernel for its workload. Rows are
grouped by input type (16-bit floats, fp8, int8: runtime/shipped.input_class) and shape; in
each group the kernels are ranked by the geometric mean, over the workloads that timed them,
of their time relative to the kernel full tuning chose for that workload (so a kernel chosen
everywhere scores 1.0, and the tie-breaks tuning applies within 3 % carry over), kernels timed
for fewer workloads than the most after the others; within 3 % of the best, the kernel chosen
for the most workloads comes first. The table goes to
src/epifuse/data/tuned/<GPU>.json, where runtime/shipped.py reads it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

INPUTS = {"fp16": "16-bit float", "bf16": "16-bit float", "fp8e4m3": "fp8", "int8": "int8"}
TABLES = Path(__file__).resolve().parent.parent / "src" / "epifuse" / "data" / "tuned"


def rank(tunings: list[dict], within: float = 1.03) -> list[tuple[str, int, float]]:
    """(kernel, workloads timed, geometric-mean time relative to each workload's choice) of
    every kernel in `tunings` (epifuse_tuning records of one input type and shape), best first.
    Within `within` of the best score (tuning's own tie-break margin, tune.LIGHTER_WITHIN), the
    kernel full tuning chose for the most workloads comes first."""
    ratios, chosen = defaultdict(list), defaultdict(int)
    for record in tunings:
        chosen[record["choice"]] += 1
        for kernel, us in record["timings_us"].items():
            ratios[kernel].append(us / record["timings_us"][record["choice"]])
    scored = [(kernel, len(r), math.exp(sum(map(math.log, r)) / len(r))) for kernel, r in ratios.items()]
    scored.sort(key=lambda s: (-s[1], s[2], s[0]))
    near = [s for s in scored if s[1] == scored[0][1] and s[2] <= scored[0][2] * within]
    first = max(near, key=lambda s: (chosen[s[0]], -s[2]))
    return [first, *(s for s in scored if s is not first)]


def table(results: list[dict]) -> dict:
    """The table of one GPU model from the benchmark JSONs `results`."""
    gpus = {r["env"]["gpu"] for r in results}
    if len(gpus) != 1:
        raise SystemExit(f"the JSONs come from {len(gpus)} GPU models ({sorted(gpus)}); give one model's")
    groups = defaultdict(list)
    for result in results:
        for row in result["rows"]:
            record = row.get("epifuse_tuning")
            if not record or record.get("policy", "full") != "full" or row["dtype"] not in INPUTS:
                continue   # a row whose kernel was not chosen by full tuning
            groups[(INPUTS[row["dtype"]], row["M"], row["N"], row["K"])].append(record)
    if not groups:
        raise SystemExit("no row of these JSONs holds a full tuning record (run python -m bench with EPIFUSE_TUNE=full)")
    entries = []
    for (kind, M, N, K), tunings in sorted(groups.items()):
        ranked = rank(tunings)
        entries.append({"input": kind, "M": M, "N": N, "K": K, "workloads": len(tunings),
                        "order": [kernel for kernel, _, _ in ranked],
                        "scores": [[n, round(score, 4)] for _, n, score in ranked]})
    env = results[-1]["env"]
    return {"gpu": gpus.pop(), "torch": env.get("torch"), "triton": env.get("triton"),
            "sources": sorted(r["_source"] for r in results), "entries": entries}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="benchmark JSONs of one GPU model")
    p.add_argument("--out", default=None, help="the table's path (default: the package's data folder)")
    ns = p.parse_args(argv)
    results = []
    for path in ns.results:
        with open(path) as f:
            result = json.load(f)
        result["_source"] = Path(path).name
        results.append(result)
    made = table(results)
    sys.path.insert(0, str(TABLES.parents[2]))
    from epifuse.runtime.shipped import gpu_file_name
    out = Path(ns.out) if ns.out else TABLES / gpu_file_name(made["gpu"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(made, indent=1) + "\n")
    print(f"{out}: {len(made['entries'])} entries for {made['gpu']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
