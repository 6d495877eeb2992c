"""PyTorch integration: the epifuse:: custom ops and their fake impls, torch.compile through
epifuse.gemm and FusedLinear (FusedLinear itself: test_fused_linear.py; epilogue keys:
test_epilogue_keys.py); on the GPU (marker `gpu`), CUDA graph capture and replay,
no host synchronization, torch.compile with inductor, and an MLP's training loss curve.
"""
import math

import pytest
import torch
from torch import nn
import torch._functorch.config as functorch_config
from torch._subclasses.fake_tensor import FakeTensorMode

import epifuse
from epifuse import epilogue_table, op_backward, op_planning, torch_ops
from epifuse.errors import ShapeError
from epifuse.epilogues import LinearCombination
from epifuse.nn import FusedLinear, fuse_linear_activations
from epifuse.ops import gelu, relu, sum  # noqa: A004  (names the epilogues below use)
from helpers import fast, op_tensors as _tensors, relu_aux_loss

F64 = torch.float64
M, N, K = 6, 5, 4


def bias_gelu(accum, bias):
    D = gelu(accum + bias)
    return D


# ---- the custom ops ----------------------------------------------------------------------------

def test_epilogue_registered_once():
    first = torch_ops.register_epilogue(bias_gelu)
    assert torch_ops.register_epilogue(bias_gelu) == first
    assert torch_ops.register_epilogue(bias_gelu, save_accum=True) != first
    t = _tensors()
    epifuse.gemm(t["A"], t["B"], bias_gelu, bias=t["bias"]).sum().backward()
    count = len(epilogue_table._TABLE)
    for _ in range(3):
        epifuse.gemm(t["A"], t["B"], bias_gelu, bias=t["bias"]).sum().backward()
    assert len(epilogue_table._TABLE) == count


@pytest.mark.parametrize("save_accum", [False, True])
def test_opcheck_gemm(save_accum):
    """Schema, fake impl, autograd registration and AOT dispatch (dynamic shapes) agree."""
    t = _tensors()
    key = torch_ops.entry(torch_ops.register_epilogue(relu_aux_loss, save_accum=save_accum)).key
    args = (key, t["A"], t["B"], [t["C"], t["bias"]], [3.0], "ntt", "", F64, False, "default")
    torch.library.opcheck(torch.ops.epifuse.gemm.default, args)


def test_opcheck_gemm_out():
    t = _tensors(grad=False)
    key = torch_ops.entry(torch_ops.register_epilogue(relu_aux_loss)).key
    outs = [torch.empty(M, N, dtype=F64), torch.empty(M, N, dtype=F64), torch.empty(M, dtype=F64)]
    args = (key, t["A"], t["B"], [t["C"], t["bias"]], [3.0], "ntt", outs, F64, False, False, "default")
    torch.library.opcheck(torch.ops.epifuse.gemm_out.default, args)


_REPLAY = """
import sys, torch
import epifuse.torch_ops
calls = torch.load(sys.argv[1])
assert not epifuse.epilogue_table._TABLE, "this process registered an epilogue before the replay"
outs = [torch.ops.epifuse.gemm.default(*args) for args, _ in calls]
torch.save(outs, sys.argv[2])
"""


# A function name Python accepts and ASCII does not spell (a Cyrillic е, CJK, an accent), and
# a docstring beyond ASCII: the key carries them to the next process.
NON_ASCII_EPILOGUE = ("def \u0435pi_\u878d\u5408_\u00e9(accum, alpha, C, bias):\n"
                      "    \"\"\"Fus\u00e9e \u2713\"\"\"\n"
                      "    F = (accum * alpha) + (C * 2.0) + bias\n    D = relu(F)\n    r = sum(D, dim=1)\n"
                      "    return D, F, r\n")


