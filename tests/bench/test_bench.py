"""The product benchmark (bench/): the driver's timing order (bench/run.py) on CPU with a fake
clock, and the clock sampler with a fake nvidia-smi. The research probes' tests are in
research/tests."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import run  # noqa: E402


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
    times, clocks = run._time_both_ways(calls, errors, 1.0, 1.0)
    assert order == ["cublas", "inductor", "epifuse", "epifuse", "inductor", "cublas"]
    assert times == {"cublas": 100.0 + 2.0 * (1 + 6) / 2, "inductor": 150.0 + 2.0 * (2 + 5) / 2,
                     "epifuse": 110.0 + 2.0 * (3 + 4) / 2}
    assert set(errors) == {"eager"} and "no kernel" in errors["eager"] and clocks == {}


def test_clocks_are_sampled_around_each_timing(monkeypatch):
    """Each baseline's two timings are sampled on their own; the summaries merge by sample count."""
    running = []

    class FakeSampler:
        def __enter__(self):
            running.append(True)
            return self

        def __exit__(self, *exc):
            name = order[-1]
            mhz = {"cublas": [1800.0, 1760.0], "epifuse": [1700.0, 1690.0]}[name][order.count(name) - 1]
            self.summary = {"samples": order.count(name), "sm_mhz": mhz, "power_w": 700.0, "temp_c": 60.0,
                            "throttle": "0x4" if name == "epifuse" else "0x0"}
            running.pop()
            return False

    order = []

    def fake_bench(fn, warmup, rep):
        assert running, "timed outside the sampler"
        order.append(fn())
        return 1.0

    monkeypatch.setattr(run, "bench_ms", fake_bench)
    times, clocks = run._time_both_ways({"cublas": lambda: "cublas", "epifuse": lambda: "epifuse"}, {},
                                        1.0, 1.0, FakeSampler)
    assert clocks["cublas"]["sm_mhz"] == round((1800 * 1 + 1760 * 2) / 3, 1)
    assert clocks["epifuse"]["sm_mhz"] == round((1700 * 1 + 1690 * 2) / 3, 1)
    assert clocks["epifuse"]["throttle"] == "0x4" and clocks["cublas"]["samples"] == 3
    row = {"times_ms": {"cublas": 1.0}, "ratios": {}, "errors": {}, "status": "ok", "epifuse_rel_err": None,
           "clocks_while_timed": clocks}
    from bench import report
    note = report.row_summary(row)
    assert note.endswith("MHz while timed: cublas 1773, epifuse 1693 (power cap)"), note


def test_clock_sampler_reads_nvidia_smi_and_survives_its_absence(tmp_path):
    """A fake nvidia-smi of an older driver refuses the new name of the throttle reasons as
    the real one does (a line on stdout, exit 2); the sampler falls back to the old name,
    remembers it, and averages one GPU's samples. One that refuses every field set and one
    that does not exist give no summary and do not hang."""
    import time
    from bench import timing
    log = tmp_path / "calls.log"
    fake = tmp_path / "fake-smi"
    fake.write_text(f"#!/bin/sh\necho \"$1\" >> {log}\n"
                    "case \"$1\" in *clocks_event_reasons*)\n"
                    "  echo 'Field \"clocks_event_reasons.active\" is not a valid field to query.'; exit 2;; esac\n"
                    "while true; do\n"
                    "  echo 'GPU-aaaa, 1755, 690.5, 61, 0x0000000000000004'\n"
                    "  echo 'GPU-bbbb, 1980, 80.0, 30, 0x0000000000000000'\n"
                    "  echo 'GPU-aaaa, [N/A], 700.5, 63, [N/A]'\n  sleep 0.01\ndone\n")
    fake.chmod(0o755)
    for _ in range(2):
        with timing.ClockSampler("aaaa", command=str(fake)) as sampler:
            assert sampler.lines, "the block started before the first sample"
            time.sleep(0.1)
        assert "clocks_throttle_reasons" in sampler._process.args[1]
        s = sampler.summary
        assert s["samples"] >= 4 and s["sm_mhz"] == 1755.0 and s["throttle"] == "0x4"
        assert 690.5 < s["power_w"] < 700.5 and 61 < s["temp_c"] < 63
    assert log.read_text().count("clocks_event_reasons") == 1   # the working set is remembered
    stuck = tmp_path / "stuck"
    stuck.touch()   # the fake fails while this exists: one hiccup must not end sampling for good
    fake.write_text(fake.read_text().replace("while true", f"[ -e {stuck} ] && exit 3\nwhile true"))
    with timing.ClockSampler("aaaa", command=str(fake)) as sampler:
        pass
    assert sampler.summary is None
    stuck.unlink()
    with timing.ClockSampler("aaaa", command=str(fake)) as sampler:
        time.sleep(0.05)
    assert sampler.summary and sampler.summary["sm_mhz"] == 1755.0
    failing = tmp_path / "failing-smi"
    failing.write_text("#!/bin/sh\necho 'Field \"power.draw\" is not a valid field to query.'\nexit 2\n")
    failing.chmod(0o755)
    for command in (str(failing), str(tmp_path / "missing-smi")):
        start = time.perf_counter()
        with timing.ClockSampler(command=command) as sampler:
            pass
        assert sampler.summary is None and time.perf_counter() - start < 3


