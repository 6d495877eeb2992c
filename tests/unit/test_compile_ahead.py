"""The backward's kernels compiled while the forward runs (runtime/ahead.py, backward_ahead.py:
backward_from_stand_ins): the worker queue itself, and that the calls planned ahead from fake
tensors (stand_in.py) are exactly the calls the backward then makes (else the compile ahead is wasted).
On the CPU nothing is compiled (the interpreter); the plan, checks and choice are."""
import functools
import threading
import time

import pytest
import torch

import epifuse  # noqa: F401 - registers the ops
from epifuse import backward_ahead, op_backward, torch_ops
from epifuse.runtime import ahead


# ---- the queue ---------------------------------------------------------------------------------

def test_a_key_is_queued_once_and_settle_waits_for_its_running_job():
    started, release, ran = threading.Event(), threading.Event(), []
    key = ("test", object())

    def job():
        started.set()
        release.wait(10)
        ran.append("job")
    assert ahead.soon(key, job)
    assert not ahead.soon(key, job)          # once per key
    assert ahead.pending()
    assert started.wait(10)                  # a worker runs it now
    waiter = threading.Thread(target=lambda: ran.append(("settled", ahead.settle(key))))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and ran == []   # settle waits while the job runs
    release.set()
    waiter.join(10)
    assert ran == ["job", ("settled", True)]
    assert ahead.wait_all(10)
    assert ahead.settle(key)                  # nothing left: returns at once


def test_a_failing_job_is_recorded_and_never_raises_to_the_caller():
    key = ("test-fails", object())
    before, failed = ahead.COMPLETED[0], ahead.FAILED[0]

    def job():
        raise RuntimeError("compile failed")
    ahead.soon(key, job)
    assert ahead.wait_all(10)
    assert any(k == key and "compile failed" in str(error) for k, error in ahead.FAILURES)
    assert ahead.COMPLETED[0] == before and ahead.FAILED[0] == failed + 1
    assert ahead.settle(key)


def test_settle_takes_a_job_no_worker_has_started_off_the_queue(monkeypatch):
    monkeypatch.setattr(ahead, "WORKERS", 0)   # no worker starts: the job stays queued
    ran = []
    key = ("test-queued", object())
    ahead.soon(key, lambda: ran.append(1))
    assert ahead.settle(key, timeout=1)
    monkeypatch.setattr(ahead, "WORKERS", 2)
    ahead.soon(("test-other", object()), lambda: None)
    assert ahead.wait_all(10)
    assert ran == []                          # dropped, never run


def test_compile_ahead_is_off_on_the_cpu_and_by_the_environment(monkeypatch):
    queued = []
    monkeypatch.setattr(ahead, "soon", lambda key, job: queued.append(key))
    A = torch.randn(8, 4, requires_grad=True)
    B = torch.randn(4, 16, requires_grad=True)
    torch_ops.gemm(A, B, "def e(accum):\n    D = relu(accum)\n    return D\n").sum().backward()
    assert queued == []                       # the interpreter compiles nothing
    monkeypatch.setenv("EPIFUSE_COMPILE_AHEAD", "0")
    assert not ahead.enabled()
    monkeypatch.setenv("EPIFUSE_COMPILE_AHEAD", "1")
    assert ahead.enabled()


# ---- the calls planned ahead are the backward's -------------------------------------------------

def _described(epilogue, A, B, program, values, out_dtypes, options) -> tuple:
    def layout(v):
        return (tuple(v.shape), tuple(v.stride()), v.dtype) if isinstance(v, torch.Tensor) else v
    return (epilogue, layout(A), layout(B), tuple((n, layout(values[n])) for n in program.operands), out_dtypes,
            tuple(options))


CASES = {
    "bias_gelu": ("def e(accum, bias):\n    D = gelu(accum + bias)\n    return D\n", {"bias": (16,)}, True),
    "scaled_residual": ("def e(accum, alpha, C):\n    D = alpha * accum + C\n    return D\n",
                        {"alpha": 1.5, "C": (8, 16)}, True),
    "two_outputs_and_a_row_sum": ("def e(accum, bias):\n    Z = accum + bias\n    D = tanh(Z)\n"
                                  "    r = sum(Z, dim=1)\n    return D, r\n", {"bias": (16,)}, True),
    "row_max": ("def e(accum):\n    D = sigmoid(accum)\n    m = max(accum, dim=1)\n    return D, m\n", {}, True),
    "gated": ("def e(accum):\n    gate, up = accum.chunk(2, dim=-1)\n    D = silu(gate) * up\n    return D\n",
              {}, True),
}


