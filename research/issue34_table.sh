#!/bin/bash
# One device call for issue 34's per-GPU table at the tree under test: bench.first_call at every
# workload and shape with the speed column against full tuning's recorded choices, the
# FusedLinear training step twice, then bench.overhead (host time) twice. Prints a short table last.
set -u
export PYTHONPATH=src:.
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv > $OUT/gpu.txt
lscpu | grep -E "Model name|^CPU\(s\)" >> $OUT/gpu.txt
T0=$(date +%s)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$GPU" in
  *H100*) TUNED="--tuned-from $(ls bench/results/bench_*H100*.json | tail -1)" ;;
  *) TUNED="--tuned-from bench/results/bench_20261127-085437_NVIDIA-H200.json --tuned-from bench/results/bench_20261128-041253_NVIDIA-H200.json" ;;
esac
timeout ${TABLE_S:-330} python -m bench.first_call $TUNED --out $OUT > $OUT/first_call.log 2>&1
echo "table rc=$? $(( $(date +%s) - T0 )) s"
timeout 150 python -m bench.first_call --workloads bias_gelu --shapes S2 --training --training-rounds 2 \
  --out $OUT/training > $OUT/first_call_training.log 2>&1; echo "training rc=$? $(( $(date +%s) - T0 )) s"
for round in 1 2; do
  timeout 90 python -m bench.overhead > $OUT/overhead_$round.json 2> $OUT/overhead_$round.err
done
echo "overhead $(( $(date +%s) - T0 )) s"
grep "training step" $OUT/first_call_training.log | cut -c1-300
python - <<'PY'
import glob, json, os
out = os.environ["OUT"]
for f in sorted(glob.glob(out + "/first_call_*.json")):
    d = json.load(open(f))
    print(os.path.basename(f), d.get("gpu"))
    for r in d["rows"]:
        ratio = r.get("speed_ratio")
        print(f"  {r['workload']:14s} {r['shape']:3s} cold {r.get('cold_s') or -1:5.2f} warm {r.get('warm_s') or -1:5.2f} "
              f"speed {'-' if ratio is None else round(ratio, 3)} {r.get('picked_by', '')} {(r.get('error') or '')[-120:]}")
for f in sorted(glob.glob(out + "/overhead_*.json")):
    try:
        d = json.load(open(f))
    except ValueError:
        print(f, "unreadable"); continue
    print(os.path.basename(f), {k: round(d[k], 2) for k in ("epifuse_gemm_us", "torch_addmm_us", "gemm_over_addmm_us",
                                                           "new_output_over_addmm_relu_us") if isinstance(d.get(k), float)})
PY
cd $OUT && tar czf logs.tgz *.log *.err gpu.txt && rm -f *.log *.err
