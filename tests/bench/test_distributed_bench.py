"""bench/distributed.py end to end in its --smoke mode: two processes under torchrun with gloo on
the CPU, at toy sizes, every parallelism and variant of the two-GPU run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow   # torchrun, two processes, inductor compiling the block on the CPU: 9-25 s
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_smoke_run_times_every_variant_and_writes_the_json(tmp_path):
    out = tmp_path / "distributed.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), *sys.path])}
    env.pop("TRITON_INTERPRET", None)   # the reference kernel: the smoke run proves the script, not kernels
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "-m", "bench.distributed", "--smoke", "--out", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    data = json.loads(out.read_text())
    rows = {(r["parallelism"], r["variant"]): r for r in data["rows"]}
    assert set(rows) == {(p, v) for p in ("tp", "fsdp2") for v in ("epifuse", "eager", "compile")}
    for (parallelism, variant), row in rows.items():
        assert "error" not in row, row
        assert row["ms"] > 0 and row["first_step_s"] > 0 and row["ratio_to_eager"] > 0, row
        eager = rows[(parallelism, "eager")]["loss"]   # same parameters and tokens: the same first loss
        assert abs(row["loss"] - eager) <= 1e-5 * abs(eager), (parallelism, variant, row["loss"], eager)
    assert data["config"]["smoke"] and data["world"] == 2 and data["environment"]["torch"]
    assert "ms per training step" in result.stdout and "fsdp2        epifuse" in result.stdout
