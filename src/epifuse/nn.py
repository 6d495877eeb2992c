"""epifuse.nn: `FusedLinear`, an `nn.Linear` whose activation (or any epilogue) runs fused.

    layer = FusedLinear(1024, 4096, epilogue="gelu")          # y = gelu(x @ W.T + b), one kernel
    layer = FusedLinear(1024, 4096, epilogue=my_epilogue)     # a function or a string epilogue
    model = fuse_linear_activations(model)                    # Linear + ReLU/GELU/... pairs

Parameters and `state_dict` are exactly nn.Linear's (`weight` (out, in), `bias` (out,)), so a
checkpoint loads into either. The epilogue's accum is `x @ W.T`; when the layer has a bias and
the epilogue takes no `bias` parameter, accum is `x @ W.T + bias` (the bias add is fused too);
an epilogue with a `bias` parameter receives the bias and uses it as it likes. Other operands of
the epilogue are passed to `forward` by name (`layer(x, C=residual)`); tensors shaped like the
output are flattened with it. Gradients, torch.compile, CUDA graphs and autocast (fp16/bf16:
x and W are cast, the output has the autocast dtype, the epilogue computes in fp32) work as for
`nn.Linear`; the epilogue computes in the promoted dtype of the inputs (float64 layers and
operands in float64), as `epifuse.gemm` does by default. See docs/autograd.md for
what the backward fuses. Under tensor parallelism (DTensor parameters: torch's ColwiseParallel
and RowwiseParallel take a FusedLinear, an nn.Linear subclass) each rank runs its shard
(epifuse.sharded); under FSDP2 the layer sees plain tensors.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Callable

import torch
from torch import Tensor, nn

from . import losses, sharded, torch_ops
from .activations import ACTIVATIONS, activation_source, named_activation, of_module
from .errors import EpilogueArgumentError, ShapeError, UnsupportedError, flag
from .frontend import parse
from .program import Expr, Program, Statement, rename
from .printing import FreshNames
from .shapes import check_tensor

def _program(epilogue, bias: bool) -> tuple[Program, str | None, str]:
    """(program, the operand that receives the bias, a label for repr)."""
    if epilogue is None:
        epilogue = "identity"
    if isinstance(epilogue, str) and not epilogue.lstrip().startswith("def"):
        name = epilogue.strip()   # an activation's name: the one vocabulary of every entry point
        return parse(activation_source(named_activation(name), bias, f"fused_linear_{name}")), \
            ("bias" if bias else None), name
    program = parse(epilogue)
    label = program.name
    if not bias:
        return program, None, label
    if "bias" in program.params:
        return program, "bias", label
    program = _add_bias(program)
    return program, program.params[-1], label


def _add_bias(program: Program) -> Program:
    """The same epilogue with accum meaning accum + bias (a new last parameter)."""
    taken = {*program.params, *(s.target for s in program.statements)}
    names = FreshNames(taken)
    bias, pre = names.fresh("bias"), names.fresh("accum_plus_bias")
    loc = program.statements[0].loc if program.statements else program.outputs[0][1]
    first = Statement(pre, Expr("call", "add", (Expr("name", "accum", loc=loc),
                                                Expr("name", bias, loc=loc)), loc=loc), loc)
    statements = (first,) + tuple(dataclasses.replace(s, expr=rename(s.expr, {"accum": pre}))
                                  for s in program.statements)
    extra = {"param_locs": program.param_locs + (loc,)} if hasattr(program, "param_locs") else {}
    return dataclasses.replace(program, params=program.params + (bias,), statements=statements, **extra)


def _autocast_dtype(device_type: str):
    """The dtype autocast gives matmuls on `device_type`, or None where it is off. Outside
    torch.compile a device autocast does not know (meta) counts as off; under it the check is
    skipped, since torch 2.11's dynamo cannot trace torch.amp.is_autocast_available."""
    if not torch.compiler.is_compiling() and not torch.amp.is_autocast_available(device_type):
        return None
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class FusedLinear(nn.Linear):
    """`nn.Linear` with a fused epilogue (an nn.Linear subclass, so tools that take linear
    layers, torch's tensor-parallel styles among them, take it; see epifuse.sharded).

    >>> import torch
    >>> layer = FusedLinear(4, 3, epilogue="relu")
    >>> y = layer(torch.randn(2, 4))
    >>> bool((y >= 0).all()), tuple(y.shape)
    (True, (2, 3))
    >>> sorted(layer.state_dict()) == sorted(torch.nn.Linear(4, 3).state_dict())
    True
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 epilogue: Callable | str | None = None, *, recompute: bool = False,
                 device=None, dtype=None):
        nn.Module.__init__(self)
        factory = {"device": device, "dtype": dtype}
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.recompute = flag("recompute", recompute)
        self._set_epilogue(epilogue)
        self.reset_parameters()

    def _set_epilogue(self, epilogue) -> None:
        program, bias_name, label = _program(epilogue, self.bias is not None)
        if "accum_up" in program.params:
            raise UnsupportedError(
                f"FusedLinear does not take a gated epilogue ({label}: gate, up = accum.chunk(2, dim=-1)) yet: "
                "its output would have half the layer's out_features, and its bias would apply to one half.",
                hint="Call epifuse.gemm(x, w_gate_up.t(), epi) on the merged [gate | up] weight; it is "
                     "differentiable.")
        self.epilogue_name = label
        self._program, self._bias_name = program, bias_name
        self._epilogue_id = torch_ops.register_epilogue(program)
        torch_ops.register_epilogue(program)
        torch_ops.register_epilogue(program, save_accum=True)

    def reset_parameters(self) -> None:
        """nn.Linear's initialization."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.in_features
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear, epilogue=None, recompute: bool = False) -> "FusedLinear":
        """A FusedLinear sharing `linear`'s parameters (no copy)."""
        if not isinstance(linear, nn.Linear):
            raise EpilogueArgumentError(f"from_linear takes an nn.Linear, not {type(linear).__name__}.")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        layer.bias = linear.bias
        layer.recompute = flag("recompute", recompute)
        layer._set_epilogue(epilogue)
        return layer

    def forward(self, x: Tensor, /, **operands):
        if not isinstance(x, Tensor):
            raise EpilogueArgumentError(f"x must be a torch.Tensor, got {type(x).__name__}")
        distributed = sharded.is_dtensor(x) or sharded.is_dtensor(self.weight)
        if not torch.compiler.is_compiling() and not distributed:   # dynamo cannot trace the checks; the
            check_tensor("x", x)   # op's impls make them. Before reshape: a layout no kernel reads is x's
        if x.dim() == 0:
            raise ShapeError(f"x is a 0-dim tensor but the layer takes (..., in_features={self.in_features})")
        if x.shape[-1] != self.in_features:
            raise ShapeError(f"x has {x.shape[-1]} features (its last dimension) but the layer takes "
                             f"in_features={self.in_features}")
        if distributed:   # each rank's shard through the op (the shards are checked there)
            return sharded.forward(self, x, operands, self._forward_local, _autocast_dtype(x.device.type))
        return self._forward_local(x, self.weight, self.bias, operands)

    def _forward_local(self, x: Tensor, weight: Tensor, bias: Tensor | None, operands: dict):
        """The layer on plain tensors (the whole layer, or one rank's shard of it)."""
        dtype = _autocast_dtype(x.device.type)
        if dtype is not None:
            x, weight = x.to(dtype), weight.to(dtype)
        lead = x.shape[:-1]
        x2 = x.reshape(lead.numel(), x.shape[-1])   # not -1: in_features may be 0
        for name, value in list(operands.items()):
            if isinstance(value, Tensor) and value.dim() == len(lead) + 1 and value.dim() > 2 \
                    and value.shape[:-1] == lead:
                operands[name] = value.reshape(-1, value.shape[-1])
        if self._bias_name is not None:
            if self._bias_name in operands:
                raise EpilogueArgumentError(f"Unexpected keyword argument '{self._bias_name}'",
                                            hint="The layer adds its own bias; set layer.bias instead.")
            if bias is None:
                raise EpilogueArgumentError("layer.bias is None, but the layer's epilogue adds a bias.",
                                            hint="Build the layer with bias=False for one without.")
            operands[self._bias_name] = bias
        outs = torch_ops.gemm(x2, weight.t(), self._epilogue_id, recompute=self.recompute,
                              **operands)
        single = not isinstance(outs, tuple)
        outs = (outs,) if single else outs
        if len(lead) != 1:   # (..., out) as nn.Linear; a 2-D x keeps the op's own tensors, not views
            rows = x2.shape[0]
            outs = tuple(o.reshape(*lead, o.shape[-1]) if o.dim() == 2 and o.shape[0] == rows else o
                         for o in outs)
        return outs[0] if single else outs

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, epilogue={self.epilogue_name}")


