"""epifuse.linear_cross_entropy as torch custom ops, for graphs that torch.compile traces (the
compile backend's LM-head rewrite, graph_heads.py):

    epifuse::linear_cross_entropy(x, weight, target, bias, ignore_index, reduction, label_smoothing)
        -> loss                                  the forward alone (no gradient wanted)
    epifuse::linear_cross_entropy_train(..., need_x, need_weight, need_bias) -> (loss, dx, dweight, dbias)
        the loss and the gradients asked for, for a loss gradient of 1, in one call (an empty
        tensor for each not asked for); the op's backward multiplies them by the actual one

AOTAutograd traces a custom op as one node (its fake implementation gives the shapes), where it
could not trace linear_cross_entropy itself (the call reads a device flag once, to learn whether
every target is in range). The training op runs linear_cross_entropy's forward and backward back
to back: the training path computes the gradients during the forward anyway (losses.py), so the
extra memory is theirs, dweight's size, as in an eager step. x is (tokens, hidden), target
(tokens,); reduction "mean" or "sum" ("none" needs the per-token gradient, known only in the
backward: the rewrite leaves it to Inductor). The gradients are contiguous.
"""
from __future__ import annotations

import torch

from .losses import _LinearCrossEntropy, linear_cross_entropy

TRAINED_REDUCTIONS = ("mean", "sum")


def _loss_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@torch.library.custom_op("epifuse::linear_cross_entropy", mutates_args=())
def forward_only(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
                 ignore_index: int, reduction: str, label_smoothing: float) -> torch.Tensor:
    with torch.no_grad():
        return linear_cross_entropy(x, weight, target, bias, ignore_index=ignore_index, reduction=reduction,
                                    label_smoothing=label_smoothing)


@forward_only.register_fake
def _(x, weight, target, bias, ignore_index, reduction, label_smoothing):
    shape = tuple(target.shape) if reduction == "none" else ()
    return x.new_empty(shape, dtype=_loss_dtype(x))


class _Context:
    """What _LinearCrossEntropy's forward and backward read of an autograd context, for calling
    them directly: the saved tensors and which inputs want gradients."""

    def __init__(self, needs_input_grad: tuple):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors = ()

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


@torch.library.custom_op("epifuse::linear_cross_entropy_train", mutates_args=())
def forward_and_gradients(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
                          ignore_index: int, reduction: str, label_smoothing: float, need_x: bool,
                          need_weight: bool, need_bias: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if reduction not in TRAINED_REDUCTIONS:
        raise ValueError(f"epifuse::linear_cross_entropy_train takes reduction 'mean' or 'sum', not {reduction!r}")
    need_bias = need_bias and bias is not None
    ctx = _Context((need_x, need_weight, need_bias, False, False, False, False, False, False, False))
    with torch.no_grad():
        loss = _LinearCrossEntropy.forward(ctx, x, weight, bias, target, ignore_index, reduction,
                                           float(label_smoothing), 0.0, None, True)
        grads = _LinearCrossEntropy.backward(ctx, torch.ones((), dtype=loss.dtype, device=loss.device))[:3]
    # contiguous, as the fake outputs say; an empty tensor for a gradient not asked for
    return (loss, *(g.contiguous() if need and g is not None else x.new_empty(0)
                    for g, need in zip(grads, (need_x, need_weight, need_bias))))


@forward_and_gradients.register_fake
def _(x, weight, target, bias, ignore_index, reduction, label_smoothing, need_x, need_weight, need_bias):
    def grad(t, need):
        return t.new_empty(t.shape) if need and t is not None else x.new_empty(0)
    return (x.new_empty((), dtype=_loss_dtype(x)), grad(x, need_x), grad(weight, need_weight),
            grad(bias, need_bias and bias is not None))


def _setup_context(ctx, inputs, output) -> None:
    _, dx, dweight, dbias = output
    ctx.needs = inputs[7], inputs[8], inputs[9] and inputs[3] is not None
    ctx.save_for_backward(dx, dweight, dbias)
    ctx.mark_non_differentiable(dx, dweight, dbias)


def _backward(ctx, grad_loss, *unused):
    grads = [g * grad_loss if need else None for g, need in zip(ctx.saved_tensors, ctx.needs)]
    return grads[0], grads[1], None, grads[2], None, None, None, None, None, None


torch.library.register_autograd("epifuse::linear_cross_entropy_train", _backward, setup_context=_setup_context)

__all__ = ["forward_only", "forward_and_gradients", "TRAINED_REDUCTIONS"]
