"""Warm start: load a kernel compiled by an earlier process without asking Triton to key it.

Triton finds a compiled kernel in its disk cache by a key that starts with a hash of its own
installation (every compiler source file and the 400 MB libtriton), computed once per process:
0.3-0.5 s, most of a warm start. This module keeps a small index beside the generated sources:
<cache>/compiled/<entry>, one file per compiled specialization, naming the Triton cache entry
that holds it. The entry's name is a hash of everything Triton's key covers that can change
without changing the installation's version and file identity: the generated module's text,
the specialization of the arguments and the compile options (Triton's own in-process key), the
target, and the cache-invalidating environment variables.

`warmup(kernel, values, grid, meta)` is `kernel.warmup(...)` that first puts the indexed kernel
into the JIT function's in-process cache (so Triton does not compile or key it) and, after a
compile, records it. A kernel the index lacks is compiled in a compile process where one can
take it (compile_processes.py: compiles side by side, none holding this process's GIL, and this
process never hashes Triton's installation), put into the JIT function's cache the same way,
and recorded. Anything unexpected (an entry that is not a hash, a Triton cache entry
that is gone, an internal Triton API that changed, compile hooks installed) falls back to
Triton's own path, which then rewrites the entry; an entry that is not a hash is damaged, and
is set aside with a warning first (cache.set_aside).
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
import threading
from types import SimpleNamespace

from . import compile_processes
from .triton_identity import installation
from .cache import cache_dir, read_file, set_aside, write_atomically

_HASH = re.compile(r"[0-9a-f]{64}")
_ENTRY = re.compile(rb"[0-9a-f]{64}\n?")  # an index entry: what _record writes
_ENTRY_BYTES = 65
LOADED = [0]  # kernels this process took from the index (for tests and the start-up benchmark)
COMPILED_ELSEWHERE = [0]  # kernels compile processes compiled for this process (for tests and benchmarks)
# Set once set_up has run in this process (whether or not making Triton's driver succeeded)
SET_UP = threading.Event()
_SET_UP_LOCK = threading.Lock()
_KEY_LOCK = threading.Lock()   # one thread computes Triton's hash; the others wait for it
_BIND_LOCK = threading.Lock()
LAST_FALLBACK = [None]  # why the index was last passed over with an error (for tests and debugging)
# compile processes a cold cache starts ahead: a tuning's three compiles, or a layer's forward and backward
PROCESSES_AHEAD = 3
_OTHER_KEY = "Triton keyed the launch otherwise than the index (a Triton this module does not know)"


def _directory():
    return cache_dir().parent / "compiled"


def _hooks_installed() -> bool:
    """Whether a Triton setting asks to see or change compiles (hooks, a compile listener, a
    stages hook, dumps, overrides): Triton's own path then runs, in this process."""
    from triton import knobs
    return any((knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook,
                getattr(knobs.runtime, "add_stages_inspection_hook", None),
                getattr(knobs.compilation, "listener", None), knobs.compilation.always_compile,
                knobs.compilation.override, knobs.compilation.dump_ir))


def triton_api():
    """The Triton internals this module uses (Triton 3.6 and 3.9), imported: an ImportError here
    means they moved, and every launch takes Triton's own path. Where they remain but Triton's
    own key for a launch is not the one computed here (3.9 added a keyword to it), nothing
    is recorded or served (warmup)."""
    # Function-local: private Triton modules that may be missing; ImportError is the signal.
    from triton import knobs
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import CompiledKernel, compile
    from triton.runtime.cache import get_cache_manager
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction, MockTensor, compute_cache_key
    if not hasattr(JITFunction, "_pack_args"):  # device_caches and ASTSource are per instance
        raise ImportError("triton.runtime.jit.JITFunction has no _pack_args")
    return SimpleNamespace(knobs=knobs, env_vars=get_cache_invalidating_env_vars, CompiledKernel=CompiledKernel,
                           compile=compile, get_cache_manager=get_cache_manager, driver=driver, MockTensor=MockTensor,
                           compute_cache_key=compute_cache_key)


