"""Autograd derived from the graph: every op's derivative rule, epilogues with broadcasts,
several outputs and losses, save-accum and recompute backwards, and the kernel path.

Three references: torch.autograd.gradcheck in float64 (numerical derivatives, on the reference
kernel); torch's own autograd through the reference interpreter (`epifuse.reference.evaluate`
runs torch ops, so torch differentiates the same epilogue with its own formulas); and, for the
fused kernels (Triton's interpreter on CPU), float32 gradients against those float64 ones.
"""
import dataclasses

import pytest
import torch

import epifuse
from epifuse import epilogue_table, op_planning, torch_ops
from epifuse.autodiff import derive
from epifuse.printing import graph_source
from epifuse.arguments import bound_graph
from epifuse.binding import bind
from epifuse.frontend import parse
from epifuse.ir import AXES, Operand
from epifuse.nn import FusedLinear
from epifuse.ops import OPS
from epifuse.passes import canonical_hash, optimize
from epifuse.reference import evaluate
from helpers import rel_error
from op_cases import ELEMENTWISE, source_for

M, N, K, L = 5, 6, 4, 2
F64 = torch.float64


def _leaf(*shape, dtype=F64, positive=False, scale=1.0):
    t = torch.rand(shape, dtype=dtype) + 0.5 if positive else torch.randn(shape, dtype=dtype) * scale
    return t.requires_grad_()


# gradcheck moves each input by 1e-6; a value that close to where a derivative jumps makes the
# numerical derivative straddle the jump (about once in 800 runs). Inputs are drawn again until
# every such value is MARGIN away: a kink of an op at 0, at C (comparisons, maximum, minimum),
# at test_ops' bounds and thresholds (clamp -0.5/0.75, softplus 2.5, hardsigmoid/hardswish
# +-3, relu6 6), or a tie between a reduction's two largest.
MARGIN = 1e-3
KINKS = (0.0, -0.5, 0.75, 2.5, 3.0, -3.0, 6.0)


def _near(x: torch.Tensor, points) -> bool:
    x = x.detach()
    return any(bool(((x - p).abs() < MARGIN).any()) for p in points)


def _drawn_clear(draw, near):
    """draw() again until near(*drawn) is False."""
    for _ in range(1000):
        drawn = draw()
        if not near(*drawn):
            return drawn
    raise AssertionError("no draw clear of the kinks in 1000 tries")


def _op_inputs():
    """A, B, C for test_ops' epilogues, clear of every kink of every op. Where test_ops.DOMAIN
    makes x |accum| + 0.5 or 0.2 accum, the ops are smooth there; abs's kink is accum's 0."""
    def near(A, B, C):
        accum = A.detach() @ B.detach()
        return _near(accum, KINKS) or _near(accum - C.detach(), (0.0,))
    return _drawn_clear(lambda: (_leaf(M, K, scale=0.5), _leaf(K, N), _leaf(M, N, positive=True)), near)


def _top_two_apart(x: torch.Tensor, dims) -> bool:
    """Whether every slice's largest and smallest values are each MARGIN from their runner-up."""
    flat = x.detach().movedim(dims, tuple(range(-len(dims), 0))).reshape(*[s for i, s in enumerate(x.shape)
                                                                           if i not in dims], -1)
    ordered = flat.sort(dim=-1).values
    return bool((ordered[..., -1] - ordered[..., -2] >= MARGIN).all()
                and (ordered[..., 1] - ordered[..., 0] >= MARGIN).all())


def _torch_reference(src, A, B, operands, compute=F64):
    """Outputs of `src` by the reference interpreter on torch tensors: torch differentiates it."""
    program = parse(src)
    accum = A.to(compute) @ B.to(compute)
    roles = op_planning.bind_operands(program, A, B, operands)[4]
    graph, _ = bound_graph(program, roles, accum.dim())
    values = {k: (v.to(compute) if isinstance(v, torch.Tensor) else v) for k, v in operands.items()}
    results = evaluate(graph, accum, values, compute)
    return tuple(results[o.name].reshape(_shape_of(o, accum)) for o in graph.outputs)


