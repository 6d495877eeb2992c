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


def test_ncu_probe_table_reads_the_raw_csv():
    """One line per profiled launch, in launch order, with its label; a metric ncu did not
    collect reads '-'."""
    from benchmarks import ncu_probe
    text = ('==PROF== Connected\nNCU_PROBE_LABELS ["a", "b"]\n'
            '"ID","Kernel Name","gpu__time_duration.sum","lts__t_bytes.sum"\n'
            '"","","nsecond","byte"\n'
            '"0","sm90_xmma_gemm_tilesize128x256x64_cluster2x1x1","195,500","1,200,000,000"\n'
            '"1","epifuse_kernel","201,250","1,700,000,000"\n')
    lines = ncu_probe.table(text, ["cublas A@B", "identity <k>"]).splitlines()
    assert len(lines) == 3
    assert lines[1].split()[:1] == ["195.5"] and "cublas A@B / sm90_xmma_gemm_tilesize128x256x64" in lines[1]
    assert "1200.0" in lines[1] and "1700.0" in lines[2] and "identity <k> / epifuse_kernel" in lines[2]
    assert lines[2].split()[1] == "-"             # no SM clock column in this CSV
    assert ncu_probe.table("no csv here", []) == "no kernels in the ncu output"
