"""Named epilogues (epifuse.epilogues), class-based epilogues (FusedGemm) and epifuse.debug.

CPU tests run the generated kernels through Triton's interpreter at tiny sizes; the `gpu`
section at the end checks the named and class-based epilogues against torch on CUDA.
"""
import inspect
import math
import os
import pickle

import pytest
import torch
import torch.nn.functional as F

import epifuse
from epifuse import EpilogueError, debug, epilogues as E
from epifuse import activations
from epifuse.epilogues import ScaleType
from epifuse.printing import program_source
from epifuse.frontend import parse
from epifuse.ops import relu, sigmoid

M, N, K, L = 16, 16, 16, 2


def _inputs(device="cpu", batched=False, dtype=torch.float32):
    batch = (L,) if batched else ()
    A = torch.randn(*batch, M, K, device=device, dtype=dtype)
    B = (torch.randn(*batch, K, N, device=device) / math.sqrt(K)).to(dtype)
    C = torch.randn(*batch, M, N, device=device)
    return A, B, C, A.double() @ B.double()


def _close(out, ref, tol=2e-5):
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.allclose(out, ref, rtol=tol, atol=tol), (out - ref).abs().max()


# ---- named epilogues: sources -----------------------------------------------------------------

def test_named_epilogue_is_its_source():
    epi = E.LinearCombinationRelu()
    assert isinstance(epi, str)
    assert str(epi) == ("def linear_combination_relu(accum, alpha, beta, C):\n"
                        "    F = alpha * accum + beta * C\n    D = relu(F)\n    return D\n")
    assert repr(epi) == "LinearCombinationRelu()"
    assert epi.operands == ("alpha", "beta", "C") and epi.outputs == ("D",)
    assert epi.roles == {"alpha": "number", "beta": "number", "C": "tile"}
    assert parse(epi).statements == epi.program.statements


@pytest.mark.parametrize("scale, params, line", [
    (ScaleType.DEFAULT, "accum, alpha, beta, C", "alpha * accum + beta * C"),
    (ScaleType.NO_BETA_SCALING, "accum, alpha, C", "alpha * accum + C"),
    (ScaleType.ONLY_ALPHA_SCALING, "accum, alpha", "alpha * accum"),
    (ScaleType.NOTHING, "accum", "accum"),
])
def test_scale_type_templates(scale, params, line):
    assert str(E.LinearCombination(scale)) == (f"def linear_combination({params}):\n"
                                               f"    D = {line}\n    return D\n")


def test_scale_type_names():
    assert ScaleType.of("NoBetaScaling") is ScaleType.NO_BETA_SCALING
    assert ScaleType.of("only_alpha_scaling") is ScaleType.ONLY_ALPHA_SCALING
    assert ScaleType.PER_CHANNEL_SCALING is ScaleType.DEFAULT
    with pytest.raises(EpilogueError, match="Unknown scale type 'sometimes'"):
        ScaleType.of("sometimes")


@pytest.mark.parametrize("make, statement", [
    (lambda: E.LinearCombinationGELU(), "D = gelu(F)"),
    (lambda: E.LinearCombinationGELU(approximate="tanh"), "D = gelu(F, approximate='tanh')"),
    (lambda: E.LinearCombinationSigmoid(), "D = sigmoid(F)"),
    (lambda: E.LinearCombinationSilu(), "D = silu(F)"),
    (lambda: E.LinearCombinationHardswish(), "D = hardswish(F)"),
    (lambda: E.LinearCombinationLeakyRelu(0.2), "D = leaky_relu(F, negative_slope=0.2)"),
    (lambda: E.LinearCombinationClamp(min=-1.0, max=2), "D = clamp(F, max=2.0, min=-1.0)"),
    (lambda: E.LinearCombination(activation="tanh"), "D = tanh(F)"),
    (lambda: E.LinearCombination(activation=epifuse.ops.mish), "D = mish(F)"),
    (lambda: E.LinearCombination(activation=torch.relu), "D = relu(F)"),
    (lambda: E.LinearCombination(activation=F.silu), "D = silu(F)"),
    (lambda: E.BiasElementwise(E.Clamp(max=6.0)), "D = clamp(F, max=6.0)"),
])
def test_activation_statements(make, statement):
    epi = make()
    assert f"    {statement}\n" in epi


def test_activation_errors():
    with pytest.raises(EpilogueError, match="approximate must be 'none' .erf. or 'tanh'"):
        E.LinearCombinationGELU(approximate="fast")
    with pytest.raises(EpilogueError, match="LeakyRelu slope must be a finite number"):
        E.LeakyRelu(float("nan"))
    with pytest.raises(EpilogueError, match="Clamp needs a min, a max, or both"):
        E.LinearCombinationClamp()
    with pytest.raises(EpilogueError, match="Clamp min 2.0 is larger than max 1.0"):
        E.Clamp(2.0, 1.0)
    with pytest.raises(EpilogueError, match="'sum' is not a unary elementwise op"):
        E.LinearCombination(activation="sum")
    with pytest.raises(EpilogueError, match="elu\\(\\) has no parameter 'slope'"):
        E.Activation("elu", slope=1.0)
    with pytest.raises(EpilogueError, match="Cannot use int as an activation"):
        E.BiasElementwise(3)


