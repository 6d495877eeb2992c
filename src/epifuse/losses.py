"""A linear layer and cross-entropy in one, without the logits: `epifuse.linear_cross_entropy`.

    loss = epifuse.linear_cross_entropy(x, weight, target)   # F.cross_entropy(F.linear(x, weight).float(), target)

The language-model head's logits, (tokens, vocab), are the largest tensor of a training step.
Here they are never written:

- forward: one GEMM `x @ weight.T` whose epilogue reduces each row to the three numbers the
  loss needs, the log-sum-exp of the (soft-capped) logits, the target's logit (`col() ==
  target` picks it) and, for label smoothing, their sum; the loss is then arithmetic on (tokens,)
  vectors;
- backward: the gradient of the logits, `g * ((1 + 2 z_loss lse) softmax - (1 - eps) onehot -
  eps / V)` (times the soft cap's derivative), is the epilogue of the same GEMM recomputed over a
  chunk of rows at a time (the bias gradient its column sum, a reduction of the same kernel),
  followed by two matmuls per chunk: dx = G @ weight, dweight += G.T @ x. At most one chunk of
  rows x vocab is alive at once (CHUNK_BYTES).

Semantics are torch's: `F.cross_entropy(F.linear(x, weight, bias).float(), target,
ignore_index=, reduction=, label_smoothing=)`, plus `z_loss * lse**2` over the same (not
ignored) tokens, with the logits soft-capped as `softcap * tanh(logits / softcap)` first when
`softcap` is given. Differentiable once (x, weight, bias); a double backward (create_graph=True) raises.
"""
from __future__ import annotations

import torch

from .api import gemm
from .errors import EpilogueArgumentError, ShapeError, UnsupportedError

REDUCTIONS = ("mean", "sum", "none")
CHUNK_BYTES = 1 << 28   # the backward keeps about this much of a chunk's logit gradient alive


def _logits(softcap: float | None) -> str:
    capped = "    z = softcap * tanh(y / softcap)\n" if softcap is not None else "    z = y\n"
    return capped


def _forward_source(softcap: float | None, bias: bool) -> str:
    params = ["accum", "target", *(["bias"] if bias else []), *(["softcap"] if softcap is not None else [])]
    return (f"def linear_cross_entropy_stats({', '.join(params)}):\n"
            f"    y = accum{' + bias' if bias else ''}\n" + _logits(softcap)
            + "    lse = logsumexp(z, dim=1)\n"
            "    picked = sum(where(col() == target, z, 0.0), dim=1)\n"
            "    total = sum(z, dim=1)\n"
            "    return lse, picked, total\n")


def _backward_source(softcap: float | None, bias: bool) -> str:
    """dL/dlogits of one chunk of rows: scale = g_i (1 + 2 z_loss lse_i), pick = g_i (1 - eps),
    spread = g_i eps / V, all (rows, 1) columns; and its column sum (the bias gradient)."""
    params = ["accum", "target", "lse", "scale", "pick", "spread", *(["bias"] if bias else []),
              *(["softcap"] if softcap is not None else [])]
    derivative = "    G = dz * (1.0 - (z / softcap) * (z / softcap))\n" if softcap is not None else "    G = dz\n"
    return (f"def linear_cross_entropy_grad({', '.join(params)}):\n"
            f"    y = accum{' + bias' if bias else ''}\n" + _logits(softcap)
            + "    dz = scale * exp(z - lse) - where(col() == target, pick, 0.0) - spread\n"
            + derivative
            + ("    dbias = sum(G, dim=0)\n    return G, dbias\n" if bias else "    return G\n"))