def _lookup(kernel, values, meta):
    """(Triton's in-process cache, its key there, the index entry's name) for this launch."""
    api = triton_api()
    source_sha = getattr(sys.modules.get(kernel.module), "__source_sha256__", None)
    if source_sha is None:
        return None
    device = api.driver.active.get_current_device()
    kernel_cache, key_cache, target, backend, binder = kernel.device_caches[device]
    # the keyword arguments JITFunction.run adds before it binds (3.9 adds the third)
    kwargs = dict(meta, debug=meta.get("debug", kernel.debug) or api.knobs.runtime.debug,
                  instrumentation_mode=api.knobs.compilation.instrumentation_mode)
    if hasattr(api.knobs.compilation, "fpsan_homomorphic_casts"):
        kwargs["fpsan_homomorphic_casts"] = api.knobs.compilation.fpsan_homomorphic_casts
    bound, specialization, options = binder(*map(api.MockTensor.wrap_dtype, values), **kwargs)
    key = api.compute_cache_key(key_cache, specialization, options)
    text = "\n".join([installation(), str(target), source_sha, kernel.fn.__qualname__, str(key),
                      str(sorted(api.env_vars().items()))])
    entry = hashlib.sha256(text.encode()).hexdigest()
    return kernel_cache, key, entry, (backend, kwargs, bound, specialization, options, target)


def _read(entry: str) -> str | None:
    """The Triton cache key the index entry `entry` names, or None (no entry, or a damaged one,
    which is set aside)."""
    path = _directory() / entry
    found = read_file(path, _ENTRY_BYTES)
    if found is None:
        return None
    data, seen = found
    if _ENTRY.fullmatch(data) is None:
        set_aside(path, "does not hold a Triton cache key", seen)
        return None
    return data[:64].decode("ascii")


def _record(entry: str, triton_hash: str) -> None:
    directory = _directory()
    try:
        if directory.exists() and not directory.is_dir():
            set_aside(directory, "is not a directory")
        directory.mkdir(parents=True, exist_ok=True)
        write_atomically(directory / entry, triton_hash + "\n")
    except OSError:
        pass  # a read-only cache only costs Triton's own lookup next time


def _from_index(kernel, entry: str, binding) -> object | None:
    """The CompiledKernel the index entry `entry` names, read from Triton's cache, or None."""
    triton_hash = _read(entry)
    return None if triton_hash is None else _load(kernel, triton_hash, binding)


def _compiled_elsewhere(kernel, entry: str, binding) -> object | None:
    """The kernel compiled in a compile process (compile_processes.py) and read from Triton's
    cache; None where no process could compile it. _serve records it in the index."""
    if not compile_processes.usable():
        return None
    triton_hash = compile_processes.compile_in_child(_request(kernel, binding))
    if triton_hash is None or _HASH.fullmatch(triton_hash) is None:
        return None
    return _load(kernel, triton_hash, binding)


def _request(kernel, binding) -> dict:
    """What a compile process needs to compile this launch's kernel as Triton here would: the
    generated module's text and names, and the arguments of triton.compile as the JIT
    function packs them (compile_child.compile_request)."""
    api = triton_api()
    backend, kwargs, bound, specialization, options, target = binding
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    module = sys.modules[kernel.module]
    return dict(text=module.__loader__.get_source(kernel.module), path=module.__file__, module=kernel.module,
                function=kernel.fn.__name__, source_class=_name_of(kernel.ASTSource),
                compile=_name_of(getattr(kernel, "compile", None) or api.compile), signature=signature,
                constexprs=constexprs, attrs=attrs, options=dict(options.__dict__), target=target,
                env=sorted(api.env_vars().items()), cache_dir=getattr(getattr(api.knobs, "cache", None), "dir", None))


def _name_of(thing) -> tuple[str, str]:
    return thing.__module__, thing.__qualname__


def _load(kernel, triton_hash: str, binding) -> object | None:
    """The CompiledKernel Triton's cache holds as `triton_hash` for this launch, or None."""
    api = triton_api()
    backend, kwargs, bound, specialization, options, _ = binding
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    src = kernel.ASTSource(kernel, signature, constexprs, attrs)
    name = f"{src.name[:150]}.json"
    group = api.get_cache_manager(triton_hash).get_group(name)
    if not group or name not in group:
        return None
    compiled = api.CompiledKernel(src, group, triton_hash)
    return compiled if compiled.name == kernel.fn.__name__ else None