def _shape_of(out, accum):
    """The shape epifuse.gemm gives an output: accum's, or a reduction's kept dims (0-d if none)."""
    if out.node.op.is_reduction:
        axes = AXES[3 - accum.dim():]
        dims = out.node.params["dim"]
        return tuple(s for a, s in zip(axes, accum.shape) if a not in dims)
    return accum.shape


def _weights(outputs):
    """Fixed, distinct weights per output element: a loss that reads every output."""
    return [torch.linspace(-1.0, 1.5, o.numel(), dtype=F64).reshape(o.shape) for o in outputs]


def _grads(fn, inputs):
    """Gradients of a fixed weighting of every output (zeros where nothing depends on them)."""
    outs = fn()
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.double() * w).sum() for o, w in zip(outs, _weights(outs)))
    if not loss.requires_grad:  # comparisons: a boolean result carries no gradient
        return tuple(torch.zeros_like(x) for x in inputs)
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads))


# Epilogues whose torch gradient is not the one epifuse defines: `to` rounds the gradient
# through the narrow dtype in torch (x.to(float16).to(float64) casts it back down); epifuse's
# rule passes it straight through, so the reference is the identity.
STRAIGHT_THROUGH = {"to": "def epi(accum, C):\n    D = accum\n    return D\n"}