def fuse_linear_activations(module: nn.Module, inplace: bool = False,
                            recompute: bool = False) -> nn.Module:
    """Replace each `Linear` followed by a supported activation inside any `nn.Sequential` of
    `module` (nested ones included) by a FusedLinear, and the activation by `nn.Identity`.

    Positions are kept, so `state_dict` keys do not change and checkpoints load either way. The
    FusedLinear shares the Linear's parameters. Without `inplace`, `module` is deep-copied first.

    >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    >>> fused = fuse_linear_activations(mlp)
    >>> [type(m).__name__ for m in fused]
    ['FusedLinear', 'Identity', 'Linear']
    >>> fused.load_state_dict(mlp.state_dict())
    <All keys matched successfully>
    """
    if not isinstance(module, nn.Module):
        raise EpilogueArgumentError(f"fuse_linear_activations takes an nn.Module, not {type(module).__name__}.")
    if not inplace:
        module = copy.deepcopy(module)
    for child in [m for m in module.modules() if isinstance(m, nn.Sequential)]:
        names = list(child._modules)
        for first, second in zip(names, names[1:]):
            linear, act = child._modules[first], child._modules[second]
            if type(linear) is not nn.Linear or _hooked(linear) or _hooked(act):
                continue   # a hook sees the Linear's output, which fusing would never produce
            activation = of_module(act)
            if activation is None or type(act) is nn.Identity:
                continue
            source = activation_source(activation, linear.bias is not None)
            child._modules[first] = FusedLinear.from_linear(linear, source, recompute)
            child._modules[second] = nn.Identity()
    return module


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or getattr(module, "_backward_pre_hooks", None))


class LinearCrossEntropyLoss(nn.Module):
    """epifuse.linear_cross_entropy as a module: `loss(x, weight, target, bias=None)` with the
    options given here (ignore_index, reduction, label_smoothing, z_loss, softcap). It holds no
    parameters: pass the LM head's weight (and bias), as Liger's and torch's fused losses take it."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 z_loss: float = 0.0, softcap: float | None = None):
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.z_loss, self.softcap = label_smoothing, z_loss, softcap

    def forward(self, x: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None) -> Tensor:
        return losses.linear_cross_entropy(x, weight, target, bias, ignore_index=self.ignore_index,
                                           reduction=self.reduction, label_smoothing=self.label_smoothing,
                                           z_loss=self.z_loss, softcap=self.softcap)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, softcap={self.softcap}")


__all__ = ["FusedLinear", "LinearCrossEntropyLoss", "fuse_linear_activations", "ACTIVATIONS", "activation_source"]