@pytest.mark.parametrize("epilogue", fast([relu_aux_loss, NON_ASCII_EPILOGUE], keep={1}, ids=["ascii", "non_ascii_name"]))
def test_recorded_op_calls_replay_in_a_fresh_process(tmp_path, epilogue):
    """What torch.compile's on-disk caches do: a graph recorded in one process calls the ops,
    backward epilogues included, in another that never registered them. Every name the parser
    accepts reads back from the key (a non-ASCII function name did not)."""
    import subprocess
    import sys
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.epifuse.gemm.default:
                self.calls.append((args, out))
            return out

    t = _tensors()
    inputs = [t[k] for k in ("A", "B", "C", "bias")]
    with Record() as record:
        D, F, r = epifuse.gemm(*inputs[:2], epilogue, alpha=0.5, C=t["C"], bias=t["bias"],
                               compute_dtype=F64)
        ((D * F).sum() + r.square().sum()).backward()
    assert len(record.calls) >= 2          # the forward and at least one backward epilogue
    def detach(x):
        if isinstance(x, list):
            return [detach(i) for i in x]
        return x.detach() if isinstance(x, torch.Tensor) else x

    detached = [(detach(list(args)), detach(out)) for args, out in record.calls]
    torch.save(detached, tmp_path / "calls.pt")
    done = subprocess.run([sys.executable, "-c", _REPLAY, str(tmp_path / "calls.pt"),
                           str(tmp_path / "outs.pt")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    replayed = torch.load(tmp_path / "outs.pt")
    for (_, expected), got in zip(detached, replayed, strict=True):
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            assert a.dtype == b.dtype and torch.equal(a, b)


def _compile_in_a_new_process(device, seed, cache_dir):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor"),
           "EPIFUSE_CACHE_DIR": str(cache_dir / "epifuse"), "EPIFUSE_QUIET": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "compile_cache_worker", device, str(seed)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_training_step_from_warm_inductor_caches(device, tmp_path):
    """A second process loads the compiled forward and backward from inductor's caches and
    runs the backward epilogues it never registered (a process-local id named nothing there)."""
    first = _compile_in_a_new_process(device, 1, tmp_path)
    second = _compile_in_a_new_process(device, 2, tmp_path)
    assert first["equal"] and first["grads_close"] and second["equal"] and second["grads_close"]
    assert first["cache"].get("autograd_cache_saved") and second["cache"].get("autograd_cache_hit"), \
        (first, second)


FAKE_CASES = [
    # (A shape, B shape, epilogue, operands, out_dtype, expected [(shape, dtype)])
    ((M, K), (K, N), relu_aux_loss, {"alpha": 2.0, "C": (M, N), "bias": (N,)}, None,
     [((M, N), torch.bfloat16), ((M, N), torch.bfloat16), ((M,), torch.float32)]),
    ((3, M, K), (K, N), "def e(accum, b):\n    D = sigmoid(accum + b)\n    s = mean(D, dim=(0, 2))\n    return D, s\n",
     {"b": (3, 1, N)}, torch.float32, [((3, M, N), torch.float32), ((M,), torch.float32)]),
    ((M, K), (K, N), "def e(accum):\n    loss = amax(accum)\n    return loss\n", {}, None,
     [((), torch.float32)]),
]


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("a_shape,b_shape,epilogue,operands,out_dtype,expected", FAKE_CASES)
def test_fake_tensor_shapes(a_shape, b_shape, epilogue, operands, out_dtype, expected,
                            requires_grad, monkeypatch):
    def no_kernel(args):
        raise AssertionError("a kernel ran under FakeTensorMode")

    monkeypatch.setattr(torch_ops, "choose_kernel", no_kernel)
    with FakeTensorMode():
        A = torch.empty(a_shape, dtype=torch.bfloat16, requires_grad=requires_grad)
        B = torch.empty(b_shape, dtype=torch.bfloat16)
        kwargs = {k: torch.empty(v) if isinstance(v, tuple) else v for k, v in operands.items()}
        outs = epifuse.gemm(A, B, epilogue, out_dtype=out_dtype, **kwargs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        assert [(tuple(o.shape), o.dtype) for o in outs] == expected


def test_fake_tensor_fused_linear(monkeypatch):
    monkeypatch.setattr(torch_ops, "choose_kernel", lambda args: pytest.fail("a kernel ran"))
    with FakeTensorMode():
        layer = FusedLinear(16, 32, epilogue="silu", dtype=torch.bfloat16)
        y = layer(torch.empty(2, 3, 16, dtype=torch.bfloat16))
        assert y.shape == (2, 3, 32) and y.dtype == torch.bfloat16
        y.sum().backward()
        assert layer.weight.grad.shape == (32, 16) and layer.bias.grad.shape == (32,)


# ---- the tensor checks on stand-ins --------------------------------------------------------------

STAND_IN_SRC = "def e(accum, bias):\n    D = accum + bias\n    r = sum(D, dim=1)\n    return D, r\n"


def _stand_ins(kind: str):
    """A function making a stand-in of a real tensor: a fake tensor of a mode that refuses to read
    addresses (as torch.compile's do), or a meta tensor."""
    if kind == "meta":
        return lambda t: t.to("meta")
    with functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=False):
        mode = FakeTensorMode()
    return mode.from_tensor


@pytest.mark.parametrize("kind", ["fake", "meta"])
def test_stand_ins_pass_the_tensor_checks_and_their_view_bits_do_not(kind, monkeypatch):
    """torch_ops.gemm checks every tensor before autograd and the ops' dispatch see it: stand-ins
    (no storage behind them, views at offsets) pass, with and without autograd and with given
    outputs, and get the outputs' shapes without a kernel; a negative bit on one is refused."""
    monkeypatch.setattr(torch_ops, "choose_kernel", lambda args: pytest.fail("a kernel ran"))
    make = _stand_ins(kind)
    S = torch.randint(-3, 4, (3 * M * N,)).float()
    A = make(torch.randint(-3, 4, (M, K)).float().requires_grad_())
    B, bias = make(torch.randint(-3, 4, (K, N)).float()), make(S[1:1 + N])
    D, r = make(S[N + 3:N + 3 + M * N].view(M, N)), make(S[-M:])
    got = torch_ops.gemm(A, B, STAND_IN_SRC, bias=bias)
    assert [(tuple(o.shape), o.requires_grad) for o in got] == [((M, N), True), ((M,), True)]
    with torch.no_grad():
        torch_ops.gemm(A, B, STAND_IN_SRC, bias=bias, D=D, r=r)
    with pytest.raises(ShapeError, match="A has torch's negative bit set"):
        torch_ops.gemm(torch._neg_view(make(torch.randn(M, K))), B, STAND_IN_SRC, bias=bias)
    with torch.no_grad(), pytest.raises(ShapeError, match="Output D has torch's negative bit set"):
        torch_ops.gemm(A, B, STAND_IN_SRC, bias=bias, D=torch._neg_view(make(torch.randn(M, N))), r=r)


@pytest.mark.parametrize("place", ["A", "bias"])
def test_compiled_calls_check_real_tensors_when_they_run(place):
    """Under torch.compile the checks do not fire on the fake tensors it traces with (the graph is
    one op), and the compiled call checks the real tensors it runs on: a freed storage is the
    ShapeError that names it, a plain tensor of the same metadata the right answer."""
    torch._dynamo.reset()
    fn = torch.compile(lambda A, B, bias: torch_ops.gemm(A, B, STAND_IN_SRC, bias=bias),
                       fullgraph=True, backend="aot_eager")
    t = {"A": torch.randint(-3, 4, (M, K)).float().requires_grad_(), "B": torch.randint(-3, 4, (K, N)).float(),
         "bias": torch.randint(-3, 4, (N,)).float()}
    D, r = fn(**t)
    expected = t["A"].double() @ t["B"].double() + t["bias"].double()
    assert torch.equal(D.double(), expected) and torch.equal(r.double(), expected.sum(1))
    bad = dict(t, **{place: t[place].detach().clone()})
    bad[place].untyped_storage().resize_(0)
    label = "A" if place == "A" else "Operand bias"
    with pytest.raises(ShapeError, match=f"{label}'s storage holds 0 bytes"):
        fn(**bad)


# ---- torch.compile -----------------------------------------------------------------------------

def test_compile_traces_one_graph_with_the_custom_op():
    torch._dynamo.reset()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    t = _tensors()
    fn = torch.compile(lambda A, B, bias: epifuse.gemm(A, B, bias_gelu, bias=bias) * 2.0,
                       fullgraph=True, backend=record)
    out = fn(t["A"], t["B"], t["bias"])
    assert torch.allclose(out, 2.0 * bias_gelu(t["A"] @ t["B"], t["bias"]), atol=1e-6)
    targets = [node.target for node in graphs[0].graph.nodes]
    ops = [t for t in targets if t in (torch.ops.epifuse.gemm, torch.ops.epifuse.gemm.default)]
    assert len(graphs) == 1 and len(ops) == 1


@pytest.mark.parametrize("out_dtype", [torch.uint8, torch.int16, torch.bool, torch.float8_e4m3fnuz])
def test_every_output_dtype_of_the_plain_path_goes_through_the_ops(out_dtype):
    """Autograd and torch.compile take the custom ops, which name out_dtype by its name: every
    dtype a plain call accepts (a KeyError there before), with the plain call's values."""
    A = (torch.randint(-3, 4, (M, K)) * 0.5).to(torch.float16)
    B = torch.randint(-3, 4, (K, N)).to(torch.float16)
    epilogue = "def e(accum):\n    D = relu(accum * 7.0)\n    return D\n"
    plain = epifuse.gemm(A, B, epilogue, out_dtype=out_dtype)
    with_grad = epifuse.gemm(A.clone().requires_grad_(), B, epilogue, out_dtype=out_dtype)
    compiled = torch.compile(lambda a, b: epifuse.gemm(a, b, epilogue, out_dtype=out_dtype),
                             backend="aot_eager")(A, B)
    assert plain.dtype == with_grad.dtype == compiled.dtype == out_dtype
    assert torch.equal(with_grad, plain) and torch.equal(compiled, plain)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.float64])