@pytest.mark.parametrize("make", [
    lambda: E.LeakyRelu(10**400), lambda: E.Clamp(min=10**400), lambda: E.LinearCombinationLeakyRelu(-10**400),
    lambda: E.Activation("elu", alpha=10**400),
])
def test_integers_too_large_for_a_float_are_not_finite(make):
    with pytest.raises(EpilogueError, match="must be a finite number, got an integer too large for a float"):
        make()


def test_pickle_and_equality():
    epi = E.BiasElementwise("relu", scale="NoBetaScaling", store_preactivation=True)
    again = pickle.loads(pickle.dumps(epi))
    assert again == epi and type(again) is E.BiasElementwise
    assert repr(again) == repr(epi) == ("BiasElementwise(Activation('relu'), "
                                        "scale=ScaleType.NO_BETA_SCALING, store_preactivation=True)")
    assert again.outputs == ("D", "Z")


# ---- Generic: a user's activation, parsed and inlined -------------------------------------------

def quick_gelu(x):
    # a comment line, which the parser skips
    t = 1.702 * x
    y = x * sigmoid(t)
    return y


def uses_accum(x):
    y = x + accum  # noqa: F821 - accum is not the activation's to read
    return y


def two_args(x, z):
    return x


def identity(x):
    return x


def test_generic_inlines_prefixed_locals():
    epi = E.Generic(quick_gelu)
    assert str(epi) == ("def linear_combination_generic(accum, alpha, beta, C):\n"
                        "    F = alpha * accum + beta * C\n"
                        "    act_t = 1.702 * F\n"
                        "    D = F * sigmoid(act_t)\n"
                        "    return D\n")
    assert repr(epi) == "Generic(quick_gelu)"
    assert "D = F\n" in E.Generic(identity)
    same = E.Generic("def g(v):\n    w = v * sigmoid(1.702 * v)\n    return w\n")
    assert "D = F * sigmoid(1.702 * F)" in same


def test_generic_errors_point_at_the_activation():
    line = inspect.getsourcelines(uses_accum)[1] + 1
    with pytest.raises(EpilogueError, match="Variable 'accum' is not defined") as info:
        E.Generic(uses_accum)
    assert info.value.loc.line == line and info.value.loc.filename.endswith("test_epilogues.py")
    with pytest.raises(EpilogueError, match="takes exactly one argument, but two_args\\(\\) takes 2"):
        E.Generic(two_args)
    with pytest.raises(EpilogueError, match="Lambdas cannot be activations"):
        E.Generic(lambda x: x)
    with pytest.raises(EpilogueError, match="Unsupported operation 'gleu'") as info:
        E.Generic("def act(x):\n    y = gleu(x)\n    return y\n")
    assert "Did you mean" in str(info.value)
    with pytest.raises(EpilogueError, match="Generic needs an activation"):
        E.Generic(None)


def test_generic_never_calls_the_activation():
    calls = []

    def act(x):
        y = relu(x)
        return y

    act.__call__ = lambda *a: calls.append(a)   # would record a call; there must be none
    epi = E.Generic(act)
    A, B, C, accum = _inputs()
    _close(epi(A, B, C=C), torch.relu(accum + C.double()))
    assert calls == []


# ---- running named epilogues ----------------------------------------------------------------------

NAMED_CASES = [
    (lambda: E.LinearCombination(), lambda f: f),
    (lambda: E.LinearCombinationRelu(), torch.relu),
    (lambda: E.LinearCombinationGELU(), lambda f: F.gelu(f)),
    (lambda: E.LinearCombinationGELU(approximate="tanh"), lambda f: F.gelu(f, approximate="tanh")),
    (lambda: E.LinearCombinationSigmoid(), torch.sigmoid),
    (lambda: E.LinearCombinationSilu(), F.silu),
    (lambda: E.LinearCombinationHardswish(), F.hardswish),
    (lambda: E.LinearCombinationLeakyRelu(0.3), lambda f: F.leaky_relu(f, 0.3)),
    (lambda: E.LinearCombinationClamp(min=-0.5, max=0.75), lambda f: f.clamp(-0.5, 0.75)),
    (lambda: E.Generic(quick_gelu), lambda f: f * torch.sigmoid(1.702 * f)),
]


@pytest.mark.parametrize("make, ref", NAMED_CASES)
def test_named_epilogues_match_torch(make, ref):
    A, B, C, accum = _inputs()
    epi = make()
    D = epi(A, B, alpha=1.5, beta=-0.5, C=C)
    _close(D, ref(1.5 * accum - 0.5 * C.double()))


