"""Cross-process locking of the kernel source cache (runtime/cache.py).

Processes sharing one EPIFUSE_CACHE_DIR take a per-entry file lock while they check and write
an entry: exactly one of them writes it, the others wait and find it intact. The lock never
makes a write fail or hang: without fcntl, without a lock file (a read-only directory), or
while another process holds the lock for too long, the write goes ahead unlocked.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from cache_lock_worker import write_entry
from helpers import run_spawned
from epifuse.runtime import cache

STEM = "locked_stem"
BODY = "# a generated kernel\n" + "VALUE = 42\n" * 5000
PROCESSES = 4


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("EPIFUSE_CACHE_DIR", str(root))
    return root


def _valid(text: str) -> bool:
    first, _, body = text.partition("\n")
    return first == f"# sha256 {cache._checksum(body)}"


def _race(tmp_path: Path, locking: bool) -> tuple[list, list[str]]:
    """Run PROCESSES writers of one entry at once; their results and the logged writers."""
    log = tmp_path / "writes.log"
    log.touch()
    results = run_spawned(write_entry, PROCESSES, cache.__file__, str(tmp_path / "cache"), STEM, BODY,
                          str(log), locking)
    errors = [r for r in results if r[0] != "ok"]
    assert not errors, errors[0][1]
    return results, log.read_text().split()


@pytest.mark.skipif(cache.fcntl is None, reason="no fcntl: writes are atomic renames only")
def test_processes_writing_one_entry_write_it_once(tmp_path):
    results, writers = _race(tmp_path, locking=True)
    assert len(writers) == 1, f"{len(writers)} processes wrote the entry"
    path = tmp_path / "cache" / "kernels" / f"{STEM}.py"
    assert {r[1] for r in results} == {str(path)}
    assert all(r[2] == cache.file_text(BODY) and _valid(r[2]) for r in results)
    assert path.read_text() == cache.file_text(BODY)
    assert not list(path.parent.glob(".*.tmp"))


def test_without_locks_processes_race_but_files_stay_whole(tmp_path):
    """The control: with no lock every process writes (so the test above can see a race), and
    the atomic rename still leaves one whole, checksum-valid file."""
    results, writers = _race(tmp_path, locking=False)
    assert len(writers) >= 2
    path = tmp_path / "cache" / "kernels" / f"{STEM}.py"
    assert all(r[2] == cache.file_text(BODY) for r in results)
    assert _valid(path.read_text()) and not list(path.parent.glob(".*.tmp"))


@pytest.mark.skipif(cache.fcntl is None, reason="no fcntl")
def test_a_writer_waits_for_the_lock_holder(cache_root, monkeypatch):
    directory = cache_root / "kernels"
    directory.mkdir(parents=True)
    held, release = threading.Event(), threading.Event()

    def holder():
        with cache.entry_lock(directory, STEM) as locked:
            assert locked
            held.set()
            release.wait(timeout=30)
            (directory / f"{STEM}.py").write_text(cache.file_text(BODY))  # the holder's write

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(timeout=30)
    threading.Timer(0.3, release.set).start()
    start = time.monotonic()
    written = []
    real_write = cache._write_file
    monkeypatch.setattr(cache, "_write_file", lambda *args: written.append(args) or real_write(*args))
    path = cache.write_source(STEM, BODY)
    thread.join(timeout=30)
    assert time.monotonic() - start >= 0.25
    assert not written, "the entry was written again after the holder wrote it"
    assert path.read_text() == cache.file_text(BODY)


@pytest.mark.skipif(cache.fcntl is None, reason="no fcntl")
def test_a_lock_held_too_long_is_passed_by(cache_root, monkeypatch):
    """A holder that never lets go (a stuck process) delays a writer by LOCK_TIMEOUT_S only."""
    monkeypatch.setattr(cache, "LOCK_TIMEOUT_S", 0.2)
    directory = cache_root / "kernels"
    directory.mkdir(parents=True)
    with cache.entry_lock(directory, STEM) as locked:
        assert locked
        with cache.entry_lock(directory, STEM) as second:
            assert not second
        start = time.monotonic()
        path = cache.write_source(STEM, BODY)
        elapsed = time.monotonic() - start
    assert 0.2 <= elapsed < 5.0
    assert path.parent == directory and path.read_text() == cache.file_text(BODY)


@pytest.mark.parametrize("obstacle", ["lock-path-is-a-directory", "no-fcntl", "lock-file-not-creatable"])
def test_writes_go_ahead_without_a_lock(cache_root, monkeypatch, obstacle):
    directory = cache_root / "kernels"
    directory.mkdir(parents=True)
    if obstacle == "lock-path-is-a-directory":
        (directory / f".{STEM}.lock").mkdir()
    elif obstacle == "no-fcntl":
        monkeypatch.setattr(cache, "fcntl", None)
    else:  # a read-only directory holding the entry's lock path, as root cannot make one
        real_open = os.open

        def refuse_lock_files(path, *args, **kwargs):
            if str(path).endswith(".lock"):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(cache.os, "open", refuse_lock_files)
    with cache.entry_lock(directory, STEM) as locked:
        assert not locked
    path = cache.write_source(STEM, BODY)
    assert path.parent == directory and path.read_text() == cache.file_text(BODY)


@pytest.mark.skipif(cache.fcntl is None, reason="no fcntl")
def test_an_intact_entry_is_read_without_locking(cache_root, monkeypatch):
    path = cache.write_source(STEM, BODY)

    def no_locking(*args, **kwargs):
        raise AssertionError("locked to read an intact entry")

    monkeypatch.setattr(cache, "entry_lock", no_locking)
    assert cache.write_source(STEM, BODY) == path


def test_read_only_cache_with_an_intact_entry(cache_root, monkeypatch):
    """A cache directory that cannot be written (os.access says so, as for a read-only mount)
    falls back to the private directory, as before: no lock file is made in it."""
    kernels = cache_root / "kernels"
    kernels.mkdir(parents=True)
    (kernels / f"{STEM}.py").write_text(cache.file_text(BODY))
    real_access = os.access
    monkeypatch.setattr(cache.os, "access",
                        lambda p, mode: False if Path(p) == kernels else real_access(p, mode))
    path = cache.write_source(STEM, BODY)
    assert path.parent != kernels and path.read_text() == cache.file_text(BODY)
    assert not list(kernels.glob(".*.lock"))