def test_reduction_outputs_have_one_dtype_with_and_without_autograd(compute_dtype):
    """One allocator: a reduction output epifuse allocates is float64 when the epilogue
    computes in float64 and float32 otherwise, whether or not an input requires grad."""
    epilogue = "def e(accum):\n    D = accum * 0.5\n    r = sum(accum, dim=1)\n    return D, r\n"
    A = torch.randint(-3, 4, (M, K)).to(torch.float16)
    B = torch.randint(-3, 4, (K, N)).to(torch.float16)
    _, plain = epifuse.gemm(A, B, epilogue, compute_dtype=compute_dtype)
    _, with_grad = epifuse.gemm(A.clone().requires_grad_(), B, epilogue, compute_dtype=compute_dtype)
    expected = (A.double() @ B.double()).sum(dim=1)  # integer values: exact in either dtype
    assert plain.dtype == with_grad.dtype == compute_dtype
    assert torch.equal(plain.double(), expected) and torch.equal(with_grad.detach().double(), expected)


class _ReluBiasTimesC(epifuse.FusedGemm):
    def epilogue(self, accum, C, bias):
        D = relu(accum + bias) * C
        r = sum(D, dim=1)
        return D, r


def test_float64_inputs_compute_in_float64_at_every_entry_point():
    """No compute_dtype given: the epilogue computes in the promoted dtype of the inputs, so
    float64 inputs (or a float64 operand) get float64 math and float64 reductions at every
    entry point (epifuse.gemm computed them in float32, a relative error of 1e-7)."""
    A, B, C = (torch.randn(*s, dtype=F64) for s in ((M, K), (K, N), (M, N)))
    bias = torch.randn(N, dtype=F64)
    src = _ReluBiasTimesC.source
    D64 = torch.relu(A @ B + bias) * C
    expected = {"D": D64, "r": D64.sum(dim=1)}

    def check(outs, what, tile_dtype=F64):
        D, r = (t.detach() for t in outs)
        assert D.dtype == tile_dtype and r.dtype == F64, (what, D.dtype, r.dtype)
        tol = 1e-12 if tile_dtype == F64 else 1e-6   # a float32 tile is rounded when stored
        assert torch.allclose(D.double(), expected["D"], rtol=tol, atol=tol), what
        assert torch.allclose(r, expected["r"], rtol=1e-12, atol=1e-12), what

    check(epifuse.gemm(A, B, src, C=C, bias=bias), "epifuse.gemm")
    check(epifuse.gemm(A.clone().requires_grad_(), B, src, C=C, bias=bias), "epifuse.gemm with autograd")
    check(torch_ops.gemm(A, B, src, C=C, bias=bias), "torch_ops.gemm")
    D, r = torch.empty(M, N, dtype=F64), torch.empty(M, dtype=F64)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, C=C, bias=bias, D=D, r=r))
    assert args.compute_dtype == F64
    epifuse.get_kernels(args)[0].run(args)
    check((D, r), "EpilogueArguments/GemmArguments")
    op = _ReluBiasTimesC()
    check(op(A, B, C=C, bias=bias), "FusedGemm")
    args = op.arguments(A, B, C=C, bias=bias)
    assert args.compute_dtype == F64 and args.outputs["r"].dtype == F64
    named = LinearCombination()
    assert torch.allclose(named(A, B, alpha=0.5, beta=2.0, C=C), 0.5 * (A @ B) + 2.0 * C, rtol=1e-12, atol=1e-12)
    assert named.arguments(A, B, alpha=0.5, beta=2.0, C=C).compute_dtype == F64
    layer = FusedLinear(K, N, epilogue=src, bias=False, dtype=F64)
    x = A.clone().requires_grad_()
    D = torch.relu(x.detach() @ layer.weight.detach().T + bias) * C
    got = layer(x, C=C, bias=bias)
    assert got[1].dtype == F64 and torch.allclose(got[1].detach(), D.sum(dim=1), rtol=1e-12, atol=1e-12)

    # float32 GEMM inputs with a float64 operand promote to float64 too; an explicit
    # compute_dtype is kept
    A32, B32 = A.float(), B.float()
    expected = {"D": torch.relu(A32.double() @ B32.double() + bias) * C}
    expected["r"] = expected["D"].sum(dim=1)
    check(epifuse.gemm(A32, B32, src, C=C, bias=bias), "float64 operand", tile_dtype=torch.float32)
    check(epifuse.gemm(A32.requires_grad_(), B32, src, C=C, bias=bias), "float64 operand, autograd",
          tile_dtype=torch.float32)
    _, r32 = epifuse.gemm(A, B, src, C=C, bias=bias, compute_dtype=torch.float32)
    assert r32.dtype == torch.float32
    _, r32 = epifuse.gemm(A.float(), B.float(), src, C=C.float(), bias=bias.float())
    assert r32.dtype == torch.float32


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_through_epifuse_gemm(backend):
    torch._dynamo.reset()
    t = _tensors()

    def step(A, B, C, bias):
        D, F, r = epifuse.gemm(A, B, relu_aux_loss, alpha=0.5, C=C, bias=bias, compute_dtype=F64)
        return (D * F).sum() + r.square().sum()

    inputs = [t[k] for k in ("A", "B", "C", "bias")]
    expected = step(*inputs)
    expected_grads = torch.autograd.grad(expected, inputs)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    got = compiled(*inputs)
    got_grads = torch.autograd.grad(got, inputs)
    assert torch.allclose(got, expected, rtol=1e-12)
    for a, b in zip(got_grads, expected_grads):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_compile_with_string_epilogue_and_given_outputs():
    """No grad, outputs passed: the in-place op (epifuse::gemm_out), reductions included."""
    torch._dynamo.reset()
    t = _tensors(dtype=torch.float32, grad=False)
    src = "def e(accum, bias):\n    D = sigmoid(accum + bias)\n    r = sum(D, dim=0)\n    return D, r\n"

    def fn(A, B, bias, D, r):
        epifuse.gemm(A, B, src, bias=bias, D=D, r=r, precision="highest")
        return D * 2.0

    D, r = torch.empty(M, N), torch.full((N,), float("nan"))
    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(t["A"], t["B"], t["bias"], D, r)
    expected = torch.sigmoid(t["A"] @ t["B"] + t["bias"])
    assert torch.allclose(out, expected * 2.0, atol=1e-6)
    assert torch.allclose(r, expected.sum(0), atol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fused_linear(backend):
    torch._dynamo.reset()
    layer = FusedLinear(8, 12, epilogue="gelu")
    x = torch.randn(2, 3, 8, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    y = compiled(x)
    expected = torch.nn.functional.gelu(torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert torch.allclose(y, expected, atol=1e-5)
    grads = torch.autograd.grad((y * y).sum(), (x, layer.weight, layer.bias))
    ref_grads = torch.autograd.grad((expected * expected).sum(), (x, layer.weight, layer.bias))
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


# ---- GPU -----------------------------------------------------------------------------------------

def _warm(fn, steps=3):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(steps):
            fn()
    torch.cuda.current_stream().wait_stream(stream)


@pytest.mark.gpu
@pytest.mark.parametrize("given_outputs", [False, True])
def test_cuda_graph_capture_and_replay(given_outputs):
    """The reductions' initialization is captured: replays recompute, they do not accumulate."""
    M_, N_, K_ = 384, 256, 128
    A = torch.randn(M_, K_, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(K_, N_, device="cuda", dtype=torch.bfloat16)
    C = torch.randn(M_, N_, device="cuda")
    bias = torch.randn(N_, device="cuda")
    outs = {"D": torch.empty(M_, N_, device="cuda", dtype=torch.bfloat16),
            "F": torch.empty(M_, N_, device="cuda"), "r": torch.empty(M_, device="cuda")}
    given = outs if given_outputs else {}
    result = {}

    def call():
        result["out"] = epifuse.gemm(A, B, relu_aux_loss, alpha=0.5, C=C, bias=bias, **given)

    _warm(call)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    D, F, r = result["out"] if not given_outputs else (outs["D"], outs["F"], outs["r"])
    for _ in range(3):
        A.copy_(torch.randn_like(A))
        bias.copy_(torch.randn_like(bias))
        graph.replay()
        torch.cuda.synchronize()
        ref_F = (A.double() @ B.double()) * 0.5 + C.double() * 2.0 + bias.double()
        assert torch.allclose(F.double(), ref_F, rtol=1e-2, atol=1e-2)
        assert torch.allclose(r.double(), ref_F.relu().sum(1), rtol=1e-2, atol=1e-1)
        assert torch.allclose(D.double(), ref_F.relu(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_cuda_graph_training_step():
    """Forward and backward (the derived backward epilogue and the dA/dB GEMMs) captured."""
    layer = FusedLinear(256, 512, epilogue="gelu", device="cuda")
    ref = nn.Linear(256, 512, device="cuda")
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(128, 256, device="cuda", requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(layer, (x,))
    for _ in range(3):
        x_new = torch.randn(128, 256, device="cuda", requires_grad=True)
        layer.zero_grad()
        graphed(x_new).square().sum().backward()
    expected = torch.nn.functional.gelu(ref(x_new))
    expected.square().sum().backward()
    assert torch.allclose(layer.weight.grad, ref.weight.grad, rtol=5e-2, atol=5e-2)
    assert torch.allclose(layer.bias.grad, ref.bias.grad, rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
def test_no_host_sync_in_the_launch_path():
    """After a warm-up (compile, tuning), a training step never synchronizes with the host."""
    layer = FusedLinear(256, 512, epilogue="silu", device="cuda")
    x = torch.randn(128, 256, device="cuda", requires_grad=True)
    src = "def e(accum, bias):\n    D = relu(accum + bias)\n    r = sum(D, dim=1)\n    return D, r\n"
    bias = torch.randn(512, device="cuda", requires_grad=True)

    def step():
        layer(x).square().sum().backward()
        D, r = epifuse.gemm(x, layer.weight.t(), src, bias=bias)
        (D.sum() + r.sum()).backward()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")   # any synchronizing CUDA call raises
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_compile_inductor_on_gpu():
    torch._dynamo.reset()
    model = fuse_linear_activations(nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 64)).cuda())
    x = torch.randn(64, 128, device="cuda")
    compiled = torch.compile(model, fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, expected = compiled(x), model(x)
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), expected.float(), rtol=2e-2, atol=2e-2)
    y.float().sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_training_loss_curve_matches_pytorch(dtype, monkeypatch):
    """A few hundred SGD steps: the FusedLinear model follows the plain model's loss curve."""
    torch.manual_seed(0)
    # epifuse's default precision for fp32 is tf32; set for this test only (a later test in the
    # same process would otherwise get tf32 torch matmuls)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    plain = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.SiLU(),
                          nn.Linear(256, 10)).cuda()
    fused = fuse_linear_activations(plain)
    X = torch.randn(2048, 64, device="cuda")
    teacher = torch.randn(64, 10, device="cuda")
    Y = (X @ teacher).argmax(1)
    curves = []
    for model in (plain, fused):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for step in range(300):
            idx = torch.arange(step * 128, (step + 1) * 128, device="cuda") % X.shape[0]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                loss = nn.functional.cross_entropy(model(X[idx]).float(), Y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(torch.tensor(losses))
    plain_curve, fused_curve = curves
    assert fused_curve[-20:].mean() < 0.5 * fused_curve[:20].mean()      # it learns
    window = lambda c: c.unfold(0, 20, 20).mean(1)                       # noqa: E731
    tol = 0.05 if dtype == torch.float32 else 0.1     # relative, and absolute in units of the
    atol = tol * 0.5 * float(plain_curve[:20].mean())  # first losses (the tail is near zero)
    assert torch.allclose(window(fused_curve), window(plain_curve), rtol=tol, atol=atol), \
        (window(fused_curve), window(plain_curve))
    assert math.isfinite(float(fused_curve.sum()))


@pytest.mark.gpu
def test_k_zero_gemm_on_every_gpu_kernel():
    """The saved-accum backward is an epilogue over a K = 0 GEMM (accum = 0, the saved accum
    an operand): every kernel that claims support must handle K = 0."""
    src = "def e(accum, C, bias):\n    D = C * 2.0 + accum\n    r = sum(C * bias, dim=0)\n    return D, r\n"
    base = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    C, bias = torch.randn(512, 384, device="cuda"), torch.randn(384, device="cuda")
    D, r = torch.empty(512, 384, device="cuda"), torch.empty(384, device="cuda")
    args = epifuse.GemmArguments(base[:, :0], base[:0, :], epilogue=epifuse.EpilogueArguments(
        src, C=C, bias=bias, D=D, r=r))
    for kernel, status in epifuse.kernel_statuses(args):
        if not status.ok:
            continue
        D.fill_(float("nan"))
        r.fill_(float("nan"))
        kernel.run(args)
        torch.cuda.synchronize()
        assert torch.equal(D, C * 2.0), kernel
        assert torch.allclose(r, (C * bias).sum(0), rtol=1e-4, atol=1e-3), kernel


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recompute", [False, True])
def test_backward_on_gpu_matches_torch(dtype, recompute):
    M_, N_, K_ = 1000, 744, 520
    A = (torch.randn(M_, K_, device="cuda") / K_ ** 0.5).to(dtype).requires_grad_()
    B = torch.randn(K_, N_, device="cuda").to(dtype).requires_grad_()
    C = torch.randn(M_, N_, device="cuda", requires_grad=True)
    bias = torch.randn(N_, device="cuda", requires_grad=True)
    D, F, r = torch_ops.gemm(A, B, relu_aux_loss, alpha=0.5, C=C, bias=bias, recompute=recompute)
    loss = (D.float() * F).sum() + r.square().sum()
    ours = torch.autograd.grad(loss, (A, B, C, bias))
    leaves = [t.detach().double().requires_grad_() for t in (A, B, C, bias)]
    D2, F2, r2 = relu_aux_loss(leaves[0] @ leaves[1], 0.5, leaves[2], leaves[3])
    theirs = torch.autograd.grad((D2 * F2).sum() + r2.square().sum(), leaves)
    tol = 2e-2  # fp32: epifuse multiplies fp32 as tf32 by default, torch's reference in full fp32
    for a, b in zip(ours, theirs):
        err = float((a.double() - b).norm() / b.norm())
        assert err < tol, err


@pytest.mark.gpu
@pytest.mark.parametrize("recompute", [False, True])
def test_second_derivatives_on_gpu_match_torch(recompute):
    """create_graph=True on the GPU kernels: the backward's own backward (saved accum included)
    gives torch's float64 second derivatives, to fp32 accuracy."""
    M_, N_, K_ = 300, 264, 200
    A = (torch.randn(M_, K_, device="cuda") / K_ ** 0.5).requires_grad_()
    B = torch.randn(K_, N_, device="cuda").requires_grad_()
    bias = torch.randn(N_, device="cuda", requires_grad=True)
    src = "def e(accum, bias):\n    D = tanh(accum + bias)\n    r = sum(D * D, dim=1)\n    return D, r\n"

    def second(fn, leaves):
        D, r = fn(*leaves)
        firsts = torch.autograd.grad(D.sum() + r.sum(), leaves, create_graph=True)
        return torch.autograd.grad(torch.stack([(g.double() ** 2).sum() for g in firsts]).sum(), leaves)

    ours = second(lambda a, b, c: torch_ops.gemm(a, b, src, bias=c, recompute=recompute, precision="highest"),
                  (A, B, bias))
    leaves = [t.detach().double().requires_grad_() for t in (A, B, bias)]

    def reference(a, b, c):
        D = torch.tanh(a @ b + c)
        return D, (D * D).sum(dim=1)

    theirs = second(reference, leaves)
    for a, b in zip(ours, theirs):
        err = float((a.double() - b).norm() / b.norm())
        assert err < 1e-4, err


def test_a_repeated_op_call_is_planned_once_per_metadata_and_errors_are_not_remembered(monkeypatch):
    """epifuse::gemm plans its outputs once per epilogue and tensor metadata (a compiled graph
    calls it with the same every step); a new shape is planned anew with its own output
    shape; an operand that does not broadcast is refused at every call, never remembered."""
    key = torch_ops.entry(torch_ops.register_epilogue(
        "def e(accum, C):\n    D = relu(accum + C)\n    R = sum(D, dim=1)\n    return D, R\n")).key
    planned = []
    real = op_planning.bind_operands
    monkeypatch.setattr(op_planning, "bind_operands", lambda *a: planned.append(1) or real(*a))
    monkeypatch.setattr(op_planning, "_OUTPUT_PLANS", type(op_planning._OUTPUT_PLANS)())
    monkeypatch.setattr(op_planning, "OUTPUT_PLANS_KEPT", 2)
    op = torch.ops.epifuse.gemm.default

    def call(M, C_shape):
        A, B = torch.randint(-3, 4, (M, 8)).float(), torch.randint(-3, 4, (8, 6)).float()
        C = torch.randint(-3, 4, C_shape).float()
        D, R = op(key, A, B, [C], [], "t", "", torch.float32, False, "highest")
        want = torch.relu(A.double() @ B.double() + C.double())
        assert torch.equal(D.double(), want) and torch.equal(R.double(), want.sum(1))
    call(5, (5, 6))
    call(5, (5, 6))
    assert len(planned) == 1
    call(7, (6,))
    assert len(planned) == 2
    for _ in range(2):
        with pytest.raises(ShapeError, match="does not broadcast"):
            call(5, (4, 6))
    assert len(planned) == 4
    call(9, (9, 6))   # a third shape: the oldest of the two kept is dropped, and planned again
    assert len(op_planning._OUTPUT_PLANS) == 2
    call(5, (5, 6))
    assert len(planned) == 6
    assert op_backward._PLANS is not op_planning._OUTPUT_PLANS   # the backward plans keep their own store
