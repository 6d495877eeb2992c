"""Gated epilogues (issue 36): `gate, up = accum.chunk(2, dim=-1)` over a merged [gate | up]
weight, one kernel multiplying each A tile by both halves of B's columns into two
accumulators; SwiGLU and GeGLU of width N / 2, against float64 references."""
import pytest
import torch
import torch.nn.functional as F

import epifuse
import epifuse.nn
from epifuse.errors import EpilogueSyntaxError, ShapeError
from epifuse.frontend import parse
from helpers import integer_tensor

SWIGLU = "def swiglu(accum):\n    gate, up = accum.chunk(2, dim=-1)\n    D = silu(gate) * up\n    return D\n"
PRODUCT = ("def product(accum, bias, C):\n    gate, up = torch.chunk(accum, 2, -1)\n"
           "    D = gate * up + bias + C\n    s = sum(up, dim=-1)\n    return D, s\n")


def halves(A, W):
    full = A.double() @ W.double()
    half = W.shape[-1] // 2
    return full[..., :half], full[..., half:]


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gated_product_is_exact_in_the_gated_kernel(dtype, batched):
    """Integer-valued: gate * up + bias + C and a row sum of up are exact in fp32, over ragged
    tiles each way (interpreter tiles are 32), batched A and B too."""
    M, N, K = 45, 70, 40
    lead = (2,) if batched else ()
    A = integer_tensor(*lead, M, K, dtype=dtype)
    W = integer_tensor(*lead, K, 2 * N, dtype=dtype)
    bias = integer_tensor(N, dtype=torch.float32)
    C = integer_tensor(*lead, M, N, dtype=torch.float32)
    D, s = torch.empty(*lead, M, N), torch.empty(*lead, M)
    args = epifuse.GemmArguments(A, W, epilogue=epifuse.EpilogueArguments(PRODUCT, bias=bias, C=C, D=D, s=s),
                                 precision="highest")
    assert args.gated and (args.N, args.K) == (N, K)
    kernels = epifuse.get_kernels(args)
    assert [k.name for k in kernels] == ["triton_gated", "reference"]
    gate, up = halves(A, W)
    for kernel in kernels:
        D.fill_(float("nan"))
        s.fill_(float("nan"))
        kernel.run(args)
        assert torch.equal(D.double(), gate * up + bias.double() + C.double()), kernel
        assert torch.equal(s.double(), up.sum(-1)), kernel


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_swiglu_and_geglu_through_gemm(act):
    """epifuse.gemm allocates D of width N / 2 in A's dtype; silu (SwiGLU) and gelu (GeGLU) of
    the gate half times the up half, within bf16's rounding of the float64 result."""
    M, N, K = 64, 96, 80
    x = torch.randn(M, K).to(torch.bfloat16)
    w = (torch.randn(K, 2 * N) / K ** 0.5).to(torch.bfloat16)
    src = SWIGLU.replace("silu", act)
    D = epifuse.gemm(x, w, src)
    assert D.shape == (M, N) and D.dtype == torch.bfloat16
    gate, up = halves(x, w)
    expected = getattr(F, act)(gate) * up
    torch.testing.assert_close(D.double(), expected, rtol=1e-2, atol=1e-2)


def test_a_gated_softmax_runs_in_passes():
    """A reduction of a half that feeds later math (a softmax over the gate half) runs as
    passes of the same gated GEMM (staging), each of width N / 2."""
    M, N, K = 40, 50, 30
    A, W = torch.randn(M, K), torch.randn(K, 2 * N)
    src = ("def g(accum):\n    gate, up = accum.chunk(2, dim=-1)\n    P = softmax(gate, dim=-1) * up\n"
           "    return P\n")
    P = epifuse.gemm(A, W, src, precision="highest")
    gate, up = halves(A, W)
    torch.testing.assert_close(P.double(), torch.softmax(gate, -1) * up, rtol=1e-5, atol=1e-6)


