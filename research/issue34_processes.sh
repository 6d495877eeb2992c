#!/bin/bash
# One device call for compiles in compile processes (runtime/compile_processes.py): the CPU tests
# of the channel and the GPU tests of the touched code, then alternately, twice, the cold first
# call and the cold training step (research/cold_timeline.py) with compile processes (the
# default) and with every compile in the calling process (EPIFUSE_COMPILE_PROCESSES=0).
set -u
T0=$(date +%s)
if [ "${SKIP_TESTS:-0}" != 1 ]; then   # SKIP_TESTS=1: the timings only
PYTHONPATH=src:tests:. timeout -s INT 120 python -m pytest -q -p no:cacheprovider -rfE tests/unit/test_compile_processes.py \
  > $OUT/cpu_tests.log 2>&1; echo "cpu tests rc=$? $(tail -1 $OUT/cpu_tests.log) $(( $(date +%s) - T0 )) s"
PYTHONPATH=src:tests:. timeout -s INT 240 python -m pytest -m gpu -q -n 16 -p no:cacheprovider -rfE tests/unit/test_cache.py \
  tests/unit/test_compile_ahead.py tests/kernels/test_launch.py tests/kernels/test_callsite.py tests/unit/test_direct_launch.py \
  tests/unit/test_autograd.py tests/gpu/test_tuning_gpu.py \
  > $OUT/gpu_touched.log 2>&1; echo "gpu tests rc=$? $(tail -1 $OUT/gpu_touched.log) $(( $(date +%s) - T0 )) s"
fi
for round in 1 2; do
  for mode in processes threads; do
    n=""; [ $mode = threads ] && n=0
    EPIFUSE_COMPILE_PROCESSES=$n PYTHONPATH=src:. timeout 60 python -m research.cold_timeline --shape S2 --top 30 > $OUT/cold_gemm_${mode}_$round.txt 2>&1
    EPIFUSE_COMPILE_PROCESSES=$n PYTHONPATH=src:. timeout 60 python -m research.cold_timeline --training --top 30 > $OUT/cold_training_${mode}_$round.txt 2>&1
  done
  echo "round $round $(( $(date +%s) - T0 )) s"
done
python research/ab_table.py $OUT
cd $OUT && tar czf logs.tgz *.txt && rm -f *.txt
