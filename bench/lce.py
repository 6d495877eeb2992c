"""Linear + cross-entropy over a vocabulary (issue 36): the language-model head's loss, forward
and backward, without (or with) writing the logits.

    PYTHONPATH=src:. python -m bench.lce [--tokens 8192,32768] [--vocab 128256,151936]

x (tokens, hidden) and weight (vocab, hidden) in bf16, target (tokens,) int64 with a few
ignore_index entries; one step = the loss, then backward into x and weight. Implementations,
each timed alone in the same process:
  epifuse    epifuse.linear_cross_entropy (generated kernels; the logits never exist whole)
  eager      F.cross_entropy(F.linear(x, weight).float(), target)
  compile    the eager function under torch.compile (default mode)
  liger      Liger-Kernel's LigerFusedLinearCrossEntropyLoss, when it is importable
  cce        Cut Cross-Entropy's linear_cross_entropy, when it is importable
Per row: the median step in ms over --reps steps (CUDA events) after --warmup steps, the
peak memory a step allocates beyond its inputs and their gradients (GiB), the floor of three
GEMMs of the logits' size (one GEMM timed with cuBLAS, times three), and the loss's and
gradients' error relative to eager's, and to the float64 truth of the same bf16 inputs
(eager rounds x @ W^T to bf16 before its float32 softmax; a fused kernel that keeps the float32
logits differs from eager by eager's own error). A variant that fails (out of
memory, not installed) is recorded with its reason and the run goes on.
`--device cpu` runs the plumbing at a tiny size under Triton's interpreter (for the tests).
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

IGNORE = -100


def _eager(x, w, t):
    return F.cross_entropy(F.linear(x, w).float(), t, ignore_index=IGNORE)


def _implementations(device: str) -> dict:
    import epifuse
    found = {"eager": _eager,   # first: the reference the others' errors are taken against
             "epifuse": lambda x, w, t: epifuse.linear_cross_entropy(x, w, t, ignore_index=IGNORE)}
    if device == "cuda":
        found["compile"] = torch.compile(_eager)
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
            liger = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE)
            found["liger"] = lambda x, w, t: liger(w, x, t)
        except Exception as error:   # not installed, or an import that fails here
            found["liger"] = f"not available: {type(error).__name__}: {error}"
        try:
            from cut_cross_entropy import linear_cross_entropy as cce
            found["cce"] = lambda x, w, t: cce(x, w, t, ignore_index=IGNORE)
        except Exception as error:
            found["cce"] = f"not available: {type(error).__name__}: {error}"
    return found


def _inputs(tokens: int, hidden: int, vocab: int, device: str, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(tokens, hidden, generator=g, device=device)).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g, device=device) / hidden ** 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    t[::97] = IGNORE
    return x, w, t


def _step(fn, x, w, t):
    x.grad = w.grad = None
    loss = fn(x, w, t)
    loss.backward()
    return loss


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, x, w, t, device, warmup: int, reps: int) -> tuple[float, float, float]:
    """(median ms, first step s, peak GiB beyond what was allocated before the step)."""
    _sync(device)
    start = time.perf_counter()
    _step(fn, x, w, t)
    _sync(device)
    first = time.perf_counter() - start
    for _ in range(warmup):
        _step(fn, x, w, t)
    times = []
    for _ in range(reps):
        if device == "cuda":
            x.grad = w.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            _step(fn, x, w, t)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
            # the gradients themselves stay allocated after the step: not counted as extra
            grads = sum(g.numel() * g.element_size() for g in (x.grad, w.grad))
            peak = (torch.cuda.max_memory_allocated() - base - grads) / 2 ** 30
        else:
            s = time.perf_counter()
            _step(fn, x, w, t)
            times.append((time.perf_counter() - s) * 1e3)
            peak = float("nan")
    return statistics.median(times), first, peak


def _truth(x, w, t, rows: int = 1024):
    """The float64 loss, dx and dw of the bf16 inputs (exact math on the rounded inputs),
    a chunk of rows at a time: the reference every implementation's error is taken against."""
    xd, wd = x.detach().double(), w.detach().double()
    valid = t != IGNORE
    count = valid.sum().clamp(min=1).double()
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    dx, dw = torch.empty_like(xd), torch.zeros_like(wd)
    for start in range(0, xd.shape[0], rows):
        part = slice(start, start + rows)
        z = xd[part] @ wd.t()
        ok = valid[part].unsqueeze(1)
        cols = torch.where(valid[part], t[part], 0).unsqueeze(1)
        lse = torch.logsumexp(z, 1, keepdim=True)
        loss += torch.where(ok, lse - z.gather(1, cols), 0.0).sum()
        G = torch.exp(z - lse).scatter_add_(1, cols, torch.full_like(lse, -1.0))
        G = torch.where(ok, G, 0.0) / count
        dx[part] = G @ wd
        dw += G.t() @ xd[part]
        del z, G
    return loss / count, dx, dw


