#!/bin/bash
# One device call for d259025 against the tree unpacked under research/ab/before/src (git
# archive <commit> src): the GPU tests of the touched code, then alternately, twice, the cold
# first call and cold training step under research/cold_timeline.py (Triton's hash computed
# ahead) and the kept launch's host time (bench.overhead, research/host_path_probe.py;
# tensors passed to Triton's launcher as addresses).
set -u
T0=$(date +%s)
# SKIP_TESTS=1 leaves out the GPU tests (when the whole GPU subset already ran at this tree).
[ "${SKIP_TESTS:-0}" = 1 ] || PYTHONPATH=src:tests:. timeout -s INT 170 python -m pytest -m gpu -q -n 16 -p no:cacheprovider -rfE tests/kernels/test_launch.py \
  tests/kernels/test_callsite.py tests/unit/test_compile_ahead.py tests/unit/test_direct_launch.py \
  tests/unit/test_cache.py::test_warm_start_loads_compiled_kernels_without_triton_keying_them \
  tests/gpu/test_gpu.py -k "kept or launch or graph or thread or stream or callsite or warm or ahead" \
  > $OUT/gpu_touched.log 2>&1; echo "gpu tests rc=$? $(tail -1 $OUT/gpu_touched.log) $(( $(date +%s) - T0 )) s"
for round in 1 2; do
  for tree in after before; do
    src=src; [ $tree = before ] && src=research/ab/before/src
    PYTHONPATH=$src:. timeout 60 python -m research.cold_timeline --shape S2 --top 30 > $OUT/cold_gemm_${tree}_$round.txt 2>&1
    PYTHONPATH=$src:. timeout 60 python -m research.cold_timeline --training --top 30 > $OUT/cold_training_${tree}_$round.txt 2>&1
    PYTHONPATH=$src:. timeout 60 python research/host_path_probe.py --tune 0 > $OUT/probe_${tree}_$round.json 2>/dev/null
    PYTHONPATH=$src:. timeout 90 python -m bench.overhead > $OUT/overhead_${tree}_$round.json 2>/dev/null
  done
  echo "round $round $(( $(date +%s) - T0 )) s"
done
python research/ab_table.py $OUT
cd $OUT && tar czf logs.tgz *.txt *.json *.log && rm -f *.txt probe_*.json overhead_*.json
