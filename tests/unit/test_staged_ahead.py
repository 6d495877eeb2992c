"""A staged epilogue's later passes compiled while its first pass runs (staged_ahead.py): the
arguments planned ahead from stand-ins are exactly those of the passes' own epifuse.gemm calls
(else the compile ahead is wasted), a call queues the job once per layout and waits for it
before its second pass, and a job that fails changes nothing the call returns. On the CPU
nothing is compiled (Triton's interpreter or the reference); the plans, checks and choices are."""
import threading

import pytest
import torch

import epifuse
from epifuse import api, staged_ahead, staging
from epifuse.arguments import epilogue_program
from epifuse.runtime import ahead
from epifuse.stand_in import layout

# a statistic over every element (staged at any N), a row softmax over N wider than one tile,
# a variance (three passes), each with an operand, a number or an output the caller passes
CASES = {
    "scaled_by_peak": ("def e(accum, bias, alpha):\n    z = accum + bias\n    D = alpha * z / amax(abs(z))\n"
                       "    return D\n", (8, 12, 16), {"bias": (16,), "alpha": 0.5}),
    "wide_softmax": ("def e(accum, scale):\n    z = accum * scale\n    D = exp(z - logsumexp(z, dim=1))\n"
                     "    return D\n", (4, 8, 300), {"scale": 0.25}),
    "normalized_rows": ("def e(accum):\n    m = mean(accum, dim=1)\n    c = accum - m\n"
                        "    v = mean(c * c, dim=1)\n    D = c / sqrt(v + 1.0)\n    return D, m\n",
                        (6, 10, 290), {"m": "output"}),
}


def _problem(case, dtype=torch.float32):
    source, (M, K, N), operands = CASES[case]
    A, B = torch.randn(M, K, dtype=dtype), torch.randn(K, N, dtype=dtype)
    tensors = {}
    for name, spec in operands.items():
        if spec == "output":
            tensors[name] = torch.empty(M, dtype=torch.float32)
        elif isinstance(spec, tuple):
            tensors[name] = torch.randn(*spec, dtype=dtype)
        else:
            tensors[name] = spec
    return source, A, B, tensors


OPTIONS = dict(out_dtype=None, deterministic=False, compute_dtype=None, precision="default")   # gemm's defaults


def _queue(source, A, B, tensors, options=OPTIONS, passes=None):
    """staged_ahead.queue as _gemm_in_passes calls it (`passes`: the first that many passes only)."""
    program = epilogue_program(source)
    steps = staging.passes(program)[:passes]
    return staged_ahead.queue(program, steps, A, B, tensors, options, api.epilogue_accum_shape(program, A, B))


