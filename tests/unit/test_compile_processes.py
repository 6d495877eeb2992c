"""Compiles in processes of their own (runtime/compile_processes.py and compile_child.py).

Triton compiles for a named GPU target without a GPU (ptxas ships with it), so the channel,
the child's compile and every failure path run on a CPU; tests/gpu/test_gpu.py checks a real
launch's kernels through them.
"""
import os
import threading
import time

import pytest

from epifuse.errors import EpilogueArgumentError
from epifuse.runtime import compile_processes

KERNEL = """import triton
import triton.language as tl


@triton.jit
def scaled_copy(x, y, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offsets, tl.load(x + offsets, mask=offsets < n) * SCALE, mask=offsets < n)
"""


@pytest.fixture
def children(tmp_path, monkeypatch):
    """compile_processes with no child running, children started under this test's Triton
    cache, and everything let go afterwards."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.delenv("EPIFUSE_COMPILE_PROCESSES", raising=False)
    monkeypatch.delenv("EPIFUSE_COMPILE_AHEAD", raising=False)
    compile_processes.let_all_go()
    monkeypatch.setattr(compile_processes, "_FAILURES", [0])
    yield compile_processes
    compile_processes.let_all_go()


def _request(tmp_path, scale: int, **changes) -> dict:
    """A compile request as runtime/compiled.py packs one, for `scale` (a constexpr: a new
    scale is a new kernel) at sm_90."""
    from triton import knobs
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    path = tmp_path / "scaled_copy.py"
    path.write_text(KERNEL)
    target = GPUTarget("cuda", 90, 32)
    request = dict(text=KERNEL, path=str(path), module="epifuse_test_generated.scaled_copy",
                   function="scaled_copy", source_class=("triton.compiler.compiler", "ASTSource"),
                   compile=("triton.compiler.compiler", "compile"),
                   signature={"x": "*fp32", "y": "*fp32", "n": "i32", "SCALE": "constexpr", "BLOCK": "constexpr"},
                   constexprs={(3,): scale, (4,): 128},
                   attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]},
                   options=dict(make_backend(target).parse_options({}).__dict__), target=target,
                   env=sorted(get_cache_invalidating_env_vars().items()), cache_dir=knobs.cache.dir)
    request.update(changes)
    return request


def _compiled_here(request, monkeypatch):
    """The same compile in this process, as Triton's JIT function would make it (a JIT
    function, not the interpreter's, which the CPU tests otherwise use)."""
    import importlib.util

    import triton
    from triton.compiler import ASTSource
    spec = importlib.util.spec_from_file_location("scaled_copy_here", request["path"])
    module = importlib.util.module_from_spec(spec)
    with monkeypatch.context() as patch:
        patch.delenv("TRITON_INTERPRET", raising=False)
        spec.loader.exec_module(module)
    fn = module.scaled_copy
    src = ASTSource(fn, request["signature"], request["constexprs"], request["attrs"])
    return triton.compile(src, target=request["target"], options=request["options"])


def test_a_child_compiles_the_kernel_this_process_would(children, tmp_path, monkeypatch):
    scale = int.from_bytes(os.urandom(2), "little") + 2   # a kernel no earlier run compiled
    request = _request(tmp_path, scale)
    triton_hash = children.compile_in_child(request)
    assert triton_hash is not None, children.LAST_ERROR[0]
    # in Triton's cache, where this process finds it by the hash: the kernel its own compile makes
    from triton.runtime.cache import get_cache_manager
    group = get_cache_manager(triton_hash).get_group("scaled_copy.json")
    assert group is not None and {"scaled_copy.ptx", "scaled_copy.cubin"} <= set(group)
    here = _compiled_here(request, monkeypatch)
    with open(group["scaled_copy.ptx"]) as ptx, open(group["scaled_copy.cubin"], "rb") as cubin:
        assert ptx.read() == here.asm["ptx"] and cubin.read() == here.asm["cubin"]
    assert "mul.f32" in here.asm["ptx"]   # the kernel, compiled: it scales
    assert here.hash != triton_hash   # children key by the installation's identity, not by hashing Triton


def test_a_failed_compile_answers_with_its_error_and_the_child_serves_on(children, tmp_path):
    assert children.compile_in_child(_request(tmp_path, 3, function="no_such_kernel")) is None
    assert "no_such_kernel" in children.LAST_ERROR[0]
    broken = KERNEL.replace("tl.arange(0, BLOCK)", "tl.arange(0, BLOCK) + undefined_name")
    assert children.compile_in_child(_request(tmp_path, 3, text=broken)) is None
    assert "undefined_name" in children.LAST_ERROR[0]
    assert children.compile_in_child(_request(tmp_path, 5)) is not None   # the same child, still serving
    assert children._RUNNING[0] == 1 and children._FAILURES[0] == 0