# recompute=True is refused for gated epilogues (test_gated), so that pair is not a case
@pytest.mark.parametrize("case,recompute", [(case, recompute) for case in sorted(CASES) for recompute in (False, True)
                                            if not (case == "gated" and recompute)])
def test_the_calls_planned_ahead_are_the_calls_the_backward_makes(case, recompute, monkeypatch):
    source, operands, needs_b = CASES[case]
    A = torch.randn(8, 12, dtype=torch.float64, requires_grad=True)
    B = torch.randn(12, 16, dtype=torch.float64, requires_grad=needs_b)
    tensors = {n: torch.randn(*v, dtype=torch.float64, requires_grad=True) if isinstance(v, tuple) else v
               for n, v in operands.items()}
    planned, made = [], []
    original = op_backward.launch_op

    def spy(*call):
        made.append(_described(*call))
        return original(*call)
    monkeypatch.setattr(op_backward, "launch_op", spy)
    queued = []
    monkeypatch.setattr(backward_ahead, "compiles_ahead", lambda A: True)   # as on a GPU
    monkeypatch.setattr(backward_ahead, "queue_backward", lambda *a: queued.append(a))
    outs = torch_ops.gemm(A, B, source, recompute=recompute, **tensors)
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert len(queued) == 1
    epilogue, qA, qB, qtensors, numbers, kinds, out_dtypes, options, needs = queued[0]
    layouts = [backward_ahead.layout(t) for t in (qA, qB, *qtensors)]
    assert needs == (qA.requires_grad, qB.requires_grad, tuple(t.requires_grad for t in qtensors))

    def record(*call):
        planned.append(_described(*call))
        return backward_ahead.compile_only(*call, planned=[])
    backward_ahead.backward_from_stand_ins(epilogue, layouts, numbers, kinds, out_dtypes, options, needs, launch=record)
    assert planned, "nothing planned ahead"
    made.clear()
    sum((o * torch.randn_like(o)).sum() for o in outs if o.is_floating_point()).backward()
    assert made, "the backward made no epifuse call"
    assert planned == made


def test_a_stand_in_plan_chooses_and_plans_the_kernel_without_running_it():
    """_compile_only's kernel choice and plan from stand-ins: the choice recorded, the
    outputs stand-ins (nothing allocated or written)."""
    from epifuse.stand_in import StandIn
    A = torch.randn(8, 12, requires_grad=True)
    B = torch.randn(12, 16, requires_grad=True)
    bias = torch.randn(16, requires_grad=True)
    source = "def e(accum, bias):\n    D = relu(accum + bias)\n    return D\n"
    key = torch_ops._describe(source, True)[0]
    layouts = [backward_ahead.layout(t) for t in (A, B, bias)]
    compiled = backward_ahead.backward_from_stand_ins(key, layouts, [], "t", "", (torch.float32, False, "default"),
                                                 (True, True, (True,)))
    assert len(compiled) == 1
    args, kernel = compiled[0]
    assert args.stand_in and all(isinstance(t, StandIn) for t in args.outputs.values())
    assert kernel in epifuse.get_kernels(args) or repr(kernel) in map(repr, epifuse.get_kernels(args))


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_compiles_in_a_pool_of_its_own(tmp_path):
    """The parent's pool threads do not exist in a forked child: a child's compile_all would
    wait forever on a pool whose idle threads it believes it has. The child starts anew."""
    import os
    assert all(f.result(10) == 1 for f in ahead.compile_all([lambda: 1, lambda: 1]))   # the pool exists, idle
    marker = tmp_path / "child"
    pid = os.fork()
    if pid == 0:   # the child: exit without running pytest's teardown
        try:
            ok = ahead.compile_all([lambda: 7])[0].result(10) == 7
            marker.write_text("ok" if ok else "wrong")
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0 and marker.read_text() == "ok"


# ---- the forward's key is the backward's, and the backward waits only where it helps -----------