def _check_against_torch(src, A, B, operands, rtol=1e-8, reference_src=None, **options):
    leaves = [A, B] + [v for v in operands.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    ours = _grads(lambda: epifuse.gemm(A, B, src, compute_dtype=F64, **operands, **options), leaves)
    theirs = _grads(lambda: _torch_reference(reference_src or src, A, B, operands), leaves)
    for x, a, b in zip(leaves, ours, theirs):
        assert a.shape == x.shape and a.dtype == x.dtype
        assert torch.allclose(a, b, atol=1e-10, rtol=rtol), (a, b)


# ---- every op's rule ---------------------------------------------------------------------------

def test_every_op_has_a_derivative_rule():
    # composites: their ops; complex parts: no autograd in complex epilogues; joins: refused by name
    missing = [name for name, op in OPS.items() if op.vjp is None and op.kind not in ("composite", "complex", "join")]
    assert not missing, f"ops without vjp: {missing}"


GRADCHECK_OPS = [n for n in ELEMENTWISE if n != "to"]  # rounding has no numerical derivative


@pytest.mark.parametrize("name", GRADCHECK_OPS)
def test_op_gradcheck(name):
    A, B, C = _op_inputs()
    src = source_for(name)
    assert torch.autograd.gradcheck(
        lambda A, B, C: epifuse.gemm(A, B, src, C=C, compute_dtype=F64), (A, B, C))


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_op_matches_torch_autograd(name):
    A, B, C = _leaf(M, K, scale=0.5), _leaf(K, N), _leaf(M, N, positive=True)
    # torch's CPU hardsigmoid backward multiplies by a float32 1/6 (rtol 3e-8); epifuse divides by 6
    rtol = 1e-7 if name == "hardsigmoid" else 1e-8
    _check_against_torch(source_for(name), A, B, {"C": C}, rtol, STRAIGHT_THROUGH.get(name))


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_op_backward_through_the_kernel(name):
    """float32 on the fused kernel (Triton's interpreter on CPU): the backward graph of every
    rule lowers, and matches torch's float64 gradient."""
    g = torch.Generator().manual_seed(1)
    A64 = (torch.randn(M, K, dtype=F64, generator=g) * 0.5).requires_grad_()
    B64 = torch.randn(K, N, dtype=F64, generator=g).requires_grad_()
    C64 = (torch.rand(M, N, dtype=F64, generator=g) + 0.5).requires_grad_()
    A, B, C = (t.detach().float().requires_grad_() for t in (A64, B64, C64))
    src = source_for(name)
    ours = _grads(lambda: epifuse.gemm(A, B, src, C=C, precision="highest"), (A, B, C))
    theirs = _grads(lambda: _torch_reference(STRAIGHT_THROUGH.get(name, src), A64, B64, {"C": C64}),
                    (A64, B64, C64))
    for a, b in zip(ours, theirs):
        if float(b.abs().max()) == 0:
            assert float(a.abs().max()) == 0
        else:
            assert rel_error(a, b) < 1e-5, (name, rel_error(a, b))


# ---- epilogues ---------------------------------------------------------------------------------

ACTIVATION_EPILOGUES = {
    "relu": "relu(x)", "gelu": "gelu(x)", "gelu_tanh": "gelu(x, approximate='tanh')",
    "silu": "silu(x)", "sigmoid": "sigmoid(x)", "tanh": "tanh(x)", "softplus": "softplus(x)",
    "leaky_relu": "leaky_relu(x, 0.1)", "elu": "elu(x)", "mish": "mish(x)",
}


@pytest.mark.parametrize("act", sorted(ACTIVATION_EPILOGUES))
def test_activation_with_bias_gradcheck(act):
    src = f"def epi(accum, bias, alpha):\n    x = accum * alpha + bias\n    D = {ACTIVATION_EPILOGUES[act]}\n    return D\n"
    A, B, bias = _drawn_clear(lambda: (_leaf(M, K), _leaf(K, N), _leaf(N)),
                              lambda A, B, bias: _near((A @ B) * 0.75 + bias, KINKS))
    assert torch.autograd.gradcheck(
        lambda A, B, bias: epifuse.gemm(A, B, src, bias=bias, alpha=0.75, compute_dtype=F64),
        (A, B, bias))


BROADCASTS = [
    # (rank, operand shape): rows, columns, scalars, tiles, per-batch scalars, 2-D into 3-D
    (2, (N,)), (2, (1, N)), (2, (M, 1)), (2, (1,)), (2, ()), (2, (M, N)),
    (3, (L, 1, N)), (3, (L, M, 1)), (3, (L, 1, 1)), (3, (M, N)), (3, (N,)), (3, (L, M, N)),
]


@pytest.mark.parametrize("rank,shape", BROADCASTS, ids=str)
def test_broadcast_operand_gradients(rank, shape):
    """A broadcast operand's gradient is the sum over the axes it is broadcast along."""
    A = _leaf(L, M, K) if rank == 3 else _leaf(M, K)
    B = _leaf(K, N)
    C = _leaf(*shape, positive=True)
    src = "def epi(accum, C):\n    D = sigmoid(accum * C) + C * C\n    return D\n"
    assert torch.autograd.gradcheck(lambda A, B, C: epifuse.gemm(A, B, src, C=C, compute_dtype=F64),
                                    (A, B, C))


@pytest.mark.parametrize("a_shape,b_shape", [((L, M, K), (L, K, N)), ((M, K), (L, K, N)),
                                             ((1, M, K), (L, K, N)), ((L, M, K), (K, N))])
def test_batched_gradients(a_shape, b_shape):
    A, B, bias = _leaf(*a_shape), _leaf(*b_shape), _leaf(N)
    src = "def epi(accum, bias):\n    D = tanh(accum + bias)\n    return D\n"
    assert torch.autograd.gradcheck(
        lambda A, B, bias: epifuse.gemm(A, B, src, bias=bias, compute_dtype=F64), (A, B, bias))


def test_several_outputs_all_receive_gradients():
    src = ("def epi(accum, alpha, C, bias):\n    F = accum * alpha + C * 2.0 + bias\n"
           "    D = relu(F) * C\n    return D, F\n")
    A, B, C, bias = _drawn_clear(lambda: (_leaf(M, K), _leaf(K, N), _leaf(M, N), _leaf(N)),
                                 lambda A, B, C, bias: _near(A @ B * 3.0 + C * 2.0 + bias, (0.0,)))
    fn = lambda A, B, C, bias: epifuse.gemm(A, B, src, alpha=3.0, C=C, bias=bias, compute_dtype=F64)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (A, B, C, bias))
    _check_against_torch(src, A, B, {"alpha": 3.0, "C": C, "bias": bias})


