"""Triton compiles in processes of their own (compile_child.py), so that compiles started at
once (the caller's, the compile pool's, a backward's worker's) run side by side.

Threads overlap only the parts of a compile that leave Python (ptxas, the launcher's C
compile); the rest (the front end, the MLIR passes) holds this process's GIL, so three compiles
in threads took about as long as three in a row less ptxas. A child process holds its own.
`compile_in_child(request)` sends one compile to an idle child (starting one where fewer than
`limit()` run, else waiting for one) and returns the compiled kernel's hash in Triton's disk
cache, or None: the caller then compiles in its own thread as before, which also raises the
compile's error, if any, where it would have been raised (a compile that fails is so compiled
twice). A child that dies, cannot be started or does not answer within ANSWER_TIMEOUT_S is let
go, and after two such failures this process compiles in its own threads. A child whose Triton
environment is no longer this process's (a cache-invalidating variable set since it started)
is let go without counting as a failure, and the next compile starts a new one.

Children hold no GPU state and import neither torch nor epifuse: starting one costs Python's
start and Triton's import (0.2-0.4 s), so runtime/compiled.py starts some ahead, as the first
call begins, where a cold cache means compiles are coming. A child idle for IDLE_LIMIT_S (5
minutes) is let go by a reaper thread, so a long run that stopped compiling holds none. Each
child runs in a session of its own, so a Ctrl-C at the terminal interrupts this process, not
its compiles. A child exits when its stdin closes: when this process lets it go or exits.

EPIFUSE_COMPILE_PROCESSES sets how many children may run (0: none, every compile in this
process's threads); by default min(4, CPUs - 1).
"""
from __future__ import annotations

import os
import pickle
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..errors import EpilogueArgumentError
from .compile_child import frame, read_message

CHILD = Path(__file__).with_name("compile_child.py")
FAILURES_BEFORE_GIVING_UP = 2
ANSWER_TIMEOUT_S = 600.0   # a child silent this long is taken for hung (a large compile takes ~30 s)
IDLE_LIMIT_S = 300.0       # a child idle this long is let go (a training run compiles in its first steps)
REAP_PERIOD_S = 30.0       # how often the reaper looks for such children

_LOCK = threading.Lock()
_FREED = threading.Condition(_LOCK)
_IDLE: list = []          # children waiting for a request
_CHILDREN: set = set()    # every child started and not let go (idle or busy)
_RUNNING = [0]            # children started or starting, and not let go
_FAILURES = [0]           # children that died, hung or could not start, in this process
_REAPER = [None]          # the thread letting idle children go, while any child runs
LAST_ERROR = [None]       # why the latest request came back without a kernel


def compile_ahead_enabled() -> bool:
    """EPIFUSE_COMPILE_AHEAD=0 turns off every compile away from the caller's thread: compile
    processes, and runtime/ahead.py's threads."""
    return os.environ.get("EPIFUSE_COMPILE_AHEAD", "1").strip() != "0"


def limit() -> int:
    """How many children may run at once (EPIFUSE_COMPILE_PROCESSES; 0: none; none either
    under EPIFUSE_COMPILE_AHEAD=0)."""
    if not compile_ahead_enabled():
        return 0
    value = os.environ.get("EPIFUSE_COMPILE_PROCESSES", "").strip()
    if value:
        count = int(value) if value.isdigit() else -1
        if count < 0:
            raise EpilogueArgumentError(
                f"EPIFUSE_COMPILE_PROCESSES={value!r}: expected a whole number of processes (0: none)")
        return count
    return min(4, max(1, (os.cpu_count() or 2) - 1))


def usable() -> bool:
    """Whether compiles may go to children in this process."""
    return _FAILURES[0] < FAILURES_BEFORE_GIVING_UP and limit() > 0


