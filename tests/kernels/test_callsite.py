"""Repeated epifuse.gemm calls reuse the first call's launch (epifuse.callsite): each later call
must still compute with its own tensors and numbers, allocate fresh outputs, and leave every
case the kept launch cannot take (aliasing, reductions, empty tensors) to the full path."""
import contextlib
import functools
import types

import pytest
import torch

import epifuse
from epifuse.runtime import callsite
from helpers import integer_tensor

SRC = "def epi(accum, bias, alpha):\n    D = relu(accum * alpha + bias)\n    F = accum - bias\n    return D, F\n"


def _expected(A, B, bias, alpha):
    accum = A.double() @ B.double()
    return torch.relu(accum * alpha + bias.double()), accum - bias.double()


@pytest.fixture(autouse=True)
def _fresh_sites():
    callsite.clear()
    yield
    callsite.clear()


def test_later_calls_use_their_own_tensors_and_fresh_outputs(device):
    B = integer_tensor(24, 36, dtype=torch.float16, device=device)
    hits, previous, first = callsite.HITS[0], None, None
    for step in range(4):
        A = integer_tensor(40, 24, dtype=torch.float16, device=device)
        bias = integer_tensor(36, dtype=torch.float32, device=device)
        D, F = epifuse.gemm(A, B, SRC, bias=bias, alpha=2.0)
        expected_D, expected_F = _expected(A, B, bias, 2.0)
        assert torch.equal(D.double(), expected_D) and torch.equal(F.double(), expected_F), step
        assert D is not previous
        layout = [(t.shape, t.stride(), t.dtype, t.device, t.storage_offset()) for t in (D, F)]
        assert layout == (first or layout), step   # a kept launch allocates what the first call did
        previous, first = D, first or layout
    assert callsite.HITS[0] - hits == 3


def test_a_new_number_is_a_new_signature(device):
    A = integer_tensor(33, 20, dtype=torch.float16, device=device)
    B = integer_tensor(20, 17, dtype=torch.float16, device=device)
    bias = integer_tensor(17, dtype=torch.float32, device=device)
    for alpha in (2.0, 3.0, 2.0, -1.0):
        D, F = epifuse.gemm(A, B, SRC, bias=bias, alpha=alpha)
        assert torch.equal(D.double(), _expected(A, B, bias, alpha)[0]), alpha


def test_given_outputs_are_the_ones_written(device):
    A = integer_tensor(40, 24, dtype=torch.float16, device=device)
    B = integer_tensor(24, 36, dtype=torch.float16, device=device)
    bias = integer_tensor(36, dtype=torch.float32, device=device)
    for _ in range(3):
        D = torch.full((40, 36), float("nan"), device=device)
        F = torch.full((40, 36), float("nan"), device=device)
        out = epifuse.gemm(A, B, SRC, bias=bias, alpha=2.0, D=D, F=F)
        assert out[0] is D and out[1] is F
        assert torch.equal(D.double(), _expected(A, B, bias, 2.0)[0])


def test_layouts_are_separate_signatures(device):
    B = integer_tensor(24, 36, dtype=torch.float16, device=device)
    bias = integer_tensor(36, dtype=torch.float32, device=device)
    for A in (integer_tensor(40, 24, dtype=torch.float16, device=device),
              integer_tensor(24, 40, dtype=torch.float16, device=device).t(),
              integer_tensor(40, 24, dtype=torch.float16, device=device)):
        D, _ = epifuse.gemm(A, B, SRC, bias=bias, alpha=1.5)
        assert torch.equal(D.double(), _expected(A, B, bias, 1.5)[0])


