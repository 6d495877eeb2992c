#!/bin/bash
# One device call for issue 34: the GPU tests of the files this change touched, then first calls
# with and without compiling ahead (table cells, a short list, the training step), the table
# cells once more with compiling ahead. Logs and JSON under $OUT.
set -u
export PYTHONPATH=src:tests:.
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv > $OUT/gpu.txt
lscpu | grep -E "Model name|^CPU\(s\)" >> $OUT/gpu.txt
T0=$(date +%s)
timeout -s INT 200 python -m pytest -m gpu -q -n 12 -p no:cacheprovider -rfE \
  tests/gpu/test_tuning_gpu.py tests/unit/test_cache.py tests/unit/test_torch_ops.py tests/unit/test_compile_ahead.py \
  tests/unit/test_tuning_policy.py tests/unit/test_tune.py tests/kernels/test_callsite.py \
  --junitxml=$OUT/gpu.xml > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$? $(( $(date +%s) - T0 )) s"
tail -3 $OUT/gpu_tests.log
CASES="--shapes S2 --workloads bias_gelu,bce_loss,identity --extra 4096x4096x1024"
timeout 150 python -m bench.first_call $CASES --training --training-rounds 2 \
  --out $OUT/ahead > $OUT/first_call_ahead.log 2>&1; echo "first_call ahead rc=$? $(( $(date +%s) - T0 )) s"
timeout 100 python -m bench.first_call $CASES --compile-ahead 0 \
  --out $OUT/serial > $OUT/first_call_serial.log 2>&1; echo "first_call serial rc=$? $(( $(date +%s) - T0 )) s"
timeout 60 python -m bench.first_call --shapes S2 --workloads bias_gelu,bce_loss,identity \
  --out $OUT/ahead2 > $OUT/first_call_ahead2.log 2>&1; echo "first_call ahead2 rc=$? $(( $(date +%s) - T0 )) s"
python - <<'P'
import json, glob, os
for tag in ("ahead", "serial", "ahead2"):
    for f in glob.glob(os.environ["OUT"] + f"/{tag}/*.json"):
        d = json.load(open(f))
        for r in d["rows"]:
            print(tag, r["workload"], r["shape"], "cold", round(r.get("cold_s") or -1, 2), "warm", round(r.get("warm_s") or -1, 2),
                  "full", round(r.get("full_tuning_s") or -1, 2), "ratio", r.get("speed_ratio"), r.get("picked_by"), r.get("error", "")[-200:])
        t = d.get("training") or {}
        print(tag, "training", {k: v for k, v in t.items() if not k.endswith("profile") and k != "model"})
P
