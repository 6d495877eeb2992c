"""What a compile process runs (compile_processes.py starts it by this file's path): Triton
compiles for the parent process, one at a time, into Triton's disk cache.

It imports the standard library and Triton only (not torch, not epifuse), and never touches a
GPU: every compile names its target. It imports Triton at start, then answers requests on stdin
until stdin closes (the parent exited or let it go). A request holds a generated module's text
and the arguments of one `triton.compile`, as the parent's JIT function packed them for a
launch; the answer is ("ok", the compiled kernel's hash in Triton's cache, where the parent
loads it), ("stale", why) where the parent's Triton environment is no longer this process's,
or ("error", the exception's text). With a Triton that builds a launcher per kernel signature
(a C compile), it is built here too, beside the compile's last stages, and lands in Triton's
cache, where the parent's first launch finds it.

Messages are pickles, each after its length (8 bytes, little-endian). This process's own
stdout is pointed at stderr once the channel is set up, so nothing Triton prints can corrupt
the channel.
"""
import importlib
import importlib.util
import linecache
import os
import pickle
import struct
import sys
import threading
import types

if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]   # run by path: this directory's modules must not shadow any other

_HEADER = struct.Struct("<Q")
# What a first compile imports besides (0.2-0.3 s), imported while the parent plans its first kernel
_IMPORTED_AHEAD = ("triton.language.extra.libdevice", "triton.compiler.code_generator", "triton.experimental.gluon",
                   "triton.backends.nvidia.compiler", "triton.backends.nvidia.driver")
_FUNCTIONS: dict = {}
# The compile in progress (its source) and the thread building its launcher early.
_EARLY: dict = {"src": None, "thread": None}


class StaleEnvironment(Exception):
    """The parent's cache-invalidating Triton environment is no longer this process's."""