def test_in_place_update_takes_the_full_path(device):
    src = "def epi(accum, C):\n    D = accum + C\n    return D\n"
    A = integer_tensor(32, 16, dtype=torch.float32, device=device)
    B = integer_tensor(16, 24, dtype=torch.float32, device=device)
    C = integer_tensor(32, 24, dtype=torch.float32, device=device)
    expected = C.double().clone()
    hits = callsite.HITS[0]
    for _ in range(3):
        epifuse.gemm(A, B, src, C=C, D=C)   # D aliases C: declared in place
        expected += A.double() @ B.double()
        assert torch.equal(C.double(), expected)
    assert callsite.HITS[0] == hits


@pytest.mark.parametrize("deterministic", [False, True])
def test_reductions_are_kept_and_start_over_every_call(deterministic, device):
    """A kept launch with reductions initializes them and writes them out on every call: an
    fp32 sum (atomic into the output itself), a sum into fp16 (a work buffer), a max (partials
    folded after the launch), an amax (an integer atomic max), beside a tile output; each call
    with new inputs."""
    src = ("def epi(accum, bias):\n    D = accum + bias\n    r = sum(D, dim=1)\n    h = sum(D, dim=0)\n"
           "    m = max(D)\n    a = amax(D)\n    return D, r, h, m, a\n")
    B = integer_tensor(16, 24, dtype=torch.float16, device=device)
    hits = callsite.HITS[0]
    for _ in range(3):
        A = integer_tensor(40, 16, dtype=torch.float16, device=device)
        bias = integer_tensor(24, dtype=torch.float32, device=device)
        h = torch.full((24,), float("nan"), device=device, dtype=torch.float16)
        D, r, h_out, m, a = epifuse.gemm(A, B, src, bias=bias, h=h, out_dtype=torch.float32,
                                      deterministic=deterministic)
        expected = A.double() @ B.double() + bias.double()
        assert torch.equal(D.double(), expected)
        assert torch.equal(r.double(), expected.sum(1))
        assert h_out is h and torch.equal(h.double(), expected.sum(0).half().double())
        assert m.shape == a.shape == ()   # 0-d, as torch's amax over every dim
        assert torch.equal(m.double(), expected.amax())
        assert torch.equal(a.double(), expected.abs().amax())
    assert callsite.HITS[0] - hits == 2


def test_kept_reductions_fold_into_their_destination_when_accumulating(device):
    src = "def epi(accum):\n    r = sum(accum, dim=1)\n    top = max(accum, dim=0)\n    return r, top\n"
    B = integer_tensor(16, 24, dtype=torch.float16, device=device)
    r = integer_tensor(32, dtype=torch.float32, device=device)
    top = integer_tensor(24, dtype=torch.float32, device=device)
    expected_r, expected_top = r.double().clone(), top.double().clone()
    hits = callsite.HITS[0]
    for _ in range(3):
        A = integer_tensor(32, 16, dtype=torch.float16, device=device)
        epifuse.gemm(A, B, src, r=r, top=top, accumulate=True)
        accum = A.double() @ B.double()
        expected_r += accum.sum(1)
        expected_top = torch.maximum(expected_top, accum.amax(0))
        assert torch.equal(r.double(), expected_r) and torch.equal(top.double(), expected_top)
    assert callsite.HITS[0] - hits == 2


def test_a_kept_inference_launch_does_not_serve_calls_that_need_autograd(device):
    """A weight that requires grad, used under no_grad, keeps its launch; the same call with
    grad enabled must still go through the custom ops and come back with a grad_fn."""
    A = integer_tensor(40, 24, dtype=torch.float32, device=device)
    weight = torch.nn.Parameter(integer_tensor(24, 36, dtype=torch.float32, device=device))
    bias = integer_tensor(36, dtype=torch.float32, device=device)
    hits = callsite.HITS[0]
    with torch.no_grad():
        for _ in range(2):
            D, F = epifuse.gemm(A, weight, SRC, bias=bias, alpha=2.0)
            assert D.grad_fn is None
    assert callsite.HITS[0] - hits == 1
    D, F = epifuse.gemm(A, weight, SRC, bias=bias, alpha=2.0)
    assert D.grad_fn is not None and callsite.HITS[0] - hits == 1
    (D.sum() + F.sum()).backward()
    accum = A.double() @ weight.detach().double()
    expected = A.double().t() @ ((accum * 2.0 + bias.double() > 0).double() * 2.0 + 1.0)
    assert torch.allclose(weight.grad.double(), expected)


