"""The on-disk cache of generated kernel sources, and loading them as modules.

Each generated kernel is written to <cache>/kernels/<stem>.py, for people and tools to read.
What runs is always the text generated in this process, never bytes read back from the
directory (nor a __pycache__ entry planted beside the file): the module's code is compiled
from that text under a name that is no file (.../runtime/<generated>/<stem>.py), whose source
the module's loader serves, so `inspect`, Triton's JIT and Triton's interpreter (which reads a
kernel's source when it first runs it) read that same text, even once `linecache` was
cleared, whatever the file holds by then.

Files are written atomically (a temporary file, then a rename) and carry a checksum of their
body on the first line. A file that does not hold exactly the body we generated is rewritten:
silently where it is intact (its checksum holds: a kernel another version rendered), and set
aside as <name>.corrupt-<n> with a CacheWarning where it is damaged (truncated, edited, not
text, not a regular file). Every file epifuse reads back from its cache directory (the
tuning records and the index of compiled kernels too) is read through `read_file`: at most a
bound of bytes, a regular file only, and without blocking on a FIFO; what cannot be what
epifuse wrote is set aside the same way, and the call goes on as if there were no file. The
directory is $EPIFUSE_CACHE_DIR, else ~/.cache/epifuse; if it cannot be written, a private
temporary directory is used instead.

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
import stat
import sys
import tempfile
import threading
import time
import warnings
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
MAX_SOURCE_BYTES = 16 << 20  # far above any generated kernel; a larger file is not one of ours
SET_ASIDE_SLOTS = 8  # <name>.corrupt-1 .. -8 per file; past that the last one is replaced
# Where generated modules' code says it comes from: a directory that does not exist, inside
# the installed package, so no file there can stand in for the text (only whoever may change
# epifuse itself could make one), and linecache always asks the module's loader.
CODE_DIR = Path(__file__).resolve().parent / "<generated>"


class CacheWarning(RuntimeWarning):
    """A file in epifuse's cache directory was damaged; it was set aside and is rebuilt."""


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


def _read(path: Path, limit: int) -> tuple[bytes | None, os.stat_result | None, str | None]:
    """(bytes, stat, None) of the regular file `path` if it holds at most `limit` bytes;
    (None, None, None) where there is no file; else (None, stat or None, what is wrong)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except (FileNotFoundError, NotADirectoryError):
        return None, None, None
    except OSError as error:
        return None, None, f"cannot be read ({error.strerror or error})"
    seen = None
    try:
        seen = os.fstat(fd)
        if not stat.S_ISREG(seen.st_mode):
            return None, seen, "is not a regular file"
        if seen.st_size > limit:
            return None, seen, f"holds {seen.st_size} bytes, more than epifuse writes there ({limit})"
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                return b"".join(chunks), seen, None
            chunks.append(chunk)
            size += len(chunk)
        return None, seen, f"holds more bytes than epifuse writes there ({limit})"
    except (OSError, MemoryError) as error:
        return None, seen, f"cannot be read ({error})"
    finally:
        os.close(fd)


def read_file(path: Path, limit: int) -> tuple[bytes, os.stat_result] | None:
    """The bytes (at most `limit`) and stat of the cache file `path`, or None where there is
    none. What epifuse never writes there (not a regular file, over `limit` bytes, a file that
    cannot be read) is set aside (set_aside) and read as None. The file is opened without
    blocking, so a FIFO in its place cannot hang the call."""
    data, seen, problem = _read(path, limit)
    if problem is not None:
        set_aside(path, problem, seen)
    return None if data is None else (data, seen)


def _identity(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def set_aside(path: Path, problem: str, seen: os.stat_result | None = None) -> None:
    """Rename the damaged cache file `path` to <name>.corrupt-<n> (the first free n, else the
    last one is replaced), with a CacheWarning naming the file and `problem`; the caller goes on
    as if there were no file. `seen`: the stat of the file found damaged; a file that has been
    replaced since (another process rebuilt it) is left where it is."""
    try:
        if seen is not None and _identity(os.stat(path)) != _identity(seen):
            return
        slots = [path.with_name(f"{path.name}.corrupt-{n}") for n in range(1, SET_ASIDE_SLOTS + 1)]
        target = next((slot for slot in slots if not os.path.lexists(slot)), slots[-1])
        os.replace(path, target)
    except FileNotFoundError:
        return  # gone meanwhile: another process set it aside or replaced it
    except OSError as error:
        warnings.warn(f"epifuse: the cache file {path} {problem}; it could not be set aside ({error}), "
                      "so it is ignored", CacheWarning, stacklevel=2)
        return
    warnings.warn(f"epifuse: the cache file {path} {problem}; it was set aside as {target.name} and "
                  "is rebuilt", CacheWarning, stacklevel=2)


def _damage(data: bytes) -> str | None:
    """What is wrong with a source file holding `data` (not the body we generated): None where
    it is intact, a checksummed body another renderer wrote."""
    try:
        first, newline, body = data.decode("utf-8").partition("\n")
    except UnicodeDecodeError:
        return "is not UTF-8 text"
    if not newline or not first.startswith("# sha256 "):
        return "has no checksum line (a truncated or foreign file)"
    if first != f"# sha256 {_checksum(body)}":
        return "does not match its checksum (truncated or edited)"
    return None


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
    expected = file_text(body).encode()
    if _read(path, len(expected))[0] == expected:
        return path
    with entry_lock(directory, stem):
        # checked again: another process may have written it meanwhile
        data, seen, problem = _read(path, max(MAX_SOURCE_BYTES, len(expected)))
        if data == expected:
            return path
        if data is not None:
            problem = _damage(data)
        if problem is not None:
            set_aside(path, problem, seen)
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


class _GeneratedSource:
    """A generated module's loader: it serves the module's text to linecache (and so to
    inspect and Triton) whenever linecache has no entry for the module's code."""

    def __init__(self, text: str):
        self.text = text

    def get_source(self, name: str) -> str:
        return self.text


def load_kernel_module(stem: str, body: str, interpret: bool) -> ModuleType:
    """Import the generated module `stem` (written first if needed); cached per process."""
    key = (stem, "interpret" if interpret else "compiled")
    with _LOCK:
        module = _MODULES.get(key)
        if module is not None:
            return module
        write_source(stem, body)
        text = file_text(body)
        code_name = str(CODE_DIR / f"{stem}.py")
        name = f"epifuse_generated.{stem}_{key[1]}"
        module = ModuleType(name)
        module.__file__ = code_name
        module.__loader__ = _GeneratedSource(text)
        module.__source_sha256__ = _checksum(body)  # what runtime.compiled keys compiled kernels by
        # mtime None: linecache.checkcache keeps the entry; once linecache.clearcache drops it,
        # the loader serves the same text again (the name is no file linecache could read).
        linecache.cache[code_name] = (len(text), None, text.splitlines(True), code_name)
        code = compile(text, code_name, "exec")
        sys.modules[name] = module
        with _interpreter(interpret):
            exec(code, module.__dict__)  # generated-source: the kernel text emitted above
        _MODULES[key] = module
        return module
