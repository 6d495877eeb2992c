"""Caches under stress, and concurrency.

- The kernel source cache (runtime/cache.py): a truncated or tampered file is detected, set
  aside with a warning and rewritten; what runs is always the text generated in-process (a
  planted __pycache__ entry or a file edited before or after loading never runs, even once
  linecache was cleared); an unwritable cache directory falls back to a private one.
- The tuning cache (runtime/tune.py): a damaged tuning.json (not JSON, nested, binary, huge,
  not a file) is set aside with a warning and rebuilt; stores at once keep every choice.
- The index of compiled kernels (runtime/compiled.py): a new process loads the kernel an earlier
  one compiled without Triton keying it; a damaged entry (set aside with a warning) or a Triton
  cache emptied since falls back to Triton's own path and the entry is rewritten.
- Every file read back from the cache directory may be anything: a directory, a FIFO (never
  waited on), a sparse file of many megabytes, a file that cannot be read, a symbolic link loop.
- Three processes ('spawn') sharing one EPIFUSE_CACHE_DIR compile the same epilogue at once:
  every result is right and bitwise identical, no file is torn, no temporary file is left.
- Threads: loading kernel modules concurrently; epifuse.gemm from several threads.
"""
from __future__ import annotations

import inspect
import json
import linecache
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import epifuse
from epifuse.backends import select
from epifuse.runtime import cache, compiled, tune
from helpers import fast, integer_tensor, reference_outputs, rel_error, run_spawned

HAS_CUDA = torch.cuda.is_available()
M, N, K = 37, 45, 21


