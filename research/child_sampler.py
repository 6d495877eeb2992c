"""A compile process (src/epifuse/runtime/compile_child.py) run under a wall-clock stack sampler,
for research/child_timeline.py: at exit it appends one JSON line to $EPIFUSE_CHILD_TIMELINE with
its start, when its warm-up ended, each request's arrival and answer (time.time()), and the
functions with the most samples (inclusive seconds, sampled every 5 ms) while it compiled."""
import collections
import importlib.util
import json
import os
import sys
import threading
import time

STARTED = time.time()
PERIOD_S = 0.005
_here = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _here:
    del sys.path[0]
_path = os.environ["EPIFUSE_CHILD_SOURCE"]
spec = importlib.util.spec_from_file_location("compile_child", _path)
child = importlib.util.module_from_spec(spec)
sys.modules["compile_child"] = child
spec.loader.exec_module(child)

events = {"pid": os.getpid(), "started": STARTED, "requests": []}
counts = collections.Counter()
busy = threading.Event()
stop = threading.Event()
main_ident = threading.get_ident()


def sample():
    while not stop.wait(PERIOD_S):
        if not busy.is_set():
            continue
        seen = set()
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue
            while frame is not None:
                code = frame.f_code
                name = code.co_filename
                for mark in ("/triton/", "/epifuse/"):
                    if mark in name:
                        name = mark.strip("/") + "/" + name.split(mark, 1)[1]
                        break
                else:
                    name = os.path.basename(name)
                seen.add(f"{name}:{code.co_name}")
                frame = frame.f_back
        counts.update(seen)


warm = child._warm


def timed_warm():
    warm()
    events["warm_done"] = time.time()


child._warm = timed_warm
compile_request = child.compile_request


def timed_compile(request):
    arrived = time.time()
    busy.set()
    try:
        return compile_request(request)
    finally:
        busy.clear()
        events["requests"].append({"arrived": arrived, "answered": time.time(),
                                   "bytes": len(request.get("source", "") or "") if isinstance(request, dict) else 0})


child.compile_request = timed_compile
threading.Thread(target=sample, daemon=True).start()
try:
    child.main()
finally:
    stop.set()
    events["top"] = [(label, round(n * PERIOD_S, 3)) for label, n in counts.most_common(40)]
    with open(os.environ["EPIFUSE_CHILD_TIMELINE"], "a") as f:
        f.write(json.dumps(events) + "\n")
