"""A wall-clock stack sampler for the research timelines (cold_timeline.py in a first call's
process, child_sampler.py in a compile process): a thread reads every thread's stack each
PERIOD_S (sys._current_frames; no tracing, so Triton's Python front end is not slowed as under
cProfile) and counts, per thread, each function on the stack once per sample (inclusive time):
the thread that entered the sampler as "caller", all others together as "others". It imports
nothing but the standard library, so a compile process can load it without torch.
"""
from __future__ import annotations

import collections
import os
import sys
import threading

PERIOD_S = 0.005
KEEP = ("epifuse", "triton", "subprocess", "threading.py", "concurrent")


def _label(frame) -> str:
    path = frame.f_code.co_filename
    for mark in ("/epifuse/", "/triton/", "/bench/"):
        if mark in path:
            path = mark.strip("/") + "/" + path.split(mark, 1)[1]
            break
    else:
        path = os.path.basename(path)
    return f"{path}:{frame.f_code.co_name}"


class Sampler:
    def __init__(self):
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.samples: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._main = threading.get_ident()

    def _run(self):
        me = threading.get_ident()
        while not self._stop.wait(PERIOD_S):
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                who = "caller" if ident == self._main else "others"
                seen = set()
                while frame is not None:
                    label = _label(frame)
                    if label not in seen and any(k in label for k in KEEP):
                        seen.add(label)
                    frame = frame.f_back
                if who == "caller" or seen:
                    self.samples[who] += 1
                self.counts[who].update(seen)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def table(self, top: int) -> dict:
        return {who: {"samples": self.samples[who], "top": [(label, round(n * PERIOD_S, 3))
                                                            for label, n in c.most_common(top)]}
                for who, c in self.counts.items()}