def test_named_epilogue_arguments_and_every_kernel():
    A, B, C, accum = _inputs()
    epi = E.LinearCombinationSilu()
    args = epi.arguments(A, B, alpha=2.0, beta=0.25, C=C)
    kernels = epifuse.get_kernels(args)
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert [k.name for k in kernels] == ["triton_persistent", "triton_tiled", "reference"]
    for kernel in kernels:
        debug.run(kernel, args, verify=True)   # raises on a mismatch
    _close(args.outputs["D"], F.silu(2.0 * accum + 0.25 * C.double()))


@pytest.mark.parametrize("scale, ref", [
    ("default", lambda acc, C: 2.0 * acc + 0.5 * C),
    ("no_beta_scaling", lambda acc, C: 2.0 * acc + C),
    ("only_alpha_scaling", lambda acc, C: 2.0 * acc),
    ("nothing", lambda acc, C: acc),
])
def test_scale_types_run(scale, ref):
    A, B, C, accum = _inputs()
    epi = E.LinearCombinationRelu(scale=scale)
    tensors = {k: v for k, v in dict(alpha=2.0, beta=0.5, C=C).items() if k in epi.operands}
    _close(epi(A, B, **tensors), torch.relu(ref(accum, C.double())))


def test_alpha_beta_forms():
    A, B, C, accum = _inputs(batched=True)
    epi = E.LinearCombination()
    C64 = C.double()
    one = torch.tensor([1.5])
    per_channel = torch.rand(N) + 0.5
    per_row = torch.rand(M, 1)
    per_batch = torch.tensor([2.0, -1.0])
    _close(epi(A, B, alpha=one, beta=one, C=C), 1.5 * accum + 1.5 * C64)
    _close(epi(A, B, alpha=per_channel, beta=0.0, C=C), per_channel.double() * accum)
    _close(epi(A, B, alpha=1.0, beta=per_row, C=C), accum + per_row.double() * C64)
    _close(epi(A, B, alpha=per_batch, beta=per_batch, C=C),
           per_batch.double().view(L, 1, 1) * (accum + C64))
    _close(epi(A, B, C=C), accum + C64)   # alpha = beta = 1.0 by default, as torch.addmm


def test_per_batch_ambiguity_is_an_error():
    A, B = torch.randn(4, 8, 4), torch.randn(4, 4, 4)   # L == N == 4
    with pytest.raises(EpilogueError, match=r"alpha has shape \(4,\), which is both one value per batch") as info:
        E.LinearCombination()(A, B, alpha=torch.ones(4), C=torch.zeros(4, 8, 4))
    assert "alpha.reshape(4, 1, 1)" in str(info.value)


def test_one_element_alpha_is_read_at_run_time():
    A, B, C, accum = _inputs()
    epi = E.LinearCombination(ScaleType.ONLY_ALPHA_SCALING)
    alpha = torch.tensor([2.0])
    args = epi.arguments(A, B, alpha=alpha)
    kernel = epifuse.get_kernels(args)[0]
    kernel.run(args)
    _close(args.outputs["D"], 2.0 * accum)
    alpha.fill_(-3.0)
    kernel.run(args)
    _close(args.outputs["D"], -3.0 * accum)


def test_in_place_D_is_C():
    A, B, C, accum = _inputs(batched=True)
    before = C.double().clone()
    out = E.LinearCombinationRelu()(A, B, alpha=1.0, beta=2.0, C=C, D=C)
    assert out is C
    _close(C, torch.relu(accum + 2.0 * before))


def test_bias_elementwise_with_preactivation():
    A, B, C, accum = _inputs()
    bias = torch.randn(N)
    epi = E.BiasElementwise(E.GELU("tanh"), store_preactivation=True)
    D, Z = epi(A, B, alpha=1.0, beta=0.5, C=C, bias=bias)
    z = accum + 0.5 * C.double() + bias.double()
    _close(Z, z)
    _close(D, F.gelu(z, approximate="tanh"))


def test_named_epilogue_through_epifuse_gemm_and_strings():
    A, B, C, accum = _inputs()
    epi = E.LinearCombinationHardswish()
    _close(epifuse.gemm(A, B, epi, alpha=1.0, beta=1.0, C=C), F.hardswish(accum + C.double()))
    _close(epifuse.gemm(A, B, str(epi), alpha=1.0, beta=1.0, C=C), F.hardswish(accum + C.double()))


def test_named_epilogue_errors_are_epilogue_errors():
    A, B, C, _ = _inputs()
    with pytest.raises(EpilogueError, match="Argument C is not provided"):
        E.LinearCombination()(A, B, alpha=1.0)
    with pytest.raises(EpilogueError, match="Unexpected keyword argument 'gamma'"):
        E.LinearCombination()(A, B, C=C, gamma=1.0)