def test_signature_refuses_what_it_cannot_key():
    A, B = torch.ones(4, 3), torch.ones(3, 5)
    opts = (None, False, False, torch.float32, "default")
    assert callsite.signature("src", A, B, {"alpha": 2.0}, opts) is not None
    assert callsite.signature("src", A, B, {"alpha": True}, opts) is None          # a bool
    assert callsite.signature("src", A, B, {"alpha": [1.0]}, opts) is None         # not a number
    assert callsite.signature("src", [[1.0]], B, {}, opts) is None                 # not a tensor
    assert callsite.signature("src", A, B.as_subclass(_Subclass), {}, opts) is None   # a subclass
    assert callsite.signature({}, A, B, {}, opts) is None                          # unhashable


class _Subclass(torch.Tensor):
    pass


def _kept_for(call):
    """A site filed for `call` as remember files one, to ask which later calls it serves."""
    site = callsite.Site([], (), None, (), (), torch.device("cpu"))
    callsite._file(call, site)
    return site


@pytest.fixture(params=["torch", "python"])
def guard(request, monkeypatch):
    """Each site's guard: torch's C++ check of tensor metadata, and the Python one used where
    this torch lacks it."""
    if request.param == "torch":
        if callsite._tensor_guard_type() is None:
            pytest.skip("this torch has no C++ tensor guard as callsite calls it")
        monkeypatch.setattr(callsite, "_GUARD_TYPE", [callsite._tensor_guard_type()])
    else:
        monkeypatch.setattr(callsite, "_GUARD_TYPE", [callsite.PythonGuard])
    return request.param


def test_a_kept_site_serves_only_calls_of_its_signature(guard):
    """A site serves a later call only if it is the first call's signature: the same numbers,
    names, and each tensor's type, sizes, strides, dtype, address modulo 16 and grad state, no
    storage shared, each storage holding its view, no sign bit."""
    opts = (None, False, False, torch.float32, "default")

    def sig(A, B, **tensors):
        return callsite.signature("src", A, B, tensors, opts)

    def fresh(*shape, dtype=torch.float32):
        return torch.randn(*shape, dtype=dtype)
    A, B, C = fresh(4, 3), fresh(3, 5), fresh(4, 5)
    site = _kept_for(sig(A, B, C=C, alpha=2.0))
    assert callsite.lookup(sig(fresh(4, 3), fresh(3, 5), C=fresh(4, 5), alpha=2.0)) is site
    assert callsite.lookup(sig(A, B, C=C, alpha=3.0)) is None                     # another number
    assert callsite.lookup(sig(A, B, D=C, alpha=2.0)) is None                     # another name
    assert callsite.lookup(sig(fresh(5, 3), B, C=C, alpha=2.0)) is None           # another size
    assert callsite.lookup(sig(fresh(3, 4).t(), B, C=C, alpha=2.0)) is None       # other strides
    assert callsite.lookup(sig(fresh(4, 3, dtype=torch.float64), B, C=C, alpha=2.0)) is None
    assert callsite.lookup(sig(A, B, C=C._neg_view(), alpha=2.0)) is None         # a sign bit
    assert callsite.lookup(sig(A, B, C=torch.nn.Parameter(C), alpha=2.0)) is None   # another type
    shared = fresh(32)   # A's 12 elements, then C's 20 (48 bytes on: aligned as the first C)
    assert callsite.lookup(sig(A, B, C=shared[12:].view(4, 5), alpha=2.0)) is site
    assert callsite.lookup(sig(shared[:12].view(4, 3), B, C=shared[12:].view(4, 5), alpha=2.0)) is None
    freed = fresh(4, 5)
    freed.untyped_storage().resize_(0)
    assert callsite.lookup(sig(A, B, C=freed, alpha=2.0)) is None                 # freed storage
    shrunk = fresh(4, 5)
    shrunk.untyped_storage().resize_(40)
    assert callsite.lookup(sig(A, B, C=shrunk, alpha=2.0)) is None                # shrunk storage

    base = fresh(64)   # 4 bytes apart: misaligned by different amounts, which a view the launch
    kept = _kept_for(sig(A, B, C=base[1:21].view(4, 5)))   # takes (a gated B's half) may tell apart
    assert callsite.lookup(sig(A, B, C=fresh(64)[1:21].view(4, 5))) is kept
    assert callsite.lookup(sig(A, B, C=fresh(64)[2:22].view(4, 5))) is None
    assert callsite.lookup(sig(A, B, C=fresh(64)[:20].view(4, 5))) is None

    accum = fresh(4, 5)   # K = 0 factors: empty views sharing the operand's storage
    empty = _kept_for(sig(accum[:, :0], accum[:0, :], C=accum))
    other = fresh(4, 5)
    assert callsite.lookup(sig(other[:, :0], other[:0, :], C=other)) is empty


