"""The tuning policies on a GPU: fast takes the shipped choice untimed (on a GPU model with a
table) or times a short list; background serves at once and swaps in full tuning's winner."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import epifuse
from epifuse.backends import select
from epifuse.runtime import callsite, shipped, tune

pytestmark = pytest.mark.gpu

EPILOGUE = "def e(accum, bias):\n    D = gelu(accum + bias)\n    return D\n"


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No choice remembered in memory or on disk; whatever the test sets is undone."""
    monkeypatch.setenv("EPIFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("EPIFUSE_QUIET", "1")
    monkeypatch.setattr(tune, "_MEMORY", {})
    select._forget_choices()
    callsite.clear()
    yield
    tune.wait_for_background(60)
    select._forget_choices()
    callsite.clear()


def _problem(M, N, K, dtype=torch.float16):
    A = torch.randn(M, K, device="cuda", dtype=dtype)
    B = torch.randn(K, N, device="cuda", dtype=dtype) / K ** 0.5
    bias = torch.randn(N, device="cuda", dtype=dtype)
    return A, B, bias


def _expected(A, B, bias):
    return torch.nn.functional.gelu(A.double() @ B.double() + bias.double())


def _chosen(A, B, bias, D):
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(EPILOGUE, bias=bias, D=D))
    return args, select.choose_kernel(args)


def _warmups_by_thread(monkeypatch) -> list:
    """(thread name, compiled kernel) of every warmup from now on, in order."""
    import threading

    from epifuse.runtime import compiled as compiled_index
    seen = []
    original = compiled_index.warmup

    def spy(kernel, values, grid, meta):
        compiled = original(kernel, values, grid, meta)
        seen.append((threading.current_thread().name, compiled))
        return compiled
    monkeypatch.setattr(compiled_index, "warmup", spy)
    return seen


def test_fast_runs_the_shipped_choice_untimed(fresh, monkeypatch):
    gpu = torch.cuda.get_device_name()
    if shipped.table(gpu) is None:
        pytest.skip(f"no shipped table for {gpu} (the tables cover {sorted(p.stem for p in shipped.TABLES.glob('*.json'))})")
    monkeypatch.delenv("EPIFUSE_TUNE", raising=False)
    A, B, bias = _problem(12288, 4096, 1024)   # within an octave of S2 (16384 x 4096 x 1024) in each dimension
    timed = len(tune.HISTORY)
    D = epifuse.gemm(A, B, EPILOGUE, bias=bias)
    torch.testing.assert_close(D.double(), _expected(A, B, bias), rtol=2e-2, atol=2e-2)
    assert len(tune.HISTORY) == timed
    args, kernel = _chosen(A, B, bias, D)
    generated = [k for k in epifuse.get_kernels(args) if k.name != "reference"]
    assert repr(kernel) == repr(shipped.ranked(args, generated, gpu)[0])


def test_fast_times_a_short_list_where_no_shipped_choice_is_near(fresh, monkeypatch):
    monkeypatch.setenv("EPIFUSE_TUNE", "fast")
    A, B, bias = _problem(96, 24576, 200)
    timed = len(tune.HISTORY)
    D = epifuse.gemm(A, B, EPILOGUE, bias=bias)
    torch.testing.assert_close(D.double(), _expected(A, B, bias), rtol=2e-2, atol=2e-2)
    assert len(tune.HISTORY) == timed + 1
    record = tune.HISTORY[-1]
    assert record["policy"] == "fast" and len(record["timings_us"]) <= tune.SHORT_LIST