def test_a_child_under_another_triton_environment_is_replaced(children, tmp_path):
    """A cache-invalidating variable set after a child started: the child refuses the compile
    and is let go (not a failure); the next compile starts a child with the new environment."""
    children.start(1)
    stale = children._IDLE[0]
    request = _request(tmp_path, 3, env=[("TRITON_SOME_CACHE_INVALIDATING_KNOB", "1")])
    assert children.compile_in_child(request) is None
    assert "environment differs" in children.LAST_ERROR[0]
    assert stale.popen.wait(60) is not None and children._RUNNING[0] == 0 and children._FAILURES[0] == 0
    assert children.compile_in_child(_request(tmp_path, 3)) is not None


def test_a_request_that_does_not_pickle_starts_no_child(children, tmp_path):
    assert children.compile_in_child(_request(tmp_path, 3, constexprs={(3,): threading.Lock()})) is None
    assert "does not pickle" in children.LAST_ERROR[0] and children._RUNNING[0] == 0


def test_children_that_die_are_replaced_then_given_up(children, tmp_path):
    children.start(1)
    child = children._IDLE[0]
    child.popen.kill()
    child.popen.wait(10)
    assert children.compile_in_child(_request(tmp_path, 3)) is None   # the dead child: let go, counted
    assert "ended" in children.LAST_ERROR[0] and children._RUNNING[0] == 0 and children._FAILURES[0] == 1
    assert children.compile_in_child(_request(tmp_path, 3)) is not None   # a new child
    children._IDLE[0].popen.kill()
    children._IDLE[0].popen.wait(10)
    assert children.compile_in_child(_request(tmp_path, 3)) is None
    assert not children.usable() and children.compile_in_child(_request(tmp_path, 3)) is None   # given up
    assert children._RUNNING[0] == 0


