#!/bin/bash
# One device call for a staged epilogue's later passes compiled ahead (staged_ahead.py): the GPU
# tests of the touched code, then bench.first_call's softmax_rows (two passes at N > 256) with
# the tree under test and with an earlier tree copied to $OLD, alternately, twice each.
set -u
OLD=${OLD:-research/_old_src}
T0=$(date +%s)
PYTHONPATH=src:tests:. timeout -s INT 200 python -m pytest -m gpu -q -n 16 -p no:cacheprovider -rfE \
  tests/gpu/test_tuning_gpu.py tests/kernels/test_staging.py tests/kernels/test_staging_edges.py \
  tests/kernels/test_one_pass_reductions.py tests/kernels/test_launch.py tests/kernels/test_callsite.py \
  tests/unit/test_staged_ahead.py > $OUT/gpu_touched.log 2>&1
echo "gpu tests rc=$? $(tail -1 $OUT/gpu_touched.log) $(( $(date +%s) - T0 )) s"
TUNED="--tuned-from bench/results/bench_20261127-085437_NVIDIA-H200.json --tuned-from bench/results/bench_20261128-041253_NVIDIA-H200.json"
for round in 1 2; do
  for tree in new old; do
    path=src; [ $tree = old ] && path=$OLD
    PYTHONPATH=$path:. timeout 120 python -m bench.first_call --workloads softmax_rows $TUNED --out $OUT/fc_$tree \
      > $OUT/first_call_${tree}_$round.log 2>&1
  done
  echo "round $round $(( $(date +%s) - T0 )) s"
done
PYTHONPATH=src:. timeout 150 python -m bench.first_call --workloads bias_gelu --shapes S2 --training --training-rounds 2 \
  --out $OUT/fc_training > $OUT/first_call_training.log 2>&1; echo "training rc=$? $(( $(date +%s) - T0 )) s"
grep "training step" $OUT/first_call_training.log | cut -c1-400
for f in $OUT/first_call_*.log; do echo "$(basename $f)"; grep -E "^softmax_rows" $f | cut -c1-60; done
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
