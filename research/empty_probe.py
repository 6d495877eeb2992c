"""torch.empty against torch.empty_strided on a GPU, host time per call, alternately in one
process (the allocation a kept epifuse.gemm makes for each output it returns).
    PYTHONPATH=src:. python research/empty_probe.py"""
import json
import statistics

import torch

from bench.overhead import _per_call_us as per_call_us


device, dtype, shape = torch.device("cuda"), torch.float16, (256, 256)
strides = torch.empty(shape, dtype=dtype, device=device).stride()
calls = {"empty": lambda: torch.empty(shape, dtype=dtype, device=device),
         "empty_strided": lambda: torch.empty_strided(shape, strides, dtype=dtype, device=device)}
rounds = {name: [] for name in calls}
for _ in range(7):
    for name, fn in calls.items():
        rounds[name].append(per_call_us(fn, 5000))
print(json.dumps({name: {"median_us": round(statistics.median(r), 3), "rounds": [round(x, 3) for x in r]}
                  for name, r in rounds.items()}))