def test_only_some_outputs_used():
    """Outputs that take no part in the loss contribute nothing (their gradients are zero)."""
    src = "def epi(accum, bias):\n    F = accum + bias\n    D = gelu(F)\n    return D, F\n"
    A, B, bias = _leaf(M, K), _leaf(K, N), _leaf(N)
    D, F = epifuse.gemm(A, B, src, bias=bias, compute_dtype=F64)
    (D * D).sum().backward()
    A2, B2, b2 = (t.detach().clone().requires_grad_() for t in (A, B, bias))
    (torch.nn.functional.gelu(A2 @ B2 + b2) ** 2).sum().backward()
    for x, y in ((A, A2), (B, B2), (bias, b2)):
        assert torch.allclose(x.grad, y.grad, atol=1e-12)


def test_fused_loss_gradcheck():
    """A fused binary cross-entropy: only a reduction output, which receives the gradient."""
    src = ("def bce(accum, bias, target):\n    x = accum + bias\n"
           "    l = softplus(x) - x * target\n    loss = mean(l)\n    return loss\n")
    A, B, bias = _leaf(M, K), _leaf(K, N), _leaf(N)
    target = torch.rand(M, N, dtype=F64)
    fn = lambda A, B, bias: epifuse.gemm(A, B, src, bias=bias, target=target, compute_dtype=F64)  # noqa: E731
    assert fn(A, B, bias).shape == ()
    assert torch.autograd.gradcheck(fn, (A, B, bias))
    expected = torch.nn.functional.binary_cross_entropy_with_logits(A @ B + bias, target)
    assert torch.allclose(fn(A, B, bias), expected)


@pytest.mark.parametrize("kind", ["sum", "mean", "max", "min", "amax"])
@pytest.mark.parametrize("dim", ["dim=0", "dim=1", "dim=(0, 1)"])
def test_reduction_outputs_gradcheck(kind, dim):
    src = (f"def epi(accum, C):\n    x = accum * C\n    D = tanh(x)\n    r = {kind}(x, {dim})\n"
           "    return D, r\n")
    dims = {"dim=0": (0,), "dim=1": (1,), "dim=(0, 1)": (0, 1)}[dim]

    def tied(A, B, C):
        x = (A @ B) * C
        return kind in ("max", "min", "amax") and not _top_two_apart(x.abs() if kind == "amax" else x, dims)
    A, B, C = _drawn_clear(lambda: (_leaf(M, K), _leaf(K, N), _leaf(M, N, positive=True)), tied)
    assert torch.autograd.gradcheck(
        lambda A, B, C: epifuse.gemm(A, B, src, C=C, compute_dtype=F64), (A, B, C))
    _check_against_torch(src, A, B, {"C": C})


def test_reduction_over_batches():
    src = "def epi(accum, bias):\n    x = sigmoid(accum + bias)\n    r = sum(x, dim=(0, 2))\n    return r\n"
    A, B, bias = _leaf(L, M, K), _leaf(L, K, N), _leaf(L, 1, N)
    assert torch.autograd.gradcheck(
        lambda A, B, bias: epifuse.gemm(A, B, src, bias=bias, compute_dtype=F64), (A, B, bias))