def _errors(loss, x, w, reference) -> dict:
    ref_loss, ref_dx, ref_dw = reference

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())
    return {"loss": rel(loss.detach().reshape(()), ref_loss), "dx": rel(x.grad, ref_dx), "dw": rel(w.grad, ref_dw)}


def measure(tokens: int, hidden: int, vocab: int, device: str, warmup: int, reps: int) -> list[dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, w, t = _inputs(tokens, hidden, vocab, device, dtype)
    rows = []
    floor_ms = None
    if device == "cuda":
        from bench.timing import bench_ms
        xd, wd = x.detach(), w.detach()
        floor_ms = 3 * bench_ms(lambda: xd @ wd.t(), 25.0, 100.0)
    reference = None
    truth = _truth(x, w, t)
    for name, fn in _implementations(device).items():
        row = {"implementation": name, "tokens": tokens, "hidden": hidden, "vocab": vocab,
               "dtype": str(dtype).removeprefix("torch."), "three_gemm_floor_ms": floor_ms}
        if isinstance(fn, str):
            row["error"] = fn
            rows.append(row)
            continue
        try:
            loss = _step(fn, x, w, t)
            if name == "eager":
                reference = (loss.detach().reshape(()).clone(), x.grad.clone(), w.grad.clone())
            ms, first, peak = _time(fn, x, w, t, device, warmup, reps)
            row.update(ms=ms, first_step_s=first, extra_peak_gib=peak, loss=float(loss.detach()))
            loss = _step(fn, x, w, t)
            if reference is not None and name != "eager":
                row["error_vs_eager"] = _errors(loss, x, w, reference)
            if truth is not None:
                row["error_vs_float64"] = _errors(loss, x, w, truth)
        except Exception as error:   # out of memory, an unsupported shape: recorded, the run goes on
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        rows.append(row)
        x.grad = w.grad = None
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    from bench.timing import parse_small, save_rows, small_parser
    p = small_parser(__doc__, do_bench=False)
    p.add_argument("--tokens", default="8192,32768")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", default="128256,151936")
    p.add_argument("--warmup", type=int, default=2, help="steps before the timed ones")
    p.add_argument("--reps", type=int, default=5, help="timed steps (the median is reported)")
    ns = parse_small(p, argv)
    rows = []
    for vocab in (int(v) for v in ns.vocab.split(",")):
        for tokens in (int(t) for t in ns.tokens.split(",")):
            rows += measure(tokens, ns.hidden, vocab, ns.device, ns.warmup, ns.reps)
    path = save_rows("linear_cross_entropy", "lce", rows, ns.out, ns.device)
    print(f"{'vocab':>7s} {'tokens':>6s} {'impl':8s} {'ms':>9s} {'x floor':>7s} {'extra GiB':>9s}  "
          "error vs float64 (loss, dx, dw)")
    for r in rows:
        if "ms" not in r:
            print(f"{r['vocab']:7d} {r['tokens']:6d} {r['implementation']:8s} {r['error'][:60]}")
            continue
        ratio = r["ms"] / r["three_gemm_floor_ms"] if r["three_gemm_floor_ms"] else float("nan")
        print(f"{r['vocab']:7d} {r['tokens']:6d} {r['implementation']:8s} {r['ms']:9.2f} {ratio:7.2f} "
              f"{r['extra_peak_gib']:9.2f}  " + " ".join(f"{v:.1e}" for v in r.get("error_vs_float64", {}).values()))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
