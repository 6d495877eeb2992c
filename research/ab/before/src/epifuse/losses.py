"""A linear layer and cross-entropy in one, without the logits: `epifuse.linear_cross_entropy`.

    loss = epifuse.linear_cross_entropy(x, weight, target)   # F.cross_entropy(F.linear(x, weight).float(), target)

The language-model head's logits, (tokens, vocab), are the largest tensor of a training step.
Here they never exist whole; at most one chunk of rows is alive at once:

- training (gradients wanted, reduction "mean" or "sum", no soft cap): per chunk of rows, one
  GEMM `x @ weight.T` whose epilogue writes E = `exp(z - SHIFT)` of the chunk's logits z in the
  inputs' dtype (rounded from float32, so as precise where it matters as a float32 softmax) and
  reduces each row to the three numbers the loss needs (the log-sum-exp, the target's logit,
  picked by `col() == target`, and for label smoothing their sum). The chunk's gradient is
  u * E' minus the spread, u a factor per row and E' = E with its target entries set from the
  float32 target logit; two matmuls consume E' at once without scaling it (dx = u * (E' @
  weight), dweight += E'.T @ (u * x)), see _statistics_and_gradients. A row whose log-sum-exp
  lies outside WINDOW (its exponentials would overflow or vanish) counts for nothing there and
  is recomputed after the chunks by the gradient's own epilogue. The call syncs with the GPU
  once, after the loss too is queued, to learn whether any row needs that and whether every
  target lies in [0, vocab) (a device flag until then; no kernel sees such an index). Three GEMMs in all, run during the forward; the backward
  multiplies them by the loss's gradient where it is not 1. A chunk holds as many bytes as the
  weight (`hidden` rows), so the extra memory is about the weight gradient's own size. E' is
  held in the inputs' dtype (float16 takes the other path, its range too narrow) and dweight
  sums the chunks' products in weight's dtype, one rounding per chunk. A forward with gradients
  enabled whose backward never runs still pays for the gradients (three GEMMs, not one).
- otherwise: the forward is that GEMM without the logits (the three row reductions only) and the
  backward recomputes each chunk's logits, with the gradient of the logits, `g * ((1 + 2 z_loss
  lse) softmax - (1 - eps) onehot - eps / V)` (times the soft cap's derivative), as the epilogue
  (the bias gradient its column sum), followed by the same two matmuls. This path serves
  reduction "none" (whose per-token gradient is known only in the backward), the soft cap, a
  second backward of the same graph, float16, and inputs of mixed dtypes.

CHUNK_BYTES sets the chunk's size in bytes of logits.

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
CHUNK_BYTES: int | None = None   # bytes of one chunk's logits; None: the weight's own size (hidden rows)
# The epilogue writes exp(min(z - SHIFT, 60)): finite, and a row's sum below e**77 (2**24 classes,
# the most linear_cross_entropy takes, times e**60), so every product of it is finite. A row whose
# log-sum-exp lies in WINDOW has no capped entry (z <= lse <= SHIFT + 60) and keeps every entry
# that matters normal in bf16 and float32 (those within 20 of the log-sum-exp, above e**-80; the
# rest weigh below e**-20), and its factor exp(SHIFT - lse) stays above e**-60. Another row is
# recomputed after the chunks.
SHIFT = 30.0
WINDOW = (SHIFT - 60.0, SHIFT + 60.0)


def _logits(softcap: float | None) -> str:
    capped = "    z = softcap * tanh(y / softcap)\n" if softcap is not None else "    z = y\n"
    return capped


def _forward_source(softcap: float | None, bias: bool, exponentials: bool = False) -> str:
    """The row statistics (log-sum-exp, target logit, sum of logits), after `exp(z - shift)`
    of the logits where `exponentials`."""
    params = ["accum", "target", *(["bias"] if bias else []), *(["softcap"] if softcap is not None else []),
              *(["shift"] if exponentials else [])]
    name = "linear_cross_entropy_exponentials" if exponentials else "linear_cross_entropy_stats"
    return (f"def {name}({', '.join(params)}):\n"
            f"    y = accum{' + bias' if bias else ''}\n" + _logits(softcap)
            + ("    E = exp(min(z - shift, 60.0))\n" if exponentials else "")
            + "    lse = logsumexp(z, dim=1)\n"
            "    picked = sum(where(col() == target, z, 0.0), dim=1)\n"
            "    total = sum(z, dim=1)\n"
            f"    return {'E, ' if exponentials else ''}lse, picked, total\n")


def _chunk_rows(vocab: int, hidden: int, element_size: int) -> int:
    """Rows per chunk: CHUNK_BYTES of logits, or as many bytes as the weight (hidden rows)."""
    budget = CHUNK_BYTES if CHUNK_BYTES is not None else vocab * hidden * element_size
    return max(1, budget // max(1, vocab * element_size))


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


def _raise_if_out_of_range(out_of_range: bool, vocab: int, ignore_index: int) -> None:
    if out_of_range:
        raise ShapeError(f"target holds class indices outside [0, {vocab}) (other than ignore_index "
                         f"{ignore_index}).")


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, ignore_index, reduction, label_smoothing, z_loss, softcap, training):
        rows = x.reshape(-1, x.shape[-1])
        flat = target.reshape(-1)
        vocab = weight.shape[0]
        valid = flat != ignore_index
        out_of_range = (valid & ((flat < 0) | (flat >= vocab))).any()   # a device flag: read at the call's sync
        valid = valid & ~out_of_range   # until then no index outside [0, vocab) reaches a kernel
        target_col = torch.where(valid, flat, -1).to(torch.float32).unsqueeze(1)   # -1: no column
        eps, z_loss = float(label_smoothing), float(z_loss)
        ctx.options = (reduction, eps, z_loss, softcap, x.shape)
        ctx.gradients = None
        outside = None
        with torch.no_grad():
            if (training and reduction != "none" and softcap is None and x.dtype == weight.dtype
                    and x.dtype != torch.float16):   # float16's range cannot hold exp(z - SHIFT)
                (lse, picked, total), ctx.gradients, outside = _statistics_and_gradients(
                    ctx, rows, weight, bias, target_col, flat, valid, eps, z_loss)
            else:
                _raise_if_out_of_range(bool(out_of_range), vocab, ignore_index)
                operands = dict(target=target_col)
                if bias is not None:
                    operands["bias"] = bias
                if softcap is not None:
                    operands["softcap"] = float(softcap)
                lse, picked, total = gemm(rows, weight.t(), _forward_source(softcap, bias is not None), **operands)
        per = (1.0 - eps) * (lse - picked) + eps * (lse - total / vocab) + z_loss * lse * lse
        per = torch.where(valid, per, 0.0)
        count = valid.sum()
        if reduction == "mean":
            loss = per.sum() / count   # as torch: NaN where every token is ignored
        elif reduction == "sum":
            loss = per.sum()
        else:
            loss = per.reshape(target.shape)
        if outside is not None:   # the training path's one sync, after everything is queued
            bad, fix_up = torch.stack((out_of_range, outside.any())).tolist()
            _raise_if_out_of_range(bad, vocab, ignore_index)
            if fix_up:   # rows whose exponentials would overflow or vanish
                _recompute_rows(outside.nonzero().squeeze(1), rows, weight, bias, target_col, lse, eps,
                                z_loss, reduction, valid, *ctx.gradients)
        ctx.save_for_backward(rows, weight, bias, target_col, lse, valid, count)
        return loss

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():   # create_graph=True: a gradient of this gradient was asked for
            raise UnsupportedError("epifuse.linear_cross_entropy is differentiable once: its backward has no "
                                   "backward of its own (create_graph=True, double backward).",
                                   hint="Take the gradient without create_graph, or use F.linear and F.cross_entropy "
                                        "for higher derivatives.")
        with torch.no_grad():
            if ctx.gradients is not None:   # the forward's; handed out once (a second backward recomputes)
                computed, ctx.gradients = ctx.gradients, None
                return _scaled(ctx, computed, grad)
            return _gradients(ctx, grad)


def _statistics_and_gradients(ctx, rows, weight, bias, target_col, flat, valid, eps: float, z_loss: float):
    """The forward's row statistics and, chunk of rows by chunk, the gradients of the loss for
    a loss gradient of 1 (_scaled multiplies them by the actual one).

    A chunk's gradient is G = u E' - spread, u = (1 + 2 z_loss lse) exp(SHIFT - lse) a factor
    per row and E' the epilogue's exp(z - SHIFT) with each target entry replaced by (softmax -
    (1 - eps)) / u, computed in float32 from the target logit (near 0 for a confident token,
    where the rounded softmax minus 1 would keep only its rounding error). E' is never scaled
    in place: dx = u * (E' @ W) scales the small product's rows, dweight += E'^T (u * x) scales
    x's, and the spread (label smoothing) is a rank-one term applied to dx, dweight and dbias."""
    vocab, hidden = weight.shape
    n = rows.shape[0]
    exact = torch.float64 if rows.dtype == torch.float64 else torch.float32
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = bias is not None and ctx.needs_input_grad[2]
    reduction = ctx.options[0]
    g = 1.0 / valid.sum().clamp(min=1).to(exact) if reduction == "mean" else 1.0   # d loss / d token's loss
    dx = torch.empty_like(rows) if need_x else None
    dw = torch.empty_like(weight) if need_w else None   # the first chunk's product, the others added
    db = torch.zeros(vocab, dtype=exact, device=weight.device) if need_b else None
    spread_x = torch.zeros(hidden, dtype=exact, device=rows.device) if eps else None   # sum of spread_i x_i
    spread_sum = torch.zeros((), dtype=exact, device=rows.device)
    weight_sum = weight.sum(0, dtype=exact) if eps and need_x else None
    stats = [torch.empty(n, dtype=exact, device=rows.device) for _ in range(3)]
    operands = dict(bias=bias) if bias is not None else {}
    source = _forward_source(None, bias is not None, exponentials=True)
    columns = torch.where(valid, flat, 0).long().unsqueeze(1)   # scatter_ indexes in int64
    step = _chunk_rows(vocab, hidden, rows.element_size())
    outside = torch.zeros(n, dtype=torch.bool, device=rows.device)   # valid rows left to the fix-up
    for start in range(0, n, step):
        part = slice(start, start + step)
        E, *chunk_stats = gemm(rows[part], weight.t(), source, target=target_col[part], shift=SHIFT, **operands)
        for whole, piece in zip(stats, chunk_stats):
            whole[part] = piece
        lse, picked, ok = chunk_stats[0].unsqueeze(1), chunk_stats[1].unsqueeze(1), valid[part].unsqueeze(1)
        scale = 1.0 + 2.0 * z_loss * lse
        inside = (lse >= WINDOW[0]) & (lse <= WINDOW[1]) & (scale > 0)
        live = ok & inside   # rows this chunk's matmuls serve; an ignored row's gradient is 0
        outside[part] = (ok & ~inside).squeeze(1)
        u = torch.where(live, scale * torch.exp(SHIFT - lse), 0.0)
        entry = torch.where(live, (scale * torch.exp(picked - lse) - (1.0 - eps)) / u, 0.0)
        E.scatter_(1, columns[part], entry.to(E.dtype))
        r = u * g                                 # 0 on rows not served: their E rows count for nothing
        spread = live.to(exact) * (g * eps / vocab)
        if dx is not None:
            torch.mm(E, weight, out=dx[part])
            dx[part] = dx[part] * r if weight_sum is None else dx[part] * r - spread * weight_sum
        if dw is not None:
            x_part = (rows[part] * r).to(rows.dtype)
            if start == 0:
                torch.mm(E.t(), x_part, out=dw)
            else:
                dw.addmm_(E.t(), x_part)
        if db is not None:
            db += torch.mv(E.t(), r.squeeze(1).to(E.dtype)).to(exact)
        if eps:
            spread_x += (spread * rows[part].to(exact)).sum(0)
            spread_sum += spread.sum()
        del E   # before the next chunk's exponentials are allocated: one chunk alive at a time
    if dw is not None and n == 0:
        dw.zero_()
    if dw is not None and eps:
        dw.sub_(spread_x.to(dw.dtype))
    if db is not None and eps:
        db.sub_(spread_sum)
    return stats, (dx, dw, db), outside


def _recomputed_chunk(rows, weight, bias, target_col, lse, scale, pick, spread, softcap=None):
    """One chunk's logit gradient (and its column sum with a bias, else None) by the gradient's
    epilogue, from the chunk's log-sum-exp: the recompute path's every chunk, and the training
    path's rows whose exponentials would leave the float range."""
    operands = dict(target=target_col, lse=lse, scale=scale, pick=pick, spread=spread)
    if bias is not None:
        operands["bias"] = bias
    if softcap is not None:
        operands["softcap"] = float(softcap)
    out = gemm(rows, weight.t(), _backward_source(softcap, bias is not None), **operands)
    return out if bias is not None else (out, None)


def _recompute_rows(index, rows, weight, bias, target_col, lse, eps, z_loss, reduction, valid, dx, dw, db):
    """Add the gradient of the rows at `index` by the gradient's own epilogue (a fourth GEMM
    over them, a chunk of rows at a time), from their log-sum-exp: rows whose exponentials would
    leave the float range, whose contributions the chunks left at 0."""
    vocab = weight.shape[0]
    step = _chunk_rows(vocab, weight.shape[1], rows.element_size())
    exact = lse.dtype
    g = 1.0 / valid.sum().clamp(min=1).to(exact) if reduction == "mean" else 1.0
    for start in range(0, index.numel(), step):
        at = index[start:start + step]
        l = lse[at].unsqueeze(1)
        G, dbias = _recomputed_chunk(rows[at], weight, bias, target_col[at], l, (1.0 + 2.0 * z_loss * l) * g,
                                     torch.full_like(l, (1.0 - eps)) * g, torch.full_like(l, eps / vocab) * g)
        if dx is not None:
            dx[at] = G @ weight
        if dw is not None:
            dw.addmm_(G.t(), rows[at])
        if db is not None:
            db += dbias


def _scaled(ctx, computed, grad):
    """The forward's gradients (for a loss gradient of 1) times the loss's gradient."""
    dx, dw, db = computed
    x_shape = ctx.options[4]
    factor = float(grad)
    if factor != 1.0:
        for t in (dx, dw, db):
            if t is not None:
                t.mul_(factor)
    bias = ctx.saved_tensors[2]
    return (dx.reshape(x_shape) if dx is not None else None, dw,
            db.to(bias.dtype) if db is not None else None, None, None, None, None, None, None, None)


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
    chunk = _chunk_rows(vocab, weight.shape[1], rows.element_size())
    for start in range(0, rows.shape[0], chunk):
        part = slice(start, start + chunk)
        gi, l = g[part].unsqueeze(1), lse[part].unsqueeze(1)
        G, dbias = _recomputed_chunk(rows[part], weight, bias, target_col[part], l, gi * (1.0 + 2.0 * z_loss * l),
                                     gi * (1.0 - eps), gi * (eps / vocab), softcap)
        if dx is not None:
            dx[part] = (G @ weight.to(G.dtype)).to(dx.dtype)
        if dw is not None:   # each chunk's product in the inputs' dtype, summed in float32 (float64)
            dw += (G.t() @ rows[part].to(G.dtype)).to(exact)
        if db is not None:
            db += dbias
    return (dx.reshape(x_shape) if dx is not None else None, dw.to(weight.dtype) if dw is not None else None,
            db.to(bias.dtype) if db is not None else None, None, None, None, None, None, None, None)


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
                                     float(z_loss), softcap, torch.is_grad_enabled())


__all__ = ["linear_cross_entropy"]