def test_recompute_matches_save():
    src = "def epi(accum, bias, C):\n    D = silu(accum + bias) * C\n    r = amax(D, dim=1)\n    return D, r\n"
    A, B, bias, C = _leaf(M, K), _leaf(K, N), _leaf(N), _leaf(M, N)
    leaves = (A, B, bias, C)
    save = _grads(lambda: torch_ops.gemm(A, B, src, bias=bias, C=C, compute_dtype=F64), leaves)
    again = _grads(lambda: torch_ops.gemm(A, B, src, bias=bias, C=C, compute_dtype=F64,
                                          recompute=True), leaves)
    for a, b in zip(save, again):
        assert torch.allclose(a, b, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda A, B, bias, C: torch_ops.gemm(A, B, src, bias=bias, C=C, compute_dtype=F64,
                                             recompute=True), leaves)


def test_only_operands_require_grad():
    src = "def epi(accum, bias):\n    D = gelu(accum + bias)\n    return D\n"
    A, B = torch.randn(M, K, dtype=F64), torch.randn(K, N, dtype=F64)
    bias = _leaf(N)
    assert torch.autograd.gradcheck(lambda bias: epifuse.gemm(A, B, src, bias=bias, compute_dtype=F64),
                                    (bias,))


def test_no_gradient_path_gives_zeros():
    """An operand that requires grad but only feeds a comparison gets a zero gradient."""
    src = "def epi(accum, C):\n    D = where(C > 0.0, accum, 0.0)\n    return D\n"
    A, B, C = _leaf(M, K), _leaf(K, N), _leaf(M, N)
    epifuse.gemm(A, B, src, C=C, compute_dtype=F64).sum().backward()
    assert torch.equal(C.grad, torch.zeros_like(C))
    assert torch.allclose(A.grad, ((C > 0).double() @ B.detach().T))


def test_mixed_input_and_operand_dtypes_keep_their_grad_dtypes():
    src = "def epi(accum, bias, C):\n    D = relu(accum + bias) * C\n    return D\n"
    A, B = _leaf(M, K, dtype=torch.float32), _leaf(K, N, dtype=torch.float32)
    bias, C = _leaf(N, dtype=F64), _leaf(M, N, dtype=torch.float16)
    D = epifuse.gemm(A, B, src, bias=bias, C=C, precision="highest")
    assert D.dtype == torch.float32
    D.sum().backward()
    assert (A.grad.dtype, B.grad.dtype, bias.grad.dtype, C.grad.dtype) == \
        (torch.float32, torch.float32, F64, torch.float16)


# ---- the fused kernel path -----------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors take the interpreter only on "
                    "CPU-only machines; on a GPU test_backward_on_gpu_matches_torch covers the kernels")
def test_backward_runs_on_the_fused_kernels(monkeypatch):
    """float32 on CPU: forward, backward epilogue and the reductions it implies all run in
    generated kernels (Triton's interpreter), not in the reference kernel."""
    used = []
    original = torch_ops.choose_kernel

    def spy(args):
        kernel = original(args)
        used.append((args.K, kernel.name))
        return kernel

    monkeypatch.setattr(torch_ops, "choose_kernel", spy)
    src = ("def epi(accum, bias, C):\n    F = accum + bias\n    D = gelu(F) * C\n"
           "    r = sum(D, dim=1)\n    return D, F, r\n")
    A, B, bias, C = (_leaf(*s, dtype=torch.float32) for s in ((40, 24), (24, 36), (36,), (40, 36)))
    outs = epifuse.gemm(A, B, src, bias=bias, C=C, precision="highest")
    leaves = (A, B, bias, C)
    ours = _grads(lambda: outs, leaves)
    doubles = [t.detach().double().requires_grad_() for t in leaves]
    theirs = _grads(lambda: _torch_reference(src, doubles[0], doubles[1],
                                             {"bias": doubles[2], "C": doubles[3]}), doubles)
    for a, b in zip(ours, theirs):
        assert rel_error(a, b) < 1e-5
    assert [k for k, _ in used] == [24, 0]        # the forward GEMM, then the K = 0 backward
    assert all(name != "reference" for _, name in used), used