def test_at_most_limit_children_run_and_callers_wait_for_one(children, tmp_path, monkeypatch):
    monkeypatch.setenv("EPIFUSE_COMPILE_PROCESSES", "2")
    results = []
    callers = [threading.Thread(target=lambda s=s: results.append(children.compile_in_child(_request(tmp_path, s))))
               for s in (11, 12, 13, 14, 15)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(300)
    assert len(results) == 5 and None not in results and len(set(results)) == 5
    assert children._RUNNING[0] == 2 and len(children._IDLE) == 2


def test_the_number_of_children_is_a_setting(children, monkeypatch):
    monkeypatch.setenv("EPIFUSE_COMPILE_PROCESSES", "0")
    assert children.limit() == 0 and not children.usable()
    monkeypatch.setenv("EPIFUSE_COMPILE_PROCESSES", "3")
    assert children.limit() == 3 and children.usable()
    monkeypatch.setenv("EPIFUSE_COMPILE_AHEAD", "0")   # every compile in the caller's thread
    assert children.limit() == 0
    monkeypatch.delenv("EPIFUSE_COMPILE_AHEAD")
    for bad in ("many", "-1", "2.5"):
        monkeypatch.setenv("EPIFUSE_COMPILE_PROCESSES", bad)
        with pytest.raises(EpilogueArgumentError, match=f"EPIFUSE_COMPILE_PROCESSES={bad!r}"):
            children.limit()


def test_a_bad_setting_is_raised_by_the_call_that_would_compile(children, monkeypatch):
    """Not swallowed with the other reasons a compile falls back to the caller's thread."""
    from epifuse.runtime import compiled
    monkeypatch.setenv("EPIFUSE_COMPILE_PROCESSES", "all")
    with pytest.raises(EpilogueArgumentError, match="EPIFUSE_COMPILE_PROCESSES='all'"):
        compiled.warmup(object(), [], (1,), {})


def test_a_forked_process_starts_its_own_children(children, tmp_path):
    """...and closes its copies of the parent's pipes to them: a child sees its input end when
    the parent lets it go, whatever processes the parent forked."""
    children.start(1)
    assert children._RUNNING[0] == 1
    stdin_fd = children._IDLE[0].popen.stdin.fileno()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # the forked process: none of its parent's compile processes, nor their pipes
        os.close(read)
        try:
            os.fstat(stdin_fd)
            pipe = "open"
        except OSError:
            pipe = "closed"
        os.write(write, f"{children._RUNNING[0]} {len(children._IDLE)} {pipe}".encode())
        os._exit(0)
    os.close(write)
    seen = os.read(read, 100).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert seen == "0 0 closed"
    assert children.compile_in_child(_request(tmp_path, 3)) is not None   # the parent's child still serves


class _SilentChild:
    """A compile process that never answers (a hung compile)."""

    def __init__(self):
        import subprocess
        import sys
        self.popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    ask = compile_processes._Child.ask
    close_pipes = compile_processes._Child.close_pipes
    let_go = compile_processes._Child.let_go


def test_a_child_that_does_not_answer_is_killed_and_counted(children, tmp_path, monkeypatch):
    monkeypatch.setattr(children, "_Child", _SilentChild)
    monkeypatch.setattr(children, "ANSWER_TIMEOUT_S", 0.5)
    assert children.compile_in_child(_request(tmp_path, 3)) is None
    assert "no answer in" in children.LAST_ERROR[0]
    assert children._RUNNING[0] == 0 and children._FAILURES[0] == 1 and not children._CHILDREN


def test_an_interrupted_compile_frees_its_slot(children, tmp_path, monkeypatch):
    """A KeyboardInterrupt while waiting for an answer (a notebook's interrupt) lets that child
    go and frees its slot: with one slot, the next compile still gets a child."""
    monkeypatch.setenv("EPIFUSE_COMPILE_PROCESSES", "1")

    def interrupted(self, data, timeout):
        raise KeyboardInterrupt
    with monkeypatch.context() as patch:
        patch.setattr(children._Child, "ask", interrupted)
        for _ in range(2):
            with pytest.raises(KeyboardInterrupt):
                children.compile_in_child(_request(tmp_path, 3))
            assert children._RUNNING[0] == 0 and children._FAILURES[0] == 0
    assert children.compile_in_child(_request(tmp_path, 3)) is not None


def test_every_waiter_returns_when_children_are_given_up(children, tmp_path, monkeypatch):
    """Callers waiting for a child when the children are given up (two died) all return None
    (compiling in their own threads), none waits forever."""
    monkeypatch.setenv("EPIFUSE_COMPILE_PROCESSES", "1")
    gate = threading.Event()

    def dying(self, data, timeout):
        gate.wait(60)
        self.popen.kill()
        self.popen.wait(60)
        return None
    monkeypatch.setattr(children._Child, "ask", dying)
    results = []
    callers = [threading.Thread(target=lambda: results.append(children.compile_in_child(_request(tmp_path, 3))))
               for _ in range(5)]
    for caller in callers:
        caller.start()
    time.sleep(0.5)   # one caller holds the one child; four wait
    gate.set()
    for caller in callers:
        caller.join(60)
    assert not any(caller.is_alive() for caller in callers)
    assert results == [None] * 5 and not children.usable() and children._RUNNING[0] == 0


def test_idle_children_are_let_go_and_the_reaper_stops(children, tmp_path, monkeypatch):
    monkeypatch.setattr(children, "IDLE_LIMIT_S", 0.5)
    monkeypatch.setattr(children, "REAP_PERIOD_S", 0.1)
    monkeypatch.setattr(children, "_REAPER", [None])
    children.start(1)
    popen, reaper = children._IDLE[0].popen, children._REAPER[0]
    assert reaper is not None and reaper.is_alive()
    assert popen.wait(30) == 0   # let go once idle: its input closed, it exited
    reaper.join(30)
    assert not reaper.is_alive() and children._RUNNING[0] == 0 and children._FAILURES[0] == 0
    assert children.compile_in_child(_request(tmp_path, 3)) is not None   # a new child, a new reaper
    reaper = children._REAPER[0]
    assert reaper is not None and reaper.is_alive()
    children.let_all_go()
    reaper.join(30)   # none left behind for the other tests
    assert not reaper.is_alive() and children._REAPER[0] is None


def test_a_reaper_that_could_not_start_is_started_at_the_next_give_back(children, monkeypatch):
    monkeypatch.setattr(children, "_REAPER", [None])
    monkeypatch.setattr(children, "REAP_PERIOD_S", 0.1)
    start = threading.Thread.start

    def no_threads(self):
        if self.name == "epifuse-compile-reaper":
            raise RuntimeError("can't start new thread")
        return start(self)
    with monkeypatch.context() as patch:
        patch.setattr(threading.Thread, "start", no_threads)
        children.start(1)
    assert children._REAPER[0] is None and len(children._IDLE) == 1   # the child serves all the same
    child = children._IDLE.pop()
    children._give_back(child)
    reaper = children._REAPER[0]
    assert reaper is not None and reaper.is_alive()
    children.let_all_go()
    reaper.join(30)
    assert not reaper.is_alive() and children._REAPER[0] is None


def test_a_child_exits_when_its_parent_lets_it_go(children):
    children.start(1)
    popen = children._IDLE[0].popen
    children.let_all_go()
    assert popen.wait(60) == 0 and children._RUNNING[0] == 0


_EARLY_LAUNCHER_PROBE = """
import pickle, sys, threading
from triton.backends.nvidia import driver
from epifuse.runtime import compile_child
built = []

class Launcher:
    def __init__(self, src, metadata):
        settled = "tensordesc_meta" in metadata._metadata if hasattr(metadata, "_metadata") else None
        built.append((threading.current_thread() is threading.main_thread(), src.fn.__name__, settled))

driver.make_launcher = lambda *args: ""
driver.CudaLauncher = Launcher
compile_child._build_launcher_early()
compile_child._build_launcher_early()   # wraps the stages once
request = pickle.load(open(sys.argv[1], "rb"))
compile_child.compile_request(request)
first = list(built)
built.clear()
compile_child.compile_request(request)   # a cache hit: no stage runs
print(repr((first, built, compile_child._EARLY)))
"""


def test_a_child_builds_the_launcher_beside_the_compiles_last_stages(tmp_path):
    """With a Triton that builds a C launcher per kernel signature (3.6; the one here may not),
    a child starts that build in a thread once the TTGIR stage has settled how tensor
    descriptors are lowered, beside the later stages, then builds it once more from the final
    metadata (a cache hit in Triton's cache). Run in a process of its own (not interpreting),
    with a recording launcher in place of Triton's."""
    import pickle
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    request = _request(tmp_path, int.from_bytes(os.urandom(2), "little") + 2, cache_dir=str(tmp_path / "triton"))
    (tmp_path / "request.pickle").write_bytes(pickle.dumps(request))
    out = subprocess.run([sys.executable, "-c", _EARLY_LAUNCHER_PROBE, str(tmp_path / "request.pickle")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    first, again, early = eval(out.stdout.strip().splitlines()[-1])
    assert [row[:2] for row in first] == [(False, "scaled_copy"), (True, "scaled_copy")]  # early, in a thread
    assert first[0][2] is True   # built once the TTGIR stage had settled the descriptors' lowering
    assert [row[:2] for row in again] == [(True, "scaled_copy")]   # no stage ran: after the compile only
    assert early == {"src": None, "thread": None}


_WARMUP_PROBE = """
import json, os, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver


class NoGPU:
    # what Triton's JIT asks of a driver to key and compile a launch (sm_90), without a GPU
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


driver.set_active(NoGPU())
from epifuse.runtime import cache, compile_processes, compiled
module = cache.load_kernel_module("scaled_copy_" + sys.argv[1], sys.argv[2], False)
launched = compiled.warmup(module.scaled_copy, [torch.float32, torch.float32, 1000], (8,),
                           {"SCALE": int(sys.argv[1]), "BLOCK": 128})
from triton.runtime.cache import triton_key
print(json.dumps({"elsewhere": compiled.COMPILED_ELSEWHERE[0], "loaded": compiled.LOADED[0],
                  "fallback": compiled.LAST_FALLBACK[0], "child_error": compile_processes.LAST_ERROR[0],
                  "name": launched.name, "scales": "mul.f32" in launched.asm["ptx"],
                  "hashed_triton": triton_key.cache_info().currsize, "entries": len(os.listdir(compiled._directory()))}))
"""


def test_a_launch_is_compiled_in_a_child_recorded_and_loaded_warm(tmp_path):
    """compiled.warmup end to end, with a driver that stands for an sm_90 GPU (Triton keys and
    compiles without one): a cold process has a child compile the launch's kernel, records it
    in the index and never hashes Triton; a second process loads it from the index; with
    EPIFUSE_COMPILE_PROCESSES=0, Triton compiles a new kernel in the process, hashing itself."""
    import json
    import subprocess
    import sys
    scale = int.from_bytes(os.urandom(2), "little") + 2
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(EPIFUSE_CACHE_DIR=str(tmp_path / "cache"), TRITON_CACHE_DIR=str(tmp_path / "triton"),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p), EPIFUSE_COMPILE_PROCESSES="")

    def run(scale: int, **changes) -> dict:
        out = subprocess.run([sys.executable, "-c", _WARMUP_PROBE, str(scale), KERNEL], capture_output=True,
                             text=True, env={**env, **changes}, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        seen = json.loads(out.stdout.strip().splitlines()[-1])
        assert seen["name"] == "scaled_copy" and seen["scales"] and seen["fallback"] is None, seen
        return seen

    cold = run(scale)
    assert (cold["elsewhere"], cold["loaded"], cold["hashed_triton"], cold["entries"]) == (1, 0, 0, 1), cold
    warm = run(scale)
    assert (warm["elsewhere"], warm["loaded"], warm["hashed_triton"], warm["entries"]) == (0, 1, 0, 1), warm
    here = run(scale + 1, EPIFUSE_COMPILE_PROCESSES="0")
    assert (here["elsewhere"], here["loaded"], here["hashed_triton"], here["entries"]) == (0, 0, 1, 2), here