def test_a_site_for_tensors_that_require_grad_serves_only_calls_without_grad(guard):
    A, B = torch.randn(4, 3), torch.nn.Parameter(torch.randn(3, 5))
    opts = (None, False, False, torch.float32, "default")
    call = callsite.signature("src", A, B, {}, opts)
    assert not callsite._keepable(call.tensors)    # with grad: autograd's custom ops record it
    with torch.no_grad():
        call = callsite.signature("src", A, B, {}, opts)
        assert callsite._keepable(call.tensors)
        site = _kept_for(call)
        assert callsite.lookup(callsite.signature("src", A, B, {}, opts)) is site
    assert callsite.lookup(callsite.signature("src", A, B, {}, opts)) is None
    assert callsite.lookup(callsite.signature("src", A, B.detach(), {}, opts)) is None


def test_sites_of_one_head_are_bounded(monkeypatch):
    """Calls that differ only in their tensors' layouts (a batch size that varies) keep up to
    SITES_PER_HEAD sites under one head, the latest first."""
    monkeypatch.setattr(callsite, "SITES_PER_HEAD", 3)
    opts = (None, False, False, torch.float32, "default")
    calls = [callsite.signature("src", torch.randn(m, 3), torch.randn(3, 5), {}, opts) for m in range(1, 6)]
    sites = [_kept_for(call) for call in calls]
    assert len(callsite._SITES) == 1 and callsite.sites() == sites[2:]
    assert [callsite.lookup(call) for call in calls] == [None, None, *sites[2:]]


def test_sites_are_bounded(monkeypatch, device):
    monkeypatch.setattr(callsite, "MAX_SITES", 2)
    A = integer_tensor(16, 8, dtype=torch.float32, device=device)
    B = integer_tensor(8, 16, dtype=torch.float32, device=device)
    bias = integer_tensor(16, dtype=torch.float32, device=device)
    for alpha in (1.0, 2.0, 3.0, 4.0):
        epifuse.gemm(A, B, SRC, bias=bias, alpha=alpha)
    assert len(callsite._SITES) <= 2