def test_k_zero_gemm_is_an_epilogue_over_zeros():
    """The saved-accum backward runs its epilogue over a K = 0 GEMM: every kernel must give
    accum = 0 there."""
    src = "def epi(accum, C, bias):\n    D = C * 2.0 + accum\n    r = sum(C * bias, dim=0)\n    return D, r\n"
    C, bias = torch.randn(33, 34), torch.randn(34)
    base = torch.randn(33, 34)
    A, B = base[:, :0], base[:0, :]
    D, r = torch.empty(33, 34), torch.empty(34)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, C=C, bias=bias, D=D, r=r))
    for kernel in epifuse.get_kernels(args):
        D.fill_(float("nan"))
        r.fill_(float("nan"))
        kernel.run(args)
        assert torch.equal(D, C * 2.0), kernel
        assert torch.allclose(r, (C * bias).sum(0), atol=1e-5), kernel


# ---- autodiff itself -----------------------------------------------------------------------------

def _bound(src, roles, rank=2):
    program = parse(src)
    return optimize(bind(program, {r.name: r for r in roles}, rank))


def test_bias_gradient_is_a_column_sum():
    graph = _bound("def epi(accum, bias):\n    D = relu(accum + bias)\n    return D\n",
                   [Operand("bias", "tensor", ("N",))])
    backward = derive(graph, ("accum", "bias"), ("D",), 2)
    outputs = {o.name: o.node for o in backward.graph.outputs}
    assert outputs[backward.grads["bias"]].op.name == "sum"
    assert outputs[backward.grads["bias"]].params["dim"] == ("M",)
    assert outputs[backward.grads["bias"]].src[0] is outputs[backward.grads["accum"]]


def test_unused_operand_gets_no_output():
    graph = _bound("def epi(accum, C):\n    D = where(C > 0.0, accum, 1.0)\n    return D\n",
                   [Operand("C", "tensor", ("M", "N"))])
    backward = derive(graph, ("accum", "C"), ("D",), 2)
    assert backward.grads["C"] is None
    assert len(backward.graph.outputs) == 1


ROUND_TRIP = [
    ("def e(accum, bias, alpha):\n    F = accum * alpha + bias\n    D = gelu(F, approximate='tanh')\n"
     "    r = max(F, dim=1)\n    return D, F, r\n", (Operand("bias", "tensor", ("N",)), Operand("alpha", "number", ()))),
    ("def e(accum, C):\n    D = clamp(where(C > 0.5, accum, -accum), -1.5, 2.0).to(torch.float16)\n"
     "    s = sum(D, dim=(0, 1))\n    return D, s\n", (Operand("C", "tensor", ("M", "N")),)),
    ("def e(accum):\n    D = leaky_relu(accum, 0.25) + softplus(accum, 2.0, 10.0) + 1e-30\n    return D\n", ()),
]


@pytest.mark.parametrize("src,roles", ROUND_TRIP)
def test_graph_source_round_trips(src, roles):
    graph = _bound(src, list(roles))
    again = _bound(graph_source(graph, 2), list(roles))
    assert canonical_hash(again) == canonical_hash(graph)


def test_backward_epilogue_is_registered_once():
    src = "def epi(accum, bias):\n    D = sigmoid(accum + bias)\n    return D\n"
    A, B, bias = _leaf(M, K), _leaf(K, N), _leaf(N)
    epifuse.gemm(A, B, src, bias=bias, compute_dtype=F64).sum().backward()
    count = len(epilogue_table._TABLE)
    for _ in range(3):
        epifuse.gemm(A, B, src, bias=bias, compute_dtype=F64).sum().backward()
    assert len(epilogue_table._TABLE) == count


