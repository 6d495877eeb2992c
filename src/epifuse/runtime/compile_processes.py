"""Triton compiles in processes of their own (compile_child.py), so that compiles started at
once (the caller's, the compile pool's, a backward's worker's) run side by side.

Threads overlap only the parts of a compile that leave Python (ptxas, the launcher's C
compile); the rest (the front end, the MLIR passes) holds this process's GIL, so three compiles
in threads took about as long as three in a row less ptxas. A child process holds its own.
`compile(request)` sends one compile to an idle child (starting one where fewer than
`limit()` run, else waiting for one) and returns the compiled kernel's hash in Triton's disk
cache, or None: the caller then compiles in its own thread as before, which also raises the
compile's error, if any, where it would have been raised. A child that dies or cannot be
started is let go, and after two such failures this process compiles in its own threads.

Children hold no GPU state and import neither torch nor epifuse: starting one costs Triton's
import and the hash of its installation (0.5-0.9 s), so runtime/compiled.py starts one ahead,
while the first call plans, where a cold cache means compiles are coming. A child exits when
its stdin closes: when this process lets it go or exits.

EPIFUSE_COMPILE_PROCESSES sets how many children may run (0: none, every compile in this
process's threads); by default min(4, CPUs - 1).
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

from ..errors import EpilogueArgumentError
from .compile_child import frame, read_message

CHILD = Path(__file__).with_name("compile_child.py")
FAILURES_BEFORE_GIVING_UP = 2

_LOCK = threading.Lock()
_FREED = threading.Condition(_LOCK)
_IDLE: list = []          # children waiting for a request
_RUNNING = [0]            # children started and not let go (idle or busy)
_FAILURES = [0]           # children that died or could not start, in this process
COMPILED = [0]            # compiles a child answered (for tests and the start-up benchmark)
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
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)

    def ask(self, data: bytes):
        self.popen.stdin.write(data)
        self.popen.stdin.flush()
        return read_message(self.popen.stdout)

    def let_go(self) -> None:
        for stream in (self.popen.stdin, self.popen.stdout):
            try:
                stream.close()
            except OSError:
                pass


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
        with _LOCK:
            _IDLE.append(child)
            _FREED.notify()


def _started():
    try:
        return _Child()
    except OSError as error:
        _failed(f"could not start a compile process: {error}")
        return None


def _failed(why: str) -> None:
    with _LOCK:
        _RUNNING[0] -= 1
        _FAILURES[0] += 1
        LAST_ERROR[0] = why
        _FREED.notify()


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


def compile(request: dict) -> str | None:
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
        answer = child.ask(data)
    except (OSError, ValueError, EOFError, pickle.UnpicklingError) as error:
        answer, seen = None, f"{error!r}, "
    else:
        seen = ""
    if answer is None:
        why = f"the compile process ended ({seen}exit status {child.popen.poll()})"
        child.let_go()
        _failed(why)
        return None
    with _LOCK:
        _IDLE.append(child)
        _FREED.notify()
    kind, value = answer
    if kind == "ok":
        COMPILED[0] += 1
        return value
    LAST_ERROR[0] = value
    return None


def let_all_go() -> None:
    """Let every idle child go (they exit); busy ones finish their compile first."""
    with _LOCK:
        children = list(_IDLE)
        _IDLE.clear()
        _RUNNING[0] -= len(children)
        _FREED.notify_all()
    for child in children:
        child.let_go()


def _after_fork_in_child() -> None:
    """A forked child shares its parent's compile processes' pipes: it drops them (without
    closing: the parent still talks to them) and starts its own when it compiles."""
    global _LOCK, _FREED
    _LOCK = threading.Lock()
    _FREED = threading.Condition(_LOCK)
    _IDLE.clear()
    _RUNNING[0] = 0
    _FAILURES[0] = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["limit", "usable", "start", "compile", "let_all_go", "COMPILED", "LAST_ERROR"]