def test_background_serves_at_once_then_runs_full_tunings_winner(fresh, monkeypatch):
    monkeypatch.setenv("EPIFUSE_TUNE", "background")
    A, B, bias = _problem(320, 2304, 576)
    timed = len(tune.HISTORY)
    D = epifuse.gemm(A, B, EPILOGUE, bias=bias)
    epifuse.gemm(A, B, EPILOGUE, bias=bias)   # kept: the served choice launches again
    assert tune.wait_for_background(300)
    record = tune.HISTORY[-1]
    assert len(tune.HISTORY) == timed + 1 and record["policy"] == "background"
    assert len(record["timings_us"]) > 1
    hits = callsite.HITS[0]
    D2 = epifuse.gemm(A, B, EPILOGUE, bias=bias)
    assert callsite.HITS[0] == hits   # the kept launch of the served kernel was dropped
    torch.testing.assert_close(D2.double(), _expected(A, B, bias), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(D.double(), D2.double(), rtol=2e-2, atol=2e-2)
    _, kernel = _chosen(A, B, bias, D2)
    assert repr(kernel) == record["choice"]


def test_background_times_fresh_tensors_laid_out_as_the_callers(fresh, monkeypatch):
    """The worker times the kernels on tensors it makes on the caller's GPU when it reaches the
    problem: the caller's sizes, strides (a column-major B, a broadcast bias) and dtypes, random
    values, drawn without moving the caller's CUDA random stream, and freed once it is done."""
    monkeypatch.setenv("EPIFUSE_TUNE", "background")
    A, B, bias = _problem(384, 1536, 640)
    B = B.t().contiguous().t()
    bias = bias.expand(384, 1536)
    seen, alive = [], []
    timer = tune._time_all

    def spy(args, kernels, mode="full"):
        tensors = {"A": args.A, "B": args.B, "bias": args.operands["bias"], **args.outputs}
        seen.append({n: (tuple(t.shape), t.stride(), t.dtype, t.device, t.untyped_storage().data_ptr(),
                         bool(t.isfinite().all()), float(t.float().std())) for n, t in tensors.items()})
        alive.extend(weakref.ref(t) for t in tensors.values())
        return timer(args, kernels, mode)
    monkeypatch.setattr(tune, "_time_all", spy)
    rng = torch.cuda.get_rng_state()
    D = epifuse.gemm(A, B, EPILOGUE, bias=bias)
    assert tune.wait_for_background(300)
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    assert len(seen) == 1 and tune.HISTORY[-1]["policy"] == "background"
    for name, caller in {"A": A, "B": B, "bias": bias, "D": D}.items():
        shape, stride, dtype, device, address, finite, std = seen[0][name]
        assert (shape, stride, dtype, device) == (tuple(caller.shape), caller.stride(), caller.dtype, caller.device)
        assert address != caller.untyped_storage().data_ptr() and finite and std > 0.1
    gc.collect()
    assert all(ref() is None for ref in alive)


def test_the_backward_kernel_compiles_in_a_worker_while_the_forward_runs(fresh, monkeypatch):
    """A forward that needs grad queues its backward's kernel (runtime/ahead.py): a worker
    compiles it from stand-ins, and the backward then launches that very compiled kernel (the
    same object from Triton's cache, not a second compile in the caller's thread), with the
    gradients of the float64 reference."""

    from epifuse import torch_ops
    from epifuse.runtime import ahead
    monkeypatch.setenv("EPIFUSE_COMPILE_AHEAD", "1")
    scale = 1.0 + torch.rand(()).item()   # a kernel no earlier test has compiled
    # smooth, so that bf16 rounding moves the gradients by rounding only (relu's mask flips
    # where the fp32 and float64 sums of an element near zero differ in sign)
    source = f"def e(accum, bias):\n    D = gelu(accum + bias) * {scale!r}\n    return D\n"
    seen = _warmups_by_thread(monkeypatch)
    A = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    W = (torch.randn(512, 768, device="cuda", dtype=torch.bfloat16) / 512 ** 0.5).requires_grad_()
    bias = torch.randn(768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    failures = ahead.FAILED[0]
    D = torch_ops.gemm(A, W, source, bias=bias)
    assert ahead.wait_all(300)
    assert ahead.FAILED[0] == failures, list(ahead.FAILURES)[-1:]
    # the job plans in the worker (epifuse-compile-ahead) and compiles in the pool (epifuse-compile_N)
    in_worker = {id(c) for name, c in seen if name.startswith("epifuse-compile")}
    assert in_worker, "nothing was compiled ahead"
    seen.clear()
    G = torch.randn_like(D)
    D.backward(G)
    in_caller = [c for name, c in seen if not name.startswith("epifuse-compile")]
    assert in_caller and all(id(c) in in_worker for c in in_caller)
    a, w, b = (t.detach().double().requires_grad_() for t in (A, W, bias))
    (torch.nn.functional.gelu(a @ w + b) * scale).backward(G.double())
    for got, want in ((A.grad, a.grad), (W.grad, w.grad), (bias.grad, b.grad)):
        assert ((got.double() - want).norm() / want.norm()).item() < 2e-2


def test_planning_a_backward_ahead_allocates_no_gpu_memory(fresh):
    """The worker plans and compiles from stand-ins (stand_in.py): at a layer whose backward
    would need gigabytes (accum 1 GiB, its gradient, the plan's buffers), the caching
    allocator's peak does not move, and the kernel is compiled."""
    from epifuse import backward_ahead, torch_ops
    key = torch_ops._describe(EPILOGUE, True)[0]
    device = torch.device("cuda", torch.cuda.current_device())
    M, N, K = 32768, 16384, 8192   # accum has 2^29 elements: under the 32-bit span the Triton kernels take
    layouts = [((M, K), (K, 1), 0, torch.bfloat16, device), ((K, N), (1, K), 0, torch.bfloat16, device),
               ((N,), (1,), 0, torch.bfloat16, device)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    compiled = backward_ahead.backward_from_stand_ins(key, layouts, [], "t", "", (torch.float32, False, "default"),
                                                      (True, True, (True,)))
    torch.cuda.synchronize()
    from epifuse.backends.triton.kernels import TritonKernel
    assert compiled and all(args.stand_in for args, _ in compiled)
    assert any(isinstance(kernel, TritonKernel) for _, kernel in compiled), compiled
    assert torch.cuda.max_memory_allocated() == before


def test_tuning_compiles_its_candidates_in_threads_before_timing_them(fresh, monkeypatch):
    """Full tuning of an epilogue no earlier test compiled: the candidates are compiled in the
    pool's threads (runtime/ahead.py) before any is timed, Triton's set-up done first
    (compiled.set_up), and the timings and the call then run those very compiled kernels
    (none compiled in the caller's thread); the result matches float64."""

    monkeypatch.setenv("EPIFUSE_TUNE", "full")
    scale = 1.0 + torch.rand(()).item()
    source = f"def e(accum, bias):\n    D = gelu(accum + bias) * {scale!r}\n    return D\n"
    seen = _warmups_by_thread(monkeypatch)
    A, B, bias = _problem(1024, 768, 512)
    D = epifuse.gemm(A, B, source, bias=bias)
    in_pool = {id(c) for name, c in seen if name.startswith("epifuse-compile")}
    by_caller = {id(c) for name, c in seen if not name.startswith("epifuse-compile")}
    assert len(in_pool) >= 2, seen
    assert not by_caller - in_pool, seen
    expected = torch.nn.functional.gelu(A.double() @ B.double() + bias.double()) * scale
    assert ((D.double() - expected).norm() / expected.norm()).item() < 1e-2


def test_a_staged_epilogues_later_passes_compile_in_a_worker_while_its_first_runs(fresh, monkeypatch):
    """A row softmax over N wider than one tile runs as two passes (staging.py); its first call
    queues the second pass's kernel (staged_ahead.py): a worker compiles it from stand-ins
    while the caller compiles and runs the first pass, and the second pass then launches that
    very compiled kernel, with the float64 reference's values."""
    from epifuse.runtime import ahead
    monkeypatch.setenv("EPIFUSE_COMPILE_AHEAD", "1")
    monkeypatch.setenv("EPIFUSE_TUNE", "0")   # each pass compiles the kernel it runs, and nothing else
    scale = 0.5 + torch.rand(()).item()   # a kernel no earlier test has compiled
    source = f"def e(accum):\n    z = accum * {scale!r}\n    D = exp(z - logsumexp(z, dim=1))\n    return D\n"
    seen = _warmups_by_thread(monkeypatch)
    A = torch.randn(512, 256, device="cuda", dtype=torch.float16)
    B = torch.randn(256, 1536, device="cuda", dtype=torch.float16) / 16
    failures = ahead.FAILED[0]
    D = epifuse.gemm(A, B, source)
    assert ahead.wait_all(300)
    assert ahead.FAILED[0] == failures, list(ahead.FAILURES)[-1:]
    in_worker = {id(c) for name, c in seen if name.startswith("epifuse-compile")}
    in_caller = [c for name, c in seen if not name.startswith("epifuse-compile")]
    assert in_worker, "nothing was compiled ahead"
    assert len(in_caller) == 2 and id(in_caller[0]) not in in_worker and id(in_caller[1]) in in_worker, \
        (len(in_caller), len(in_worker))
    expected = torch.softmax((A.double() @ B.double()) * scale, dim=1)
    assert ((D.double() - expected).norm() / expected.norm()).item() < 1e-2
