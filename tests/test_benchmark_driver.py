"""The benchmark driver's timing order (benchmarks/run.py), on CPU with a fake clock."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import run  # noqa: E402


def test_every_baseline_is_timed_forward_and_backward(monkeypatch):
    """A GPU that slows down as it runs adds the same to each baseline's mean; a baseline
    that fails is reported, not timed."""
    order = []

    def fake_bench(fn, warmup, rep):
        order.append(fn())
        return {"cublas": 100.0, "inductor": 150.0, "epifuse": 110.0}[order[-1]] + 2.0 * len(order)

    def broken():
        raise RuntimeError("no kernel")

    monkeypatch.setattr(run, "bench_ms", fake_bench)
    calls = {"cublas": lambda: "cublas", "inductor": lambda: "inductor", "eager": broken,
             "epifuse": lambda: "epifuse"}
    errors = {}
    times = run._time_both_ways(calls, errors, 1.0, 1.0)
    assert order == ["cublas", "inductor", "epifuse", "epifuse", "inductor", "cublas"]
    assert times == {"cublas": 100.0 + 2.0 * (1 + 6) / 2, "inductor": 150.0 + 2.0 * (2 + 5) / 2,
                     "epifuse": 110.0 + 2.0 * (3 + 4) / 2}
    assert set(errors) == {"eager"} and "no kernel" in errors["eager"]
