#!/bin/bash
# One device call for issue 34's host time: the GPU tests of the kept launch and the compile
# pool, then bench.overhead (five alternating rounds against addmm) and its per-family breakdown.
set -u
export PYTHONPATH=src:tests:.
nvidia-smi --query-gpu=name,clocks.sm,driver_version --format=csv,noheader > $OUT/gpu.txt
lscpu | grep -E "Model name" >> $OUT/gpu.txt
T0=$(date +%s)
timeout -s INT ${TEST_LIMIT:-200} python -m pytest -m gpu -q -n 16 -p no:cacheprovider -rfE \
  tests/gpu/test_tuning_gpu.py tests/gpu/test_gpu.py tests/kernels/test_callsite.py tests/kernels/test_zeroing.py \
  tests/unit/test_torch_ops.py tests/unit/test_compile_ahead.py tests/unit/test_fused_linear.py \
  --junitxml=$OUT/gpu.xml > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$? $(( $(date +%s) - T0 )) s"
tail -3 $OUT/gpu_tests.log
STAMP=$(date +%Y%m%d-%H%M)
timeout 120 python -m bench.overhead > $OUT/overhead_$STAMP.json 2> $OUT/overhead.err; echo "overhead rc=$? $(( $(date +%s) - T0 )) s"
timeout 90 python -m bench.overhead --breakdown > $OUT/overhead_breakdown_$STAMP.json 2> $OUT/breakdown.err; echo "breakdown rc=$? $(( $(date +%s) - T0 )) s"
cat $OUT/gpu.txt
python - <<'P'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/overhead*.json")):
    try:
        d = json.load(open(f))
    except Exception as e:
        print(f, "unreadable", e); continue
    for k, v in d.items():
        if isinstance(v, (int, float)):
            print(f"{k:40s} {v:8.2f}")
        elif isinstance(v, dict):
            print(k, {a: round(b, 2) for a, b in v.items() if isinstance(b, (int, float))})
P
