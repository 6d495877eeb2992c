"""The order of a GPU test run (tests/conftest.py applies it when CUDA is there): the longest
tests first, by the seconds each took in a recent run (tests/gpu_durations.json, which
research/gpu_durations.py writes from JUnit XML)."""
from __future__ import annotations

import json
import os
from pathlib import Path

GPU_DURATIONS = Path(__file__).resolve().parent / "gpu_durations.json"


def longest_first(items: list, workers: int | None = None) -> list:
    """`items` with the GPU tests that took longest in a recent run first, so that
    pytest-xdist's workers do not end on them; tests without a recorded time (new ones, whose
    time is not known, or ones a run's time limit cut off) go before all, in their order. xdist hands its first quarter of the tests out one by one, round robin, so
    with `workers` (PYTEST_XDIST_WORKER_COUNT, which each worker has) every second round of
    that many is reversed: the worker that got a round's longest test gets the next round's
    shortest. Each worker collects and sorts alike, as xdist requires. Simulated on the
    durations file of 2026-11-29 morning (tests under 2 s not recorded, unrecorded ones last):
    327 s for 16 workers, against 416 in collection order and 353 longest first without the
    reversal (316 is the total over 16). On the H200 that order took 541 s, six unrecorded
    30-57 s tests starting last; the present rule and file have not run there yet."""
    try:
        seconds = json.loads(GPU_DURATIONS.read_text())
    except (OSError, ValueError):
        return items
    order = {id(item): i for i, item in enumerate(items)}
    ranked = sorted(items, key=lambda item: (-seconds.get(item.nodeid, float("inf")), order[id(item)]))
    workers = workers or int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers < 2:
        return ranked
    rounds = [ranked[i:i + workers] for i in range(0, len(ranked), workers)]
    return [item for r, chunk in enumerate(rounds) for item in (chunk[::-1] if r % 2 else chunk)]
