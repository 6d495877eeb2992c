"""The GPU run's order (tests/gpu_order.py): the tests that took longest start first."""
from types import SimpleNamespace

import gpu_order


def test_unrecorded_tests_come_first_then_the_longest_recorded(tmp_path, monkeypatch):
    durations = tmp_path / "gpu_durations.json"
    durations.write_text('{"t.py::b": 3.0, "t.py::d": 90.5, "t.py::e": 3.0}')
    monkeypatch.setattr(gpu_order, "GPU_DURATIONS", durations)
    items = [SimpleNamespace(nodeid=f"t.py::{name}") for name in "abcdef"]
    assert [i.nodeid[-1] for i in gpu_order.longest_first(items)] == list("acfdbe")
    monkeypatch.setattr(gpu_order, "GPU_DURATIONS", tmp_path / "missing.json")
    assert gpu_order.longest_first(items) == items


def test_the_recorded_durations_name_collected_tests():
    """A renamed test loses its place silently: most recorded names must still be tests."""
    import json
    import subprocess
    import sys
    recorded = json.loads(gpu_order.GPU_DURATIONS.read_text())
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                             "tests", "--ignore=tests/gpu/test_distributed_gpu.py"],
                            capture_output=True, text=True, cwd=gpu_order.GPU_DURATIONS.parents[1], timeout=600)
    collected = set(result.stdout.splitlines())
    assert sum(name in collected for name in recorded) >= 0.9 * len(recorded)


class _Worker:
    """What xdist's scheduler sees of a worker: the tests sent to it, and its shutdown."""

    def __init__(self, name):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent = []

    def send_runtest_some(self, indices):
        self.sent.extend(indices)

    def shutdown(self):
        self.shutting_down = True


def test_a_gpu_run_hands_each_next_test_to_the_worker_that_frees_up():
    """Two tests per worker at the start (round robin, so the longest go to different workers,
    each with one of the shortest behind it), then one more to a worker each time it finishes
    one, in collection order; each worker shuts down once nothing is left. xdist's own
    scheduling sent each worker a chunk of consecutive tests first: with the longest first,
    the first worker got all of the longest."""
    import pytest
    pytest.importorskip("xdist")   # in the test extras; skipped only where the extras are not installed
    config = SimpleNamespace(getvalue=lambda name: ["popen"] * 3 if name == "tx" else None,
                             getoption=lambda name, default=None: None)
    scheduler = gpu_order.scheduler_class()(config, None)
    workers = [_Worker(f"gw{i}") for i in range(3)]
    for worker in workers:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, [f"t.py::{i}" for i in range(10)])
    scheduler.schedule()
    assert [w.sent for w in workers] == [[0, 9], [1, 8], [2, 7]]
    scheduler.mark_test_complete(workers[1], 1, 0.5)
    assert workers[1].sent == [1, 8, 3] and workers[0].sent == [0, 9]
    scheduler.mark_test_complete(workers[1], 8, 0.5)
    scheduler.mark_test_complete(workers[2], 2, 9.0)
    assert workers[1].sent == [1, 8, 3, 4] and workers[2].sent == [2, 7, 5]
    for worker, index in ((workers[0], 0), (workers[0], 9), (workers[1], 3), (workers[1], 4), (workers[2], 7),
                          (workers[2], 5), (workers[0], 6)):
        scheduler.mark_test_complete(worker, index, 1.0)
    assert sorted(i for w in workers for i in w.sent) == list(range(10))
    assert all(w.shutting_down for w in workers)


def test_the_simulated_gpu_run_ends_near_its_share_of_test_time():
    import json

    import pytest
    pytest.importorskip("xdist")   # simulate runs the scheduler itself
    seconds = sorted(json.loads(gpu_order.GPU_DURATIONS.read_text()).values(), reverse=True)
    wall = gpu_order.simulate(seconds, 16)
    assert max(seconds) <= wall < 1.1 * max(sum(seconds) / 16, max(seconds))
    # round robin two deep: the 1 s test queued behind the 5 s one waits for it
    assert gpu_order.simulate([5.0, 1.0, 1.0, 1.0], 2) == 6.0
    assert gpu_order.simulate([1.0] * 6, 2) == 3.0
    # the shortest go behind the longest at the start: no 4 s test waits behind the 10 s one (which
    # would end at 14 s); the other worker runs the three, 12 s
    assert gpu_order.simulate([10.0, 4.0, 4.0, 4.0, 0.0, 0.0], 2) == 12.0
