"""The order of a GPU test run (tests/conftest.py applies it when CUDA is there): the longest
tests first, by the seconds each took in a recent run (tests/gpu_durations.json, which
research/gpu_durations.py writes from JUnit XML), each handed to the next free xdist worker.

pytest-xdist's own load scheduling (3.6) starts each worker with a chunk of consecutive tests
(a quarter of its share: 9 each for 600 tests on 16 workers), so with the longest tests first
the first worker got the nine longest and the run ended on it (at 79fe442 the 540 s limit cut
off its last three); the other tests were handed out as workers ran low, several at a time. `scheduler_class()` replaces that
for GPU runs (conftest's pytest_xdist_make_scheduler): every worker holds the test it runs and
the one after it (at the start, one of the longest and one of the shortest: first_order), and
a worker that finishes a test gets the next one in this order, which is greedy longest-first
scheduling (xdist's --maxschedchunk does not apply to it). Simulated (`simulate`) on the
durations of 2026-11-29 evening, 16 workers: 320 s, against 5109 / 16 = 319 s of tests per
worker; xdist's own chunks would have given the first worker 991 s before its next test. On
those of the 6462fab run (the fuzz sweep alone 387 s): 387 s, the sweep's own time.
"""
from __future__ import annotations

import json
from pathlib import Path

GPU_DURATIONS = Path(__file__).resolve().parent / "gpu_durations.json"
QUEUED = 2   # tests a worker holds: the one it runs and the next (xdist runs a test once it knows the next)


def longest_first(items: list) -> list:
    """`items` with the GPU tests that took longest in a recent run first; tests without a
    recorded time (new ones, whose time is not known, or ones a run's time limit cut off) go
    before all, in their order. Each worker collects and sorts alike, as xdist requires."""
    try:
        seconds = json.loads(GPU_DURATIONS.read_text())
    except (OSError, ValueError):
        return items
    order = {id(item): i for i, item in enumerate(items)}
    return sorted(items, key=lambda item: (-seconds.get(item.nodeid, float("inf")), order[id(item)]))


def scheduler_class():
    """xdist's LoadScheduling handing out one test at a time, in collection order, to whichever
    worker holds fewer than QUEUED (imported here: xdist is there only where runs are parallel)."""
    from itertools import cycle

    from xdist.scheduler import LoadScheduling

    class OneAtATime(LoadScheduling):
        def schedule(self):
            assert self.collection_is_completed
            if self.collection is not None:   # a worker added later: top every worker up
                for node in self.nodes:
                    self.check_schedule(node)
                return
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = list(self.node2collection.values())[0]
            self.pending[:] = first_order(len(self.collection), len(self.nodes))
            nodes = cycle(self.nodes)
            for _ in range(min(len(self.pending), QUEUED * len(self.nodes))):
                self._send_tests(next(nodes), 1)
            if not self.pending:
                for node in self.nodes:
                    node.shutdown()

        def check_schedule(self, node, duration=0):
            if node.shutting_down:
                return
            if self.pending:
                missing = QUEUED - len(self.node2pending[node])
                if missing > 0:
                    self._send_tests(node, missing)
            else:
                node.shutdown()

    return OneAtATime


def first_order(count: int, workers: int) -> list[int]:
    """The order in which OneAtATime hands out `count` tests (indices, longest first) to
    `workers`: the first round the `workers` longest, the second round the `workers` shortest,
    then the rest longest first. The second test a worker holds waits for its first, so each
    of the longest is followed by one that takes no time, not by the next longest (the 17th
    longest queued behind the fuzz sweep would end the run a minute after it)."""
    head = list(range(min(workers, count)))
    tail = list(range(count - 1, len(head) - 1, -1))[:workers * (QUEUED - 1)]
    return head + tail + list(range(len(head), count - len(tail)))


def simulate(seconds: list[float], workers: int) -> float:
    """The wall time of tests taking `seconds` (in collection order) on `workers` under the
    scheduler itself (scheduler_class, given stand-ins for xdist's workers): each worker runs
    the tests sent to it in the order they came, one at a time, and each test's end is
    reported to the scheduler, which sends what it sends then."""
    import heapq
    from types import SimpleNamespace

    class Worker:
        def __init__(self, name: str):
            self.gateway, self.shutting_down, self.queue = SimpleNamespace(id=name), False, []

        def send_runtest_some(self, indices):
            self.queue.extend(indices)

        def shutdown(self):
            self.shutting_down = True
    config = SimpleNamespace(getvalue=lambda name: ["popen"] * workers if name == "tx" else None,
                             getoption=lambda name, default=None: None)
    scheduler = scheduler_class()(config, None)
    nodes = [Worker(f"gw{w}") for w in range(workers)]
    names = [f"t.py::{i}" for i in range(len(seconds))]
    for node in nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, names)
    scheduler.schedule()
    running = [(seconds[node.queue[0]], w) for w, node in enumerate(nodes) if node.queue]
    heapq.heapify(running)
    end = 0.0
    while running:
        end, w = heapq.heappop(running)
        node = nodes[w]
        scheduler.mark_test_complete(node, node.queue.pop(0), 0.0)
        if node.queue:
            heapq.heappush(running, (end + seconds[node.queue[0]], w))
    return end
