"""Every op of the registry, through the generated Triton kernel, against its torch reference.

Walks the registry: an op either has a Triton rule and passes here, or is listed in
UNSUPPORTED with a reason. Random inputs test accuracy; special values (NaN, +-Inf, +-0,
huge and tiny numbers) test that the formulas keep torch's results.
"""
import math
import pydoc

import pytest
import torch

import epifuse
from epifuse.backends.triton.epilogue import COMBINE_HELPERS
from epifuse.backends.triton.rules import TRITON, UNSUPPORTED, missing_rules
from epifuse.ops import OPS, OpDef, reductions as all_reductions
from helpers import integer_tensor, reference_outputs, rel_error
from op_cases import ELEMENTWISE, JUMPS, expression, source_for


def test_every_op_has_a_rule_or_a_reason():
    for op in OPS.values():
        assert op in TRITON or op in UNSUPPORTED or op.is_reduction or op.kind in ("composite", "complex", "join"), op
    assert set(missing_rules()) == set(UNSUPPORTED)


def test_every_reduction_has_what_the_backends_fold_it_with():
    """A reduction is an OpDef with a Reduction record; its combine is one the reference folds
    with (Reduction.fold, .merge) and the Triton epilogue has a helper for."""
    reductions = all_reductions()
    assert {op.name for op in reductions} >= {"sum", "mean", "max", "min", "amax"}
    x = torch.tensor([[1.0, -3.0], [2.0, 0.5]])
    for op in reductions:
        assert op.kind == "reduce" and op.reduction.combine in COMBINE_HELPERS, op
        folded = op.reduction.fold(x.abs() if op.reduction.magnitude else x, (1,))
        if op.reduction.mean:
            folded = folded / 2
        assert torch.equal(folded, op(x, dim=(1,))), op
        doubled = op.reduction.merge(folded, folded)
        twice = {"add": folded * 2, "logsumexp": folded + math.log(2.0)}.get(op.reduction.combine, folded)
        assert torch.allclose(doubled, twice, rtol=1e-6, atol=0), op


def test_help_on_an_op_says_what_it_computes():
    """help(epifuse.ops.gelu) shows gelu's own doc, written from its registry entry (what it
    computes, its arguments, its torch reference, its derivative), not OpDef's class doc."""
    text = pydoc.render_doc(epifuse.ops.gelu, renderer=pydoc.plaintext)
    for part in ("gelu(x, approximate='none')", OPS["gelu"].doc, "torch.nn.functional.gelu",
                 "approximate: a literal (default 'none')", "Derivative: yes"):
        assert part in text, part
    assert "canonical name" not in text   # OpDef's own docstring
    assert "canonical name" in OpDef.__doc__ and "canonical name" in pydoc.render_doc(OpDef)
    summed = pydoc.render_doc(epifuse.ops.sum, renderer=pydoc.plaintext)
    assert "torch.sum(x, dim, keepdim)" in summed and "0-d" in summed
    lt = pydoc.render_doc(epifuse.ops.lt, renderer=pydoc.plaintext)
    assert "lt(a, b)" in lt and "torch.lt" in lt and "Also spelled: less" in lt and "Derivative: none" in lt
    for op in OPS.values():
        doc = op.__doc__
        assert doc.startswith(f"{op.name}(") and op.doc in doc and "Derivative:" in doc, op


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_op_against_reference(name, device):
    M, N, K = 40, 36, 24
    if name in JUMPS:
        A, B, C = (integer_tensor(*shape, dtype=torch.float32, device=device) for shape in ((M, K), (K, N), (M, N)))
    else:
        A = torch.randn(M, K, device=device) / math.sqrt(K)
        B = torch.randn(K, N, device=device)
        C = torch.rand(M, N, device=device) + 0.5
    D = torch.empty(M, N, device=device)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(source_for(name), C=C, D=D),
                                 precision="highest")
    kernel = epifuse.get_kernels(args)[0]
    assert kernel.name.startswith("triton_")
    D.fill_(float("nan"))
    kernel.run(args)
    ref = reference_outputs(args)["D"]
    tol = 2e-3 if name == "to" else 1e-5
    assert rel_error(D, ref) < tol, (name, rel_error(D, ref))
    assert name not in JUMPS or len(ref.unique()) > 1, "a jump seen from one side only"


SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30,
           1.0, -1.0, 0.5, -0.5, 3.0, -3.0, 6.0, 7.5, 20.0, -20.0, 90.0, -90.0, 1e-4, -1e-4]


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_op_special_values(name, device):
    """NaN and Inf propagate as in torch: the kernel matches torch's float32 result."""
    values = torch.tensor(SPECIAL, device=device)
    N = len(values)
    C = values.repeat(N, 1)                  # C[i, j] = SPECIAL[j]
    X = values[:, None].expand(N, N).contiguous()  # X[i, j] = SPECIAL[i]
    expr = expression(name)
    src = f"def epi(accum, X, C):\n    x = X\n    D = {expr}\n    return D\n"
    A = torch.randn(N, 16, device=device)
    B = torch.randn(16, N, device=device)
    D = torch.empty(N, N, device=device)
    epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, X=X, C=C, D=D))
    out = epifuse.gemm(A, B, src, X=X, C=C, out_dtype=torch.float32)
    ref = _torch_float32(name, X, C)
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), (name, _mismatch(out, ref, X, C))
    inf = torch.isinf(ref)
    assert torch.equal(out[inf], ref[inf]), (name, _mismatch(out, ref, X, C))
    finite = torch.isfinite(ref)
    close = torch.isclose(out[finite], ref[finite], rtol=5e-5, atol=1e-6)
    assert bool(close.all()), (name, _mismatch(out, ref, X, C))


def _torch_float32(name, X, C):
    """The op applied by torch in float32 (the epilogue function run on tensors)."""
    from epifuse import ops  # noqa: F401  (names for the namespace below)
    namespace = {n: OPS[n] for n in OPS}
    namespace.update(torch=torch, maximum=OPS["maximum"], minimum=OPS["minimum"],
                     row=lambda: OPS["row"](X), col=lambda: OPS["col"](X))   # positions in accum's shape
    fn_src = f"def f(x, C):\n    return ({expression(name)})\n"
    local: dict = {}
    exec(compile(fn_src, "<test>", "exec"), namespace, local)  # test-only: our own string
    return local["f"](X, C).float()


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_of_inf_is_inf_in_every_kernel(approximate, device):
    """torch's CPU erf GELU gives NaN at +inf in float32; the op (on tensors, in the reference
    kernel and in the Triton kernels) gives +inf, as its doc line says."""
    A, B = torch.ones(4, 8, device=device), torch.ones(8, 4, device=device)
    src = f"def e(accum, X):\n    D = gelu(accum * X, approximate='{approximate}')\n    return D\n"
    X = torch.tensor([float("inf"), -float("inf"), 1.0, 0.0], device=device).expand(4, 4)
    expected = torch.nn.functional.gelu(8.0 * X.double(), approximate=approximate).float()
    assert OPS["gelu"](X * 8.0, approximate=approximate)[0, 0] == float("inf")
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(src, X=X, D=torch.empty(4, 4, device=device)))
    for kernel in epifuse.get_kernels(args):
        kernel.run(args)
        out = args.outputs["D"]
        assert out[0, 0] == float("inf") and torch.isnan(out[0, 1]), kernel
        assert torch.allclose(out[:, 2:], expected[:, 2:]), kernel


def _mismatch(out, ref, X, C):
    bad = ~(torch.isclose(out, ref, rtol=5e-5, atol=1e-6, equal_nan=True))
    idx = bad.nonzero()[:5].tolist()
    return [(X[i, j].item(), C[i, j].item(), out[i, j].item(), ref[i, j].item()) for i, j in idx]


@pytest.mark.parametrize("bounds", ["min=6.0, max=4.0", "min=-1.0", "max=2.5", "min=-1.0, max=2.5"])
def test_clamp_bounds_as_torch(bounds, device):
    """clamp with both, one or crossed bounds (min > max gives max everywhere, as torch),
    NaN kept, on special values."""
    values = torch.tensor(SPECIAL, device=device)
    N = len(values)
    X = values[:, None].expand(N, N).contiguous()
    src = f"def epi(accum, X):\n    D = clamp(X, {bounds})\n    return D\n"
    A, B = torch.randn(N, 16, device=device), torch.randn(16, N, device=device)
    out = epifuse.gemm(A, B, src, X=X, out_dtype=torch.float32)
    ref = eval(f"torch.clamp(X, {bounds})", {"torch": torch, "X": X})  # test-only: our own string
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(out[~torch.isnan(ref)], ref[~torch.isnan(ref)])