class _Child:
    """One compile process and the two ends of its channel."""

    def __init__(self):
        self.popen = subprocess.Popen([sys.executable, str(CHILD)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
                                      start_new_session=True)

    def ask(self, data: bytes, timeout: float):
        """Send a framed request; the answer, or None where the child ended or stayed silent
        for `timeout` seconds."""
        self.popen.stdin.write(data)
        self.popen.stdin.flush()
        readable, _, _ = select.select([self.popen.stdout], [], [], timeout)
        if not readable:
            return None
        return read_message(self.popen.stdout)

    def close_pipes(self) -> None:
        for stream in (self.popen.stdin, self.popen.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def let_go(self, kill: bool = False) -> None:
        """Close the channel and reap the child: an idle child exits at the end of its input at
        once; one that is dead, hung or still compiling for an interrupted caller is killed."""
        self.close_pipes()
        try:
            if not kill:
                try:
                    self.popen.wait(timeout=5)
                    return
                except subprocess.TimeoutExpired:
                    pass
            self.popen.kill()
            self.popen.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass   # subprocess reaps it later


def start(count: int = 1) -> None:
    """Start children until `count` run (within limit()), without waiting for them to be ready."""
    while usable():
        with _LOCK:
            if _RUNNING[0] >= min(count, limit()):
                return
            _RUNNING[0] += 1
        child = _started()
        if child is None:
            return
        _give_back(child)


def _started():
    """A new child for a slot already counted in _RUNNING, or None (the slot is freed)."""
    try:
        child = _Child()
    except OSError as error:
        _failed(f"could not start a compile process: {error}")
        return None
    except BaseException:
        _freed()
        raise
    with _LOCK:
        _CHILDREN.add(child)
    return child


def _give_back(child) -> None:
    child.idle_since = time.monotonic()
    with _LOCK:
        _IDLE.append(child)
        _FREED.notify()
        if _REAPER[0] is None:
            reaper = threading.Thread(target=_reap, name="epifuse-compile-reaper", daemon=True)
            try:
                reaper.start()
            except RuntimeError:   # no thread to be had, or the interpreter is exiting:
                return             # the next give-back tries again
            _REAPER[0] = reaper


def _reap() -> None:
    """Let children idle for IDLE_LIMIT_S go (each holds a Python and Triton's compiler in
    memory), until none runs; a compile after that starts new ones."""
    try:
        _reap_until_none_runs()
    finally:
        with _LOCK:
            if _REAPER[0] is threading.current_thread():
                _REAPER[0] = None


def _reap_until_none_runs() -> None:
    while True:
        time.sleep(REAP_PERIOD_S)
        now = time.monotonic()
        with _LOCK:
            idle = [child for child in _IDLE if now - child.idle_since >= IDLE_LIMIT_S]
            for child in idle:
                _IDLE.remove(child)
        for child in idle:
            child.let_go()
            _freed(child)
        with _LOCK:
            if not _CHILDREN and _RUNNING[0] == 0:
                if _REAPER[0] is threading.current_thread():
                    _REAPER[0] = None
                return


def _freed(child=None) -> None:
    """A child's slot is free again (the child, if any, let go): every waiter looks again."""
    with _LOCK:
        _RUNNING[0] -= 1
        _CHILDREN.discard(child)
        _FREED.notify_all()


def _failed(why: str, child=None) -> None:
    with _LOCK:
        _FAILURES[0] += 1
        LAST_ERROR[0] = why
    _freed(child)


def _take():
    """An idle child, a new one where fewer than limit() run, or None (children unusable)."""
    with _LOCK:
        while True:
            if not usable():
                return None
            if _IDLE:
                return _IDLE.pop()
            if _RUNNING[0] < limit():
                _RUNNING[0] += 1
                break
            _FREED.wait()
    return _started()


def compile_in_child(request: dict) -> str | None:
    """The hash of the kernel a child compiled for `request` (compile_child.compile_request),
    or None (no child, or it failed: LAST_ERROR says why)."""
    try:
        data = frame(request)
    except Exception as error:  # noqa: BLE001 - something Triton packed that does not pickle
        LAST_ERROR[0] = f"the request does not pickle: {error!r}"
        return None
    child = _take()
    if child is None:
        return None
    try:
        answer = child.ask(data, ANSWER_TIMEOUT_S)
    except (OSError, ValueError, EOFError, pickle.UnpicklingError) as error:
        answer, seen = None, f"{error!r}, "
    except BaseException:   # interrupted while waiting: the answer is still coming, so the child goes
        child.let_go(kill=True)
        _freed(child)
        raise
    else:
        seen = "" if child.popen.poll() is not None else f"no answer in {ANSWER_TIMEOUT_S:.0f} s, "
    if answer is None:
        child.let_go(kill=True)
        _failed(f"the compile process ended ({seen}exit status {child.popen.poll()})", child)
        return None
    kind, value = answer
    if kind == "stale":
        child.let_go()
        _freed(child)
    else:
        _give_back(child)
    if kind == "ok":
        return value
    LAST_ERROR[0] = value
    return None


def let_all_go() -> None:
    """Let every idle child go (they exit); busy ones finish their compile first."""
    with _LOCK:
        children = list(_IDLE)
        _IDLE.clear()
    for child in children:
        child.let_go()
        _freed(child)


def _after_fork_in_child() -> None:
    """A forked process (a DataLoader worker, say) shares this process's pipes to its compile
    processes: it closes its copies, so that a child still sees its input end when this
    process lets it go, and starts children of its own when it compiles."""
    global _LOCK, _FREED
    _LOCK = threading.Lock()
    _FREED = threading.Condition(_LOCK)
    for child in _CHILDREN:
        child.close_pipes()
        child.popen.returncode = 0   # not this process's child: never to be waited for here
    _CHILDREN.clear()
    _IDLE.clear()
    _RUNNING[0] = 0
    _FAILURES[0] = 0
    _REAPER[0] = None   # the parent's reaper thread does not run here


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["limit", "usable", "start", "compile_in_child", "let_all_go", "LAST_ERROR",
           "ANSWER_TIMEOUT_S"]