def _keys_of_a_step(monkeypatch, source, backward, calls=1, dtype=torch.float64, **operands):
    """Run `calls` forwards (CPU, as if on a GPU) and one backward of the last: the keys queued
    (soon) and waited for (settle)."""
    queued, settled = [], []
    monkeypatch.setattr(backward_ahead, "compiles_ahead", lambda A: True)
    monkeypatch.setattr(ahead, "soon", lambda key, job: queued.append(key) or True)
    monkeypatch.setattr(ahead, "pending", lambda: True)
    monkeypatch.setattr(ahead, "settle", lambda key, timeout=None: settled.append(key) or True)
    A = torch.randn(16, 8, dtype=dtype, requires_grad=True)
    B = torch.randn(8, 24, dtype=dtype, requires_grad=True)
    for _ in range(calls):
        outs = torch_ops.gemm(A, B, source, **operands)
    backward(outs if isinstance(outs, tuple) else (outs,))
    return queued, settled


TWO_OUTPUTS = "def e(accum, bias):\n    D = tanh(accum + bias)\n    E = sigmoid(accum)\n    return D, E\n"


def test_the_backward_waits_under_the_key_its_forward_queued(monkeypatch):
    bias = torch.randn(24, dtype=torch.float64, requires_grad=True)

    def backward(outs):
        sum((o * torch.randn_like(o)).sum() for o in outs).backward()
    queued, settled = _keys_of_a_step(monkeypatch, TWO_OUTPUTS, backward, bias=bias)
    assert len(queued) == 1 and settled == queued


def test_a_repeated_forward_queues_nothing_more(monkeypatch):
    """The second call of a layout is a kept launch (a Triton kernel's: float32 runs one under
    the interpreter): no key is built or queued for it."""
    from epifuse.runtime import callsite
    hits = callsite.HITS[0]
    queued, _ = _keys_of_a_step(monkeypatch, TWO_OUTPUTS, lambda outs: None, calls=3, dtype=torch.float32,
                                bias=torch.randn(24, requires_grad=True))
    assert callsite.HITS[0] == hits + 2 and len(queued) == 1


def test_the_backward_does_not_wait_for_a_plan_it_will_not_use(monkeypatch):
    """The worker plans for every visible output seeded with a contiguous gradient; a backward
    with an output unseeded, or an expanded gradient (out.sum()), compiles its own at once."""
    bias = torch.randn(24, dtype=torch.float64, requires_grad=True)
    queued, settled = _keys_of_a_step(monkeypatch, TWO_OUTPUTS, lambda outs: outs[0].mul(2).sum().backward(),
                                      bias=bias)
    assert len(queued) == 1 and settled == []     # E got no gradient
    queued, settled = _keys_of_a_step(monkeypatch, TWO_OUTPUTS, lambda outs: (outs[0].sum() + outs[1].sum()).backward(),
                                      bias=torch.randn(24, dtype=torch.float64, requires_grad=True))
    assert len(queued) == 1 and settled == []     # gradients of stride 0


def test_torch_compile_with_dynamic_sizes_traces_the_backward_while_a_job_is_pending():
    """AOTAutograd traces the backward with symbolic sizes: a pending job must not make it
    build a key from them (unhashable: the compile failed)."""
    release = threading.Event()
    key = ("test-pending", object())
    ahead.soon(key, lambda: release.wait(60))
    try:
        assert ahead.pending()
        source = "def e(accum, bias):\n    D = tanh(accum + bias)\n    return D\n"

        def step(A, B, bias, W):   # W: D's gradient, contiguous (as the worker plans for)
            return (torch_ops.gemm(A, B, source, bias=bias) * W).sum()
        compiled = torch.compile(step, backend="aot_eager", dynamic=True, fullgraph=True)
        A = torch.randn(16, 8, dtype=torch.float64, requires_grad=True)
        B = torch.randn(8, 24, dtype=torch.float64, requires_grad=True)
        bias = torch.randn(24, dtype=torch.float64, requires_grad=True)
        W = torch.randn(16, 24, dtype=torch.float64)
        compiled(A, B, bias, W).backward()
        a, b, c = (t.detach().requires_grad_() for t in (A, B, bias))
        (torch.tanh(a @ b + c) * W).sum().backward()
        assert torch.allclose(A.grad, a.grad) and torch.allclose(bias.grad, c.grad)
    finally:
        release.set()
        assert ahead.wait_all(60)


