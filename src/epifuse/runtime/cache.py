"""The on-disk cache of generated kernel sources, and loading them as modules.

Triton needs kernel source it can inspect, so each generated kernel is written to a file and
imported from there. Files are written atomically (a temporary file, then a rename), carry a
checksum of their body on the first line, and are rewritten when the checksum does not match
(a truncated or edited file). The directory is $EPIFUSE_CACHE_DIR, else ~/.cache/epifuse; if
it cannot be written, a private temporary directory is used instead.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

_LOCK = threading.Lock()
_MODULES: dict[tuple[str, str], ModuleType] = {}
_FALLBACK_DIR: Path | None = None


def cache_dir() -> Path:
    configured = os.environ.get("EPIFUSE_CACHE_DIR")
    base = Path(configured) if configured else Path.home() / ".cache" / "epifuse"
    return base / "kernels"


def _writable_dir() -> Path:
    global _FALLBACK_DIR
    path = cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    if _FALLBACK_DIR is None:
        _FALLBACK_DIR = Path(tempfile.mkdtemp(prefix="epifuse-kernels-"))
    return _FALLBACK_DIR


def _checksum(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def _read_valid(path: Path, body: str) -> bool:
    try:
        text = path.read_text()
    except OSError:
        return False
    first, _, rest = text.partition("\n")
    return first == f"# sha256 {_checksum(body)}" and rest == body


def write_source(stem: str, body: str) -> Path:
    """Write `body` to <cache>/<stem>.py unless an intact copy is there; return the path."""
    directory = _writable_dir()
    path = directory / f"{stem}.py"
    if _read_valid(path, body):
        return path
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"# sha256 {_checksum(body)}\n{body}")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


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
        path = write_source(stem, body)
        name = f"epifuse_generated.{stem}_{key[1]}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        with _interpreter(interpret):
            spec.loader.exec_module(module)  # generated-source: our own emitted kernel file
        _MODULES[key] = module
        return module
