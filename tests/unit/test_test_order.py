"""The GPU run's order (tests/gpu_order.py): the tests that took longest start first."""
from types import SimpleNamespace

import gpu_order


def test_unrecorded_tests_come_first_then_the_longest_recorded(tmp_path, monkeypatch):
    durations = tmp_path / "gpu_durations.json"
    durations.write_text('{"t.py::b": 3.0, "t.py::d": 90.5, "t.py::e": 3.0}')
    monkeypatch.setattr(gpu_order, "GPU_DURATIONS", durations)
    items = [SimpleNamespace(nodeid=f"t.py::{name}") for name in "abcdef"]
    assert [i.nodeid[-1] for i in gpu_order.longest_first(items)] == list("acfdbe")
    # three workers: rounds of three, every second one reversed
    assert [i.nodeid[-1] for i in gpu_order.longest_first(items, workers=3)] == list("acfebd")
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