def test_chunk_is_parsed_into_two_accumulators():
    program = parse(SWIGLU)
    assert program.params == ("accum", "accum_up") and program.operands == ()
    assert [(s.target, s.expr.value) for s in program.statements][:2] == [("gate", "accum"), ("up", "accum_up")]


@pytest.mark.parametrize("src, message", [
    ("def e(accum):\n    g, u = accum.chunk(2, dim=-1)\n    D = g * u + accum\n    return D\n",
     "reads the halves, not accum itself"),
    ("def e(accum):\n    g, u = accum.chunk(3, dim=-1)\n    D = g\n    return D\n", "takes 2 chunks"),
    ("def e(accum):\n    g, u = accum.chunk(2, dim=0)\n    D = g\n    return D\n", "splits the last dimension"),
    ("def e(accum, x):\n    g, u = x.chunk(2, dim=-1)\n    D = g\n    return D\n", "Only accum can be chunked"),
    ("def e(accum):\n    g, u, v = accum.chunk(2, dim=-1)\n    D = g\n    return D\n", "exactly two names"),
    ("def e(accum):\n    g, u = accum, accum\n    D = g\n    return D\n", "must unpack accum.chunk"),
    ("def e(accum):\n    g, u = accum.chunk(2, dim=-1)\n    h, v = accum.chunk(2, dim=-1)\n    D = g\n    return D\n",
     "chunked once"),
    ("def e(accum, accum_up):\n    D = accum\n    return D\n", "'accum_up' is reserved"),
])
def test_what_chunk_refuses(src, message):
    with pytest.raises(EpilogueSyntaxError, match=message):
        parse(src)


def test_an_odd_number_of_columns_is_refused():
    A, W = integer_tensor(8, 8, dtype=torch.float32), integer_tensor(8, 7, dtype=torch.float32)
    with pytest.raises(ShapeError, match="its last dimension must be even"):
        epifuse.gemm(A, W, SWIGLU)


def test_the_second_half_of_b_is_an_input_no_output_may_overlap():
    A = integer_tensor(8, 8, dtype=torch.float32)
    W = integer_tensor(16, 8, dtype=torch.float32).t()   # K-major: each half's columns are a block of its own
    before = W.clone()
    with pytest.raises(ShapeError, match="Output D overlaps the GEMM input B_up"):
        epifuse.gemm(A, W, SWIGLU, D=W[:, 8:])
    assert torch.equal(W, before)


@pytest.mark.parametrize("batched", [False, True])
def test_gated_gradients_are_exact_on_integers(batched):
    """The backward of a gated epilogue: the forward saves both halves of accum, one
    elementwise pass over them gives the gradient of each half, and dA, dB come from the two
    halves side by side ([gate | up], B's column order). A product epilogue on integers has
    integer gradients: every one exact, through the interpreted kernels (fp32, full products)."""
    lead = (2,) if batched else ()
    A = integer_tensor(*lead, 24, 16, low=-2, high=3, dtype=torch.float32).requires_grad_()
    W = integer_tensor(16, 2 * 20, low=-2, high=3, dtype=torch.float32).requires_grad_()
    bias = integer_tensor(20, low=-3, high=4, dtype=torch.float32).requires_grad_()
    C = integer_tensor(*lead, 24, 20, low=-3, high=4, dtype=torch.float32)
    D, s = epifuse.gemm(A, W, PRODUCT, bias=bias, C=C, precision="highest")
    gD = integer_tensor(*D.shape, low=-2, high=3, dtype=torch.float32)
    gs = integer_tensor(*s.shape, low=-2, high=3, dtype=torch.float32)
    ((D * gD).sum() + (s * gs).sum()).backward()
    a, w, b = (t.detach().double().requires_grad_() for t in (A, W, bias))
    gate, up = (a @ w).chunk(2, dim=-1)
    D_ref, s_ref = gate * up + b + C.double(), up.sum(-1)
    ((D_ref * gD.double()).sum() + (s_ref * gs.double()).sum()).backward()
    assert torch.equal(D.double(), D_ref) and torch.equal(s.double(), s_ref)
    for name, got, want in (("A", A.grad, a.grad), ("W", W.grad, w.grad), ("bias", bias.grad, b.grad)):
        assert torch.equal(got.double(), want), name


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_swiglu_and_geglu_gradients_against_float64(act):
    src = SWIGLU.replace("silu", act)
    A = torch.randn(40, 24).requires_grad_()
    W = (torch.randn(24, 2 * 36) / 4).requires_grad_()
    D = epifuse.gemm(A, W, src, precision="highest")
    g = torch.randn_like(D)
    (D * g).sum().backward()
    a, w = (t.detach().double().requires_grad_() for t in (A, W))
    gate, up = (a @ w).chunk(2, dim=-1)
    ((getattr(F, act)(gate) * up) * g.double()).sum().backward()
    for name, got, want in (("A", A.grad, a.grad), ("W", W.grad, w.grad)):
        error = float((got.double() - want).abs().max() / want.abs().max())
        assert error < 2e-6, (name, error)


