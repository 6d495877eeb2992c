"""Kernels compiled ahead of their first launch, in worker threads, while the caller goes on.

Each thread's compile goes to a compile process of its own where it can
(compile_processes.py), so compiles started at once run side by side; where none can take it,
the thread compiles itself, which overlaps others only in ptxas and the launcher's build
(separate processes) while the rest holds the GIL. Two uses:

- Tuning: `compile_all(jobs)` compiles the kernels about to be timed all at once, each in a
  thread of a small pool (runtime/tune.py), instead of one before each timing.
- A training step's backward: a cold step compiles each layer's forward kernel, then, in the
  backward, each layer's backward kernel. The backward's problem is known as soon as its
  forward is called (the same A and B, or the saved accum; gradients shaped as the outputs),
  so the forward queues it here (backward_ahead.py) and a worker plans and chooses its
  kernels from stand-ins (stand_in.py: metadata without memory; nothing is allocated or
  launched) and has the pool compile them, while the caller's thread compiles and runs the
  forward. `soon(key, job)` queues `job` once per `key` in this process; `settle(key)` waits
  for that job if it is queued or running, so the caller that needs the kernel takes the
  compiled one instead of compiling it a second time alongside the worker. A job's exception
  is kept in FAILURES (for tests and debugging) and never reaches the caller: the real call
  plans, checks and compiles as it would have, and raises there if it must.

EPIFUSE_COMPILE_AHEAD=0 turns both off (every kernel compiles at its first launch, in the
caller's thread). Under Triton's interpreter nothing is compiled, so nothing is queued.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from queue import SimpleQueue

from ..backends.triton.device import uses_interpreter
from .compile_processes import compile_ahead_enabled
from .compiled import start_thread

WORKERS = 2            # threads planning backward jobs at once (their compiles run in the pool)
POOL_THREADS = 4       # threads compile_all compiles in at once
SETTLE_TIMEOUT_S = 120.0   # settle() gives up waiting after this (the caller then compiles itself)
KEYS_KEPT = 4096       # keys remembered as queued once (least recently queued dropped)

_LOCK = threading.Lock()
_QUEUE: deque = deque()        # (key, job) not started yet
_DONE: dict = {}               # key -> threading.Event, set when its job has finished (or failed)
_SEEN: OrderedDict = OrderedDict()   # keys queued in this process
_THREADS: list = []
FAILURES: deque = deque(maxlen=64)   # (key, exception) of the latest jobs or compiles that raised
FAILED = [0]                   # how many have raised in this process (FAILURES keeps the latest only)
COMPLETED = [0]                # jobs that finished without raising (for tests and the start-up benchmark)


enabled = compile_ahead_enabled


def compiles_on(device) -> bool:
    """Whether kernels for `device` compile ahead (and in threads): a GPU, not under Triton's
    interpreter (which compiles nothing), unless EPIFUSE_COMPILE_AHEAD=0."""
    return device.type == "cuda" and not uses_interpreter(device) and enabled()


def soon(key, job) -> bool:
    """Queue `job` for a worker unless `key` was queued before in this process; whether it was
    queued now."""
    with _LOCK:
        if key in _SEEN:
            _SEEN.move_to_end(key)
            return False
        _SEEN[key] = True
        while len(_SEEN) > KEYS_KEPT:
            _SEEN.popitem(last=False)
        _DONE[key] = threading.Event()
        _QUEUE.append((key, job))
        _THREADS[:] = [t for t in _THREADS if t.is_alive()]
        if len(_THREADS) < WORKERS:
            try:
                _THREADS.append(start_thread(_work, "epifuse-compile-ahead"))
            except RuntimeError:   # no thread to be had: the job waits for a worker, or settle drops it
                pass
    return True


class _Pool:
    """Daemon threads running submitted jobs, at most `threads` at once. Daemon threads, unlike
    ThreadPoolExecutor's: a process that ends while a backward's compiles are still queued (a
    script that ran one forward with grad) exits at once instead of waiting for every one."""

    def __init__(self, threads: int, name: str):
        self._jobs: SimpleQueue = SimpleQueue()
        self._threads, self._name, self._started = threads, name, 0
        self._lock = threading.Lock()

    def submit(self, job) -> Future:
        """The job's future; the job runs in a pool thread, or here where none could be started
        (a process out of threads), as the caller would have compiled without the pool."""
        future: Future = Future()
        with self._lock:
            alone = False   # no pool thread exists, nor could one be started
            if self._started < self._threads:
                try:
                    start_thread(self._work, f"{self._name}_{self._started}")
                    self._started += 1
                except RuntimeError:
                    alone = self._started == 0
        if alone:
            _run([future, job])
        else:
            self._jobs.put((future, job))
        return future

    def _work(self) -> None:
        while True:
            _run(list(self._jobs.get()))


def _run(item: list) -> None:
    """Run the job of `item`, [future, job], for its future: its result or exception kept there,
    as an executor does. The job and what it holds (a tuning's scratch tensors, a backward's
    plans) are let go before the future wakes a waiter: `item` is emptied, so no caller's frame
    still holds them."""
    future, job = item
    item.clear()
    ran, result, error = future.set_running_or_notify_cancel(), None, None
    if ran:
        try:
            result = job()
        except BaseException as caught:  # noqa: BLE001 - kept in the future, as an executor does
            error = caught
    job = None
    if error is not None:
        future.set_exception(error)
    elif ran:
        future.set_result(result)
    # a failed job's traceback holds this frame: no cycle through its future and exception
    future = result = error = None


_POOL: list = []   # the _Pool of compile_all, made on first use


def compile_all(jobs: list) -> list[Future]:
    """Start every job (a callable taking no arguments) in the pool, at most POOL_THREADS at
    once; their futures, in order. A job's exception stays in its future."""
    with _LOCK:
        if not _POOL:
            _POOL.append(_Pool(POOL_THREADS, "epifuse-compile"))
        pool = _POOL[0]
    return [pool.submit(job) for job in jobs]


