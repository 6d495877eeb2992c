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
