#!/bin/bash
# Next device call for issue 34's cold training step (3 s target): shipped-table entries at the
# FusedLinear MLP's shapes (bench.first_call --training: Linear(4096, 16384) + GELU + Linear(16384,
# 4096), bf16, 1024 tokens; forward 1024x16384x4096 and 1024x4096x16384, the backward's dX at the
# same two, dW at 4096x16384x1024 and 16384x4096x1024 = S2, already in the table), from full
# tuning on this GPU; the table rebuilt from them and the table's earlier source; then the cold
# training step with the new table, and without it (the committed table) in the same run.
set -u
export PYTHONPATH=src:tests:.
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-')
T0=$(date +%s)
timeout 270 python -m bench --shapes 1024x16384x4096,1024x4096x16384,4096x16384x1024 \
  --workloads identity,bias_gelu --dtypes bf16 --baselines cublas,epifuse --no-inductor \
  --out $OUT/bench > $OUT/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s) - T0 )) s"
NEW=$(ls $OUT/bench/bench_*.json | head -1)
OLD=$(python -c "import json;print(json.load(open('src/epifuse/data/tuned/$GPU.json'))['sources'][0])")
cp src/epifuse/data/tuned/$GPU.json $OUT/table_before.json
python -m bench.choices bench/results/$OLD $NEW --out $OUT/table_after.json; echo "choices rc=$?"
cp $OUT/table_after.json src/epifuse/data/tuned/$GPU.json
timeout 130 python -m bench.first_call --shapes S2 --workloads bias_gelu --training --training-rounds 2 \
  --out $OUT/with_table > $OUT/first_call_with.log 2>&1; echo "training with new table rc=$? $(( $(date +%s) - T0 )) s"
cp $OUT/table_before.json src/epifuse/data/tuned/$GPU.json
timeout 130 python -m bench.first_call --shapes S2 --workloads bias_gelu --training --training-rounds 2 \
  --out $OUT/without_table > $OUT/first_call_without.log 2>&1; echo "training with old table rc=$? $(( $(date +%s) - T0 )) s"
python - <<'P'
import json, glob, os
for tag in ("with_table", "without_table"):
    for f in glob.glob(os.environ["OUT"] + f"/{tag}/*.json"):
        t = json.load(open(f)).get("training") or {}
        print(tag, {k: v for k, v in t.items() if not k.endswith("profile") and k != "model"})
P