def test_gated_gradcheck_and_gradgradcheck_in_float64():
    A = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    W = torch.randn(6, 10, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    src = "def s(accum, bias):\n    gate, up = accum.chunk(2, dim=-1)\n    D = silu(gate + bias) * up\n    return D\n"
    folds = ("def f(accum):\n    gate, up = accum.chunk(2, dim=-1)\n    D = gelu(gate) * up\n"
             "    top = max(D, dim=1)\n    s = sum(up, dim=0)\n    return D, top, s\n")
    assert torch.autograd.gradcheck(lambda A, W, bias: epifuse.gemm(A, W, src, bias=bias), (A, W, bias))
    assert torch.autograd.gradgradcheck(lambda A, W, bias: epifuse.gemm(A, W, src, bias=bias), (A, W, bias))
    assert torch.autograd.gradcheck(lambda A, W: epifuse.gemm(A, W, folds), (A, W))


def test_gated_backward_under_torch_compile_matches_eager():
    A = torch.randn(16, 8).requires_grad_()
    W = torch.randn(8, 24).requires_grad_()
    compiled = torch.compile(lambda A, W: epifuse.gemm(A, W, SWIGLU, precision="highest"),
                             fullgraph=True, backend="aot_eager")
    D = compiled(A, W)
    g = torch.randn_like(D)
    (D * g).sum().backward()
    grads = A.grad.clone(), W.grad.clone()
    A.grad = W.grad = None
    D_eager = epifuse.gemm(A, W, SWIGLU, precision="highest")
    (D_eager * g).sum().backward()
    assert torch.equal(D, D_eager)
    assert torch.equal(grads[0], A.grad) and torch.equal(grads[1], W.grad)


def test_what_a_gated_epilogue_refuses_with_autograd():
    """recompute=True (the backward reads the saved halves), FusedLinear (its out_features and
    bias would not match the halves) and DTensors (the halves would have to shard alike) say so."""
    A = integer_tensor(8, 8, dtype=torch.float32).requires_grad_()
    W = integer_tensor(8, 16, dtype=torch.float32)
    with pytest.raises(epifuse.errors.UnsupportedError, match="recompute=True with a gated epilogue"):
        epifuse.gemm(A, W, SWIGLU, recompute=True)
    with pytest.raises(epifuse.errors.UnsupportedError, match="FusedLinear does not take a gated epilogue"):
        epifuse.nn.FusedLinear(8, 8, epilogue=SWIGLU)
    from epifuse import sharding
    with pytest.raises(epifuse.errors.UnsupportedError, match="does not run on DTensors yet"):
        sharding.problem(parse(SWIGLU), "", (8, 8), (8, 16), [])
    with torch.no_grad():
        assert epifuse.gemm(A, W, SWIGLU).shape == (8, 8)


def test_tuning_times_gated_arguments_on_both_halves():
    """Tuning's scratch copy of gated arguments is built from B as given (both halves), not
    from the first half the arguments keep as B (which a gated program would halve again)."""
    from epifuse.runtime import tune
    A, W = integer_tensor(40, 30, dtype=torch.float32), integer_tensor(30, 60, dtype=torch.float32)
    args = epifuse.GemmArguments(A, W, epilogue=epifuse.EpilogueArguments(SWIGLU.replace("silu(gate)", "gate"),
                                                                          D=torch.empty(40, 30)))
    scratch = tune._scratch_args(args)
    assert scratch.gated and scratch.signature == args.signature
    epifuse.get_kernels(scratch)[0].run(scratch)
    gate, up = halves(A, W)
    assert torch.equal(scratch.outputs["D"].double(), gate * up)


def test_background_tuning_leaves_gated_arguments_to_the_caller(monkeypatch):
    """The background worker rebuilds real GEMMs from their layouts; gated arguments are timed
    in the call instead (the worker would halve B's gate half again)."""
    from epifuse.runtime import tune
    A, W = integer_tensor(40, 30, dtype=torch.float32), integer_tensor(30, 60, dtype=torch.float32)
    args = epifuse.GemmArguments(A, W, epilogue=epifuse.EpilogueArguments(SWIGLU, D=torch.empty(40, 30)))
    queued = []
    monkeypatch.setenv("EPIFUSE_TUNE", "background")
    monkeypatch.setattr(tune, "_on_gpu", lambda args: True)
    monkeypatch.setattr(tune, "_gpu_name", lambda args: "NVIDIA H200")
    monkeypatch.setattr(tune, "tune_in_background", lambda *a: queued.append(a))
    monkeypatch.setattr(tune, "_tune", lambda args, kernels, key, mode: kernels[0])
    monkeypatch.setattr(tune.shipped, "ranked", lambda *a: [])
    monkeypatch.setattr(tune.shipped, "short_list", lambda *a: [])
    kernels = [k for k in epifuse.get_kernels(args) if k.name != "reference"]
    tune.choose(args, kernels + kernels)
    assert queued == []


def test_repeated_gated_calls_keep_their_launch_and_stay_exact():
    """A repeated gated call (inference through epifuse.gemm, and a training step through the
    custom ops) takes its kept launch, which splits each call's own B into its halves: fresh
    inputs every call, every result exact."""
    from epifuse.runtime import callsite
    for step in range(3):
        A = integer_tensor(24, 16, low=-2, high=3, dtype=torch.float32)
        W = integer_tensor(16, 2 * 20, low=-2, high=3, dtype=torch.float32)
        bias = integer_tensor(20, low=-3, high=4, dtype=torch.float32)
        C = integer_tensor(24, 20, low=-3, high=4, dtype=torch.float32)
        hits = callsite.HITS[0]
        D, s = epifuse.gemm(A, W, PRODUCT, bias=bias, C=C, precision="highest")
        assert callsite.HITS[0] - hits == (0 if step == 0 else 1), step
        gate, up = halves(A, W)
        assert torch.equal(D.double(), gate * up + bias.double() + C.double()) and torch.equal(s.double(), up.sum(-1))
    for step in range(3):
        A = integer_tensor(24, 16, low=-2, high=3, dtype=torch.float32)
        W = integer_tensor(16, 2 * 20, low=-2, high=3, dtype=torch.float32).requires_grad_()
        g = integer_tensor(24, 20, low=-2, high=3, dtype=torch.float32)
        hits = callsite.HITS[0]
        D = epifuse.gemm(A, W, "def p(accum):\n    gate, up = accum.chunk(2, dim=-1)\n    D = gate * up\n    return D\n",
                         precision="highest")
        (D * g).sum().backward()
        assert callsite.HITS[0] - hits == (0 if step == 0 else 2), step   # the forward and the backward pass
        gate, up = halves(A, W.detach())
        assert torch.equal(D.double(), gate * up)
        expected = A.double().t() @ torch.cat((g.double() * up, g.double() * gate), dim=-1)
        assert torch.equal(W.grad.double(), expected)
