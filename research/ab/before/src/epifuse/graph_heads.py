"""A language-model head in a dynamo graph, `F.cross_entropy(F.linear(x, weight, bias) [.view(-1,
vocab)] [.float()], target)`, rewritten as one call of epifuse's linear cross-entropy ops
(loss_ops.py), so the (tokens, vocab) logits never exist: the compile backend's first rewrite,
on the graph dynamo hands it, before AOTAutograd traces forward and backward (after it, the
cross-entropy is decomposed into pieces spread over two graphs).

A head is rewritten where
- the logits are a `linear` (torch._C._nn.linear or F.linear) read by nothing but the
  cross-entropy, through reshapes to (tokens, vocab) and conversions to a float dtype;
- the cross-entropy has no class weights and the default size_average / reduce, reduction
  "mean" or "sum" (the training op computes the gradients with the loss), or any reduction
  where no gradient is wanted (the forward-only op);
- its input is (tokens, vocab) with vocab the weight's rows, and its target has as many
  elements as x has rows.
The op's loss is float32 (float64 for float64 inputs), as torch's cross-entropy over the float32
logits; where the graph's cross-entropy ran in the logits' dtype, the loss is converted to it.
Everything else is left as it was, with the reason (`fuse_heads` returns both).
"""
from __future__ import annotations

import inspect
import math
import operator

import torch
import torch.nn.functional as F

from . import loss_ops
from .losses import REDUCTIONS

_LINEARS = (torch._C._nn.linear, F.linear)
_CROSS_ENTROPY = inspect.signature(F.cross_entropy)
_RESHAPES = ("view", "reshape", "flatten", "contiguous")


def _value(node):
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


_WIDE = (torch.float32, torch.float64)   # what the op computes the loss in: conversions to these lose nothing


def _source(node):
    """The tensor a reshape or conversion node reads (its first argument, or `input=`)."""
    value = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))
    return value if isinstance(value, torch.fx.Node) else None


def _passes_values_through(node) -> bool:
    """A reshape, or a conversion to float32 or float64: the logits' values, in another shape, or
    in a dtype at least as wide as what the op computes them in."""
    if node.op == "call_method":
        if node.target in _RESHAPES or node.target in ("float", "double"):
            return True
        if node.target == "to":
            dtypes = [*node.args[1:], *node.kwargs.values()]
            return bool(dtypes) and set(node.kwargs) <= {"dtype"} and all(d in _WIDE for d in dtypes)
        return False
    return node.op == "call_function" and node.target in (torch.reshape, torch.flatten)


