"""A process that writes one kernel cache entry, for tests/test_cache_locking.py.

runtime/cache.py uses the standard library only, so the worker loads that file alone rather
than importing epifuse (and torch): each spawned process starts in a fraction of a second.
"""
from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path


def load_cache_module(path: str):
    spec = importlib.util.spec_from_file_location("epifuse_cache_alone", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_entry(cache_file: str, cache_root: str, stem: str, body: str, log: str, locking: bool,
                barrier, index: int, queue) -> None:
    """Write the shared entry once every process is ready; each real write is logged and
    slowed down, so writers that do not exclude each other overlap: without locks a writer
    waits (up to 30 s) until a second one has logged, so the race is certain, not likely."""
    try:
        os.environ["EPIFUSE_CACHE_DIR"] = cache_root
        cache = load_cache_module(cache_file)
        if not locking:
            cache.fcntl = None
        real_write = cache._write_file

        def logged_write(*args):
            with open(log, "a") as f:
                f.write(f"{os.getpid()}\n")
            time.sleep(1.0)
            deadline = time.monotonic() + 30
            while not locking and len(Path(log).read_text().split()) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            real_write(*args)

        cache._write_file = logged_write
        barrier.wait(timeout=120)
        path = cache.write_source(stem, body)
        queue.put(("ok", str(path), path.read_text()))
    except BaseException as error:  # noqa: BLE001  (reported to the parent)
        import traceback
        queue.put(("error", traceback.format_exc(), repr(error)))
