"""FusedLinear and fuse_linear_activations given what they cannot take: each refused with the
error that names the problem (x's features, type and layout; a bias keyword; a module that is
not an nn.Linear; a missing bias), or answered as nn.Linear would be (no in_features, meta
tensors, hooked pairs left alone, activations with infinite parameters)."""
import math

import numpy as np
import pytest
import torch

from epifuse.errors import EpilogueArgumentError, ShapeError
from epifuse.nn import FusedLinear
from helpers import integer_tensor


@pytest.mark.parametrize("x, expect, phrase", [
    (torch.randn(4, 15), ShapeError, "x has 15 features (its last dimension) but the layer takes in_features=16"),
    (torch.tensor(1.0), ShapeError, "x is a 0-dim tensor but the layer takes (..., in_features=16)"),
    (None, EpilogueArgumentError, "x must be a torch.Tensor, got NoneType"),
    (np.zeros((4, 16), dtype=np.float32), EpilogueArgumentError, "x must be a torch.Tensor, got ndarray"),
], ids=["features", "0-dim", "none", "numpy"])
def test_fused_linear_rejects_inputs_it_cannot_take(x, expect, phrase):
    with pytest.raises(expect) as info:
        FusedLinear(16, 8)(x)
    assert phrase in str(info.value)


def _fused_linear_inputs():
    x = integer_tensor(4, 16, dtype=torch.float32)
    jagged = torch.nested.nested_tensor([integer_tensor(2, 16, dtype=torch.float32),
                                         integer_tensor(3, 16, dtype=torch.float32)], layout=torch.jagged)
    freed = integer_tensor(4, 16, dtype=torch.float32)
    freed.untyped_storage().resize_(0)
    return {"sparse": (x.to_sparse(), "sparse"), "jagged-nested": (jagged, "nested"),
            "neg-bit": (torch._neg_view(x), "negative bit"), "freed": (freed, "storage holds 0 bytes")}


@pytest.mark.parametrize("kind", ["sparse", "jagged-nested", "neg-bit", "freed"])
def test_fused_linear_names_x_for_a_layout_no_kernel_reads(kind):
    """A layout no kernel reads is refused as x's, before the layer reshapes it (where torch
    would raise its own error, or resolve a sign bit that another path drops)."""
    x, phrase = _fused_linear_inputs()[kind]
    with pytest.raises(ShapeError, match=phrase) as info:
        FusedLinear(16, 8)(x)
    assert str(info.value).startswith(("x ", "x's ")), str(info.value)


def test_fused_linear_runs_on_meta_tensors():
    layer = FusedLinear(16, 8, epilogue="relu", device="meta")
    y = layer(torch.empty(4, 3, 16, device="meta"))
    assert y.device.type == "meta" and y.shape == (4, 3, 8)


def test_fused_linear_refuses_a_bias_keyword_it_would_overwrite():
    layer = FusedLinear(4, 3, epilogue="relu")
    with pytest.raises(EpilogueArgumentError, match="Unexpected keyword argument 'bias'"):
        layer(torch.randn(2, 4), bias=torch.full((3,), 100.0))


@pytest.mark.parametrize("module", [None, torch.nn.Conv1d(4, 3, 1), torch.nn.Sequential(torch.nn.Linear(4, 3))])
def test_from_linear_takes_a_linear(module):
    with pytest.raises(EpilogueArgumentError, match=f"from_linear takes an nn.Linear, not {type(module).__name__}"):
        FusedLinear.from_linear(module)


def test_fusing_keeps_hooks_by_leaving_hooked_pairs_alone():
    """A hook on the Linear sees its output, which the fused layer never produces: such a pair
    (or one whose activation is hooked) stays as it is, and the model computes the same."""
    from epifuse.nn import fuse_linear_activations
    x = torch.randn(5, 4)
    for hook_on in (0, 1):
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2), torch.nn.GELU())
        model[hook_on].register_forward_hook(lambda module, inputs, output: output * 10)
        fused = fuse_linear_activations(model)
        assert type(fused[0]) is torch.nn.Linear and type(fused[2]).__name__ == "FusedLinear"
        assert torch.allclose(fused(x), model(x), atol=1e-6)


@pytest.mark.parametrize("act", [torch.nn.Softplus(threshold=float("inf")), torch.nn.LeakyReLU(float("inf")),
                                 torch.nn.ELU(alpha=float("-inf")), torch.nn.LeakyReLU(float("nan"))])
def test_fusing_takes_activations_with_infinite_parameters(act):
    """inf is written 1e999 in the generated epilogue (it was a syntax error there); NaN, which
    no literal spells, leaves the pair unfused."""
    from epifuse.nn import fuse_linear_activations
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), act)
    fused = fuse_linear_activations(model)
    x = torch.randn(5, 4)
    nan_parameter = any(isinstance(v, float) and math.isnan(v) for v in vars(act).values())
    assert type(fused[0]).__name__ == ("Linear" if nan_parameter else "FusedLinear")
    assert torch.allclose(fused(x), model(x), atol=1e-6, equal_nan=True)


def test_fused_linear_edge_cases_are_answered():
    from epifuse.nn import fuse_linear_activations
    assert FusedLinear(0, 3)(torch.randn(2, 0)).shape == (2, 3)          # as nn.Linear(0, 3)
    layer = FusedLinear(4, 3, epilogue="relu")
    layer.bias = None
    with pytest.raises(EpilogueArgumentError, match="layer.bias is None, but the layer's epilogue adds a bias"):
        layer(torch.randn(2, 4))
    with pytest.raises(EpilogueArgumentError, match="fuse_linear_activations takes an nn.Module, not NoneType"):
        fuse_linear_activations(None)
