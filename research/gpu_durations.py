"""Write tests/gpu_durations.json from JUnit XML reports of GPU runs (`pytest -m gpu
--junitxml=...`): each test's node id and seconds, every test that ran (not those skipped).
The test set-up (tests/conftest.py) starts the tests it has no time for first (new ones), then
the longest, so that pytest-xdist's workers do not end on them.
    python research/gpu_durations.py research/results/<run>/gpu.xml [more.xml] [rerun.log]
A report not ending in .xml is a pytest log with `--durations` lines ("12.34s call <node id>"),
for tests a run's time limit cut off and a second call ran. A test in the reports takes its time
there (its longest, where several reports have it); one only in the file keeps the file's (a
test the limit cut off would otherwise drop out of the file and start first next time)."""
from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "gpu_durations.json"


def node_id(case) -> str:
    parts = case.get("classname").split(".")
    name = case.get("name")
    # JUnit names a test in a class as module.Class: a capitalized last part is the class
    if parts[-1][:1].isupper():
        return f"{'/'.join(parts[:-1])}.py::{parts[-1]}::{name}"
    return f"{'/'.join(parts)}.py::{name}"


DURATION_LINE = re.compile(r"^\s*([0-9.]+)s call\s+(\S.*?)\s*$")


def main(paths: list[str]) -> int:
    seconds: dict[str, float] = {}
    for path in paths:
        if not path.endswith(".xml"):
            for line in Path(path).read_text().splitlines():
                if match := DURATION_LINE.match(line):
                    key = match.group(2)
                    seconds[key] = max(seconds.get(key, 0.0), float(match.group(1)))
            continue
        for case in ET.parse(path).iter("testcase"):
            if case.get("classname") and case.find("skipped") is None:
                key = node_id(case)
                seconds[key] = max(seconds.get(key, 0.0), float(case.get("time") or 0.0))
    recorded = json.loads(OUT.read_text()) if OUT.exists() else {}
    merged = {**recorded, **seconds}
    kept = {k: round(v, 1) for k, v in sorted(merged.items(), key=lambda kv: -kv[1])}
    OUT.write_text(json.dumps(kept, indent=0) + "\n")
    print(f"{OUT}: {len(kept)} tests, {sum(kept.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