def test_named_and_class_based_epilogues_are_differentiable():
    A = torch.randn(M, K, dtype=torch.float64, requires_grad=True)
    B = torch.randn(K, N, dtype=torch.float64)
    C = torch.randn(M, N, dtype=torch.float64, requires_grad=True)
    D = E.LinearCombinationSilu()(A, B, alpha=2.0, beta=0.5, C=C, compute_dtype=torch.float64)
    D.sum().backward()
    A2, C2 = A.detach().clone().requires_grad_(), C.detach().clone().requires_grad_()
    F.silu(2.0 * A2 @ B + 0.5 * C2).sum().backward()
    assert torch.allclose(A.grad, A2.grad) and torch.allclose(C.grad, C2.grad)
    bias = torch.randn(N, dtype=torch.float64, requires_grad=True)
    TwoOutputs(compute_dtype=torch.float64)(A, B, bias=bias)[0].sum().backward()
    assert torch.allclose(bias.grad, ((A.detach() @ B + bias.detach()) > 0).double().sum(0))


# ---- printing programs back to source ----------------------------------------------------------

def test_program_source_round_trips():
    src = ("def e(accum, a, b):\n"
           "    t = -(accum * a) + relu(a - b) ** 2.0\n"
           "    u = where(t > 0.0, -t, t < -1.0)\n"
           "    v = clamp(u, min=-1e999, max=3.0) + sum(u * 2.0, dim=(0, 1)) + max(t, 1) + max(t, u)\n"
           "    w = ~(t > 1.0) | (u <= 2.0)\n"
           "    x = gelu(v, approximate='tanh').to(torch.float16) / w + logical_not(accum) + logical_or(a, t)\n"
           "    return v, x\n")
    once = program_source(parse(src))
    assert program_source(parse(once)) == once and "logical_not(accum)" in once
    assert "max(t, dim=(1,))" in once and "maximum(t, u)" in once and "-1e999" in once


# ---- class-based epilogues ---------------------------------------------------------------------------

class AlphaBetaX(epifuse.FusedGemm):
    def epilogue(self, accum, C, X, alpha, beta, x_factor):
        D = alpha * accum + beta * C + x_factor * X
        return D


class TwoOutputs(epifuse.FusedGemm):
    @staticmethod
    def epilogue(accum, bias):
        D = relu(accum + bias)
        r = D.amax(dim=1)
        return D, r


def test_fused_gemm_matches_torch():
    A, B, C, accum = _inputs(batched=True)
    X = torch.randn(L, M, N)
    op = AlphaBetaX()
    D = op(A, B, C=C, X=X, alpha=1.5, beta=0.5, x_factor=-2.0)
    _close(D, 1.5 * accum + 0.5 * C.double() - 2.0 * X.double())
    # the method is its own eager reference
    ref = op.epilogue(accum, C.double(), X.double(), 1.5, 0.5, -2.0)
    _close(D, ref)
    assert AlphaBetaX.operands == ("C", "X", "alpha", "beta", "x_factor")
    assert AlphaBetaX.program.name == "AlphaBetaX"


def test_fused_gemm_outputs_options_and_kernels():
    A, B, C, accum = _inputs()
    bias = torch.randn(N)
    D, r = TwoOutputs(out_dtype=torch.float16)(A, B, bias=bias)
    assert D.dtype == torch.float16 and r.shape == (M,)
    expected = torch.relu(accum + bias.double())
    _close(D, expected, tol=2e-3)
    _close(r, expected.amax(dim=1))
    args = TwoOutputs().arguments(A, B, bias=bias)
    assert set(args.outputs) == {"D", "r"} and args.reductions == {"r": "amax"}
    report = debug.run(epifuse.get_kernels(args)[-2:][0], args)   # the tiled kernel, if there
    assert report.ok and [c.name for c in report.checks] == ["D", "r"]


def test_fused_gemm_errors():
    A, B, C, _ = _inputs()
    line = inspect.getsourcelines(AlphaBetaX.epilogue)[1]
    with pytest.raises(EpilogueError, match="Argument x_factor is not provided") as info:
        AlphaBetaX()(A, B, C=C, X=C, alpha=1.0, beta=1.0, x_fator=2.0)
    assert info.value.loc.line == line and "'x_fator'" in str(info.value)
    with pytest.raises(EpilogueError, match="Unexpected keyword argument 'gamma'"):
        AlphaBetaX()(A, B, C=C, X=C, alpha=1.0, beta=1.0, x_factor=2.0, gamma=1.0)


def test_fused_gemm_method_as_a_string():
    class FromString(epifuse.FusedGemm):
        epilogue = "def epilogue(self, accum, s):\n    D = accum * s\n    return D\n"

    A, B, _, accum = _inputs()
    assert FromString.operands == ("s",) and FromString.source.startswith("def FromString(accum, s):")
    _close(FromString()(A, B, s=3.0), 3.0 * accum)