def _check(x, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, softcap):
    for label, t in (("x", x), ("weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{label} must be a torch.Tensor, not {type(t).__name__}.")
    if weight.dim() != 2:
        raise ShapeError(f"weight must be (vocab, hidden) as nn.Linear's, but has shape {tuple(weight.shape)}.")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ShapeError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply: x's last "
                         f"dimension must be weight's hidden size {weight.shape[1]}.")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ShapeError(f"target must hold class indices (an integer tensor), not {target.dtype}; "
                         "probabilities as targets are not supported.")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ShapeError(f"target has shape {tuple(target.shape)}, but x {tuple(x.shape)} has "
                         f"{tuple(x.shape[:-1])} tokens.")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        raise ShapeError(f"bias must be a ({weight.shape[0]},) tensor, not "
                         f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}.")
    if reduction not in REDUCTIONS:
        raise EpilogueArgumentError(f"reduction must be one of {', '.join(REDUCTIONS)}, not {reduction!r}.")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise EpilogueArgumentError(f"label_smoothing must be in [0, 1], not {label_smoothing!r}.")
    if float(z_loss) < 0.0:
        raise EpilogueArgumentError(f"z_loss must be 0 or more, not {z_loss!r}.")
    if softcap is not None and not float(softcap) > 0.0:
        raise EpilogueArgumentError(f"softcap must be a positive number or None, not {softcap!r}.")
    vocab = weight.shape[0]
    if vocab > 2 ** 24:   # col() and the target column are exact in fp32 up to here
        raise ShapeError(f"linear_cross_entropy takes a vocabulary of at most 2**24 classes, not {vocab}: "
                         "class indices are compared in fp32, exact only that far.")
    valid = target != ignore_index
    if bool(((target[valid] < 0) | (target[valid] >= vocab)).any()):
        raise ShapeError(f"target holds class indices outside [0, {vocab}) (other than ignore_index "
                         f"{ignore_index}).")


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, ignore_index, reduction, label_smoothing, z_loss, softcap):
        rows = x.reshape(-1, x.shape[-1])
        flat = target.reshape(-1)
        valid = flat != ignore_index
        target_col = torch.where(valid, flat, -1).to(torch.float32).unsqueeze(1)   # -1: no column
        operands = dict(target=target_col)
        if bias is not None:
            operands["bias"] = bias
        if softcap is not None:
            operands["softcap"] = float(softcap)
        with torch.no_grad():
            lse, picked, total = gemm(rows, weight.t(), _forward_source(softcap, bias is not None), **operands)
        vocab = weight.shape[0]
        eps = float(label_smoothing)
        per = (1.0 - eps) * (lse - picked) + eps * (lse - total / vocab) + float(z_loss) * lse * lse
        per = torch.where(valid, per, 0.0)
        count = valid.sum()
        if reduction == "mean":
            loss = per.sum() / count   # as torch: NaN where every token is ignored
        elif reduction == "sum":
            loss = per.sum()
        else:
            loss = per.reshape(target.shape)
        ctx.save_for_backward(rows, weight, bias, target_col, lse, valid, count)
        ctx.options = (reduction, eps, float(z_loss), softcap, x.shape)
        return loss

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():   # create_graph=True: a gradient of this gradient was asked for
            raise UnsupportedError("epifuse.linear_cross_entropy is differentiable once: its backward has no "
                                   "backward of its own (create_graph=True, double backward).",
                                   hint="Take the gradient without create_graph, or use F.linear and F.cross_entropy "
                                        "for higher derivatives.")
        with torch.no_grad():
            return _gradients(ctx, grad)


def _gradients(ctx, grad):
    """dx, dweight, dbias (and Nones for the options) of the loss, chunk of rows by chunk."""
    rows, weight, bias, target_col, lse, valid, count = ctx.saved_tensors
    reduction, eps, z_loss, softcap, x_shape = ctx.options
    vocab = weight.shape[0]
    exact = lse.dtype   # float32, or float64 for float64 inputs
    g = grad.reshape(-1).to(exact) if reduction == "none" else grad.to(exact).expand(rows.shape[0])
    if reduction == "mean":
        g = g / count
    g = torch.where(valid, g, 0.0)
    need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
    dx = torch.empty_like(rows) if need_x else None
    dw = torch.zeros(weight.shape, dtype=exact, device=weight.device) if need_w else None
    db = torch.zeros(vocab, dtype=exact, device=weight.device) if need_b else None
    source = _backward_source(softcap, bias is not None)
    chunk = max(1, CHUNK_BYTES // max(1, vocab * rows.element_size()))
    for start in range(0, rows.shape[0], chunk):
        part = slice(start, start + chunk)
        gi = g[part].unsqueeze(1)
        operands = dict(target=target_col[part], lse=lse[part].unsqueeze(1),
                        scale=gi * (1.0 + 2.0 * z_loss * lse[part].unsqueeze(1)), pick=gi * (1.0 - eps),
                        spread=gi * (eps / vocab))
        if bias is not None:
            operands["bias"] = bias
        if softcap is not None:
            operands["softcap"] = float(softcap)
        out = gemm(rows[part], weight.t(), source, **operands)
        G, dbias = out if bias is not None else (out, None)
        if dx is not None:
            dx[part] = (G @ weight.to(G.dtype)).to(dx.dtype)
        if dw is not None:   # each chunk's product in the inputs' dtype, summed in float32 (float64)
            dw += (G.t() @ rows[part].to(G.dtype)).to(exact)
        if db is not None:
            db += dbias
    return (dx.reshape(x_shape) if dx is not None else None, dw.to(weight.dtype) if dw is not None else None,
            db.to(bias.dtype) if db is not None else None, None, None, None, None, None, None)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         z_loss: float = 0.0, softcap: float | None = None) -> torch.Tensor:
    """`F.cross_entropy(F.linear(x, weight, bias).float(), target, ignore_index=, reduction=,
    label_smoothing=)` + `z_loss * logsumexp**2` over the same tokens, the logits soft-capped as
    `softcap * tanh(logits / softcap)` first, without writing the logits (see the module doc).

    x (..., hidden), weight (vocab, hidden) as nn.Linear's, target (...) class indices; returns
    a 0-d float32 loss ("mean", "sum") or the per-token float32 losses ("none"; ignored tokens
    0), float64 for float64 inputs. Differentiable in x, weight and bias.
    """
    _check(x, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, softcap)
    return _LinearCrossEntropy.apply(x, weight, bias, target, ignore_index, reduction, float(label_smoothing),
                                     float(z_loss), softcap)


__all__ = ["linear_cross_entropy"]
