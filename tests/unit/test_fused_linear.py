"""FusedLinear against nn.Linear (activation names and expressions, function and string
epilogues, extra operands and outputs, state_dict, initialization, autocast) and
fuse_linear_activations on nn.Sequential."""
import pytest
import torch
from torch import nn

import epifuse
from epifuse.nn import ACTIVATIONS, FusedLinear, activation_source, fuse_linear_activations
from epifuse.ops import relu  # (names the epilogues below use)

F64 = torch.float64
M, N, K = 6, 5, 4


# ---- FusedLinear ---------------------------------------------------------------------------------

TORCH_ACTIVATIONS = {
    "identity": lambda x: x, "relu": torch.relu, "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "relu6": torch.nn.functional.relu6, "mish": torch.nn.functional.mish,
    "hardswish": torch.nn.functional.hardswish, "hardsigmoid": torch.nn.functional.hardsigmoid,
    "softplus": torch.nn.functional.softplus, "elu": torch.nn.functional.elu,
    "leaky_relu": torch.nn.functional.leaky_relu, "relu_squared": lambda x: torch.relu(x) ** 2,
}


def test_activation_source_takes_an_activation_or_an_expression_in_x():
    A, B, bias = (torch.randint(-3, 4, s).double() for s in ((M, K), (K, N), (N,)))
    by_name = epifuse.gemm(A, B, activation_source(ACTIVATIONS["relu_squared"], True), bias=bias)
    by_expression = epifuse.gemm(A, B, activation_source("square(relu(x))", True), bias=bias)
    assert torch.equal(by_name, torch.relu(A @ B + bias) ** 2) and torch.equal(by_expression, by_name)


def test_every_named_activation_has_a_torch_twin():
    assert set(ACTIVATIONS) == set(TORCH_ACTIVATIONS)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("bias", [True, False])
