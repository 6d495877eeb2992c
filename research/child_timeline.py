"""Where a cold first call's wait on its compile process goes (issue 34: bce_loss S2 waits
2.2 s on its child where bias_gelu S2 waits 1.4 s).

    PYTHONPATH=src:. python -m research.child_timeline [--workload bce_loss] [--shape S2] [--rounds 2]

Runs research.cold_timeline's cold case with every compile process started through
research/child_sampler.py (the same compile_child, sampled every 5 ms while it compiles, by
research/stack_sampler.py) and prints, relative to the start of the timed call: when each child
started, finished its warm-up, received each request and answered it, then the child's
functions with the most samples.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from research import cold_timeline


def _case(spec):
    spec = dict(spec)
    os.environ["EPIFUSE_CHILD_TIMELINE"] = spec.pop("timeline")
    result = cold_timeline.gemm_child(spec)
    return {**result, "call_started": time.time() - result["seconds"]}   # the timed call's start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="bce_loss")
    p.add_argument("--shape", default="S2")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    from epifuse.runtime import compile_processes
    os.environ["EPIFUSE_CHILD_SOURCE"] = str(compile_processes.CHILD)
    compile_processes.CHILD = Path(__file__).with_name("child_sampler.py")
    from bench.first_call import _caches, in_child
    from bench.workloads import SHAPES
    for round_ in range(a.rounds):
        with tempfile.TemporaryDirectory() as root:
            timeline = os.path.join(root, "children.jsonl")
            env = {**_caches(root, "case"), "EPIFUSE_TUNE": "fast", "EPIFUSE_QUIET": "1"}
            spec = {"env": env, "top": 15, "workload": a.workload, "shape": SHAPES[a.shape], "device": "cuda",
                    "timeline": timeline}
            result = in_child(_case, spec)
            if "error" in result:
                print(result["error"])
                return 1
            time.sleep(0.5)   # the children write their lines once their stdin closes
            t0 = result["call_started"]
            print(f"== {a.workload} {a.shape} round {round_ + 1}: call {result['seconds']:.2f} s")
            children = [json.loads(line) for line in open(timeline)] if os.path.exists(timeline) else []
            for c in children:
                rel = lambda t: f"{t - t0:+.2f}"
                reqs = ", ".join(f"request {rel(r['arrived'])} -> {rel(r['answered'])} ({r['answered'] - r['arrived']:.2f} s)"
                                 for r in c["requests"])
                print(f"  child {c['pid']}: started {rel(c['started'])}, warm {rel(c.get('warm_done', c['started']))}; {reqs or 'no request'}")
            for c in children:
                if c["requests"]:
                    for who, top in c["top"].items():
                        print(f"   child {c['pid']}, {who} (the compile's thread; others: its launcher's early build)")
                        for label, seconds in top[:a.top]:
                            print(f"    {seconds:7.3f}  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