def test_a_forward_kept_by_a_call_without_grad_still_queues_its_backward(monkeypatch):
    """recompute=True: a call under no_grad (an evaluation, a warm-up) and a training call share
    the kept launch; the training call's backward is still queued, once."""
    from epifuse.runtime import callsite
    queued = []
    monkeypatch.setattr(backward_ahead, "compiles_ahead", lambda A: True)
    monkeypatch.setattr(ahead, "soon", lambda key, job: queued.append(key) or True)
    A = torch.randn(16, 8, requires_grad=True)
    B = torch.randn(8, 24, requires_grad=True)
    source = "def e(accum):\n    D = tanh(accum)\n    return D\n"
    with torch.no_grad():
        torch_ops.gemm(A, B, source, recompute=True)
    hits = callsite.HITS[0]
    for _ in range(3):
        torch_ops.gemm(A, B, source, recompute=True)
    assert callsite.HITS[0] == hits + 3 and len(queued) == 1


def test_the_backward_waits_on_the_key_queued_even_when_saved_tensors_come_back_laid_out_anew(monkeypatch):
    """A saved-tensor hook that returns dense copies (offloading) changes the saved tensors'
    strides: the backward settles on the key its forward queued, kept on its context."""
    queued, settled = [], []
    monkeypatch.setattr(backward_ahead, "compiles_ahead", lambda A: True)
    monkeypatch.setattr(ahead, "soon", lambda key, job: queued.append(key) or True)
    monkeypatch.setattr(ahead, "pending", lambda: True)
    monkeypatch.setattr(ahead, "settle", lambda key, timeout=None: settled.append(key) or True)
    A = torch.randn(16, 8, dtype=torch.float64, requires_grad=True)
    W = torch.randn(24, 8, dtype=torch.float64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.contiguous().clone(), lambda t: t):
        D = torch_ops.gemm(A, W.t(), "def e(accum):\n    D = tanh(accum)\n    return D\n")
    (D * torch.randn_like(D)).sum().backward()
    assert len(queued) == 1 and settled == queued


# ---- a backward's compiles run at once, and Triton is set up once --------------------------------

def test_a_backward_plans_every_call_then_compiles_them_all_at_once(monkeypatch):
    """backward_from_stand_ins plans each call of the backward in the worker's thread, then
    compiles all of them in the pool together: a barrier that only opens when every compile
    is running at once passes. A compile that fails is recorded and left out of the result."""
    A = torch.randn(8, 12, requires_grad=True)
    B = torch.randn(12, 16, requires_grad=True)
    source = CASES["row_max"][0]   # its backward makes two calls (the max's and the tiles')
    key = torch_ops._describe(source, True)[0]
    layouts = [backward_ahead.layout(t) for t in (A, B)]
    options, needs = (torch.float32, False, "default"), (True, True, ())
    calls = []
    backward_ahead.backward_from_stand_ins(key, layouts, [], "", "", options, needs,
                                      launch=lambda *call: calls.append(call) or backward_ahead.compile_only(*call, planned=[]))
    assert len(calls) >= 2, "this backward makes one call: it cannot show compiles overlapping"
    barrier = threading.Barrier(len(calls), timeout=10)
    seen = []

    class Kernel:
        def __init__(self, n):
            self.n = n

        def compile_job(self, args):
            seen.append(("planned", self.n, threading.current_thread().name))

            def job():
                barrier.wait()   # raises BrokenBarrierError unless all compile at once
                seen.append(("compiled", self.n, threading.current_thread().name))
                if self.n == 0:
                    raise RuntimeError("this compile fails")
            return job

        def __repr__(self):
            return f"<kernel {self.n}>"
    counter = iter(range(100))
    monkeypatch.setattr(backward_ahead, "kernels_to_compile", lambda args, time_heavy=False: [Kernel(next(counter))])
    failed = ahead.FAILED[0]
    compiled = backward_ahead.backward_from_stand_ins(key, layouts, [], "", "", options, needs)
    here = threading.current_thread().name
    assert [n for step, n, thread in seen if step == "planned" and thread == here] == list(range(len(calls)))
    assert sorted(n for step, n, thread in seen if step == "compiled" and thread.startswith("epifuse-compile")) \
        == list(range(len(calls)))
    assert [repr(kernel) for _, kernel in compiled] == [f"<kernel {n}>" for n in range(1, len(calls))]
    assert ahead.FAILED[0] == failed + 1 and "this compile fails" in str(ahead.FAILURES[-1][1])


