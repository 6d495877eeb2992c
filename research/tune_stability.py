"""How stable is tuning's choice, and how fast is the chosen kernel under sustained load?
Runs epifuse.gemm's first call (tuning) in fresh processes with empty tuning caches (Triton's
compile cache stays warm), then times the chosen kernel and cuBLAS back to back for a second.

    PYTHONPATH=src:. python -m research.tune_stability [--case identity:S1] [--runs 4] [--ranker resweep]

`--ranker resweep` tries an alternative to runtime.tune.rank: the contenders are timed twice
more, in reverse and in forward order (30 ms each), and ranked by those two times only, leaving
out the first pass, which times each kernel right after its compile, on a GPU cooled by it.
`--ranker reversed` runs runtime.tune.rank on the candidates in the reverse of get_kernels'
order: does a kernel's place in the order favour it? Each run also prints the tuning times of
PAIR (the Triton persistent 128x256 kernel over the Gluon cooperative one) where both ran.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def resweep_rank(kernels, time_ms, close: float | None = None):
    from triton.testing import do_bench

    from epifuse.runtime.tune import CLOSE
    close = CLOSE if close is None else close
    timings = []
    for position, kernel in enumerate(kernels):
        try:
            timings.append([time_ms(kernel), position, kernel])
        except Exception:  # noqa: BLE001
            continue
    fastest = min((t for t, _, _ in timings), default=None)
    contenders = [e for e in timings if fastest is not None and e[0] <= fastest * close]
    if len(contenders) > 1:
        sums = {id(e): 0.0 for e in contenders}
        for order in (list(reversed(contenders)), contenders):
            for e in order:
                try:
                    time_ms(e[2])   # the progress line and a warm call
                    sums[id(e)] += do_bench(lambda k=e[2]: k.run(_SCRATCH[0]), warmup=3, rep=30,
                                            return_mode="median")
                except Exception:  # noqa: BLE001
                    sums[id(e)] += float("inf")
        for e in contenders:
            e[0] = sums[id(e)] / 2
    return sorted((t, p, k) for t, p, k in timings)


_SCRATCH: list = []


def child(case: str, ranker: str) -> dict:
    import torch

    import epifuse
    import epifuse.runtime.tune as tune

    from bench.run import _epifuse_call
    from bench.workloads import SHAPES, WORKLOADS

    from .power_probe import measure, nvml_handle
    if ranker == "resweep":
        original = tune._scratch_args

        def keep(args):
            _SCRATCH[:] = [original(args)]
            return _SCRATCH[0]
        tune._scratch_args = keep
        tune.rank = resweep_rank
    elif ranker == "reversed":
        forward = tune.rank
        tune.rank = lambda kernels, time_ms, *rest: forward(list(kernels)[::-1], time_ms, *rest)
    workload, shape = case.split(":")
    w = WORKLOADS[workload]
    M, N, K = SHAPES[shape]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    s = w.build(M, N, K, torch.float16, "cuda", gen)
    fused = _epifuse_call(epifuse, w, s, False)[0]
    fused()
    cublas = w.cublas(s)
    nvml = nvml_handle()
    c1 = measure(cublas, nvml, 0.5, 1.0)["sustained_ms"]
    e1 = measure(fused, nvml, 0.5, 1.0)["sustained_ms"]
    e2 = measure(fused, nvml, 0.5, 1.0)["sustained_ms"]
    c2 = measure(cublas, nvml, 0.5, 1.0)["sustained_ms"]
    return {"choice": tune.HISTORY[-1]["choice"], "ratio": (e1 + e2) / (c1 + c2),
            "timings_us": tune.HISTORY[-1]["timings_us"], "calls_us": tune.HISTORY[-1]["calls_us"]}


PAIR = ("<triton_persistent 128x256x64 group 8, 8 warps, 3 stages, flat>",
        "<gluon_cooperative 128x256x64 group 8, 8 warps, 3 stages>")


def pair_ratio(timings_us: dict) -> float | None:
    """PAIR's tuning times, the first over the second, where both were timed."""
    first, second = (timings_us.get(name) for name in PAIR)
    return first / second if first and second else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="identity:S1")
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--ranker", default="current", choices=("current", "resweep", "reversed"))
    p.add_argument("--out", default=None, help="write every run's choice, ratio and tuning times as JSON here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.case, args.ranker)))
        return 0
    results = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, EPIFUSE_CACHE_DIR=cache, EPIFUSE_QUIET="1")
            out = subprocess.run([sys.executable, "-m", "research.tune_stability", "--child", "--case", args.case,
                                  "--ranker", args.ranker], env=env, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            pair = pair_ratio(results[-1]["timings_us"])
            print(f"{args.case} {args.ranker}: {results[-1]['ratio']:.3f}  {results[-1]['choice']}"
                  + (f"  tuning Triton/Gluon {pair:.3f}" if pair else ""), flush=True)
    if args.out:
        stem = f"tune_stability_{time.strftime('%Y%m%d-%H%M', time.gmtime())}_{args.ranker}"
        path = Path(args.out) / f"{stem}_{args.case.replace(':', '-')}.json"
        path.write_text(json.dumps({"case": args.case, "ranker": args.ranker, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
