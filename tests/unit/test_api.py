"""The entry points' keywords. Operands and outputs are passed by name next to the options of
the entry points that take them, so every keyword those entry points have is a reserved name
(frontend.RESERVED_KEYWORDS), which the parser refuses for an operand or output; an epilogue
that one entry point accepts, every other one accepts too.
"""
from __future__ import annotations

import inspect

import pytest
import torch

import epifuse
from epifuse import EpilogueArguments, FusedGemm, GemmArguments, torch_ops
from epifuse.epilogues import BiasElementwise, LinearCombination
from epifuse.errors import EpilogueSyntaxError
from epifuse.frontend import RESERVED_KEYWORDS
from epifuse.nn import FusedLinear

from helpers import integer_tensor


class _Scaled(FusedGemm):
    def epilogue(self, accum, alpha):
        D = accum * alpha
        return D


def _entry_points() -> dict:
    """Every callable that takes an epilogue's operands and outputs as keywords, bound (a
    method's receiver is never a keyword)."""
    op = _Scaled()
    named = LinearCombination()
    layer = FusedLinear(3, 2, bias=False)
    return {
        "epifuse.gemm": epifuse.gemm,
        "torch_ops.gemm": torch_ops.gemm,
        "EpilogueArguments": EpilogueArguments,
        "FusedGemm.__call__": op.__call__,
        "FusedGemm.arguments": op.arguments,
        "NamedEpilogue.__call__": named.__call__,
        "NamedEpilogue.arguments": named.arguments,
        "BiasElementwise.__call__": BiasElementwise().__call__,
        "FusedLinear.forward": layer.forward,
    }


def test_every_keyword_of_an_entry_point_is_a_reserved_name():
    """A new option of an entry point must be reserved: an operand of its name could never be
    passed (it was 'Argument precision is not provided', or a TypeError of Python's)."""
    keywords = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    for label, entry in _entry_points().items():
        signature = inspect.signature(entry)
        assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()), label
        for name, parameter in signature.parameters.items():
            if parameter.kind in keywords:
                assert name in RESERVED_KEYWORDS, f"{label} takes {name}=, which is not reserved"


def test_names_that_clash_with_no_keyword_are_not_reserved():
    """accum is the one parameter every epilogue has and may be returned (as an output named
    accum); GemmArguments' out takes no operands beside it, so an output may be called out."""
    assert not {"accum", "out", "x", "C", "D"} & RESERVED_KEYWORDS
    assert all(name.isidentifier() and not name.startswith("__") for name in RESERVED_KEYWORDS)
    A, B = integer_tensor(4, 3, dtype=torch.float32), integer_tensor(3, 5, dtype=torch.float32)
    accum = epifuse.gemm(A, B, "def e(accum):\n    return accum\n")
    assert torch.equal(accum.double(), A.double() @ B.double())
    source = "def e(accum, x):\n    out = accum * x\n    return out\n"
    out = torch.empty(4, 5)
    args = GemmArguments(A, B, epilogue=EpilogueArguments(source, x=2.0, out=out))
    epifuse.get_kernels(args)[0].run(args)
    assert torch.equal(out.double(), 2 * A.double() @ B.double())
    assert torch.equal(epifuse.gemm(A.clone().requires_grad_(), B, source, x=2.0).detach(), out)


# The options of epifuse.gemm and its kin as of this test (the signature test above finds any
# added later): an operand named like one got "Argument precision is not provided".
OPTIONS = ["A", "B", "epilogue", "out_dtype", "accumulate", "deterministic", "compute_dtype",
           "precision", "recompute", "accumulator_type"]


def _epilogues(name: str) -> dict:
    return {
        "operand": f"def e(accum, {name}):\n    D = accum * {name}\n    return D\n",
        "output": f"def e(accum):\n    {name} = accum * 2.0\n    return {name}\n",
    }