def test_fused_gemm_rejects_self_and_bad_methods():
    with pytest.raises(EpilogueError, match="'self' cannot be used inside UsesSelf.epilogue"):
        class UsesSelf(epifuse.FusedGemm):
            def epilogue(self, accum):
                D = accum * self.scale
                return D
    with pytest.raises(EpilogueError, match="must take self first"):
        class NoSelf(epifuse.FusedGemm):
            def epilogue(accum):
                D = accum
                return D
    with pytest.raises(EpilogueError, match="'if' is not supported"):
        class Branchy(epifuse.FusedGemm):
            def epilogue(self, accum):
                if accum:
                    D = accum
                return D
    with pytest.raises(TypeError, match="defines no epilogue"):
        epifuse.FusedGemm()


# ---- debug: verify, trace, alignment, pictures ------------------------------------------------------

def _relu_aux(accum, alpha, C, bias):
    F = (accum * alpha) + (C * 2.0) + bias
    D = relu(F) * sigmoid(F)
    s = sum(D, dim=1)
    return D, F, s


def _args(M_=40, N_=36, K_=16):
    A, B = torch.randn(M_, K_), torch.randn(K_, N_) / 4
    C, bias = torch.randn(M_, N_), torch.randn(N_)
    outs = dict(D=torch.empty(M_, N_), F=torch.empty(M_, N_, dtype=torch.float16), s=torch.empty(M_))
    return epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(
        _relu_aux, alpha=3.0, C=C, bias=bias, **outs))


def test_verify_passes_and_reports_each_output():
    args = _args()
    report = debug.run(epifuse.get_kernels(args)[0], args, verify=True)
    assert report.ok and [c.name for c in report.checks] == ["D", "F", "s"]
    assert report.checks[1].rtol == 2e-3 and report.checks[0].rtol == 2e-5
    assert "matches the float64 reference" in str(report)


class _Broken:
    """A kernel that writes one wrong element (and one NaN) into D."""

    name = "broken"

    def __init__(self, inner):
        self.inner = inner

    def __repr__(self):
        return "<broken>"

    def run(self, args):
        self.inner.run(args)
        args.outputs["D"][3, 5] += 1.0


def test_verify_raises_with_the_largest_error_and_where():
    args = _args()
    with pytest.raises(debug.VerificationError, match=r"FAIL D: largest error 1 at \(3, 5\)") as info:
        debug.run(_Broken(epifuse.get_kernels(args)[-1]), args)
    assert not info.value.report.ok
    report = debug.run(_Broken(epifuse.get_kernels(args)[-1]), args, raise_on_mismatch=False)
    assert [c.ok for c in report.checks] == [False, True, True]


def test_verify_catches_nan_mismatch():
    out, ref = torch.zeros(4, 4), torch.zeros(4, 4)
    out[1, 2] = float("nan")
    check = debug.compare("D", out, ref, 1e-5)
    assert not check.ok and check.index == (1, 2) and "NaN" in check.note
    ref[1, 2] = float("nan")
    assert debug.compare("D", out, ref, 1e-5).ok


def test_with_verify_adds_the_keyword():
    from epifuse.backends.reference import ReferenceKernel

    class Checked(ReferenceKernel):
        run = debug.with_verify(ReferenceKernel.run)

    class Wrong(ReferenceKernel):
        @debug.with_verify
        def run(self, args):
            ReferenceKernel.run(self, args)
            args.outputs["s"].mul_(2.0)

    args = _args()
    assert Checked().run(args) is None
    assert Checked().run(args, verify=True).ok
    with pytest.raises(debug.VerificationError, match="FAIL s"):
        Wrong().run(args, verify=True)


def test_verify_in_place_uses_the_inputs_before_the_run():
    A, B, C, accum = _inputs()
    before = C.double().clone()
    args = E.LinearCombination().arguments(A, B, alpha=1.0, beta=1.0, C=C, D=C)
    report = debug.run(epifuse.get_kernels(args)[0], args)
    assert report.ok
    _close(C, accum + before)


def test_trace_every_intermediate_of_one_tile():
    args = _args()
    kernel = epifuse.get_kernels(args)[0]
    kernel.run(args)
    t = debug.trace(args, tile=(1, 1), tile_shape=(32, 32))
    assert t.rows == range(32, 40) and t.cols == range(32, 36)
    for name in ("accum", "alpha", "C", "bias", "F", "D", "s"):
        assert name in t
    _close(t["D"], args.outputs["D"][32:40, 32:36], tol=1e-5)
    _close(t["F"], (t["accum"] * 3.0 + t["C"] * 2.0 + t["bias"]))
    assert t["s"].shape == (8,)   # a reduction over the tile only
    labels = [s.label for s in t.steps]
    assert "relu(F)" in labels and "sigmoid(F)" in labels and "mul(C, 2.0)" in labels
    text = str(t)
    assert text.startswith("tile (1, 1): rows 32..39, columns 32..35") and "D = mul(relu(F), sigmoid(F))" in text


