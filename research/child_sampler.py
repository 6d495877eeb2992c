"""A compile process (src/epifuse/runtime/compile_child.py) whose compiles are sampled, for
research/child_timeline.py: at exit it appends one JSON line to $EPIFUSE_CHILD_TIMELINE with its
start, when its warm-up ended, each request's arrival and answer (time.time()), and per thread
(the compile's own, "caller"; the launcher's early build, "others") the functions with the most
samples while it compiled (research/stack_sampler.py: inclusive seconds)."""
import collections
import importlib.util
import json
import os
import sys
import time

STARTED = time.time()
import stack_sampler  # noqa: E402 - this file's folder, sys.path[0] while it runs by path

_here = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _here:
    del sys.path[0]
spec = importlib.util.spec_from_file_location("compile_child", os.environ["EPIFUSE_CHILD_SOURCE"])
child = importlib.util.module_from_spec(spec)
sys.modules["compile_child"] = child
spec.loader.exec_module(child)

events = {"pid": os.getpid(), "started": STARTED, "requests": []}
counts = collections.defaultdict(collections.Counter)
warm, compile_request = child._warm, child.compile_request


def timed_warm():
    warm()
    events["warm_done"] = time.time()


def sampled_compile(request):
    arrived = time.time()
    try:
        with stack_sampler.Sampler() as sampler:
            return compile_request(request)
    finally:
        events["requests"].append({"arrived": arrived, "answered": time.time()})
        for who, seen in sampler.counts.items():
            counts[who].update(seen)


child._warm, child.compile_request = timed_warm, sampled_compile
try:
    child.main()
finally:
    events["top"] = {who: [(label, round(n * stack_sampler.PERIOD_S, 3)) for label, n in c.most_common(40)]
                     for who, c in counts.items()}
    with open(os.environ["EPIFUSE_CHILD_TIMELINE"], "a") as f:
        f.write(json.dumps(events) + "\n")