@pytest.mark.parametrize("name", sorted(set(OPTIONS) | RESERVED_KEYWORDS))
def test_a_name_of_an_option_is_refused_by_every_entry_point(name):
    A, B = integer_tensor(4, 3, dtype=torch.float32), integer_tensor(3, 5, dtype=torch.float32)
    message = f"The name '{name}' cannot be an operand or output: it clashes with the gemm option '{name}'"
    for role, source in _epilogues(name).items():
        attempts = {
            "epifuse.gemm": lambda: epifuse.gemm(A, B, source),
            "epifuse.gemm with autograd": lambda: epifuse.gemm(A.clone().requires_grad_(), B, source),
            "torch_ops.gemm": lambda: torch_ops.gemm(A, B, source),
            "EpilogueArguments": lambda: EpilogueArguments(source),
            "FusedGemm": lambda: type("Op", (FusedGemm,),
                                      {"epilogue": source.replace("(accum", "(self, accum")}),
            "FusedLinear": lambda: FusedLinear(3, 5, bias=False, epilogue=source),
        }
        for label, attempt in attempts.items():
            with pytest.raises(EpilogueSyntaxError, match=message) as info:
                attempt()
            assert info.value.hint == f"Rename it (for example {name}_).", (role, label)
        renamed = source.replace(name, name + "_")
        epifuse.frontend.parse(renamed)


def test_an_operand_named_x_reaches_a_fused_linear_layer():
    """FusedLinear's input is positional only, so an operand may be called x."""
    layer = FusedLinear(3, 5, bias=False, epilogue="def e(accum, x):\n    D = accum * x\n    return D\n",
                        dtype=torch.float64)
    with torch.no_grad():
        layer.weight.copy_(integer_tensor(5, 3, dtype=torch.float64))
    inputs, x = integer_tensor(4, 3, dtype=torch.float64), integer_tensor(5, dtype=torch.float64)
    out = layer(inputs, x=x)
    assert torch.equal(out.detach(), (inputs @ layer.weight.detach().t()) * x)


def test_a_fused_linear_layer_takes_a_deeply_nested_epilogue():
    """The layer rewrites accum as accum + bias in every expression (it was a recursion, a
    RecursionError on an expression a few hundred operators deep that the parser accepts)."""
    source = "def long_sum(accum, b):\n    D = accum * 2.0" + " + b" * 400 + "\n    return D\n"
    layer = FusedLinear(3, 5, bias=True, epilogue=source, dtype=torch.float64)
    with torch.no_grad():
        layer.weight.copy_(integer_tensor(5, 3, dtype=torch.float64))
        layer.bias.copy_(integer_tensor(5, dtype=torch.float64))
    x, b = integer_tensor(4, 3, dtype=torch.float64), integer_tensor(5, dtype=torch.float64).requires_grad_()
    out = layer(x, b=b)
    weight, bias = layer.weight.detach(), layer.bias.detach()
    assert torch.equal(out.detach(), (x @ weight.t() + bias) * 2 + 400 * b.detach())
    out.sum().backward()
    assert torch.equal(layer.bias.grad, torch.full((5,), 8.0, dtype=torch.float64))
    assert torch.equal(b.grad, torch.full((5,), 1600.0, dtype=torch.float64))


# ---- an activation's name is an epilogue ----------------------------------------------------

_TORCH_ACTIVATIONS = {
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "silu": torch.nn.functional.silu,
    "leaky_relu": torch.nn.functional.leaky_relu,
    "relu_squared": lambda x: torch.relu(x) ** 2,
    "identity": lambda x: x,
}


@pytest.mark.parametrize("name", sorted(_TORCH_ACTIVATIONS))
def test_an_activation_name_is_an_epilogue_at_every_entry_point(name):
    """`epifuse.gemm(A, B, "gelu")` is D = gelu(accum), the vocabulary of FusedLinear(epilogue=):
    through the plain path, the custom ops (autograd), EpilogueArguments and get_kernels."""
    A = integer_tensor(12, 8, dtype=torch.float32)
    B = integer_tensor(8, 10, low=-1, high=2, dtype=torch.float32)
    accum = A.double() @ B.double()   # exact: integer-valued inputs
    expected = _TORCH_ACTIVATIONS[name](accum)
    D = epifuse.gemm(A, B, name)
    assert D.shape == (12, 10) and torch.allclose(D.double(), expected, rtol=1e-5, atol=1e-5)
    A_grad = A.clone().requires_grad_()
    D_grad = torch_ops.gemm(A_grad, B, name)
    assert torch.allclose(D_grad.detach().double(), expected, rtol=1e-5, atol=1e-5)
    D_grad.sum().backward()
    A64 = A.double().requires_grad_()
    _TORCH_ACTIVATIONS[name](A64 @ B.double()).sum().backward()
    assert torch.allclose(A_grad.grad.double(), A64.grad, rtol=1e-4, atol=1e-4)
    out = torch.empty(12, 10)
    args = GemmArguments(A, B, out=out, epilogue=EpilogueArguments(name, D=out))
    epifuse.get_kernels(args)[0].run(args)
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-5)
    layer = FusedLinear(8, 10, bias=False, epilogue=name)
    with torch.no_grad():
        layer.weight.copy_(B.t())
    assert torch.equal(layer(A).detach(), D)