def test_missing_rule_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(OPS, "erf", dataclasses.replace(OPS["erf"], vjp=None))
    src = "def epi(accum):\n    D = erf(accum)\n    return D\n"
    A, B = _leaf(M, K), _leaf(K, N)
    D = epifuse.gemm(A, B, src, compute_dtype=F64)
    with pytest.raises(epifuse.EpilogueError, match="erf has no derivative rule"):
        D.sum().backward()


def test_outputs_passed_with_grad_is_an_error():
    A, B = _leaf(M, K), _leaf(K, N)
    D = torch.empty(M, N, dtype=F64)
    with pytest.raises(epifuse.EpilogueError, match="autograd does not flow through them.*but A, B require grad"):
        epifuse.gemm(A, B, "def e(accum):\n    D = relu(accum)\n    return D\n", D=D)
    with pytest.raises(epifuse.EpilogueError, match="but D requires grad"):
        epifuse.gemm(A.detach(), B.detach(), "def e(accum):\n    D = relu(accum)\n    return D\n",
                     D=torch.empty(M, N, dtype=F64, requires_grad=True))
    with torch.no_grad():
        epifuse.gemm(A, B, "def e(accum):\n    D = relu(accum)\n    return D\n", D=D)
    assert torch.allclose(D, torch.relu(A @ B).detach().float().double(), atol=1e-5)


def test_inputs_without_grad_take_the_plain_path(monkeypatch):
    calls = []
    monkeypatch.setattr(torch_ops, "gemm", lambda *a, **k: calls.append(a))
    A, B = _leaf(M, K), _leaf(K, N)
    src = "def e(accum, alpha):\n    D = accum * alpha\n    return D\n"
    with torch.no_grad():
        D = epifuse.gemm(A, B, src, alpha=2.0)
    D2 = epifuse.gemm(A.detach(), B.detach(), src, alpha=2.0)
    assert not calls and D.grad_fn is None and D2.grad_fn is None
    assert torch.allclose(D, D2)


# ---- second derivatives (create_graph=True) -----------------------------------------------------

SECOND_ORDER = {
    "tanh": ("def epi(accum):\n    D = tanh(accum)\n    return D\n", {}),
    "relu_aux": (("def epi(accum, alpha, C, bias):\n    F = accum * alpha + C * 2.0 + bias\n"
                  "    D = relu(F)\n    r = sum(D * F, dim=1)\n    return D, F, r\n"),
                 {"alpha": 0.75, "C": (M, N), "bias": (N,)}),
    "bias_operand": ("def epi(accum, bias):\n    D = sigmoid(accum * bias) + bias * bias\n    return D\n",
                     {"bias": (N,)}),
    "reductions": (("def epi(accum, b):\n    D = exp(accum * 0.5) * b\n    m = amax(D, dim=1)\n"
                    "    s = mean(D * D, dim=0)\n    return m, s\n"), {"b": (M, 1)}),
}


def _second_order(fn, inputs):
    """The first gradients (taken with create_graph=True) of a fixed weighting of every output,
    then the gradients, w.r.t. `inputs`, of their squared norm."""
    outs = fn()
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o * w).sum() for o, w in zip(outs, _weights(outs)))
    firsts = torch.autograd.grad(loss, inputs, create_graph=True, allow_unused=True)
    again = sum((g * g).sum() for g in firsts if g is not None and g.requires_grad)
    seconds = torch.autograd.grad(again, inputs, allow_unused=True)
    return tuple(torch.zeros_like(x) if g is None else g.detach() for x, g in (*zip(inputs, firsts),
                                                                           *zip(inputs, seconds)))