def test_named_epilogues(name, bias):
    layer = FusedLinear(7, 9, bias=bias, epilogue=name, dtype=F64)
    x = torch.randn(4, 7, dtype=F64, requires_grad=True)
    while bool((torch.nn.functional.linear(x, layer.weight, layer.bias).abs() < 1e-3).any()):
        x = torch.randn(4, 7, dtype=F64, requires_grad=True)  # gradcheck's 1e-6 steps across relu's kink
    expected = TORCH_ACTIVATIONS[name](torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert torch.allclose(layer(x), expected, atol=1e-12)
    inputs = (x, layer.weight) + ((layer.bias,) if bias else ())
    assert torch.autograd.gradcheck(lambda *a: layer(a[0]), inputs)
    assert layer.extra_repr().endswith(f"epilogue={name}")


def test_function_and_string_epilogues_get_the_bias_added():
    def scaled_silu(accum):
        D = torch.nn.functional.silu(accum) * 0.5
        return D

    text = "def scaled_silu(accum):\n    D = silu(accum) * 0.5\n    return D\n"
    x = torch.randn(3, 6, dtype=F64)
    for epilogue in (scaled_silu, text):
        layer = FusedLinear(6, 4, epilogue=epilogue, dtype=F64)
        expected = 0.5 * torch.nn.functional.silu(torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert torch.allclose(layer(x), expected, atol=1e-12)


def test_epilogue_taking_bias_uses_it_itself():
    def bias_after(accum, bias):
        D = torch.tanh(accum) + bias
        return D

    layer = FusedLinear(6, 4, epilogue=bias_after, dtype=F64)
    x = torch.randn(3, 6, dtype=F64)
    assert torch.allclose(layer(x), torch.tanh(x @ layer.weight.T) + layer.bias, atol=1e-12)


def test_extra_operands_and_several_outputs():
    def residual(accum, C):
        F = accum + C
        D = relu(F)
        return D, F

    layer = FusedLinear(6, 4, epilogue=residual, dtype=F64)
    x, C = torch.randn(2, 3, 6, dtype=F64), torch.randn(2, 3, 4, dtype=F64)
    D, F = layer(x, C=C)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias) + C
    assert D.shape == F.shape == (2, 3, 4)
    assert torch.allclose(F, expected, atol=1e-12) and torch.allclose(D, expected.relu(), atol=1e-12)


def test_unknown_activation_name():
    with pytest.raises(epifuse.EpilogueError, match="Unknown activation 'gelux'(.|\n)*'gelu'"):
        FusedLinear(4, 4, epilogue="gelux")


@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_round_trips(bias):
    linear = nn.Linear(6, 5, bias=bias)
    fused = FusedLinear(6, 5, bias=bias, epilogue="relu")
    assert fused.state_dict().keys() == linear.state_dict().keys()
    fused.load_state_dict(linear.state_dict())
    x = torch.randn(3, 6)
    assert torch.allclose(fused(x), torch.relu(linear(x)), atol=1e-6)
    other = nn.Linear(6, 5, bias=bias)
    other.load_state_dict(FusedLinear(6, 5, bias=bias, epilogue="gelu").state_dict())
    assert torch.equal(FusedLinear.from_linear(other).weight, other.weight)


def test_initialization_matches_nn_linear():
    torch.manual_seed(3)
    a = nn.Linear(64, 32)
    torch.manual_seed(3)
    b = FusedLinear(64, 32)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_on_cpu(dtype):
    layer = FusedLinear(16, 8, epilogue="gelu")
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        y = layer(x)
        expected = torch.nn.functional.gelu(torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert y.dtype == expected.dtype == dtype
    assert torch.allclose(y.float(), expected.float(), atol=3e-2, rtol=3e-2)
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


def test_autocast_under_compile_does_not_trace_the_availability_check(monkeypatch):
    """torch 2.11's dynamo cannot trace torch.amp.is_autocast_available, and a fullgraph compile of
    a FusedLinear under autocast failed there (seen on the GPU machine); here the check is made
    untraceable the same way, so CPU CI catches a forward that calls it while compiling."""
    monkeypatch.setattr(torch.amp, "is_autocast_available",
                        torch._dynamo.disable(torch.amp.is_autocast_available))
    torch._dynamo.reset()
    layer = FusedLinear(16, 8, epilogue="gelu")
    x = torch.randn(4, 16)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, expected = compiled(x), layer(x)
    finally:
        torch._dynamo.reset()
    assert y.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(y, expected)


# ---- converting an nn.Sequential ----------------------------------------------------------------

def _mlp():
    return nn.Sequential(
        nn.Linear(8, 16), nn.GELU(approximate="tanh"),
        nn.Sequential(nn.Linear(16, 16), nn.LeakyReLU(0.2), nn.Linear(16, 16), nn.Softplus(2.0, 5.0)),
        nn.Linear(16, 4), nn.Dropout(0.0), nn.Linear(4, 3), nn.SiLU(),
    ).double()


def test_fuse_linear_activations():
    mlp = _mlp()
    fused = fuse_linear_activations(mlp)
    kinds = [type(m).__name__ for m in fused.modules()]
    assert kinds.count("FusedLinear") == 4 and kinds.count("Linear") == 1   # Linear -> Dropout stays
    assert all(type(m).__name__ != "FusedLinear" for m in mlp.modules())    # not in place
    assert fused.state_dict().keys() == mlp.state_dict().keys()
    x = torch.randn(5, 8, dtype=F64)
    assert torch.allclose(fused(x), mlp(x), atol=1e-12)
    fused(x).square().sum().backward()
    mlp(x).square().sum().backward()
    for (name, p), q in zip(fused.named_parameters(), mlp.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-10), name
    mlp.load_state_dict(fused.state_dict())
    fused.load_state_dict(mlp.state_dict())


def test_fuse_in_place_shares_parameters():
    mlp = _mlp()
    weight = mlp[0].weight
    fused = fuse_linear_activations(mlp, inplace=True)
    assert fused is mlp and isinstance(mlp[0], FusedLinear) and mlp[0].weight is weight