def test_split_k_launches_are_kept_with_their_workspace(device, monkeypatch):
    """A kept split-K launch reuses its workspace and counters; every call must still be exact
    (the counters reset themselves), with new inputs each time."""
    from epifuse import api
    from epifuse.backends.triton.configs import TileConfig
    from epifuse.backends.triton.families import SPLIT_K
    from epifuse.backends.triton.kernels import TritonKernel
    config = TileConfig(16, 16, 16, 2, 1, 1, split_k=3) if device == "cpu" else None
    chosen = {}

    def choose_split_k(args):
        kernels = [k for k in api.get_kernels(args) if k.name == "triton_splitk"]
        if config is not None:
            kernels = [TritonKernel(SPLIT_K, config)]
        return chosen.setdefault("k", kernels[0])
    monkeypatch.setattr(api, "choose_kernel", choose_split_k)
    K = 160 if device == "cpu" else 1024
    B = integer_tensor(K, 40, dtype=torch.float16, device=device)
    bias = integer_tensor(40, dtype=torch.float32, device=device)
    hits = callsite.HITS[0]
    for _ in range(3):
        A = integer_tensor(24, K, dtype=torch.float16, device=device)
        D, F = epifuse.gemm(A, B, SRC, bias=bias, alpha=2.0)
        expected_D, expected_F = _expected(A, B, bias, 2.0)
        assert torch.equal(D.double(), expected_D) and torch.equal(F.double(), expected_F)
    assert callsite.HITS[0] - hits == 2


def test_a_layout_the_chosen_kernel_cannot_take_chooses_again(device):
    """The kernel chosen for a problem is remembered with the operands' layout class: the same
    shapes with A contiguous along M (which the TMA kernels refuse) choose again instead of
    reusing the persistent kernel."""
    B = integer_tensor(64, 48, dtype=torch.float16, device=device)
    bias = integer_tensor(48, dtype=torch.float32, device=device)
    for A in (integer_tensor(40, 64, dtype=torch.float16, device=device),
              integer_tensor(64, 40, dtype=torch.float16, device=device).t()):
        D, F = epifuse.gemm(A, B, SRC, bias=bias, alpha=2.0)
        expected_D, expected_F = _expected(A, B, bias, 2.0)
        assert torch.equal(D.double(), expected_D) and torch.equal(F.double(), expected_F)


# ---- calls at once, redefined epilogues, tensors the checks refuse --------------------------------

THREADED = ("def epi(accum, bias):\n    D = accum + bias\n    r = sum(D, dim=1)\n    m = max(D, dim=0)\n"
            "    return D, r, m\n")


def threaded_calls(device, threads: int, calls: int, stream_of=lambda worker: None, M=40, N=24, K=16) -> list:
    """`threads` workers each make `calls` epifuse.gemm calls of one signature (an fp16 sum,
    which folds through an fp32 work buffer, and a max, through per-program partials), with
    inputs of their own, all started at once, worker i on stream_of(i) (None: the current
    stream); (worker, call, output) of every result that is not exact. tests/gpu runs it too."""
    import threading
    B = integer_tensor(K, N, low=-1, high=2, dtype=torch.float16, device=device)
    start, errors = threading.Barrier(threads), []

    def worker(index):
        stream = stream_of(index)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            start.wait()
            for call in range(calls):
                A = integer_tensor(M, K, dtype=torch.float16, device=device)
                bias = integer_tensor(N, dtype=torch.float32, device=device)
                r = torch.full((M,), float("nan"), dtype=torch.float16, device=device)
                D, r, m = epifuse.gemm(A, B, THREADED, bias=bias, r=r, out_dtype=torch.float32)
                if stream is not None:
                    stream.synchronize()
                expected = A.double() @ B.double() + bias.double()
                for name, got, want in (("D", D, expected), ("r", r, expected.sum(1).half()),
                                        ("m", m, expected.amax(0))):
                    if not torch.equal(got.double(), want.double()):
                        errors.append((index, call, name))
    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return errors


