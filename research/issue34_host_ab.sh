#!/bin/bash
# One device call for the host time of a repeated epifuse.gemm (issue 34): bench.overhead with
# the tree under test (src) and with an earlier tree copied to $OLD, alternately, ROUNDS times
# each, on one host; then the GPU tests of the launch path. Prints a short table last.
set -u
OLD=${OLD:-research/_old_src}
ROUNDS=${ROUNDS:-3}
T0=$(date +%s)
for round in $(seq 1 $ROUNDS); do
  for tree in new old; do
    path=src; [ $tree = old ] && path=$OLD
    PYTHONPATH=$path:. timeout 120 python -m bench.overhead > $OUT/overhead_${tree}_$round.json 2> $OUT/overhead_${tree}_$round.err
  done
  echo "round $round $(( $(date +%s) - T0 )) s"
done
if [ "${SKIP_TESTS:-0}" != 1 ]; then
PYTHONPATH=src:tests:. timeout -s INT 200 python -m pytest -m gpu -q -n 8 -p no:cacheprovider -rfE tests/kernels/test_launch.py \
  tests/kernels/test_callsite.py tests/unit/test_direct_launch.py tests/kernels/test_gluon.py tests/unit/test_cache.py \
  > $OUT/gpu_touched.log 2>&1; echo "gpu tests rc=$? $(tail -1 $OUT/gpu_touched.log) $(( $(date +%s) - T0 )) s"
fi
python - <<'PY'
import glob, json, os, statistics
out = os.environ["OUT"]
keys = ["epifuse_gemm_us", "torch_addmm_us", "gemm_over_addmm_us", "epifuse_gemm_new_output_us",
        "new_output_over_addmm_relu_us", "signature_us", "lookup_us", "site_call_without_launch_us",
        "launch_with_us", "gluon_kernel_run_c_us"]
rows = {}
for tree in ("new", "old"):
    runs = []
    for path in sorted(glob.glob(f"{out}/overhead_{tree}_*.json")):
        try:
            runs.append(json.load(open(path)))
        except ValueError:
            pass
    rows[tree] = {k: statistics.median(r[k] for r in runs if isinstance(r.get(k), float)) if any(
        isinstance(r.get(k), float) for r in runs) else None for k in keys}
print(f"{'us (median of rounds)':32s} {'new':>8s} {'old':>8s}")
for k in keys:
    n, o = rows["new"][k], rows["old"][k]
    print(f"{k:32s} {n if n is None else round(n, 2):>8} {o if o is None else round(o, 2):>8}")
PY
