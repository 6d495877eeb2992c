"""The on-disk cache of generated kernel sources, and loading them as modules.

Triton needs kernel source it can inspect, so each generated kernel is written to a file and
loaded from there. Files are written atomically (a temporary file, then a rename), carry a
checksum of their body on the first line, and are rewritten when they do not hold exactly the
body we generated (a truncated or edited file). What runs is always the text generated in this
process, compiled here, never bytes read back from the directory (nor a __pycache__ entry
planted beside the file); Triton's source inspection is served the same text. The directory
is $EPIFUSE_CACHE_DIR, else ~/.cache/epifuse; if it cannot be written, a private temporary
directory is used instead.

Processes sharing the directory take a per-entry lock (`fcntl.flock` on `.<stem>.lock`) while
they check and write an entry, so one writes it and the others find it intact. The lock is
an optimization: where there is no fcntl, the lock file cannot be made (a read-only
directory) or it is held for longer than LOCK_TIMEOUT_S (a stuck process), the write goes
ahead unlocked, still atomic.
"""
from __future__ import annotations

import contextlib
import hashlib
import linecache
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

try:
    import fcntl
except ImportError:  # Windows: atomic renames only
    fcntl = None

LOCK_TIMEOUT_S = 10.0
_LOCK_POLL_S = 0.01
_LOCK = threading.Lock()
_MODULES: dict[tuple[str, str], ModuleType] = {}
_FALLBACK_DIR: Path | None = None


def cache_dir() -> Path:
    configured = os.environ.get("EPIFUSE_CACHE_DIR")
    base = Path(configured).expanduser() if configured else Path.home() / ".cache" / "epifuse"
    return base / "kernels"


def _fallback_dir() -> Path:
    global _FALLBACK_DIR
    if _FALLBACK_DIR is None:
        _FALLBACK_DIR = Path(tempfile.mkdtemp(prefix="epifuse-kernels-"))
    return _FALLBACK_DIR


def _writable_dir() -> Path:
    path = cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    return _fallback_dir()


def _checksum(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def file_text(body: str) -> str:
    """What a cache file holding `body` contains: the checksum line, then the body."""
    return f"# sha256 {_checksum(body)}\n{body}"


def _read_valid(path: Path, body: str) -> bool:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read() == file_text(body)
    except (OSError, UnicodeError):
        return False


@contextlib.contextmanager
def entry_lock(directory: Path, stem: str, timeout: float | None = None):
    """Hold the cross-process lock of entry `stem` in `directory`; yields whether it is held
    (False: no fcntl, no lock file, or still busy after `timeout` seconds: go on unlocked)."""
    fd = _open_lock_file(directory / f".{stem}.lock")
    if fd is None:
        yield False
        return
    try:
        yield _acquire(fd, LOCK_TIMEOUT_S if timeout is None else timeout)
    finally:
        os.close(fd)  # closing releases the lock


def _open_lock_file(path: Path) -> int | None:
    if fcntl is None:
        return None
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None


def _acquire(fd: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_LOCK_POLL_S)
        except OSError:  # a file system without locks (some NFS mounts)
            return False


def _write(directory: Path, stem: str, body: str) -> Path:
    path = directory / f"{stem}.py"
    if _read_valid(path, body):
        return path
    with entry_lock(directory, stem):
        if not _read_valid(path, body):  # another process may have written it meanwhile
            _write_file(directory, stem, path, body)
    return path


def _write_file(directory: Path, stem: str, path: Path, body: str) -> None:
    write_atomically(path, file_text(body))


def write_atomically(path: Path, text: str) -> None:
    """Write `path`: a temporary file in the same directory (.<stem>.*.tmp), then a rename, so
    readers see the old file or the new one, never a part; the temporary file is removed on
    failure."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_source(stem: str, body: str) -> Path:
    """Write `body` to <cache>/<stem>.py unless an intact copy is there; return the path.

    A directory that looks writable but is not (a full disk, a path that is a directory) costs
    a write into the private fallback directory instead of an error."""
    directory = _writable_dir()
    try:
        return _write(directory, stem, body)
    except OSError:
        if directory == _fallback_dir():
            raise
        return _write(_fallback_dir(), stem, body)


@contextlib.contextmanager
def _interpreter(enabled: bool):
    """triton.jit decides interpreted or compiled when a function is decorated."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if enabled else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def load_kernel_module(stem: str, body: str, interpret: bool) -> ModuleType:
    """Import the generated module `stem` (written first if needed); cached per process."""
    key = (stem, "interpret" if interpret else "compiled")
    with _LOCK:
        module = _MODULES.get(key)
        if module is not None:
            return module
        path = str(write_source(stem, body))
        text = file_text(body)
        name = f"epifuse_generated.{stem}_{key[1]}"
        module = ModuleType(name)
        module.__file__ = path
        module.__source_sha256__ = _checksum(body)  # what runtime.compiled keys compiled kernels by
        # inspect (and so Triton) reads source through linecache: serve it the text we generated
        # (mtime None: linecache never re-reads it from the file, which could change under us).
        linecache.cache[path] = (len(text), None, text.splitlines(True), path)
        code = compile(text, path, "exec")
        sys.modules[name] = module
        with _interpreter(interpret):
            exec(code, module.__dict__)  # generated-source: the kernel text emitted above
        _MODULES[key] = module
        return module