def start_thread(target, name: str) -> threading.Thread:
    """A daemon thread running `target`, started once Triton (0.15 s, not loaded with epifuse)
    is imported in the calling thread: every thread epifuse starts compiles, times or sets
    Triton up. Python's import of a submodule takes a parent package found in sys.modules as
    it is, even while another thread is still running the parent's __init__, so threads
    importing parts of Triton while it loads can fail with 'partially initialized module'.
    Once `triton` is loaded, the parts epifuse's threads use are too."""
    import triton  # noqa: F401
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def set_up() -> None:
    """Triton's driver, made once in this process: its first use builds (once per machine)
    and loads a small CUDA helper module, 0.3-0.4 s on an H200 host. Every warmup calls this
    first: the first caller does the work and threads arriving meanwhile wait for it, rather
    than each make a driver of their own. A step that fails here is left to the compile,
    which does it again and raises there. Where the index is empty (a cold cache: this
    process's first kernel will be compiled), the compile processes are started (as
    set_up_soon does); where compiles stay in this process, the hash of Triton's installation
    that each needs first (_key_triton) is computed beside the driver instead, in a thread of
    its own."""
    if SET_UP.is_set():
        return
    with _SET_UP_LOCK:
        if SET_UP.is_set():
            return
        if _index_empty() and not _start_processes():
            start_thread(_key_triton, "epifuse-triton-key")
        try:
            _make_driver()
        except Exception:  # noqa: BLE001 - the compile redoes it and raises there
            pass
        finally:
            SET_UP.set()


def _index_empty() -> bool:
    """Whether the index names no compiled kernel (or cannot be read): a warm start's index
    serves its kernels without Triton's hash, which is then never computed."""
    try:
        with os.scandir(_directory()) as entries:
            return next(entries, None) is None
    except FileNotFoundError:
        return True
    except OSError:
        return False


def set_up_soon() -> None:
    """set_up() in a daemon thread, while the caller parses, chooses and plans its first
    kernel; the caller's warmup then waits for whatever is left of it (set_up)."""
    if SET_UP.is_set() or _SET_UP_LOCK.locked():
        return
    if _index_empty():
        _start_processes()   # before Triton's import below (0.15 s): they import it themselves
    start_thread(set_up, "epifuse-triton-set-up")


def _start_processes() -> bool:
    """Start the compile processes a cold cache will need (PROCESSES_AHEAD); whether compiles
    go to them."""
    try:
        children = compile_processes.usable()
    except Exception:  # noqa: BLE001 - a bad EPIFUSE_COMPILE_PROCESSES: warmup raises it in the caller
        return False
    if children:
        compile_processes.start(PROCESSES_AHEAD)
    return children


def _make_driver() -> None:
    """Triton's driver for this machine's GPUs, made on first use (a Triton whose other
    internals moved, which triton_api reports, still has this)."""
    from triton.runtime.driver import driver
    driver.active.get_current_device()


def _key_triton() -> None:
    """The hash of Triton's installation that starts every compile's key (0.3-0.7 s, cached by
    Triton once computed), computed once before a compile: threads compiling at once would
    each compute it, as Triton's cache does not lock. Not computed for a kernel the index
    serves, which never needs it (a warm start), nor where compile processes compile (they key
    by the installation's identity); computed ahead by set_up where the index is empty and
    compiles stay in this process."""
    with _KEY_LOCK:
        try:
            _triton_key()()
        except Exception:  # noqa: BLE001 - the compile computes it again and raises there
            pass