@pytest.mark.slow   # threads through the interpreter (about 4.5 s)
def test_threads_sharing_a_kept_launch_get_their_own_reductions(device, monkeypatch):
    """Eight threads calling with one signature at once, a reduction among the outputs: each
    call folds its own reductions (a kept launch's work buffers were shared by its calls, so one
    call zeroed them while another's kernel still added into them), every result exact."""
    import threading
    served, lock, call = [0], threading.Lock(), callsite.Site.call

    def counted(site, *args):
        with lock:
            served[0] += 1
        return call(site, *args)
    monkeypatch.setattr(callsite.Site, "call", counted)
    epifuse.gemm(integer_tensor(40, 16, dtype=torch.float16, device=device),
                 integer_tensor(16, 24, dtype=torch.float16, device=device), THREADED,
                 bias=integer_tensor(24, dtype=torch.float32, device=device),
                 r=torch.empty(40, dtype=torch.float16, device=device),
                 out_dtype=torch.float32)  # the site every thread's call is served from
    assert threaded_calls(device, threads=8, calls=3) == []
    assert served[0] == 24


def _times_two(accum, bias):
    D = accum * 2.0 + bias
    return D


def _plus_three(accum, bias):
    D = accum + 3.0 - bias
    return D


def _decorated(fn):
    @functools.wraps(fn)
    def wrapper(*args):
        return fn(*args)
    return wrapper


@_decorated
def _wrapped_times_two(accum, bias):
    D = accum * 2.0 + bias
    return D


@_decorated
def _wrapped_plus_three(accum, bias):
    D = accum + 3.0 - bias
    return D


def test_a_redefined_function_is_a_new_epilogue(device):
    """Replacing a function's __code__ (IPython's autoreload, a notebook cell run again) changes
    the epilogue: the call after it computes the new one, not the kept launch of the old."""
    epi = types.FunctionType(_times_two.__code__, globals(), "epi")
    B = integer_tensor(24, 36, dtype=torch.float16, device=device)
    bias = integer_tensor(36, dtype=torch.float32, device=device)
    for step, (code, expected) in enumerate([(None, lambda acc: acc * 2 + bias.double()),
                                             (None, lambda acc: acc * 2 + bias.double()),
                                             (_plus_three.__code__, lambda acc: acc + 3 - bias.double()),
                                             (None, lambda acc: acc + 3 - bias.double()),
                                             (_times_two.__code__, lambda acc: acc * 2 + bias.double())]):
        if code is not None:
            epi.__code__ = code
        A = integer_tensor(40, 24, dtype=torch.float16, device=device)
        D = epifuse.gemm(A, B, epi, bias=bias, out_dtype=torch.float32)
        assert torch.equal(D.double(), expected(A.double() @ B.double())), step


def test_functions_a_decorator_wrapped_are_told_apart(device):
    """Two functions wrapped by one decorator share the wrapper's code: each is still its own
    epilogue, read from the function it wraps (functools.wraps' __wrapped__)."""
    B = integer_tensor(24, 36, dtype=torch.float16, device=device)
    bias = integer_tensor(36, dtype=torch.float32, device=device)
    for _ in range(2):
        for epi, expected in ((_wrapped_times_two, lambda acc: acc * 2 + bias.double()),
                              (_wrapped_plus_three, lambda acc: acc + 3 - bias.double())):
            A = integer_tensor(40, 24, dtype=torch.float16, device=device)
            D = epifuse.gemm(A, B, epi, bias=bias, out_dtype=torch.float32)
            assert torch.equal(D.double(), expected(A.double() @ B.double())), epi.__name__


def _negative(t):
    return torch._neg_view(t)


def _freed(t):
    t.untyped_storage().resize_(0)
    return t