def _installation() -> str:
    """triton_identity.installation(), loaded by path: a child, run by path itself, cannot
    import the package."""
    spec = importlib.util.spec_from_file_location(
        "epifuse_triton_identity", os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_identity.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.installation()


def read_frame(stream) -> bytes | None:
    """The next message's pickle on `stream`, or None at its end."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    size = _HEADER.unpack(header)[0]
    data = stream.read(size)
    return data if len(data) == size else None


def read_message(stream):
    """The next message on `stream`, or None at its end."""
    data = read_frame(stream)
    return None if data is None else pickle.loads(data)


def frame(message) -> bytes:
    """`message` as sent: its pickle after the pickle's length."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def write_message(stream, message) -> None:
    stream.write(frame(message))
    stream.flush()


def _function(request):
    """The JIT function `request` names, from its module's text, loaded once per process as the
    parent loads it (same file name and module name: Triton's key of the function reads both)."""
    key = (request["path"], request["module"], request["function"], request["text"])
    found = _FUNCTIONS.get(key)
    if found is None:
        text, path = request["text"], request["path"]
        module = types.ModuleType(request["module"])
        module.__file__ = path
        linecache.cache[path] = (len(text), None, text.splitlines(True), path)
        sys.modules[request["module"]] = module
        exec(compile(text, path, "exec"), module.__dict__)  # generated-source: the parent's kernel module
        found = _FUNCTIONS[key] = getattr(module, request["function"])
    return found


def _environment_check(request) -> None:
    from triton import knobs
    from triton._C.libtriton import get_cache_invalidating_env_vars
    seen = sorted(get_cache_invalidating_env_vars().items())
    if seen != request["env"]:
        raise StaleEnvironment("Triton's cache-invalidating environment differs from the parent's")
    if request["cache_dir"] is not None and knobs.cache.dir != request["cache_dir"]:
        knobs.cache.dir = request["cache_dir"]


def compile_request(request) -> str:
    """Compile what `request` describes; the compiled kernel's hash in Triton's cache."""
    _environment_check(request)
    fn = _function(request)
    source_class, compile_function = _named(request["source_class"]), _named(request["compile"])
    src = source_class(fn, request["signature"], request["constexprs"], request["attrs"])
    _EARLY.update(src=src, thread=None)
    try:
        compiled = compile_function(src, target=request["target"], options=request["options"])
    finally:
        early = _EARLY["thread"]
        _EARLY.update(src=None, thread=None)
        if early is not None:
            early.join()
    _build_launcher(src, compiled.metadata)   # built early: found in Triton's cache
    return compiled.hash


def _named(name: tuple):
    """The object named (module, qualified name): the parent's JIT function's source class and
    compile function, which differ between Triton's kernels and Gluon's and between versions."""
    found = importlib.import_module(name[0])
    for part in name[1].split("."):
        found = getattr(found, part)
    return found


def _build_launcher(src, metadata) -> None:
    """The C launcher of a Triton that builds one per kernel signature (3.6 does, 3.9 does
    not), into Triton's cache; left to the parent's first launch where that fails."""
    try:
        from triton.backends.nvidia import driver
        if hasattr(driver, "make_launcher"):
            driver.CudaLauncher(src, metadata)
    except Exception:  # noqa: BLE001 - the parent builds it at the first launch
        pass



class _EarlyMetadata:
    """A compile's metadata as of its TTGIR stage, for building its launcher: the launcher's C
    source depends on the signature, the constants and the tensor descriptors' lowering, which
    that stage settles; the fields settled later only set attributes of the launcher object,
    which is thrown away."""

    def __init__(self, metadata: dict):
        self._metadata = metadata

    def __getattr__(self, name):
        return self._metadata.get(name, (1, 1, 1) if name == "cluster_dims" else 0)


def _build_launcher_early() -> None:
    """Have the CUDA backend's TTGIR stage start the launcher's build (a C compile, 0.3-0.4 s)
    in a thread once it has run, beside the stages left (LLVM IR, PTX, ptxas: over a second);
    compile_request then finds it built. Where Triton's stages differ, nothing starts early."""
    try:
        from triton.backends.nvidia import driver
        from triton.backends.nvidia.compiler import CUDABackend
    except Exception:  # noqa: BLE001 - another Triton: the launcher builds after the compile
        return
    if not hasattr(driver, "make_launcher") or getattr(CUDABackend.add_stages, "_epifuse_early", False):
        return
    add_stages = CUDABackend.add_stages

    def with_early_launcher(self, stages, *rest, **named):
        add_stages(self, stages, *rest, **named)
        ttgir, src = stages.get("ttgir"), _EARLY["src"]
        if ttgir is None or src is None:
            return

        def ttgir_then_launcher(module, metadata):
            result = ttgir(module, metadata)
            if _EARLY["thread"] is None and isinstance(metadata, dict):
                early = threading.Thread(target=_build_launcher, args=(src, _EarlyMetadata(metadata)), daemon=True)
                early.start()
                _EARLY["thread"] = early
            return result
        stages["ttgir"] = ttgir_then_launcher

    with_early_launcher._epifuse_early = True
    CUDABackend.add_stages = with_early_launcher


def _warm() -> None:
    """Triton imported before the first request arrives, and its compile keys started with
    installation() instead of the hash of every file of Triton's (0.5-0.7 s per process, which
    a child would otherwise spend before its first compile; Triton's own compile pool likewise
    hands its workers a key rather than have each hash). The kernels compiled here are then
    found in Triton's cache by later children and through the parent's index, not by Triton's
    own lookup in a process that hashes (which compiles such a kernel again). Like the index,
    the key does not see edits to Triton's Python files alone (an editable install)."""
    try:
        key = f"epifuse compile process: {_installation()}"
        for name in ("triton.runtime.cache", "triton.compiler.compiler"):
            module = importlib.import_module(name)
            if hasattr(module, "triton_key"):
                module.triton_key = lambda: key
    except Exception:  # noqa: BLE001 - Triton hashes itself at the first compile
        pass
    _build_launcher_early()
    for name in _IMPORTED_AHEAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a Triton without it: the request that needs it says so
            pass


def main() -> None:
    os.environ.pop("TRITON_INTERPRET", None)   # compiles, whatever the parent interprets
    requests = sys.stdin.buffer
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _warm()
    while True:
        data = read_frame(requests)
        if data is None:
            return
        try:
            answer = ("ok", compile_request(pickle.loads(data)))
        except StaleEnvironment as error:
            answer = ("stale", str(error))
        except BaseException as error:  # noqa: BLE001 - every failure is the parent's to report or redo
            answer = ("error", f"{type(error).__name__}: {error}")
        write_message(answers, answer)


if __name__ == "__main__":
    main()