def plan_compiles(args, kernels, planned: list) -> None:
    """Append to `planned` (args, kernel, job) for each of `kernels` to compile for `args`,
    job None where nothing is left to compile. A kernel whose job cannot be made is recorded
    (note_failure) and left out: the real call plans it again and raises there if it must."""
    for kernel in kernels:
        try:
            job = kernel.compile_job(args)
        except Exception as error:  # noqa: BLE001 - recorded, never raised here
            note_failure(("compile", repr(kernel)), error)
            continue
        planned.append((args, kernel, job))


def compile_planned(planned: list) -> list:
    """Run every job of `planned` (from plan_compiles) at once in the pool and wait for them;
    (args, kernel) of each kernel compiled, in order. A compile that fails is recorded, not
    raised, and left out."""
    jobs = [job for _, _, job in planned if job is not None]
    errors = iter([future.exception() for future in compile_all(jobs)] if jobs else [])
    compiled = []
    for args, kernel, job in planned:
        error = next(errors) if job is not None else None
        if error is None:
            compiled.append((args, kernel))
        else:
            note_failure(("compile", repr(kernel)), error)
    return compiled


def note_failure(key, error: BaseException) -> None:
    """Record a failure of a job, or of one compile within a job, without raising it."""
    with _LOCK:
        FAILURES.append((key, error))
        FAILED[0] += 1


def pending() -> bool:
    """Whether any job is queued or running (a cheap test before computing a key to settle)."""
    with _LOCK:
        return bool(_DONE)


def settle(key, timeout: float | None = SETTLE_TIMEOUT_S) -> bool:
    """Wait for the job queued under `key`, if it is queued or running; whether none is left.
    A job still queued (no worker has started it) is taken off the queue instead: the caller
    is about to compile the kernel itself, which is no slower than waiting for a worker to."""
    with _LOCK:
        done = _DONE.get(key)
        if done is None:
            return True
        for i, (queued, _) in enumerate(_QUEUE):
            if queued == key:
                del _QUEUE[i]
                _DONE.pop(key, None)
                done.set()
                return True
    return done.wait(timeout)


def wait_all(timeout: float | None = None) -> bool:
    """Wait until every queued job has finished (for tests and benchmarks); whether they have."""
    with _LOCK:
        events = list(_DONE.values())
    return all(event.wait(timeout) for event in events)


def _work() -> None:
    while True:
        with _LOCK:
            if not _QUEUE:
                if threading.current_thread() in _THREADS:
                    _THREADS.remove(threading.current_thread())
                return
            key, job = _QUEUE.popleft()
        try:
            job()
        except Exception as error:  # noqa: BLE001 - the real call redoes this work and raises there
            note_failure(key, error)
        else:
            with _LOCK:
                COMPLETED[0] += 1
        finally:
            with _LOCK:
                done = _DONE.pop(key, None)
            if done is not None:
                done.set()


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: its pool and workers start anew, and
    jobs the parent had queued or running are dropped (their waiters are released; the child
    compiles what it calls itself). The lock is made anew: a parent's thread may have held it
    at the fork, and nothing in the child would release it."""
    global _LOCK
    _LOCK = threading.Lock()
    _POOL.clear()
    _THREADS.clear()
    _QUEUE.clear()
    for done in _DONE.values():
        done.set()
    _DONE.clear()
    _SEEN.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["enabled", "soon", "compile_all", "note_failure", "pending", "settle", "wait_all", "FAILURES", "FAILED",
           "COMPLETED"]