def _shrunk(t):
    t.untyped_storage().resize_(t.untyped_storage().nbytes() // 2)
    return t


@pytest.mark.parametrize("place", ["A", "B", "bias", "D"])
@pytest.mark.parametrize("change, phrase", [(_negative, "has torch's negative bit set"),
                                            (_freed, "storage holds 0 bytes"),
                                            (_shrunk, "storage holds")],
                         ids=["negative-bit", "freed-storage", "shrunk-storage"])
def test_a_kept_launch_does_not_take_tensors_the_checks_refuse(place, change, phrase, device):
    """A call of a kept signature whose tensor has the same sizes, strides and dtype but a sign
    bit or a storage that no longer holds it takes the full path, which refuses it: nothing
    is read as if it held data, nothing written."""
    src = "def epi(accum, bias):\n    D = accum * 2.0 + bias\n    return D\n"

    def tensors():
        return {"A": integer_tensor(40, 24, dtype=torch.float32, device=device),
                "B": integer_tensor(24, 36, dtype=torch.float32, device=device),
                "bias": integer_tensor(36, dtype=torch.float32, device=device),
                "D": torch.full((40, 36), float("nan"), device=device)}
    for _ in range(2):
        t = tensors()
        epifuse.gemm(t.pop("A"), t.pop("B"), src, **t)
    hits = callsite.HITS[0]
    t = tensors()
    t[place] = change(t[place])
    with pytest.raises(epifuse.errors.ShapeError, match=phrase):
        epifuse.gemm(t.pop("A"), t.pop("B"), src, **t)
    assert callsite.HITS[0] == hits


def test_a_number_that_differs_only_in_its_sign_is_another_signature():
    """-0.0 == 0.0 in Python, but 1 / s tells them apart: a launch kept for s = 0.0 must not
    serve s = -0.0."""
    A, B = integer_tensor(8, 8, dtype=torch.float32), integer_tensor(8, 8, dtype=torch.float32)
    src = "def epi(accum, s):\n    D = accum + 1.0 / s\n    return D\n"
    for _ in range(2):
        assert bool((epifuse.gemm(A, B, src, s=0.0) == float("inf")).all())
        assert bool((epifuse.gemm(A, B, src, s=-0.0) == float("-inf")).all())


def test_training_steps_keep_the_ops_launches_and_stay_exact(device):
    """The custom ops (the path of inputs that require grad: FusedLinear, torch.compile) keep
    their launches too: from the second step on, the forward GEMM and the backward's epilogue
    pass (a K = 0 GEMM over the saved accum, with the bias gradient as a column sum) take kept
    launches, each step with new inputs and gradients exact against float64."""
    src = "def epi(accum, bias):\n    D = relu(accum + bias) * 2.0\n    return D\n"
    weight = torch.nn.Parameter(integer_tensor(24, 40, low=-2, high=3, dtype=torch.float32, device=device))
    bias = torch.nn.Parameter(integer_tensor(40, dtype=torch.float32, device=device))
    for step in range(3):
        A = integer_tensor(48, 24, low=-2, high=3, dtype=torch.float32, device=device)
        seed = integer_tensor(48, 40, low=-2, high=3, dtype=torch.float32, device=device)
        weight.grad = bias.grad = None
        hits = callsite.HITS[0]
        D = epifuse.gemm(A, weight, src, bias=bias, precision="highest")
        (D * seed).sum().backward()
        assert callsite.HITS[0] - hits == (0 if step == 0 else 2), step
        accum = A.double() @ weight.detach().double() + bias.detach().double()
        assert torch.equal(D.double(), torch.relu(accum) * 2.0)
        d_accum = (accum > 0).double() * 2.0 * seed.double()
        assert torch.equal(bias.grad.double(), d_accum.sum(0))
        assert torch.equal(weight.grad.double(), A.double().t() @ d_accum)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_a_kept_launch_does_not_keep_any_calls_tensors_alive(grad, device):
    """A site keeps the launch, not the first call's tensors: once a call's inputs and outputs
    (and, training, its autograd graph and the backward's tensors) are dropped, they are freed,
    the first call's too (reductions included, whose steps read only the options)."""
    import gc
    import weakref
    src = "def epi(accum, bias):\n    D = relu(accum + bias)\n    s = sum(D, dim=0)\n    return D, s\n"
    W = integer_tensor(24, 40, low=-2, high=3, dtype=torch.float32, device=device).requires_grad_(grad)
    bias = integer_tensor(40, dtype=torch.float32, device=device).requires_grad_(grad)
    refs = []
    for _ in range(3):
        A = integer_tensor(48, 24, low=-2, high=3, dtype=torch.float32, device=device)
        D, s = epifuse.gemm(A, W, src, bias=bias, precision="highest")
        if grad:
            (D.sum() + s.sum()).backward()
        refs.append((weakref.ref(A), weakref.ref(D), weakref.ref(s)))
        del A, D, s
    gc.collect()
    assert [[r() is None for r in trio] for trio in refs] == [[True] * 3] * 3


@pytest.mark.parametrize("place", ["A", "C"])
def test_a_nested_tensor_after_a_kept_call_gets_the_full_paths_error(place):
    """torch's C++ guard aborts the process reading a strided nested tensor's strides: such a
    call never reaches a guard, and the full path names the tensor as it does on a first call."""
    src = "def epi(accum, C):\n    D = accum + C\n    return D\n"
    A, B, C = (integer_tensor(*shape, dtype=torch.float32) for shape in ((8, 4), (4, 6), (8, 6)))
    epifuse.gemm(A, B, src, C=C)
    epifuse.gemm(A, B, src, C=C)
    assert callsite.sites()
    tensors = {"A": A, "C": C}
    tensors[place] = torch.nested.nested_tensor([tensors[place], tensors[place]])
    with pytest.raises(epifuse.errors.ShapeError, match="is a nested tensor"):
        epifuse.gemm(tensors["A"], B, src, C=tensors["C"])


def test_the_same_layout_filed_twice_keeps_one_site_and_all_heads_share_one_bound(monkeypatch):
    """Threads that make the same first call at once each file a site: the last replaces the
    others (each holds its plan's buffers). MAX_SITES bounds the sites of all heads together."""
    opts = (None, False, False, torch.float32, "default")

    def call(m, alpha=1.0):
        return callsite.signature("src", torch.randn(m, 3), torch.randn(3, 5), {"alpha": alpha}, opts)
    _kept_for(call(4))
    second = _kept_for(call(4))
    assert callsite.sites() == [second] and callsite.lookup(call(4)) is second
    monkeypatch.setattr(callsite, "MAX_SITES", 3)
    others = [_kept_for(call(m, alpha=2.0)) for m in (1, 2, 3)]
    assert callsite.sites() == others and len(callsite._SITES) == 1   # the first head went


def test_the_guard_probe_holds_under_another_default_dtype():
    """The probe that picks torch's C++ guard names every dtype it compares: a process whose
    default dtype is float64 keeps the C++ guard."""
    expected = callsite._tensor_guard_type()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert callsite._tensor_guard_type() is expected
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("ignores", ["requires_grad", "sizes", "strides", "dtype", "sign bit", "device", "type"])
def test_a_cpp_guard_that_ignores_a_field_is_not_used(ignores, monkeypatch):
    """The probe refuses a C++ guard (another torch's TensorGuards) that would let through a
    tensor differing in any field a false hit would get wrong: the Python guard is used."""
    import torch._C._dynamo.guards as guards
    fields = {"requires_grad": lambda t: t.requires_grad, "sizes": lambda t: tuple(t.shape),
              "strides": lambda t: t.stride(), "dtype": lambda t: t.dtype, "sign bit": lambda t: t.is_neg(),
              "device": lambda t: t.device, "type": type}
    kept = [f for name, f in fields.items() if name != ignores]

    class Lenient:
        def __init__(self, *tensors, dynamic_dims_sizes, dynamic_dims_strides):
            self.expected = [tuple(f(t) for f in kept) for t in tensors]

        def check(self, *tensors):
            return [tuple(f(t) for f in kept) for t in tensors] == self.expected
    monkeypatch.setattr(guards, "TensorGuards", Lenient)
    assert callsite._tensor_guard_type() is None
    kept = list(fields.values())
    assert callsite._tensor_guard_type() is Lenient   # the same fake, checking every field, passes