def _triton_key():
    """Triton's function hashing its installation (cached per process by Triton), where this
    Triton keeps it."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        from triton.compiler.compiler import triton_key
    return triton_key


def _after_fork_in_child() -> None:
    """A set-up thread of the parent may have held a lock at the fork: the child's are new."""
    global _SET_UP_LOCK, _KEY_LOCK
    _SET_UP_LOCK = threading.Lock()
    _KEY_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def bind(kernel) -> None:
    """Make the JIT function's cache for the current device in this thread: Triton makes it on
    first use (a defaultdict whose factory is Python code), so threads compiling the function's
    configs at once would each make one, and all but one compiled kernel would be lost."""
    set_up()   # before the first use of Triton's driver, which set_up makes once
    try:
        device = triton_api().driver.active.get_current_device()
        with _BIND_LOCK:
            kernel.device_caches[device]
    except Exception:  # noqa: BLE001 - a Triton without these internals (or a test's stand-in kernel):
        pass           # each thread makes its own, as Triton does; nothing else depends on it


def prepare(kernel, values, grid, meta) -> None:
    """warmup() without loading onto the GPU: the kernel compiled (or found in the index) and its
    launcher built (a separate compile of its own, cached on disk by Triton), so that the first
    launch only loads both. Touches no GPU state: safe while another thread captures a CUDA graph.
    Where Triton's launcher API differs, the launcher is left to the first launch."""
    compiled = warmup(kernel, values, grid, meta)
    try:
        launcher_cls = triton_api().driver.active.launcher_cls
        launcher_cls(compiled.src, compiled.metadata)
    except Exception as error:  # noqa: BLE001 - an internal Triton API that moved: built at first launch
        LAST_FALLBACK[0] = repr(error)


def warmup(kernel, values, grid, meta):
    """kernel.warmup(*values, grid=grid, **meta): served from the index when it can be, else
    compiled in a compile process when one can, else by Triton in this thread."""
    compile_processes.limit()   # raises on a bad EPIFUSE_COMPILE_PROCESSES, in the caller
    bind(kernel)   # Triton set up, and every thread's first use of the JIT function under the lock
    return _warmup(kernel, values, grid, meta)


def _warmup(kernel, values, grid, meta):
    try:
        found = None if _hooks_installed() else _lookup(kernel, values, meta)
    except Exception as error:  # a Triton internal this module reads has changed: Triton's own path
        LAST_FALLBACK[0] = repr(error)
        found = None
    if found is None:
        _key_triton()
        return kernel.warmup(*values, grid=grid, **meta)
    kernel_cache, key, entry, binding = found
    if key not in kernel_cache:
        launched = _serve(kernel, values, grid, meta, found, _from_index)
        if launched is not None:
            return launched
        launched = _serve(kernel, values, grid, meta, found, _compiled_elsewhere)
        if launched is not None:
            return launched
    if key not in kernel_cache:   # Triton compiles it now, in this thread
        _key_triton()
    compiled = kernel.warmup(*values, grid=grid, **meta)
    if kernel_cache.get(key) is not compiled:  # Triton keyed it otherwise: an entry would never be asked for
        LAST_FALLBACK[0] = _OTHER_KEY
        return compiled
    triton_hash = getattr(compiled, "hash", None)
    if isinstance(triton_hash, str) and _HASH.fullmatch(triton_hash) and _read(entry) != triton_hash:
        _record(entry, triton_hash)
    return compiled


def _serve(kernel, values, grid, meta, found, source):
    """kernel.warmup(...) with the compiled kernel `source` gives (the index, a compile process)
    put into the JIT function's cache first; None where `source` has none. Where Triton keys the
    launch otherwise than _lookup (a Triton this module does not know), it compiles the kernel
    itself, which is what this returns then."""
    kernel_cache, key, entry, binding = found
    try:
        compiled = source(kernel, entry, binding)
    except Exception as error:  # noqa: BLE001 - a Triton internal that moved: Triton compiles it
        LAST_FALLBACK[0] = repr(error)
        return None
    if compiled is None:
        return None
    kernel_cache[key] = compiled
    launched = kernel.warmup(*values, grid=grid, **meta)
    if launched is compiled:
        if source is _from_index:
            LOADED[0] += 1
        else:   # recorded only once Triton has taken it for this launch
            _record(entry, compiled.hash)
            COMPILED_ELSEWHERE[0] += 1
    else:
        kernel_cache.pop(key, None)
        LAST_FALLBACK[0] = _OTHER_KEY
    return launched