def test_the_first_call_benchmark_runs_its_cases_in_forked_processes(capsys):
    """bench.first_call on CPU (Triton's interpreter, a tiny shape): every case gets a cold and
    a warm process of its own, each with an output checked against float64."""
    from bench import first_call
    assert first_call.main(["--device", "cpu", "--workloads", "identity,rowsumsq"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "tiny" in ln]
    assert len(lines) == 2 and all("cold" in ln and "warm" in ln for ln in lines)


def test_a_failing_child_reports_its_error():
    from bench import first_call

    def fails():
        raise RuntimeError("no GPU here")
    assert "no GPU here" in first_call.in_child(fails)["error"]


def _parallel_matmul():
    import torch
    a = torch.randn(512, 512)
    return {"sum": float((a @ a).sum())}


def test_a_child_forked_after_cpu_work_does_not_hang(monkeypatch):
    """A parent that ran a parallel CPU op holds an OpenMP pool its fork does not copy: the
    child runs with one thread, so its own parallel op finishes (it hung before)."""
    import torch
    from bench import first_call
    monkeypatch.setattr(first_call, "CHILD_TIMEOUT_S", 30)
    a = torch.randn(512, 512)
    (a @ a).sum()
    result = first_call.in_child(_parallel_matmul)
    assert "sum" in result, result


def test_planar_benchmark_runs_end_to_end_on_cpu(tmp_path, capsys):
    """bench.planar's plumbing at a tiny size under the interpreter: its three ways agree
    with the float64 reference (fp16 planes round D once, the four real GEMMs each product)."""
    import json

    from bench import planar
    assert planar.main(["--device", "cpu", "--size", "40", "--dtypes", "fp16,fp32", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("planar_*_cpu.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["dtype"] for r in rows] == ["float16", "float32"]
    for row in rows:
        bound = 2e-3 if row["dtype"] == "float16" else 1e-5
        assert all(0 < e < bound for e in row["rel_error"].values()), row


def test_gated_benchmark_runs_end_to_end_on_cpu(tmp_path):
    import json

    from bench import gated
    assert gated.main(["--device", "cpu", "--tokens", "40,3", "--hidden", "32", "--inner", "48",
                       "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("gated_*_cpu.json")
    rows = json.loads(path.read_text())["rows"]
    assert [row["tokens"] for row in rows] == [40, 3]
    for row in rows:
        assert set(row["rel_error"]) == {"epifuse", "eager"} and all(0 < e < 1e-2 for e in row["rel_error"].values())


def test_uint8_benchmark_runs_end_to_end_on_cpu(tmp_path):
    """bench.uint8's plumbing at a tiny size: every way within bf16's rounding of float64."""
    import json

    from bench import uint8
    assert uint8.main(["--device", "cpu", "--shapes", "40x24x72", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("uint8_*_cpu.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert set(row["rel_error"]) == {"u8 x u8", "u8 x s8", "s8 x s8"}
    assert all(0 < e < 4e-3 for e in row["rel_error"].values()), row


@pytest.mark.slow
def test_models_benchmark_runs_end_to_end_on_cpu(tmp_path):
    """bench.models' plumbing at tiny sizes: every model's epifuse-backend step matches eager's
    loss and gradients within bf16's rounding, and says what it fused and left."""
    import json

    from bench import models
    assert models.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    rows = {m: json.loads(next(tmp_path.glob(f"models_{m}_*_cpu.json")).read_text())["rows"] for m in models.MODELS}
    rows = [row for m in models.MODELS for row in rows[m]]   # one file per model
    assert [(r["model"], r["variant"]) for r in rows] == [(m, v) for m in models.MODELS for v in ("eager", "epifuse")]
    for row in rows:
        if row["variant"] == "epifuse":
            assert row["loss_rel_error_vs_eager"] < 1e-2 and row["grad_rel_error_vs_eager"] < 3e-2, row
            assert row["fused"] or row["left"], row   # the pass ran and reported every GEMM
    mlp = next(r for r in rows if r["model"] == "mlp" and r["variant"] == "epifuse")
    assert mlp["fused"], mlp   # the MLP's GEMMs take their bias and GELU (and backward) epilogues
    merged = next(r for r in rows if r["model"] == "llama_merged" and r["variant"] == "epifuse")
    assert any("gate, up = accum.chunk(2, dim=-1)" in source for source in merged["fused"]), merged
    separate = next(r for r in rows if r["model"] == "llama_mlp" and r["variant"] == "epifuse")
    assert any("one gated GEMM needs the two weights merged" in note for _, note in separate["notes"]), separate


@pytest.mark.slow   # about 3 s
def test_lce_benchmark_runs_end_to_end_on_cpu(tmp_path):
    """bench.lce's plumbing at a toy size: eager first (the reference), then epifuse with its
    loss and gradients against eager's and the float64 truth's (float32 on the CPU: agreement to
fp32 rounding)."""
    import json

    from bench import lce
    assert lce.main(["--device", "cpu", "--tokens", "24", "--hidden", "16", "--vocab", "72", "--reps", "1",
                     "--warmup", "0", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("lce_*_cpu.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["implementation"] for r in rows] == ["eager", "epifuse"]
    errors = rows[1]["error_vs_eager"]
    assert set(errors) == {"loss", "dx", "dw"} and all(0 <= e < 1e-5 for e in errors.values()), errors
    assert rows[0]["loss"] == pytest.approx(rows[1]["loss"], rel=1e-5)
    for row in rows:   # both against the float64 truth of the same inputs
        assert all(0 <= e < 1e-5 for e in row["error_vs_float64"].values()), row


def test_models_chart_takes_each_block_from_the_last_file_that_has_it(tmp_path):
    """bench.models_chart's table: a later file's block replaces an earlier one's; files of two
    GPUs are refused (the chart is per GPU)."""
    import json

    from bench import models_chart

    def write(name, gpu, rows):
        path = tmp_path / name
        path.write_text(json.dumps({"gpu": gpu, "rows": [dict(model=m, variant=v, speedup_vs_best_compile=s)
                                                          for m, v, s in rows]}))
        return str(path)
    a = write("a.json", "H200", [("mlp", "epifuse", 0.9), ("gcn", "epifuse", 0.5), ("gcn", "eager", None)])
    b = write("b.json", "H200", [("gcn", "epifuse", 0.7), ("gcn", "compile", 1.0)])
    table, gpu = models_chart.blocks([a, b])
    assert gpu == "H200" and table == {"mlp": {"epifuse": 0.9}, "gcn": {"epifuse": 0.7, "compile": 1.0}}
    with pytest.raises(SystemExit, match="2 GPUs"):
        models_chart.blocks([a, write("c.json", "H100", [("mlp", "epifuse", 1.0)])])


def test_shapes_are_named_or_written_out():
    """--shapes takes S1-S4 or a model's layer as MxNxK (the shipped table's entries come from
    such runs); anything else is refused by name."""
    from bench.workloads import shape_dims
    args = run.parse_args(["--shapes", "S2,1024x16384x4096", "--workloads", "bias_gelu"])
    assert [shape_dims(s) for s in args.shapes] == [(16384, 4096, 1024), (1024, 16384, 4096)]
    row = run.make_row(run.WORKLOADS["bias_gelu"], "1024x16384x4096", run.DTYPES["fp16"], {}, {}, {}, {},
                       epifuse_requested=False)
    assert (row["M"], row["N"], row["K"]) == (1024, 16384, 4096)
    for bad in ("S9", "1024x0x64", "1024x64", "axbxc"):
        with pytest.raises(SystemExit):
            run.parse_args(["--shapes", bad])