def _mutates(node) -> bool:
    """Whether `node` may write a tensor in place (an in-place method or function, setitem)."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("__")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return node.target is operator.setitem or (name.endswith("_") and not name.startswith("__"))
    return False


def _linear_arguments(linear) -> tuple:
    """(input, weight, bias) of a linear call, positional or by keyword."""
    bound = dict(zip(("input", "weight", "bias"), linear.args))
    bound.update(linear.kwargs)
    return bound.get("input"), bound.get("weight"), bound.get("bias")


def _logits_of(node):
    """(linear node, the chain from it to `node`) where `node` reads a linear's output through
    reshapes and conversions alone, each read only by the next; else (None, why)."""
    chain = []
    while not (node.op == "call_function" and node.target in _LINEARS):
        if not _passes_values_through(node) or _source(node) is None:
            return None, f"its input is {node.target!r} of a value, not the output of a linear"
        chain.append(node)
        node = _source(node)
    for n in [node, *chain]:
        if len(n.users) != 1:
            return None, "the logits are read elsewhere too (they would have to exist whole)"
    return node, chain


def _head_source(bias: bool, ignore_index: int, reduction: str, label_smoothing: float) -> str:
    args = "x, weight, target" + (", bias" if bias else "")
    return (f"def lm_head({args}):\n    loss = linear_cross_entropy({args}, ignore_index={ignore_index}, "
            f"reduction={reduction!r}, label_smoothing={label_smoothing!r})\n    return loss\n")


def fuse_heads(gm: torch.fx.GraphModule) -> tuple[list, list]:
    """Rewrite (in place) every LM head of `gm`; returns (fused, left): the source each head
    became, as a user would write it, and (cross_entropy node, why) for each left as it was."""
    fused, left = [], []
    graph = gm.graph
    for ce in [n for n in graph.nodes if n.op == "call_function" and n.target is F.cross_entropy]:
        try:
            bound = _CROSS_ENTROPY.bind(*ce.args, **ce.kwargs)
        except TypeError:
            left.append((ce.name, "its arguments do not bind to F.cross_entropy's"))
            continue
        options = {**{k: p.default for k, p in _CROSS_ENTROPY.parameters.items()}, **bound.arguments}
        if options["weight"] is not None or options["size_average"] is not None or options["reduce"] is not None:
            left.append((ce.name, "class weights or the deprecated size_average / reduce arguments"))
            continue
        ignore_index, reduction, smoothing = options["ignore_index"], options["reduction"], options["label_smoothing"]
        if not (isinstance(ignore_index, int) and isinstance(reduction, str) and isinstance(smoothing, (int, float))):
            left.append((ce.name, "its ignore_index, reduction or label_smoothing is not a constant"))
            continue
        if reduction not in REDUCTIONS or not 0.0 <= smoothing <= 1.0:
            left.append((ce.name, f"reduction {reduction!r} or label_smoothing {smoothing!r} is not one it runs"))
            continue
        logits_in, target = options["input"], options["target"]
        if not isinstance(logits_in, torch.fx.Node) or not isinstance(target, torch.fx.Node):
            left.append((ce.name, "its input or target is not a tensor of the graph"))
            continue
        linear, chain = _logits_of(logits_in)
        if linear is None:
            left.append((ce.name, chain))
            continue
        x, weight, bias = _linear_arguments(linear)
        if not isinstance(x, torch.fx.Node) or not isinstance(weight, torch.fx.Node):
            left.append((ce.name, "its linear's input or weight is not a tensor of the graph"))
            continue
        order = {n: k for k, n in enumerate(graph.nodes)}
        if any(_mutates(n) for n in graph.nodes if order[linear] < order[n] < order[ce]):
            left.append((ce.name, "a tensor is written in place between its linear and it (the op would read "
                                  "the inputs later than the linear did)"))
            continue
        vx, vw, vin, vt, vloss = (_value(n) for n in (x, weight, logits_in, target, ce))
        if any(v is None for v in (vx, vw, vin, vt, vloss)) or (bias is not None and _value(bias) is None):
            left.append((ce.name, "no example values to check its shapes by"))
            continue
        if vw.dim() != 2 or vin.dim() != 2 or vin.shape[1] != vw.shape[0] or vx.shape[-1] != vw.shape[1]:
            left.append((ce.name, f"its input {tuple(vin.shape)} is not (tokens, vocab) of a weight {tuple(vw.shape)}"))
            continue
        tokens = math.prod(vx.shape[:-1])
        if vin.shape[0] != tokens or vt.numel() != tokens or vt.is_floating_point():
            left.append((ce.name, "its target is not one class index per row of x"))
            continue
        if vx.dtype != vw.dtype or not vx.dtype.is_floating_point:
            left.append((ce.name, f"x is {vx.dtype} and the weight {vw.dtype}"))
            continue
        training = bool(vin.requires_grad)   # the logits need a gradient: x, the weight or the bias does
        if training and reduction not in loss_ops.TRAINED_REDUCTIONS:
            left.append((ce.name, f"reduction {reduction!r} with gradients: the per-token gradient is known only "
                                  "in the backward"))
            continue
        need_x, need_weight = bool(vx.requires_grad), bool(vw.requires_grad)
        need_bias = bias is not None and bool(_value(bias).requires_grad)
        with graph.inserting_before(ce):   # no sizes written out: they may be symbolic (dynamic shapes)
            rows = x
            if vx.dim() == 1:
                rows = graph.call_method("unsqueeze", (x, 0))
            elif vx.dim() > 2:
                rows = graph.call_function(torch.flatten, (x, 0, -2))
            flat = graph.call_function(torch.flatten, (target,))
            args = (rows, weight, flat, bias, ignore_index, reduction, float(smoothing))
            if training:
                call = graph.call_function(torch.ops.epifuse.linear_cross_entropy_train.default,
                                           (*args, need_x, need_weight, need_bias))
                loss = graph.call_function(operator.getitem, (call, 0))
            else:
                loss = graph.call_function(torch.ops.epifuse.linear_cross_entropy.default, args)
            loss = graph.call_method("to", (loss, vloss.dtype))
        ce.replace_all_uses_with(loss)
        for node in [ce, *chain, linear]:   # chain runs from the cross-entropy's input back to the linear
            graph.erase_node(node)
        fused.append(_head_source(bias is not None, ignore_index, reduction, float(smoothing)))
    if fused:
        graph.lint()
        gm.recompile()
    return fused, left


__all__ = ["fuse_heads"]