@pytest.mark.parametrize("recompute", [False, True], ids=["saved_accum", "recompute"])
@pytest.mark.parametrize("name", sorted(SECOND_ORDER))
def test_second_derivatives_match_torch(name, recompute):
    """Differentiating the backward (create_graph=True) gives torch's second derivatives: the
    saved accum's own gradient reaches A and B (it was dropped, a wrong number)."""
    src, shapes = SECOND_ORDER[name]
    A, B = _leaf(M, K), _leaf(K, N)
    operands = {k: _leaf(*v) if isinstance(v, tuple) else v for k, v in shapes.items()}
    leaves = [A, B] + [v for v in operands.values() if isinstance(v, torch.Tensor)]
    ours = _second_order(lambda: torch_ops.gemm(A, B, src, recompute=recompute, **operands), leaves)
    theirs = _second_order(lambda: _torch_reference(src, A, B, operands), leaves)
    for x, a, b in zip(leaves + leaves, ours, theirs, strict=True):   # first, then second order
        assert a.shape == x.shape and a.dtype == x.dtype
        assert float(b.abs().max()) > 0, "the second derivative must not vanish for this check"
        assert torch.allclose(a, b, atol=1e-10, rtol=1e-8), (name, rel_error(a, b))


@pytest.mark.parametrize("recompute", [False, True], ids=["saved_accum", "recompute"])
def test_gradgradcheck_with_operands_and_reductions(recompute):
    src = ("def epi(accum, C, bias):\n    x = accum * C + bias\n    D = tanh(x)\n"
           "    r = sum(sigmoid(x) * x, dim=1)\n    s = mean(D * C, dim=0)\n    return D, r, s\n")
    inputs = (_leaf(M, K), _leaf(K, N), _leaf(M, N), _leaf(N))
    assert torch.autograd.gradgradcheck(
        lambda A, B, C, bias: torch_ops.gemm(A, B, src, C=C, bias=bias, recompute=recompute), inputs)


@pytest.mark.parametrize("a_shape,b_shape", [((L, M, K), (K, N)), ((M, K), (L, K, N))])
def test_gradgradcheck_batched(a_shape, b_shape):
    src = "def epi(accum, bias):\n    D = gelu(accum + bias)\n    return D\n"
    inputs = (_leaf(*a_shape), _leaf(*b_shape), _leaf(L, 1, N))
    assert torch.autograd.gradgradcheck(lambda A, B, bias: epifuse.gemm(A, B, src, bias=bias), inputs)


def test_second_derivatives_through_the_fused_kernels():
    """float32 on the fused kernels (Triton's interpreter on CPU): the backward of the backward
    runs like any epilogue and matches torch's float64 second derivatives."""
    src, _ = SECOND_ORDER["tanh"]
    A64, B64 = _leaf(M, K, scale=0.5), _leaf(K, N)
    A, B = (t.detach().float().requires_grad_() for t in (A64, B64))
    ours = _second_order(lambda: epifuse.gemm(A, B, src, precision="highest"), (A, B))
    theirs = _second_order(lambda: _torch_reference(src, A64, B64, {}), (A64, B64))
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs):
        assert a.dtype == torch.float32 and rel_error(a, b) < 1e-5, rel_error(a, b)


# ---- float64 inputs compute in float64 by default ------------------------------------------------

def test_float64_gradcheck_and_gradgradcheck_with_defaults():
    """No compute_dtype given: float64 inputs compute in float64, so torch's own checks pass
    with their default tolerances (float32 epilogue math made gradcheck fail)."""
    src = "def epi(accum, bias):\n    D = tanh(accum + bias)\n    r = sum(D * D, dim=1)\n    return D, r\n"
    inputs = (_leaf(M, K), _leaf(K, N), _leaf(N))
    def fn(A, B, bias):
        return epifuse.gemm(A, B, src, bias=bias)

    D, r = fn(*inputs)
    assert D.dtype == F64 and r.dtype == F64
    expected = torch.tanh(inputs[0] @ inputs[1] + inputs[2])
    assert torch.allclose(D, expected, rtol=1e-13, atol=0)
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)
    layer = FusedLinear(K, N, epilogue="tanh", dtype=F64)
    x = _leaf(M, K)
    assert torch.autograd.gradcheck(layer, (x,))
    assert torch.autograd.gradgradcheck(layer, (x,))
