"""Write tests/gpu_durations.json from JUnit XML reports of GPU runs (`pytest -m gpu
--junitxml=...`): each test's node id and seconds, for those that took at least MIN_S. The
test set-up (tests/conftest.py) starts the longest GPU tests first, so that pytest-xdist's
workers do not end on them.
    python research/gpu_durations.py research/results/<run>/gpu.xml [more.xml]
A test in several reports keeps its longest time."""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

MIN_S = 2.0
OUT = Path(__file__).resolve().parents[1] / "tests" / "gpu_durations.json"


def node_id(case) -> str:
    parts = case.get("classname").split(".")
    name = case.get("name")
    # JUnit names a test in a class as module.Class: a capitalized last part is the class
    if parts[-1][:1].isupper():
        return f"{'/'.join(parts[:-1])}.py::{parts[-1]}::{name}"
    return f"{'/'.join(parts)}.py::{name}"


def main(paths: list[str]) -> int:
    seconds: dict[str, float] = {}
    for path in paths:
        for case in ET.parse(path).iter("testcase"):
            if case.get("classname") and case.find("skipped") is None:
                key = node_id(case)
                seconds[key] = max(seconds.get(key, 0.0), float(case.get("time") or 0.0))
    kept = {k: round(v, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1]) if v >= MIN_S}
    OUT.write_text(json.dumps(kept, indent=0) + "\n")
    print(f"{OUT}: {len(kept)} tests of {len(seconds)} took {MIN_S} s or more, {sum(kept.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
