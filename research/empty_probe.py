"""torch.empty against torch.empty_strided on a GPU, host time per call, alternately in one
process (the allocation a kept epifuse.gemm makes for each output it returns).
    python research/empty_probe.py"""
import json
import statistics
import time

import torch


def per_call_us(fn, calls=5000):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


device, dtype, shape = torch.device("cuda"), torch.float16, (256, 256)
strides = torch.empty(shape, dtype=dtype, device=device).stride()
calls = {"empty": lambda: torch.empty(shape, dtype=dtype, device=device),
         "empty_strided": lambda: torch.empty_strided(shape, strides, dtype=dtype, device=device)}
rounds = {name: [] for name in calls}
for _ in range(7):
    for name, fn in calls.items():
        rounds[name].append(per_call_us(fn))
print(json.dumps({name: {"median_us": round(statistics.median(r), 3), "rounds": [round(x, 3) for x in r]}
                  for name, r in rounds.items()}))