def test_triton_is_set_up_once_however_many_threads_compile(monkeypatch):
    """compiled.set_up: the first caller makes Triton's driver, threads arriving meanwhile wait
    for it rather than make their own, and a set-up that fails is left to the compile (no
    raise). The hash of Triton's installation is computed under the same lock, once."""
    from epifuse.runtime import compiled
    monkeypatch.setattr(compiled, "SET_UP", threading.Event())
    started, release, made = threading.Event(), threading.Event(), []

    def make_driver():
        made.append(threading.current_thread().name)
        started.set()
        release.wait(10)
    monkeypatch.setattr(compiled, "_make_driver", make_driver)
    compiled.set_up_soon()
    assert started.wait(10)
    callers = [threading.Thread(target=compiled.set_up) for _ in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(0.2)
    assert all(caller.is_alive() for caller in callers)   # waiting on the set-up thread
    release.set()
    for caller in callers:
        caller.join(10)
    assert made == ["epifuse-triton-set-up"] and compiled.SET_UP.is_set()

    monkeypatch.setattr(compiled, "SET_UP", threading.Event())
    monkeypatch.setattr(compiled, "_make_driver", lambda: 1 / 0)
    compiled.set_up()   # a failing step does not raise here
    assert compiled.SET_UP.is_set()

    monkeypatch.setattr(compiled, "_triton_key", lambda: 1 / 0)
    compiled._key_triton()   # nor here


def test_set_up_hashes_triton_ahead_only_where_the_index_is_empty(tmp_path, monkeypatch):
    """Where compiles stay in this process (no compile processes) and the cache is cold (an
    empty index, or none): set_up computes the hash of Triton's installation in a thread of its
    own beside the driver, so a first compile does not wait for it after the driver; a caller's
    _key_triton meanwhile waits for that thread rather than hash again. With a kept kernel in the
    index (a warm start, served without the hash), nothing is hashed."""
    from epifuse.runtime import compiled
    monkeypatch.setenv("EPIFUSE_COMPILE_PROCESSES", "0")
    monkeypatch.setenv("EPIFUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compiled, "_make_driver", lambda: None)
    started, release, hashed = threading.Event(), threading.Event(), []

    @functools.lru_cache   # as Triton's is
    def triton_key():
        hashed.append(threading.current_thread().name)
        started.set()
        release.wait(10)
    monkeypatch.setattr(compiled, "_triton_key", lambda: triton_key)

    monkeypatch.setattr(compiled, "SET_UP", threading.Event())
    compiled.set_up()                    # no index yet
    assert started.wait(10) and hashed == ["epifuse-triton-key"]
    caller = threading.Thread(target=compiled._key_triton)
    caller.start()
    caller.join(0.2)
    assert caller.is_alive()             # waits for the hashing thread
    release.set()
    caller.join(10)
    assert not caller.is_alive() and hashed == ["epifuse-triton-key"]   # hashed once
    hashed.clear()
    triton_key.cache_clear()

    index = compiled._directory()
    index.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(compiled, "SET_UP", threading.Event())
    compiled.set_up()                    # an empty index: still cold
    assert started.wait(10)
    for _ in range(100):
        if hashed:
            break
        time.sleep(0.01)
    assert hashed == ["epifuse-triton-key"]
    hashed.clear()
    triton_key.cache_clear()

    (index / ("ab" * 32)).write_text("cd" * 32 + "\n")
    monkeypatch.setattr(compiled, "SET_UP", threading.Event())
    compiled.set_up()                    # a warm start
    time.sleep(0.2)
    assert hashed == [] and not [t for t in threading.enumerate() if t.name == "epifuse-triton-key"]


def test_set_up_starts_compile_processes_where_the_index_is_empty(tmp_path, monkeypatch):
    """With compile processes (the default), a cold cache's set_up starts them (they hash
    Triton's installation themselves) instead of hashing here; a warm start starts none."""
    from epifuse.runtime import compile_processes, compiled
    monkeypatch.delenv("EPIFUSE_COMPILE_PROCESSES", raising=False)
    monkeypatch.setenv("EPIFUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compiled, "_make_driver", lambda: None)
    hashed, started = [], []
    monkeypatch.setattr(compiled, "_triton_key", lambda: lambda: hashed.append(1))
    monkeypatch.setattr(compile_processes, "start", started.append)
    monkeypatch.setattr(compiled, "SET_UP", threading.Event())
    compiled.set_up()
    assert started == [compiled.PROCESSES_AHEAD] and hashed == []
    index = compiled._directory()
    index.mkdir(parents=True, exist_ok=True)
    (index / ("ab" * 32)).write_text("cd" * 32 + "\n")
    monkeypatch.setattr(compiled, "SET_UP", threading.Event())
    compiled.set_up()
    time.sleep(0.1)
    assert started == [compiled.PROCESSES_AHEAD] and hashed == []
    monkeypatch.setenv("EPIFUSE_COMPILE_PROCESSES", "lots")   # raised by the caller's warmup, not here
    index.joinpath("ab" * 32).unlink()
    monkeypatch.setattr(compiled, "SET_UP", threading.Event())
    compiled.set_up()
    for _ in range(100):
        if hashed:
            break
        time.sleep(0.01)
    assert started == [compiled.PROCESSES_AHEAD] and hashed == [1]


_THREAD_START_PROBE = """
import sys, threading
import epifuse
from epifuse.runtime import ahead, compiled
assert "triton" not in sys.modules
started = []
start = threading.Thread.start

def recording(self):
    module = sys.modules.get("triton")
    started.append((self.name, module is not None and not getattr(module.__spec__, "_initializing", False)))
    return start(self)
threading.Thread.start = recording
compiled._make_driver = lambda: None
compiled._triton_key = lambda: (lambda: None)
{call}
print("STARTED", started)
"""


@pytest.mark.parametrize("call", ["compiled.set_up_soon()", "ahead.compile_all([lambda: None])[0].result(60)",
                                  "ahead.soon('key', lambda: None); ahead.wait_all(60)"])
def test_triton_is_loaded_before_a_thread_that_uses_it_starts(call):
    """Triton is not loaded with epifuse; each place that starts a thread which compiles or sets
    Triton up loads it first, in the caller: threads importing parts of Triton while another
    runs its __init__ can fail with 'partially initialized module'. (The compile processes'
    reaper, which set_up_soon may start first, never touches Triton.)"""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _THREAD_START_PROBE.format(call=call)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    import ast
    row = next(row for row in out.stdout.splitlines() if row.startswith("STARTED"))
    started = ast.literal_eval(row.split(" ", 1)[1])
    loaded = [was for name, was in started if name != "epifuse-compile-reaper"]
    assert loaded and all(loaded), started   # each thread using Triton: Triton loaded before it started


def test_a_process_exits_without_waiting_for_queued_compiles():
    """The pool's threads are daemons: a process that ends with compiles still queued (one
    forward with grad, then exit) exits at once rather than run each of them first."""
    import subprocess
    import sys
    import time
    code = ("import time\nfrom epifuse.runtime import ahead\n"
            "futures = ahead.compile_all([lambda: time.sleep(20)] * 8)\nprint('queued', flush=True)\n")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": __import__("os").pathsep.join(sys.path)})
    assert out.returncode == 0 and "queued" in out.stdout, out.stderr[-2000:]
    assert time.perf_counter() - start < 15   # waiting for the eight would take 40 s (four threads, 20 s each)


def test_the_pool_lets_a_job_go_before_its_future_wakes_the_waiter():
    """A tuning's compile jobs hold its scratch tensors: the pool's thread must not keep the last
    job it ran (and so a GPU's scratch memory) alive until its next job arrives, nor while it
    completes the job's future (whose callbacks run inside set_result: a waiter wakes there)."""
    import weakref

    class Held:
        pass
    for fails in (False, True):
        held, release, freed_when_done = Held(), threading.Event(), []
        alive = weakref.ref(held)

        def job(held=held):
            release.wait(10)
            if fails:
                raise ValueError("compile failed")
            return 3
        future = ahead.compile_all([job])[0]
        future.add_done_callback(lambda _: freed_when_done.append(alive() is None))
        del held, job
        release.set()
        assert (future.exception(10) is not None) if fails else future.result(10) == 3
        assert freed_when_done == [not fails]   # a failed job's traceback, kept in its future, holds its frame
        del future
        assert alive() is None, "the pool's thread still holds the job it ran"


def test_a_process_out_of_threads_still_compiles_and_never_raises_for_the_queue(monkeypatch):
    """Where no thread can be started: the pool runs each job in the caller (as it would have
    compiled without the pool) instead of leaving its future unfinished forever, and a queued
    job neither raises into the call that queued it nor outlives its settle."""
    def no_thread(target, name):
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(ahead, "start_thread", no_thread)
    pool = ahead._Pool(2, "test-pool")
    futures = [pool.submit(lambda n=n: n * 2) for n in range(3)]
    assert [f.result(0) for f in futures] == [0, 2, 4]   # done already: ran in this thread
    monkeypatch.setattr(ahead, "_THREADS", [])
    key = ("test-no-thread", object())
    assert ahead.soon(key, lambda: None)
    assert ahead.settle(key, timeout=10)