class _Kernel:
    """Stands for a kernel to compile: its job records the arguments it was planned for."""

    def __init__(self, compiled: list):
        self.compiled = compiled

    def compile_job(self, args):
        return lambda: self.compiled.append(args.signature)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_passes_planned_ahead_are_the_passes_the_call_makes(case, monkeypatch):
    source, A, B, tensors = _problem(case)
    made = []
    original = api.choose_kernel

    def spy(args, *rest, **kw):
        made.append(args.signature)
        return original(args, *rest, **kw)
    monkeypatch.setattr(api, "choose_kernel", spy)
    program = epilogue_program(source)
    steps = staging.passes(program)
    assert len(steps) >= 2, "not a staged epilogue"
    epifuse.gemm(A, B, source, **tensors)
    assert len(made) == len(steps)
    layouts = {n: layout(t) for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    numbers = {n: v for n, v in tensors.items() if n not in layouts}
    monkeypatch.setattr(staged_ahead, "kernels_to_compile", lambda args: [_Kernel([])])
    planned = staged_ahead.plan_later_passes(steps, layout(A), layout(B), layouts, numbers,
                                             OPTIONS, api.epilogue_accum_shape(program, A, B))
    assert [args.signature for args, _, _ in planned] == made[1:]
    assert all(args.stand_in for args, _, _ in planned)   # nothing allocated for the plan


def _as_on_a_gpu(monkeypatch):
    """Compile ahead as on a GPU; each job's compiles recorded instead of run."""
    monkeypatch.setattr(ahead, "compiles_on", lambda device: True)
    compiled = []
    monkeypatch.setattr(staged_ahead, "kernels_to_compile", lambda args: [_Kernel(compiled)])
    return compiled


def test_a_call_queues_its_later_passes_once_and_waits_for_them_before_its_second_pass(monkeypatch):
    compiled = _as_on_a_gpu(monkeypatch)
    source, A, B, tensors = _problem("normalized_rows")
    events = []
    queue, settle, gemm, job = staged_ahead.queue, staged_ahead.settle, api.gemm, staged_ahead.compile_later_passes
    started = threading.Event()
    monkeypatch.setattr(staged_ahead, "compile_later_passes", lambda *a: started.set() or job(*a))
    monkeypatch.setattr(staged_ahead, "queue", lambda *a: events.append("queue") or queue(*a))

    def settle_once_started(key):   # a worker has the job (else settle would take it off the queue)
        events.append(("settle", key is not None, started.wait(10)))
        settle(key)
        events.append(("settled", len(compiled)))
    monkeypatch.setattr(staged_ahead, "settle", settle_once_started)

    def each_pass(*args, **kw):
        events.append("pass")
        return gemm(*args, **kw)
    monkeypatch.setattr(api, "gemm", each_pass)
    D, m = gemm(A, B, source, **tensors)
    # both later passes compiled before the second pass ran
    assert events == ["queue", "pass", ("settle", True, True), ("settled", 2), "pass", "pass"]
    expected_m = (A.double() @ B.double()).mean(1)
    assert torch.allclose(m.double(), expected_m, atol=1e-4)
    compiled.clear()
    before = len(ahead._SEEN)
    gemm(A, B, source, **tensors)   # the same layout: nothing queued again
    assert ahead.wait_all(10) and compiled == [] and len(ahead._SEEN) == before


def test_a_nan_number_queues_once_and_a_negative_zero_apart(monkeypatch):
    """Numbers key the job by their bits: a NaN (unequal to itself) is one key, not one per
    call; -0.0 and 0.0 are two."""
    _as_on_a_gpu(monkeypatch)
    source, A, B, tensors = _problem("scaled_by_peak")
    keys = [_queue(source, A, B, dict(tensors, alpha=value)) for value in (float("nan"), float("nan"), 0.0, -0.0)]
    assert keys[0] == keys[1] and keys[2] != keys[3] and None not in keys
    assert _queue(source, A, B, tensors, dict(OPTIONS, precision=["x"])) is None


def test_nothing_is_queued_where_autograd_records_the_passes(monkeypatch):
    """A call that needs grad runs each pass through the custom ops, whose kernels differ (they
    also store accum): nothing is planned for it here."""
    _as_on_a_gpu(monkeypatch)
    source, A, B, tensors = _problem("wide_softmax")
    assert _queue(source, A.requires_grad_(), B, tensors) is None
    with torch.no_grad():
        assert _queue(source, A, B, tensors) is not None


def test_a_failing_job_changes_nothing_the_call_returns(monkeypatch):
    monkeypatch.setattr(ahead, "compiles_on", lambda device: True)
    ran = threading.Event()

    class Failing:
        def compile_job(self, args):
            def job():
                ran.set()
                raise RuntimeError("this compile fails")
            return job

        def __repr__(self):
            return "<failing kernel>"
    monkeypatch.setattr(staged_ahead, "kernels_to_compile", lambda args: [Failing()])
    source, A, B, tensors = _problem("scaled_by_peak", torch.float64)
    source = source.replace("alpha * z", "alpha * z * 1.0")   # a program of its own: a key of its own
    settle = staged_ahead.settle

    def settle_once_started(key):   # a worker has the job (else settle would take it off the queue)
        assert key is not None and ran.wait(10)
        settle(key)
    monkeypatch.setattr(staged_ahead, "settle", settle_once_started)
    failed = ahead.FAILED[0]
    D = epifuse.gemm(A, B, source, **tensors)
    z = A @ B + tensors["bias"]
    assert torch.allclose(D, 0.5 * z / z.abs().max())
    assert ahead.wait_all(10)
    assert ahead.FAILED[0] == failed + 1 and "this compile fails" in str(ahead.FAILURES[-1][1])


def test_nothing_is_queued_on_the_cpu_or_for_one_pass(monkeypatch):
    source, A, B, tensors = _problem("wide_softmax")
    assert _queue(source, A, B, tensors) is None   # the CPU compiles nothing
    monkeypatch.setattr(ahead, "compiles_on", lambda device: True)
    assert _queue(source, A, B, tensors, passes=1) is None
    assert _queue(source, A, B, tensors) is not None
