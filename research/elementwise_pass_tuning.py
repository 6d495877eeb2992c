"""How much tuning matters for the backward's elementwise pass (a K = 0 problem: the epilogue
alone, no main loop), which the fast policy times a short list of three for, since no shipped
table entry is near K = 0.

For the FusedLinear MLP of bench.first_call --training (4096 -> 16384, GELU tanh, bf16) at a few
token counts, one forward and backward under EPIFUSE_TUNE=full in a fresh cache: every
candidate timed for each problem. Reported per problem: the full choice, the untimed order's
first kernel and the fast policy's short list, each as full's time / its time (1.0 = as fast).

    PYTHONPATH=src:. python -m research.elementwise_pass_tuning [--tokens 1024,4096] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1024,4096")
    p.add_argument("--out", default=None)
    cfg = p.parse_args(argv)
    os.environ.update(EPIFUSE_TUNE="full", EPIFUSE_QUIET="1", EPIFUSE_CACHE_DIR=tempfile.mkdtemp())
    import torch

    import epifuse.nn
    from epifuse.runtime import shipped, tune

    from bench.training import _mlp
    orders = []
    original = tune._tune

    def spy(args, kernels, key, mode):
        orders.append({"problem": f"{args.M}x{args.N}x{args.K}", "untimed": [repr(k) for k in kernels],
                       "short": [repr(k) for k in (shipped.short_list(args, kernels, torch.cuda.get_device_name(),
                                                                      tune.SHORT_LIST) or kernels[:tune.SHORT_LIST])]})
        return original(args, kernels, key, mode)
    tune._tune = spy
    rows = []
    for tokens in [int(t) for t in cfg.tokens.split(",")]:
        torch.manual_seed(0)
        model = epifuse.nn.fuse_linear_activations(_mlp(4096, 16384).to("cuda", torch.bfloat16))
        x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        start = len(tune.HISTORY)
        model(x).float().square().mean().backward()
        torch.cuda.synchronize()
        for record in tune.HISTORY[start:]:
            order = next((o for o in reversed(orders) if o["problem"] == record["problem"]), None)
            times = record["timings_us"]
            best = min(times.values())
            row = {"tokens": tokens, "problem": record["problem"], "choice": record["choice"],
                   "choice_us": times[record["choice"]], "best_us": best, "timings_us": times}
            if order is not None:
                first = order["untimed"][0]
                row["untimed_first"], row["untimed_first_ratio"] = first, times[record["choice"]] / times[first]
                short = [k for k in order["short"] if k in times]
                fastest_short = min(short, key=times.get)
                row["short"], row["short_ratio"] = short, times[record["choice"]] / times[fastest_short]
            rows.append(row)
            print(f"{tokens:6d} {record['problem']:18s} full {times[record['choice']]:8.1f} us  untimed first "
                  f"{row.get('untimed_first_ratio', 0):.3f}  short list {row.get('short_ratio', 0):.3f}  "
                  f"{len(times)} timed", flush=True)
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "rows": rows}
    if cfg.out:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out) / f"elementwise_pass_tuning_{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
            json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