def test_trace_default_tile_and_batched_operands():
    A, B, C, accum = _inputs(batched=True)
    epi = E.BiasElementwise("relu")
    bias = torch.randn(N)
    args = epi.arguments(A, B, alpha=torch.tensor([1.0, 2.0]), beta=0.5, C=C, bias=bias)
    t = debug.trace(args)   # the interpreter's 32 x 32 tiles: one tile covers 16 x 16
    assert t["D"].shape == (L, M, N)
    _close(t["D"], torch.relu(torch.tensor([1.0, 2.0]).double().view(L, 1, 1) * accum
                              + 0.5 * C.double() + bias.double()))
    with pytest.raises(EpilogueError, match=r"Tile \(1, 0\) is outside the 1 x 1 grid"):
        debug.trace(args, tile=(1, 0))


def test_alignment_report_flags_misaligned_strides():
    A = torch.randn(16, 17, dtype=torch.float16)     # a 34-byte row stride
    B = torch.randn(17, 16, dtype=torch.float16)
    args = epifuse.GemmArguments(A, B, out=torch.empty(16, 16))
    rows = {name: (ok, text) for name, ok, text in debug.alignment_report(args)}
    assert not rows["A"][0] and "stride 17 (34 bytes) is not a multiple of 16 bytes" in rows["A"][1]
    assert rows["B"][0] and rows["D"][0]


def test_dot_source_and_draw(tmp_path):
    args = _args()
    dot = debug.dot_source(args.graph, "relu_aux")
    assert dot.startswith('digraph "relu_aux" {') and 'label="relu\\nD"' not in dot
    assert 'out_D [label="D"' in dot and 'label="sum(dim=(\'N\',))\\ns"' in dot
    path = debug.draw(args.graph, tmp_path / "g.dot")
    assert path.read_text() == debug.dot_source(args.graph)
    with pytest.raises(EpilogueError, match="use a .svg, .png, .pdf or .dot file"):
        debug.draw(args.graph, tmp_path / "g.txt")