def test_an_unknown_activation_name_says_which_names_there_are():
    A, B = integer_tensor(4, 3, dtype=torch.float32), integer_tensor(3, 5, dtype=torch.float32)
    attempts = {
        "epifuse.gemm": lambda: epifuse.gemm(A, B, "gleu"),
        "epifuse.gemm with autograd": lambda: epifuse.gemm(A.clone().requires_grad_(), B, "gleu"),
        "torch_ops.gemm": lambda: torch_ops.gemm(A, B, "gleu"),
        "EpilogueArguments": lambda: EpilogueArguments("gleu", D=torch.empty(4, 5)),
        "FusedLinear": lambda: FusedLinear(3, 5, epilogue="gleu"),
    }
    for label, attempt in attempts.items():
        with pytest.raises(epifuse.errors.EpilogueArgumentError, match="Unknown activation 'gleu'") as info:
            attempt()
        assert "Did you mean: 'gelu'?" in info.value.hint, label
        assert "relu_squared" in info.value.hint and "gelu_tanh" in info.value.hint, label


def test_source_code_stays_source_code_whatever_its_function_is_called():
    """Only a bare name is an activation's: a string holding a `def gelu` is its own epilogue."""
    A, B = integer_tensor(4, 3, dtype=torch.float32), integer_tensor(3, 5, dtype=torch.float32)
    D = epifuse.gemm(A, B, "def gelu(accum):\n    D = accum * 2.0\n    return D\n")
    assert torch.equal(D.double(), 2 * (A.double() @ B.double()))
    with pytest.raises(EpilogueSyntaxError, match="exactly one function definition"):
        epifuse.gemm(A, B, "D = gelu(accum)")


def test_accumulate_without_the_reductions_to_fold_into_is_refused():
    """accumulate=True folds reductions into what their outputs hold: one epifuse would
    allocate holds nothing (torch.empty), so it is refused, naming the missing outputs; tile
    outputs are written, not folded, and may still be allocated."""
    from epifuse.errors import EpilogueArgumentError
    A, B = integer_tensor(8, 6, dtype=torch.float32), integer_tensor(6, 5, dtype=torch.float32)
    src = "def epi(accum):\n    D = accum * 2.0\n    s = sum(accum)\n    m = amax(accum, dim=1)\n    return D, s, m\n"
    with pytest.raises(EpilogueArgumentError, match="reduction outputs to fold into; s, m are not passed"):
        epifuse.gemm(A, B, src, accumulate=True)
    with pytest.raises(EpilogueArgumentError, match="m is not passed"):
        epifuse.gemm(A, B, src, accumulate=True, s=torch.zeros(()))
    s, m = torch.full((), 5.0), torch.full((8,), 1e9)
    D, s_out, m_out = epifuse.gemm(A, B, src, accumulate=True, s=s, m=m)
    accum = A.double() @ B.double()
    assert torch.equal(D.double(), 2.0 * accum) and s_out is s and m_out is m
    assert float(s) == 5.0 + float(accum.sum()) and bool((m == 1e9).all())


def test_an_activation_name_is_a_class_based_epilogue_too():
    class Gelu(epifuse.FusedGemm):
        epilogue = "gelu"
    A, B = integer_tensor(8, 6, dtype=torch.float32), integer_tensor(6, 5, dtype=torch.float32)
    D = Gelu()(A, B)
    expected = torch.nn.functional.gelu(A.double() @ B.double())
    assert torch.allclose(D.double(), expected, rtol=1e-6, atol=1e-6)
