#!/bin/bash
# A/B of a kept epifuse.gemm's host time in one device call: this tree against the tree
# unpacked under research/ab/before/src (git archive <commit> src), alternately, after the
# launch tests of this tree (the plain launch against the installed Triton's own launcher).
set -u
T0=$(date +%s)
PYTHONPATH=src:tests:. timeout 100 python -m pytest -q -p no:cacheprovider tests/unit/test_direct_launch.py \
  > $OUT/launch_unit.log 2>&1; echo "launch unit rc=$? $(tail -1 $OUT/launch_unit.log)"
PYTHONPATH=src:tests:. timeout -s INT 120 python -m pytest -m gpu -q -n 16 -p no:cacheprovider -rfE tests/kernels/test_launch.py \
  tests/kernels/test_callsite.py tests/gpu/test_gpu.py -k "kept or launch or graph or thread or stream or callsite" \
  > $OUT/launch_gpu.log 2>&1; echo "launch gpu rc=$? $(tail -1 $OUT/launch_gpu.log) $(( $(date +%s) - T0 )) s"
for round in 1 2; do
  for tree in after before; do
    src=src; [ $tree = before ] && src=research/ab/before/src
    PYTHONPATH=$src:. timeout 60 python research/host_path_probe.py --tune 0 > $OUT/probe_${tree}_$round.json 2>/dev/null
    PYTHONPATH=$src:. timeout 90 python -m bench.overhead > $OUT/overhead_${tree}_$round.json 2>/dev/null
  done
done
echo "ab done $(( $(date +%s) - T0 )) s"
python research/ab_table.py $OUT