@pytest.mark.skipif(not debug.dot_available(), reason="graphviz's dot is not installed")
def test_draw_with_graphviz(tmp_path):
    args = _args()
    svg = debug.draw(args.graph, tmp_path / "g.svg", "relu_aux")
    assert "<svg" in svg.read_text() and "relu_aux" in svg.read_text()
    png = debug.draw(args.graph, tmp_path / "g.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_random_arguments_roles():
    args = debug.random_arguments(_relu_aux, 16, 24, 8, roles={"alpha": "number", "bias": "row"},
                                  dtype=torch.float32, device="cpu")
    assert isinstance(args.operands["alpha"], float)
    assert args.operands["bias"].shape == (24,) and args.operands["C"].shape == (16, 24)
    assert args.outputs["s"].shape == (16,) and args.outputs["D"].dtype == torch.float32
    with pytest.raises(EpilogueError, match="not an operand of _relu_aux"):
        debug.random_arguments(_relu_aux, 16, 24, 8, roles={"gamma": "row"})


# ---- GPU: named and class-based epilogues against torch at 512 x 512 x 256 -------------------------

GPU_M, GPU_N, GPU_K = 512, 512, 256


@pytest.fixture
def untuned(monkeypatch):
    """epifuse.gemm takes the first supported kernel: no timing of every config per epilogue."""
    monkeypatch.setenv("EPIFUSE_TUNE", "0")


def _gpu_inputs(dtype=torch.float16, batched=False):
    batch = (3,) if batched else ()
    A = torch.randn(*batch, GPU_M, GPU_K, device="cuda", dtype=dtype)
    B = (torch.randn(*batch, GPU_K, GPU_N, device="cuda") / math.sqrt(GPU_K)).to(dtype)
    C = torch.randn(*batch, GPU_M, GPU_N, device="cuda", dtype=dtype)
    return A, B, C, A.double() @ B.double()


def _rel(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


@pytest.mark.gpu
@pytest.mark.parametrize("make, ref", NAMED_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_named_epilogues(make, ref, dtype, untuned):
    A, B, C, accum = _gpu_inputs(dtype)
    epi = make()
    args = epi.arguments(A, B, alpha=1.5, beta=-0.5, C=C)
    kernels = epifuse.get_kernels(args)
    assert kernels[0].name != "reference", epifuse.kernel_statuses(args)
    for kernel in kernels[:2]:
        args.outputs["D"].fill_(float("nan"))
        kernel.run(args)
        torch.cuda.synchronize()
        expected = ref(1.5 * accum - 0.5 * C.double())
        tol = 4e-3 if dtype == torch.float16 else 2e-2
        assert _rel(args.outputs["D"], expected) < tol, (kernel, _rel(args.outputs["D"], expected))
    D = epi(A, B, alpha=1.5, beta=-0.5, C=C)
    assert _rel(D, ref(1.5 * accum - 0.5 * C.double())) < (4e-3 if dtype == torch.float16 else 2e-2)


@pytest.mark.gpu
def test_gpu_named_alpha_beta_forms_and_in_place(untuned):
    A, B, C, accum = _gpu_inputs(batched=True)
    per_batch = torch.tensor([1.0, -2.0, 0.5], device="cuda")
    per_channel = torch.rand(GPU_N, device="cuda") + 0.5
    one = torch.tensor([0.75], device="cuda")
    C64 = C.double()
    epi = E.LinearCombinationRelu()
    D = epi(A, B, alpha=per_batch, beta=one, C=C)
    assert _rel(D, torch.relu(per_batch.double().view(3, 1, 1) * accum + 0.75 * C64)) < 4e-3
    D = epi(A, B, alpha=per_channel, beta=per_batch, C=C)
    assert _rel(D, torch.relu(per_channel.double() * accum + per_batch.double().view(3, 1, 1) * C64)) < 4e-3
    out = epi(A, B, alpha=1.0, beta=1.0, C=C, D=C)
    torch.cuda.synchronize()
    assert out is C and _rel(C, torch.relu(accum + C64)) < 4e-3


@pytest.mark.gpu
def test_gpu_bias_elementwise_and_generic(untuned):
    A, B, C, accum = _gpu_inputs()
    bias = torch.randn(GPU_N, device="cuda")
    D, Z = E.BiasElementwise("gelu", store_preactivation=True)(A, B, alpha=1.0, beta=0.5, C=C, bias=bias,
                                                              out_dtype=torch.float32)
    z = accum + 0.5 * C.double() + bias.double()
    assert _rel(Z, z) < 1e-5 and _rel(D, F.gelu(z)) < 1e-5
    D = E.Generic(quick_gelu)(A, B, alpha=1.0, beta=1.0, C=C)
    pre = accum + C.double()
    assert _rel(D, pre * torch.sigmoid(1.702 * pre)) < 4e-3


@pytest.mark.gpu
def test_gpu_class_based_epilogues(untuned):
    A, B, C, accum = _gpu_inputs(batched=True)
    X = torch.randn_like(C)
    D = AlphaBetaX()(A, B, C=C, X=X, alpha=1.5, beta=0.5, x_factor=-2.0)
    assert _rel(D, 1.5 * accum + 0.5 * C.double() - 2.0 * X.double()) < 4e-3
    A, B, C, accum = _gpu_inputs()
    bias = torch.randn(GPU_N, device="cuda")
    args = TwoOutputs().arguments(A, B, bias=bias)
    kernels = epifuse.get_kernels(args)
    assert kernels[0].name != "reference", epifuse.kernel_statuses(args)
    for kernel in kernels[:2]:
        report = debug.run(kernel, args, verify=True)
        assert report.ok, report


@pytest.mark.gpu
def test_gpu_verify_and_trace():
    A, B, C, accum = _gpu_inputs()
    args = E.LinearCombinationSilu().arguments(A, B, alpha=1.0, beta=1.0, C=C)
    kernel = epifuse.get_kernels(args)[0]
    assert debug.run(kernel, args, verify=True).ok
    t = debug.trace(args, tile=(1, 1))
    rows, cols = t.rows, t.cols
    assert _rel(t["D"], args.outputs["D"][rows.start:rows.stop, cols.start:cols.stop]) < 4e-3


# ---- LinearCombinationBiasRelu and LinearCombinationTensorBroadcast (CUTLASS's names) -----------

def test_bias_relu_is_cutlass_s_with_its_mask(device):
    """z = alpha * accum + beta * C + bias; D = fmax(z, threshold) (NaN gives threshold); T = 1
    where z is not below threshold (NaN included), as CUTLASS's ReluConditional; through the
    fused kernel, against float64."""
    M, N, K = 40, 36, 8
    A, B = torch.randn(M, K, device=device), torch.randn(K, N, device=device)
    C, bias = torch.randn(M, N, device=device), torch.randn(N, device=device)
    C[3, 4] = float("nan")
    epi = E.LinearCombinationBiasRelu()
    assert epi.outputs == ("D", "T") and "LinearCombinationBiasRelu" in E.NAMED
    D, T = epi(A, B, alpha=1.5, beta=0.5, C=C, bias=bias, threshold=0.25, T=torch.empty(M, N, device=device, dtype=torch.uint8))
    z = 1.5 * (A.double() @ B.double()) + 0.5 * C.double() + bias.double()
    expected = torch.where(z >= 0.25, z, torch.tensor(0.25, dtype=torch.float64, device=device))
    assert D[3, 4] == 0.25 and T[3, 4] == 1
    assert torch.allclose(D.double(), expected, atol=1e-5)
    far = (z - 0.25).abs() > 1e-4   # away from the threshold, where fp32 and float64 z agree on the side
    assert torch.equal(T[far], (~(z < 0.25))[far].to(torch.uint8))
    only_d = E.LinearCombinationBiasRelu(store_mask=False, scale="no_beta_scaling")
    assert only_d.outputs == ("D",) and "beta" not in only_d.operands
    assert repr(only_d) == "LinearCombinationBiasRelu(store_mask=False, scale=ScaleType.NO_BETA_SCALING)"


@pytest.mark.parametrize("op0, op1, combine", [
    ("plus", None, lambda o, c0, c1: o + c0),
    ("minus", "divides", lambda o, c0, c1: (o - c0) / c1),
    ("multiplies", "maximum", lambda o, c0, c1: torch.maximum(o * c0, c1)),
    (None, None, lambda o, c0, c1: o),
])
def test_tensor_broadcast_is_cutlass_s(op0, op1, combine, device):
    """O0 = act(alpha * accum + bias), O1 = op0(O0, beta * C0), O2 = op1(O1, beta * C1),
    D = unary(O2), with beta grouped with its source (divides divides by beta * C1)."""
    M, N, K = 30, 20, 8
    A, B = torch.randn(M, K, device=device), torch.randn(K, N, device=device)
    bias, C0 = torch.randn(N, device=device), torch.randn(M, N, device=device)
    C1 = torch.rand(M, N, device=device) + 0.5
    epi = E.LinearCombinationTensorBroadcast(activation="relu", binary_op0=op0, binary_op1=op1, unary_op="tanh")
    kwargs = {"alpha": 2.0, "bias": bias, **({"beta": 0.5} if "beta" in epi.operands else {}),
              **{n: t for n, t in (("C0", C0), ("C1", C1)) if n in epi.operands}}
    D = epi(A, B, **kwargs)
    o = torch.relu(2.0 * (A.double() @ B.double()) + bias.double())
    expected = torch.tanh(combine(o, 0.5 * C0.double(), 0.5 * C1.double()))
    assert torch.allclose(D.double(), expected, atol=2e-5)


TWICE = "def act(x):\n    t = x * 2.0\n    y = tanh(t)\n    return y\n"


def test_tensor_broadcast_inlines_one_function_as_activation_and_unary_op(device):
    """The same multi-statement function as activation and unary_op: each inlining has locals
    of its own (act_t, then act2_t); one function inlined keeps the act_ names."""
    M, N, K = 30, 20, 8
    A, B = torch.randn(M, K, device=device), torch.randn(K, N, device=device)
    bias, C0 = torch.randn(N, device=device), torch.randn(M, N, device=device)
    epi = E.LinearCombinationTensorBroadcast(activation=TWICE, unary_op=TWICE)
    assert "    act_t = Z * 2.0\n" in epi and "    act2_t = O1 * 2.0\n" in epi
    D = epi(A, B, alpha=0.5, beta=2.0, bias=bias, C0=C0)
    z = 0.5 * (A.double() @ B.double()) + bias.double()
    expected = torch.tanh(2.0 * (torch.tanh(2.0 * z) + 2.0 * C0.double()))
    assert torch.allclose(D.double(), expected, atol=2e-5)
    assert "    act_t = O1 * 2.0\n" in E.LinearCombinationTensorBroadcast(unary_op=TWICE)
    assert "    act_t = Z * 2.0\n" in E.LinearCombinationTensorBroadcast(activation=TWICE, unary_op="relu")


def test_any_number_of_activations_inline_into_one_epilogue():
    """Distinct prefixes give distinct locals, whatever the functions' locals are called (a local
    spelled like another inlining's names included)."""
    tricky = activations.as_activation(
        "def act(x):\n    act2_t = x * 2.0\n    t = act2_t + 1.0\n    y = tanh(t)\n    return y\n")
    body, current = [], "accum"
    for i in range(12):
        body += tricky.statements(current, f"Y{i}", activations.activation_prefix(i))
        current = f"Y{i}"
    assert len({line.split(" = ")[0] for line in body}) == len(body)
    program = parse("def many(accum):\n" + "".join(f"    {line}\n" for line in body) + f"    return {current}\n")
    A, B = torch.randn(6, 5), torch.randn(5, 7)
    out = epifuse.gemm(A, B, program)
    expected = A.double() @ B.double()
    for _ in range(12):
        expected = torch.tanh(expected * 2.0 + 1.0)
    assert torch.allclose(out.double(), expected, atol=2e-5)


def test_tensor_broadcast_refuses_what_it_does_not_name():
    with pytest.raises(EpilogueError, match="'xor' is not one of CUTLASS's binary ops"):
        E.LinearCombinationTensorBroadcast(binary_op0="xor")
    with pytest.raises(EpilogueError, match="takes scale DEFAULT or NO_BETA_SCALING, not NOTHING"):
        E.LinearCombinationTensorBroadcast(scale="nothing")