def _fresh_constant() -> str:
    """A literal no other test uses, so its epilogue is a new graph with a new kernel file."""
    return repr(1.0 + (time.time_ns() // 1000) % 4096 / 4096)


def _valid_cache_file(path: Path) -> bool:
    first, _, body = path.read_text().partition("\n")
    return first == f"# sha256 {cache._checksum(body)}"


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("EPIFUSE_CACHE_DIR", str(root))
    return root


# ---- the kernel source cache ---------------------------------------------------------------------

BODY = "# a kernel\nVALUE = 42\n"


def test_write_source_writes_a_checksummed_file(cache_root):
    path = cache.write_source("unit_stem", BODY)
    assert path.parent == cache_root / "kernels"
    assert path.read_text() == cache.file_text(BODY) and _valid_cache_file(path)
    mtime = path.stat().st_mtime_ns
    assert cache.write_source("unit_stem", BODY) == path
    assert path.stat().st_mtime_ns == mtime  # intact: not rewritten


# Things in a cache file's place that epifuse never writes, whatever the file is for.
OBSTACLES = ["a-directory", "a-fifo", "huge-sparse", "unreadable", "symlink-loop"]


def _obstruct(path: Path, obstacle: str, size: int, monkeypatch) -> None:
    """Put `obstacle` in `path`'s place; "huge-sparse" is a file of `size` bytes."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    if obstacle == "a-directory":
        path.mkdir()
        (path / "inside").write_text("x")
    elif obstacle == "a-fifo":  # opened for reading the usual way, it blocks until a writer comes
        os.mkfifo(path)
    elif obstacle == "huge-sparse":
        with open(path, "wb") as f:
            f.truncate(size)
    elif obstacle == "unreadable":  # as chmod 000 would make it, for root too
        path.write_bytes(b"x")
        real_open = os.open

        def refuse(file, *args, **kwargs):
            if os.fspath(file) == str(path):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(file, *args, **kwargs)
        monkeypatch.setattr(os, "open", refuse)
    else:
        path.symlink_to(path.name)


def _finishes(call, seconds: float = 20.0):
    """call() run in a thread: its result, or a failure if it has not returned in `seconds`
    (a read that waits on a FIFO would otherwise hang the test)."""
    outcome = {}

    def target():
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 - raised again below
            outcome["error"] = error
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s (a blocking read?)"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _set_aside_copy(path: Path) -> Path:
    copy = path.with_name(path.name + ".corrupt-1")
    assert os.path.lexists(copy), sorted(p.name for p in path.parent.iterdir())
    return copy


@pytest.mark.parametrize("damage", ["truncated", "emptied", "body-edited", "checksum-edited", "no-checksum-line",
                                    "binary-garbage", *OBSTACLES])
def test_a_damaged_cache_file_is_set_aside_and_rewritten(cache_root, monkeypatch, damage):
    """A source file that is not what epifuse wrote is set aside as <name>.corrupt-1 with a
    warning naming it, and written again; the call neither fails nor waits."""
    path = cache.write_source("damaged_stem", BODY)
    text = path.read_text()
    damaged = {"truncated": text[: len(text) // 2], "emptied": "", "body-edited": text.replace("42", "43"),
               "checksum-edited": "# sha256 " + "0" * 64 + "\n" + BODY, "no-checksum-line": BODY,
               "binary-garbage": "\udcff\udcfe\x00garbage"}.get(damage)
    with monkeypatch.context() as patch:
        if damaged is not None:
            path.write_bytes(damaged.encode("utf-8", "surrogateescape"))
        else:
            _obstruct(path, damage, cache.MAX_SOURCE_BYTES + 1, patch)
        with pytest.warns(cache.CacheWarning, match=re.escape(str(path))):
            written = _finishes(lambda: cache.write_source("damaged_stem", BODY))
    assert written == path and path.read_text() == cache.file_text(BODY)
    copy = _set_aside_copy(path)
    if damaged is not None:
        assert copy.read_bytes() == damaged.encode("utf-8", "surrogateescape")
    assert not list(path.parent.glob(".damaged_stem.*.tmp"))


def test_an_intact_file_another_renderer_wrote_is_replaced_quietly(cache_root, recwarn):
    """A file whose checksum holds but whose body differs is a kernel another version (or
    another Triton) rendered for the same graph: replaced, with no warning and nothing set aside."""
    path = cache.write_source("other_stem", BODY)
    path.write_text(cache.file_text(BODY.replace("42", "666")))
    assert cache.write_source("other_stem", BODY) == path
    assert path.read_text() == cache.file_text(BODY)
    assert not [w for w in recwarn if issubclass(w.category, cache.CacheWarning)]
    assert sorted(p.name for p in path.parent.iterdir() if not p.name.startswith(".")) == ["other_stem.py"]


def test_set_aside_copies_are_bounded(cache_root):
    path = cache_root / "bounded.json"
    cache_root.mkdir(parents=True)
    for i in range(cache.SET_ASIDE_SLOTS + 3):
        path.write_text(f"damage {i}")
        with pytest.warns(cache.CacheWarning, match=re.escape(str(path))):
            cache.set_aside(path, "is damaged")
    copies = sorted(cache_root.glob("bounded.json.corrupt-*"))
    assert len(copies) == cache.SET_ASIDE_SLOTS and not path.exists()
    assert path.with_name(f"bounded.json.corrupt-{cache.SET_ASIDE_SLOTS}").read_text() == \
        f"damage {cache.SET_ASIDE_SLOTS + 2}"


_TAMPER_SCRIPT = """
import os, sys, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
import epifuse
device = "cuda" if torch.cuda.is_available() else "cpu"
A = (torch.arange({m} * {k}, dtype=torch.float32).reshape({m}, {k}) % 5 - 2).to(device)
B = (torch.arange({k} * {n}, dtype=torch.float32).reshape({k}, {n}) % 3 - 1).to(device)
D = epifuse.gemm(A, B, {source!r}, out_dtype=torch.float32, precision="highest")
expected = torch.relu(A.double() @ B.double() * {constant}).float()
print("KEY", epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments({source!r}, D=D)).key)
sys.exit(0 if torch.equal(D, expected) else 3)
"""


def _run_script(script: str, cache_root: Path, marker: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, EPIFUSE_CACHE_DIR=str(cache_root), PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow   # one of the longest: the README's run leaves it to -m slow (CI runs it)
@pytest.mark.parametrize("attack", fast(["edited-file", "forged-checksum", "planted-pycache"], keep={0}))
def test_tampered_kernel_files_never_run(tmp_path, attack):
    """A fresh process finds a kernel file that someone changed (or a __pycache__ entry planted
    beside it): it runs the kernel it generated, with the right result, and the file is rebuilt."""
    cache_root = tmp_path / "cache"
    marker = tmp_path / "MARKER"
    constant = _fresh_constant()
    source = f"def epi(accum):\n    D = relu(accum * {constant})\n    return D\n"
    script = _TAMPER_SCRIPT.format(m=M, n=N, k=K, source=source, constant=constant)
    first = _run_script(script, cache_root)
    assert first.returncode == 0, first.stderr[-3000:]
    key = first.stdout.split("KEY ")[1].split()[0]
    files = sorted((cache_root / "kernels").glob(f"*{key}*.py"))
    assert files, list((cache_root / "kernels").iterdir())
    originals = {f: f.read_text() for f in files}
    evil = f"open({str(marker)!r}, 'w').write('pwned')\n"
    for f, text in originals.items():
        if attack == "edited-file":
            f.write_text(text + evil)
        elif attack == "forged-checksum":
            f.write_text(cache.file_text(text.partition("\n")[2] + evil))
        else:
            import importlib.util
            from importlib._bootstrap_external import _code_to_timestamp_pyc
            code = compile(text + evil, str(f), "exec")
            stat = f.stat()
            pyc = Path(importlib.util.cache_from_source(str(f)))
            pyc.parent.mkdir(exist_ok=True)
            pyc.write_bytes(_code_to_timestamp_pyc(code, int(stat.st_mtime), stat.st_size))
    second = _run_script(script, cache_root)
    assert second.returncode == 0, second.stderr[-3000:]
    assert not marker.exists(), f"tampered kernel code ran ({attack})"
    for f, text in originals.items():
        assert f.read_text() == text


def _gemm_with_a_new_kernel(device) -> None:
    A = integer_tensor(M, K, dtype=torch.float32, device=device)
    B = integer_tensor(K, N, dtype=torch.float32, device=device)
    constant = _fresh_constant()
    D = epifuse.gemm(A, B, f"def epi(accum):\n    D = accum * {constant}\n    return D\n", precision="highest")
    assert torch.equal(D.double(), A.double() @ B.double() * float(constant))


def test_cache_dir_expands_a_leading_tilde(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("EPIFUSE_CACHE_DIR", "~/epifuse-cache")
    assert cache.cache_dir() == tmp_path / "epifuse-cache" / "kernels"


def test_unwritable_cache_directory_falls_back(tmp_path, monkeypatch, device):
    """EPIFUSE_CACHE_DIR under a regular file (unwritable even for root): kernels still build."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    monkeypatch.setenv("EPIFUSE_CACHE_DIR", str(blocker / "cache"))
    path = cache.write_source("fallback_stem", BODY)
    assert blocker not in path.parents and path.read_text() == cache.file_text(BODY)
    _gemm_with_a_new_kernel(device)


def test_read_only_cache_directory_falls_back(tmp_path, monkeypatch, device):
    kernels = tmp_path / "cache" / "kernels"
    kernels.mkdir(parents=True)
    kernels.chmod(0o500)
    try:
        if os.access(kernels, os.W_OK):
            pytest.skip("running as root: chmod does not make the directory read-only")
        monkeypatch.setenv("EPIFUSE_CACHE_DIR", str(tmp_path / "cache"))
        path = cache.write_source("read_only_stem", BODY)
        assert path.parent != kernels and path.read_text() == cache.file_text(BODY)
        _gemm_with_a_new_kernel(device)
        assert not list(kernels.iterdir())
    finally:
        kernels.chmod(0o700)


def test_a_failing_write_falls_back(cache_root, monkeypatch):
    """The directory looks writable but writing fails (a full disk): the private fallback is used."""
    real = cache.tempfile.mkstemp

    def full_disk(*args, dir=None, **kwargs):
        if Path(dir) == cache_root / "kernels":
            raise OSError(28, "No space left on device")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(cache.tempfile, "mkstemp", full_disk)
    path = cache.write_source("full_disk_stem", BODY)
    assert path.parent != cache_root / "kernels" and path.read_text() == cache.file_text(BODY)


def test_modules_load_from_the_generated_text(cache_root):
    """load_kernel_module runs the text it was given and serves the same text to inspect."""
    body = "def generated():\n    return 7\n"
    module = cache.load_kernel_module("text_stem", body, interpret=True)
    assert module.generated() == 7
    assert inspect.getsource(module.generated) == body
    assert cache.load_kernel_module("text_stem", body, interpret=True) is module


@pytest.mark.parametrize("change", ["edited", "forged-checksum", "truncated", "removed"])
def test_the_generated_text_is_served_after_linecache_is_cleared(cache_root, change):
    """inspect (and so Triton, whose interpreter reads a kernel's source when it first runs it)
    gets the text epifuse generated, not what the file holds after loading, even once
    linecache.clearcache() dropped every entry."""
    value = int.from_bytes(os.urandom(2), "little")
    body = f"def generated():\n    return {value}\n"
    stem = f"changed_stem_{change}_{value}"
    module = cache.load_kernel_module(stem, body, interpret=True)
    path = cache_root / "kernels" / f"{stem}.py"
    evil = body.replace(str(value), "-1")
    if change == "edited":
        path.write_text(path.read_text().replace(str(value), "-1"))
    elif change == "forged-checksum":
        path.write_text(cache.file_text(evil))
    elif change == "truncated":
        path.write_text(path.read_text()[:20])
    else:
        path.unlink()
    linecache.clearcache()
    assert inspect.getsource(module.generated) == body
    assert inspect.getsource(module) == cache.file_text(body)
    assert module.generated() == value


@pytest.mark.parametrize("change", ["constant-changed", "forged-checksum", "truncated"])
def test_a_kernel_file_changed_after_loading_never_runs(cache_root, change):
    """A kernel is loaded, then its file changes on disk (someone edits it to compute with
    another constant, or another process truncates it) and linecache is cleared before the
    first launch: the launch runs the kernel epifuse generated and gives the exact product. A
    later load (a new process) finds the damaged file, sets it aside with a warning and
    writes it again; a forger who kept the checksum consistent only gets the file rewritten."""
    constant = _fresh_constant()
    source = f"def epi(accum, C):\n    D = accum * {constant} + C\n    return D\n"
    A = integer_tensor(M, K, dtype=torch.float32)
    B = integer_tensor(K, N, dtype=torch.float32)
    C = integer_tensor(N, dtype=torch.float32)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
        source, C=C, D=torch.empty(M, N)), precision="highest")
    kernel = next(k for k in epifuse.get_kernels(args) if k.name != "reference")
    kernel.compile(args)
    files = sorted((cache_root / "kernels").glob(f"*{args.key}*.py"))
    assert files, list((cache_root / "kernels").iterdir())
    originals = {f: f.read_text() for f in files}
    for f, text in originals.items():
        if change == "constant-changed":
            f.write_text(text.replace(constant, "1000.0"))
        elif change == "forged-checksum":
            f.write_text(cache.file_text(text.partition("\n")[2].replace(constant, "1000.0")))
        else:
            f.write_text(text[: len(text) // 3])
    linecache.clearcache()
    kernel.run(args)
    expected = A.double() @ B.double() * float(constant) + C.double()
    assert torch.equal(args.outputs["D"].double(), expected)
    for f, text in originals.items():
        body = text.partition("\n")[2]
        if change == "forged-checksum":
            assert cache.write_source(f.stem, body) == f
        else:
            with pytest.warns(cache.CacheWarning, match=re.escape(str(f))):
                assert cache.write_source(f.stem, body) == f
            assert _set_aside_copy(f).exists()
        assert f.read_text() == text


def test_threads_loading_modules_concurrently(cache_root):
    bodies = {f"thread_stem_{i}": f"def generated():\n    return {i}\n" for i in range(6)}

    def load(stem):
        return cache.load_kernel_module(stem, bodies[stem], interpret=True)

    with ThreadPoolExecutor(8) as pool:
        modules = list(pool.map(load, [stem for stem in bodies for _ in range(5)]))
    for i, module in enumerate(modules):
        assert module.generated() == i // 5
        assert module is modules[(i // 5) * 5]
    for path in (cache_root / "kernels").glob("thread_stem_*.py"):
        assert _valid_cache_file(path)
    assert not list((cache_root / "kernels").glob(".*.tmp"))


# ---- the tuning cache ----------------------------------------------------------------------------

TUNING_DAMAGE = {
    "not-json": b"{not json", "empty": b"", "binary": b"\xff\xfe\x00\x01", "a-list": b"[1, 2, 3]",
    "null": b"null", "a-number-value": b'{"key": 3}', "an-object-value": b'{"key": {"nested": "x"}}',
    "truncated": b'{"a": "b"', "two-objects": b'{"a": "b"}{"c": "d"}',
    "huge-number": b'{"key": 1' + b"0" * 5000 + b"}",
    "deeply-nested-lists": b"[" * 100_000 + b"]" * 100_000,
    "deeply-nested-objects": b'{"a": ' * 100_000 + b'"x"' + b"}" * 100_000,
    "nesting-in-a-value": b'{"key": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "nesting-hidden-after-a-string": b'{"a": "b\\\\", "k": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
}


@pytest.mark.parametrize("damage", [*TUNING_DAMAGE, *OBSTACLES])
def test_a_damaged_tuning_file_is_set_aside_and_rebuilt(cache_root, monkeypatch, damage):
    """Whatever tuning.json holds, reading it neither raises (RecursionError on deep nesting,
    MemoryError, UnicodeDecodeError) nor waits: it is set aside with a warning naming it, and
    tuning goes on as if there were no file."""
    path = tune._path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with monkeypatch.context() as patch:
        if damage in TUNING_DAMAGE:
            path.write_bytes(TUNING_DAMAGE[damage])
        else:
            _obstruct(path, damage, tune.MAX_TUNING_BYTES + 1, patch)
        with pytest.warns(cache.CacheWarning, match=re.escape(str(path))):
            assert _finishes(tune._load) == {}
    copy = _set_aside_copy(path)
    if damage in TUNING_DAMAGE:
        assert copy.read_bytes() == TUNING_DAMAGE[damage]
    tune._store("some key", "<some kernel>")
    assert json.loads(path.read_text()) == {"some key": "<some kernel>"}
    assert tune._load() == {"some key": "<some kernel>"}


def test_a_tuning_file_of_escaped_strings_is_intact(cache_root, recwarn):
    """Brackets, braces, quotes and backslashes inside keys and choices are not nesting."""
    choices = {'key [with] {brackets} "quoted" \\': 'TritonKernel(family="tiled", [64, 64]) \\"',
               "other": "{}[]"}
    tune._path().parent.mkdir(parents=True, exist_ok=True)
    tune._path().write_text(json.dumps(choices, indent=0, sort_keys=True))
    assert tune._load() == choices
    tune._store("third", "[x]")
    assert tune._load() == {**choices, "third": "[x]"}
    assert not [w for w in recwarn if issubclass(w.category, cache.CacheWarning)]


def test_tuning_stores_at_once_keep_every_choice(cache_root, monkeypatch):
    """Threads (or processes) storing choices at once: each store reads, adds and writes under
    the entry's lock, so none writes over another's choice."""
    real_write = tune.write_atomically

    def slow_write(path, text):
        time.sleep(0.05)  # widens the window between reading the file and replacing it
        real_write(path, text)
    monkeypatch.setattr(tune, "write_atomically", slow_write)
    keys = [f"key {i}" for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda key: tune._store(key, f"<kernel for {key}>"), keys))
    assert tune._load() == {key: f"<kernel for {key}>" for key in keys}


def test_tuning_entries_are_kept_across_stores(cache_root):
    tune._store("a", "1")
    tune._store("b", "2")
    assert tune._load() == {"a": "1", "b": "2"}
    assert not list(tune._path().parent.glob(".tuning.*.tmp"))


def test_tuning_keys_tell_operand_layouts_apart():
    """Whether a kernel loads a C tile by TMA or through pointers depends on C's alignment and
    contiguity, and so does which kernel is fastest: the tuning key and the remembered choice
    tell them apart; new tensors of the same layout share both."""
    src = "def epi(accum, C):\n    D = accum + C\n    return D\n"
    A, B = torch.ones(64, 32), torch.ones(32, 48)

    def args(C):
        return epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
            src, C=C, D=torch.empty(64, 48)))
    aligned = torch.ones(64, 48)
    unaligned_rows = torch.ones(64, 50)[:, :48]
    transposed = torch.ones(48, 64).t()
    keys = [tune.tuning_key(args(C)) for C in (aligned, unaligned_rows, transposed)]
    assert len(set(keys)) == 3
    assert tune.tuning_key(args(torch.zeros(64, 48))) == keys[0]
    select._CHOSEN.clear()
    for C in (aligned, unaligned_rows, transposed, torch.zeros(64, 48)):
        select.choose_kernel(args(C))
    assert len(select._CHOSEN) == 3


def test_remembered_choices_are_kept_per_signature(monkeypatch):
    """Within one shape bucket the 128x128 tiles may fill the GPU for one shape and not for the
    next, and all of B may fit in a quarter of L2 for one and not the other, which changes the
    candidates (the 64-row ping-pong, the two-rows-deep tile order): a kernel is remembered per
    full argument signature, so no shape is served another's choice, and a repeated signature
    is served without choosing again. (A CPU has no SMs to count nor an L2 to ask, so the
    predicates are stood in for.)"""
    from epifuse.backends.triton import device
    src = "def epi(accum):\n    D = accum * 2.0\n    return D\n"

    def args(M, N):
        return epifuse.GemmArguments(torch.ones(M, 32), torch.ones(32, N),
                                     epilogue=epifuse.EpilogueArguments(src, D=torch.empty(M, N)))
    assert tune.shape_bucket(args(40, 40)) == tune.shape_bucket(args(60, 56))
    monkeypatch.setattr(device, "leaves_sms_idle", lambda a: a.M < 50)
    monkeypatch.setattr(device, "b_fits_l2", lambda a: a.N < 50)
    chosen = []
    monkeypatch.setattr(tune, "choose", lambda a, kernels: chosen.append((a.M, a.N)) or kernels[0])
    select._CHOSEN.clear()
    for M, N in ((40, 40), (60, 40), (40, 56), (40, 40), (60, 40)):
        select.choose_kernel(args(M, N))
    assert chosen == [(40, 40), (60, 40), (40, 56)] and len(select._CHOSEN) == 3


@pytest.mark.gpu
def test_malformed_or_stale_tuning_file_on_gpu(cache_root):
    A = torch.randn(256, 128, device="cuda", dtype=torch.float16)
    B = torch.randn(128, 192, device="cuda", dtype=torch.float16)
    src = f"def epi(accum):\n    D = accum * {_fresh_constant()}\n    return D\n"
    path = tune._path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{garbage")
    D = epifuse.gemm(A, B, src)
    assert rel_error(D, A.double() @ B.double() * float(src.split("* ")[1].split("\n")[0])) < 1e-2
    data = json.loads(path.read_text())
    path.write_text(json.dumps({k: "<a kernel that does not exist>" for k in data}))
    select._CHOSEN.clear()
    tune._MEMORY.clear()
    D2 = epifuse.gemm(A, B, src)
    assert torch.equal(D, D2)


# ---- the index of compiled kernels ----------------------------------------------------------------

COMPILED_DAMAGE = {"empty": b"", "not-a-hash": b"not a hash\n", "short": b"0" * 63 + b"\n",
                   "not-hex": b"g" * 64, "binary": b"\x00\xff" * 40, "two-lines": b"ab" * 32 + b"\nextra\n"}


@pytest.mark.parametrize("damage", [*COMPILED_DAMAGE, *OBSTACLES])
def test_damaged_compiled_index_entries_are_set_aside(cache_root, monkeypatch, damage):
    """An index entry that is not a Triton cache key, or not a file, reads as missing (Triton's
    own path then), set aside with a warning; the entry is then recorded again."""
    entry = "ab" * 32
    directory = cache_root / "compiled"
    directory.mkdir(parents=True)
    path = directory / entry
    with monkeypatch.context() as patch:
        if damage in COMPILED_DAMAGE:
            path.write_bytes(COMPILED_DAMAGE[damage])
        else:
            _obstruct(path, damage, 1 << 20, patch)
        with pytest.warns(cache.CacheWarning, match=re.escape(str(path))):
            assert _finishes(lambda: compiled._read(entry)) is None
    if damage in COMPILED_DAMAGE:
        assert _set_aside_copy(path).read_bytes() == COMPILED_DAMAGE[damage]
    compiled._record(entry, "0123456789abcdef" * 4)
    assert compiled._read(entry) == "0123456789abcdef" * 4
    assert sorted(p.name for p in directory.iterdir()) == [entry, f"{entry}.corrupt-1"]  # no temporary file


def test_a_compiled_index_directory_that_is_a_file_is_set_aside(cache_root):
    cache_root.mkdir(parents=True)
    (cache_root / "compiled").write_text("not a directory")
    assert compiled._read("cd" * 32) is None
    with pytest.warns(cache.CacheWarning, match=re.escape(str(cache_root / "compiled"))):
        compiled._record("cd" * 32, "0123456789abcdef" * 4)
    assert compiled._read("cd" * 32) == "0123456789abcdef" * 4


def test_compiled_index_finds_the_triton_internals_it_reads():
    """runtime.compiled reads Triton 3.6 and 3.9 internals; if they move, warm starts silently lose
    the index (every launch still works): this says so on CPU, before a GPU run would."""
    api = compiled.triton_api()
    assert callable(api.compute_cache_key) and callable(api.env_vars) and callable(api.get_cache_manager)


def test_compiled_index_needs_a_generated_module(cache_root):
    """A JIT function that epifuse did not generate (no source digest) takes Triton's path."""
    calls = []

    class NotGenerated:
        module = "no.such.module"

        def warmup(self, *values, grid, **meta):
            calls.append((values, grid, meta))
            return "compiled"

    assert compiled.warmup(NotGenerated(), [1, 2], (3,), {"BLOCK": 4}) == "compiled"
    assert calls == [((1, 2), (3,), {"BLOCK": 4})]
    assert not (cache_root / "compiled").exists()


def test_compiled_index_records_only_what_triton_keyed_as_it_does(cache_root, monkeypatch):
    """An entry is recorded only where Triton's in-process cache holds the compiled kernel under
    the index's own key: where a Triton keys its launches otherwise (3.9 added a keyword the
    index first left out), an entry would never be asked for, or would be served under a key
    Triton does not use."""
    entry = "cd" * 32

    class Compiled:
        hash = "0123456789abcdef" * 4

    def kernel_keying(key):
        class Kernel:
            def warmup(self, *values, grid, **meta):
                kernel_cache[key] = made = Compiled()
                return made
        return Kernel()

    kernel_cache = {}
    monkeypatch.setattr(compiled, "_hooks_installed", lambda: False)
    monkeypatch.setattr(compiled, "_lookup", lambda kernel, values, meta: (kernel_cache, "ours", entry, None))
    compiled.LAST_FALLBACK[0] = None
    compiled.warmup(kernel_keying("theirs"), [], (1,), {})
    assert compiled._read(entry) is None and compiled.LAST_FALLBACK[0] == compiled._OTHER_KEY
    kernel_cache.clear()
    compiled.warmup(kernel_keying("ours"), [], (1,), {})
    assert compiled._read(entry) == Compiled.hash


_WARM_SCRIPT = """
import sys, torch, triton, epifuse
from epifuse.runtime import compiled
A = torch.randint(-3, 4, (192, 96), device="cuda").half()
B = torch.randint(-3, 4, (96, 160), device="cuda").half()
bias = torch.randint(-3, 4, (160,), device="cuda").half()
D = epifuse.gemm(A, B, {source!r}, bias=bias)
expected = torch.relu(A.double() @ B.double() * {constant} + bias.double()).half()
print("LOADED", compiled.LOADED[0], "KEYED", triton.runtime.cache.triton_key.cache_info().currsize,
      "ELSEWHERE", compiled.COMPILED_ELSEWHERE[0])
print("FALLBACK", compiled.LAST_FALLBACK[0])
sys.exit(0 if torch.equal(D, expected) else 3)
"""


@pytest.mark.gpu
def test_warm_start_loads_compiled_kernels_without_triton_keying_them(tmp_path):
    """A cold process compiles in compile processes and records each kernel in the index without
    hashing Triton's installation; a warm one loads the chosen kernel from the index. Damaged
    entries or an emptied Triton cache are compiled again and rewritten; with compiles in this
    process (EPIFUSE_COMPILE_PROCESSES=0), Triton keys them itself."""
    constant = _fresh_constant()
    source = f"def epi(accum, bias):\n    D = relu(accum * {constant} + bias)\n    return D\n"
    script = _WARM_SCRIPT.format(source=source, constant=constant)
    root, triton_cache = tmp_path / "cache", tmp_path / "triton"

    def run(processes: str = "") -> tuple[int, int, bool]:
        """(kernels loaded from the index, whether Triton hashed itself, whether any kernel
        was compiled in a compile process)"""
        env = dict(os.environ, EPIFUSE_CACHE_DIR=str(root), TRITON_CACHE_DIR=str(triton_cache),
                   EPIFUSE_QUIET="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                   EPIFUSE_COMPILE_PROCESSES=processes)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                             timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
        assert "FALLBACK None" in out.stdout, out.stdout
        words = next(line for line in out.stdout.splitlines() if line.startswith("LOADED")).split()
        return int(words[1]), int(words[3]), int(words[5]) > 0

    assert run() == (0, 0, True)  # cold: every candidate compiled in compile processes, recorded
    entries = sorted((root / "compiled").iterdir())

    def intact(path) -> bool:
        return re.fullmatch(r"[0-9a-f]{64}", path.read_text().strip()) is not None

    assert entries and all(intact(p) for p in entries)
    assert run() == (1, 0, False)  # warm: the chosen kernel comes from the index; Triton never keys it
    for p in entries:
        p.write_text("garbage")
    assert run() == (0, 0, True)  # damaged entries: compiled again (a Triton cache hit), rewritten
    assert any(intact(p) for p in entries)
    assert run() == (1, 0, False)
    shutil.rmtree(triton_cache)
    assert run() == (0, 0, True)  # Triton's cache emptied: compiled again, the same answer
    assert run() == (1, 0, False)
    shutil.rmtree(triton_cache)
    assert run("0") == (0, 1, False)  # compiles in this process: Triton keys them
    assert run("0") == (1, 0, False)


# ---- several processes sharing one cache directory -----------------------------------------------

def _process_worker(cache_root: str, source: str, constant: float, barrier, index: int, queue) -> None:
    """One of several processes: hammer write_source, then compile and run the same epilogue."""
    try:
        os.environ["EPIFUSE_CACHE_DIR"] = cache_root
        import torch as torch_
        import epifuse as epifuse_
        from epifuse.runtime import cache as cache_
        device = "cuda" if torch_.cuda.is_available() else "cpu"
        barrier.wait(timeout=120)
        body = "# shared body\n" + "X = 1\n" * 2000
        for _ in range(200):  # the same stem written and read by every process at once
            path = cache_.write_source("shared_stem", body)
            assert path.read_text() == cache_.file_text(body), "torn read"
        gen = torch_.Generator().manual_seed(1234)
        A = torch_.randint(-3, 4, (2, M, K), generator=gen).float().to(device)
        B = torch_.randint(-3, 4, (2, K, N), generator=gen).float().to(device)
        C = torch_.randint(-3, 4, (N,), generator=gen).float().to(device)
        barrier.wait(timeout=120)
        D, r = epifuse_.gemm(A, B, source, C=C, deterministic=True, precision="highest",
                             out_dtype=torch_.float32)
        queue.put((index, "ok", D.cpu().numpy().tobytes(), r.cpu().numpy().tobytes()))
    except BaseException as error:  # noqa: BLE001  (reported to the parent)
        import traceback
        queue.put((index, "error", traceback.format_exc(), repr(error)))


@pytest.mark.slow
def test_processes_sharing_a_cache_directory(tmp_path):
    constant = float(_fresh_constant())
    source = (f"def epi(accum, C):\n    D = sigmoid(accum * {constant!r} + C)\n"
              "    r = sum(D, dim=(1, 2))\n    return D, r\n")
    results = run_spawned(_process_worker, 3, str(tmp_path / "cache"), source, constant)
    errors = [r for r in results if r[1] != "ok"]
    assert not errors, errors[0][2]
    outputs = {r[2] for r in results}, {r[3] for r in results}
    assert len(outputs[0]) == 1 and len(outputs[1]) == 1, "processes disagree (not bitwise equal)"
    import numpy as np
    D = torch.from_numpy(np.frombuffer(results[0][2], dtype=np.float32).copy()).reshape(2, M, N)
    gen = torch.Generator().manual_seed(1234)
    A = torch.randint(-3, 4, (2, M, K), generator=gen).float()
    B = torch.randint(-3, 4, (2, K, N), generator=gen).float()
    C = torch.randint(-3, 4, (N,), generator=gen).float()
    expected = torch.sigmoid(A.double() @ B.double() * constant + C.double())
    assert rel_error(D, expected) < 1e-6
    kernels = tmp_path / "cache" / "kernels"
    files = list(kernels.glob("*.py"))
    assert any("shared_stem" in f.name for f in files) and len(files) >= 2
    for f in files:
        assert _valid_cache_file(f), f"torn or damaged cache file {f.name}"
    assert not list(kernels.glob(".*.tmp")), "temporary files left behind"


# ---- threads calling epifuse.gemm ----------------------------------------------------------------

THREAD_EPILOGUES = [f"def epi(accum, C):\n    D = {e}\n    return D\n" for e in (
    "relu(accum + C)", "accum * C - 1.0", "maximum(accum, C) * 2.0", "abs(accum) + C",
    "where(accum > C, accum, C)", "clamp(accum - C, -4.0, 4.0)")]


def _thread_job(i: int, device: str):
    gen = torch.Generator().manual_seed(i)
    A = torch.randint(-3, 4, (40, 33), generator=gen).float().to(device)
    B = torch.randint(-3, 4, (33, 50), generator=gen).float().to(device)
    C = torch.randint(-3, 4, (50,), generator=gen).float().to(device)
    source = THREAD_EPILOGUES[i % len(THREAD_EPILOGUES)]
    D = epifuse.gemm(A, B, source, C=C, precision="highest")
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(source, C=C, D=torch.empty_like(D)))
    return bool(torch.equal(D.double(), reference_outputs(args)["D"]))


def test_threads_calling_gemm_with_different_epilogues(device):
    """Under the interpreter, launches are serialized (it patches triton.language globally)."""
    for i in range(len(THREAD_EPILOGUES)):  # each epilogue's kernel built once, then the race
        _thread_job(i, device)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(_thread_job, range(24), [device] * 24))
    assert all(results)


def test_threads_building_arguments_concurrently(device):
    """Parsing, binding, the bind cache and get_kernels from many threads; launches in turn."""
    constant = _fresh_constant()
    sources = [s.replace("    D = ", f"    D = {constant} * ") for s in THREAD_EPILOGUES]

    def build(i):
        gen = torch.Generator().manual_seed(i)
        A = torch.randint(-3, 4, (20, 9), generator=gen).float().to(device)
        B = torch.randint(-3, 4, (9, 30), generator=gen).float().to(device)
        C = torch.randint(-3, 4, (30,), generator=gen).float().to(device)
        source = sources[i % len(sources)]
        args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
            source, C=C, D=torch.empty(20, 30, device=device)), precision="highest")
        return args, epifuse.get_kernels(args)

    with ThreadPoolExecutor(8) as pool:
        built = list(pool.map(build, range(32)))
    for args, kernels in built:
        assert kernels[0].name.startswith("triton_")
        kernels[0].run(args)
        assert torch.equal(args.outputs["D"].double(), reference_outputs(args)["D"])
