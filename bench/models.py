"""Training steps of whole blocks under torch.compile's backends (issue 33's table).

    PYTHONPATH=src:. python -m bench.models [--models mlp,bert_ffn,llama_mlp,linear_bce,gcn]
        [--variants eager,compile,max_autotune,epifuse] [--scale 1.0] [--out DIR]

Each step is forward + backward (no optimizer), bf16 weights and activations, losses in fp32:
  mlp         Linear(4096 -> 16384) -> GELU(tanh) -> Linear(16384 -> 4096), 8192 tokens
  bert_ffn    LayerNorm(x + Linear(4096 -> 1024)(GELU(Linear(1024 -> 4096)(x)))), 16384 tokens
  llama_mlp   x + W_down(silu(RMSNorm(x) @ W_gate) * (RMSNorm(x) @ W_up)), 4096 -> 2 x 11008 ->
              4096, 8192 tokens
  llama_merged the same block with W_gate and W_up kept as one weight (a Linear to 2 x 11008,
              its result chunked: the gated GEMM's case)
              (the four blocks' loss: mean(y * probe), a fixed random probe per feature)
  linear_bce  BCE-with-logits of Linear(1024 -> 4096) over 16384 rows against 0/1 targets (the
              EVT paper's loss subgraph); the loss itself
  gcn         two GCN layers, A_hat @ (X @ W) with ReLU between, over a dense normalized
              adjacency of 8192 nodes, 1024 -> 1024 -> 64 features, cross-entropy over the nodes
Variants, compiled separately in one process and timed alternately (do_bench medians, best of
--rounds): eager; compile (torch.compile default); max_autotune (mode
"max-autotune-no-cudagraphs"); epifuse (torch.compile with epifuse's backend: Inductor plus
epifuse's GEMM-epilogue fusion pass). Each row records the first step's seconds (compilation),
the loss and every parameter's gradient against eager's (relative error), and the GPU kernels of
one step (where the time goes). The issue's target: epifuse at least 1.15x faster than the
better of compile and max_autotune on every step.

`--scale` shrinks every size (for a quick look); `--device cpu` runs the plumbing at a tiny size
(eager and epifuse only; Inductor's CPU code and Triton's interpreter).
"""
from __future__ import annotations

import math
import sys
import time

import torch
from torch import nn

MODELS = ("mlp", "bert_ffn", "llama_mlp", "llama_merged", "linear_bce", "gcn")
VARIANTS = ("eager", "compile", "max_autotune", "epifuse")


class _Block(nn.Module):
    """A block whose loss is its output's mean against a fixed random probe per feature: every
    gradient well away from zero (a squared output after a LayerNorm is nearly constant, and
    its gradients nearly cancel, leaving only rounding to compare)."""

    def __init__(self, h):
        super().__init__()
        self.register_buffer("probe", torch.randn(h))

    def loss(self, y):
        return (y.float() * self.probe.float()).mean()


class _Mlp(_Block):
    def __init__(self, h, f):
        super().__init__(h)
        self.up, self.down = nn.Linear(h, f), nn.Linear(f, h)

    def forward(self, x):
        return self.loss(self.down(nn.functional.gelu(self.up(x), approximate="tanh")))


class _BertFfn(_Block):
    def __init__(self, h, f):
        super().__init__(h)
        self.up, self.down, self.norm = nn.Linear(h, f), nn.Linear(f, h), nn.LayerNorm(h)

    def forward(self, x):
        return self.loss(self.norm(x + self.down(nn.functional.gelu(self.up(x)))))


class _LlamaMlp(_Block):
    def __init__(self, h, f):
        super().__init__(h)
        self.norm = nn.RMSNorm(h, eps=1e-6)
        self.gate, self.up = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.down = nn.Linear(f, h, bias=False)

    def forward(self, x):
        n = self.norm(x)
        return self.loss(x + self.down(nn.functional.silu(self.gate(n)) * self.up(n)))


class _LlamaMergedMlp(_Block):
    def __init__(self, h, f):
        super().__init__(h)
        self.norm = nn.RMSNorm(h, eps=1e-6)
        self.gate_up = nn.Linear(h, 2 * f, bias=False)
        self.down = nn.Linear(f, h, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return self.loss(x + self.down(nn.functional.silu(gate) * up))


class _LinearBce(nn.Module):
    def __init__(self, h, f):
        super().__init__()
        self.linear = nn.Linear(h, f)

    def forward(self, x, target):
        return nn.functional.binary_cross_entropy_with_logits(self.linear(x).float(), target)


class _Gcn(nn.Module):
    def __init__(self, h, f, classes):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(h, f) / math.sqrt(h))
        self.w2 = nn.Parameter(torch.randn(f, classes) / math.sqrt(f))

    def forward(self, x, adjacency, labels):
        h = torch.relu(adjacency @ (x @ self.w1))
        return nn.functional.cross_entropy((adjacency @ (h @ self.w2)).float(), labels)


def _sizes(model: str, scale: float, device: str) -> dict:
    tiny = device == "cpu"

    def s(n, small):
        return small if tiny else max(16, int(n * scale) // 16 * 16)
    return {"mlp": dict(tokens=s(8192, 24), h=s(4096, 16), f=s(16384, 48)),
            "bert_ffn": dict(tokens=s(16384, 24), h=s(1024, 16), f=s(4096, 48)),
            "llama_mlp": dict(tokens=s(8192, 24), h=s(4096, 16), f=s(11008, 40)),
            "llama_merged": dict(tokens=s(8192, 24), h=s(4096, 16), f=s(11008, 40)),
            "linear_bce": dict(tokens=s(16384, 24), h=s(1024, 16), f=s(4096, 48)),
            "gcn": dict(tokens=s(8192, 32), h=s(1024, 16), f=s(1024, 16), classes=s(64, 8))}[model]


def build(model: str, scale: float, device: str, dtype, seed: int = 0):
    """(module, inputs, sizes): the model in `dtype` on `device`, its inputs (x requires grad
    where the model's input is an activation)."""
    size = _sizes(model, scale, device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    torch.manual_seed(seed)
    n, h, f = size["tokens"], size["h"], size["f"]
    if model == "gcn":
        module = _Gcn(h, f, size["classes"])
        x = torch.randn(n, h, generator=g)
        edges = (torch.rand(n, n, generator=g) < 16 / n).float()
        adjacency = edges + edges.t() + torch.eye(n)
        degree = adjacency.sum(1).rsqrt()
        adjacency = degree[:, None] * adjacency * degree[None, :]
        labels = torch.randint(0, size["classes"], (n,), generator=g)
        inputs = (x.to(device, dtype), adjacency.to(device, dtype), labels.to(device))
    else:
        module = {"mlp": _Mlp, "bert_ffn": _BertFfn, "llama_mlp": _LlamaMlp, "llama_merged": _LlamaMergedMlp,
                  "linear_bce": _LinearBce}[model](h, f)
        x = torch.randn(n, h, generator=g).to(device, dtype)
        if model == "linear_bce":
            inputs = (x, torch.randint(0, 2, (n, f), generator=g).float().to(device))
        else:
            inputs = (x.requires_grad_(),)
    return module.to(device, dtype), inputs, size


def _compiled(module, variant: str):
    import epifuse.backend
    if variant == "eager":
        return module
    if variant == "compile":
        return torch.compile(module)
    if variant == "max_autotune":
        return torch.compile(module, mode="max-autotune-no-cudagraphs")
    return torch.compile(module, backend=epifuse.backend.backend)


def _gradients(module, inputs) -> list:
    return [p.grad for p in module.parameters()] + [t.grad for t in inputs if t.requires_grad]


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float(((a - b).norm() / b.norm().clamp(min=1e-30)).item())


def measure(model: str, variants, scale: float, device: str, rounds: int) -> list[dict]:
    import epifuse.backend
    dtype = torch.bfloat16
    base, inputs, size = build(model, scale, device, dtype)
    runs = {}
    for variant in variants:
        twin, _, _ = build(model, scale, device, dtype)
        twin.load_state_dict(base.state_dict())
        runs[variant] = (twin, _compiled(twin, variant))
    steps, rows = {}, {}
    for variant, (twin, fn) in runs.items():
        def step(twin=twin, fn=fn):
            for p in twin.parameters():
                p.grad = None
            for t in inputs:
                t.grad = None
            loss = fn(*inputs)
            loss.backward()
            return loss
        start = time.perf_counter()
        with epifuse.backend.recorded() as explanation:   # the first step compiles forward and backward
            loss = step()
            if device == "cuda":
                torch.cuda.synchronize()
        first = time.perf_counter() - start
        rows[variant] = {"model": model, "variant": variant, "sizes": size, "first_step_s": first,
                         "loss": float(loss.detach()), "grads": [g.detach().clone() for g in _gradients(twin, inputs)]}
        if variant == "epifuse":   # what the pass fused (each region's epilogue) and what it left, with why
            rows[variant]["fused"] = list(explanation.fused)
            rows[variant]["left"] = [list(item) for item in explanation.left]
            rows[variant]["eliminated"] = [list(item) for item in explanation.eliminated]
            rows[variant]["notes"] = [list(item) for item in explanation.notes]
        steps[variant] = step
    eager = rows.get("eager")
    for variant, row in rows.items():
        grads = row.pop("grads")
        if eager is not None and variant != "eager":
            row["loss_rel_error_vs_eager"] = abs(row["loss"] - eager["loss"]) / max(abs(eager["loss"]), 1e-30)
            row["grad_rel_error_vs_eager"] = max(_rel(a, b) for a, b in zip(grads, eager["_grads"]))
        if variant == "eager":
            row["_grads"] = grads
    if eager is not None:
        eager.pop("_grads")
    if device == "cuda":
        from bench.timing import alternate_ms
        from bench.training import _kernel_table
        times = alternate_ms(steps, rounds, 25.0, 200.0)
        for variant, row in rows.items():
            row["ms"] = min(times[variant])
            row["ms_rounds"] = times[variant]
            row["gpu_kernels"] = _kernel_table(steps[variant])
        best = min((rows[v]["ms"] for v in ("compile", "max_autotune") if v in rows), default=None)
        for row in rows.values():
            row["speedup_vs_best_compile"] = best / row["ms"] if best else None
    return list(rows.values())


def main(argv=None) -> int:
    from bench.timing import parse_small, save_rows, small_parser
    p = small_parser(__doc__)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--variants", default=None, help=f"comma list of {', '.join(VARIANTS)} (the CPU: eager,epifuse)")
    p.add_argument("--scale", type=float, default=1.0)
    ns = parse_small(p, argv)
    variants = (ns.variants or ("eager,epifuse" if ns.device == "cpu" else ",".join(VARIANTS))).split(",")
    for name in [*ns.models.split(","), *variants]:
        if name not in (*MODELS, *VARIANTS):
            p.error(f"unknown model or variant {name!r}: models {', '.join(MODELS)}; variants {', '.join(VARIANTS)}")
    for model in ns.models.split(","):   # one JSON per model, written as soon as it is measured
        done = measure(model, variants, ns.scale, ns.device, ns.rounds)
        for row in done:
            timing = (f"{row['ms']:8.3f} ms  x{row['speedup_vs_best_compile']:.2f} vs best compile"
                      if "ms" in row else "(not timed on the CPU)")
            check = (f"loss {row['loss_rel_error_vs_eager']:.1e} grads {row['grad_rel_error_vs_eager']:.1e} vs eager"
                     if "grad_rel_error_vs_eager" in row else "")
            print(f"{model:10s} {row['variant']:12s} {timing}  first {row['first_step_s']:.1f} s  {check}", flush=True)
            if "fused" in row:
                print(f"{'':10s} {'':12s} fused {len(row['fused'])} GEMM(s); left "
                      + ("; ".join(f"{name}: {why}" for name, why in row["left"]) or "none"), flush=True)
                for names, note in row.get("notes", []):
                    print(f"{'':10s} {'':12s} note on {names}: {note}", flush=True)
                if row.get("eliminated"):
                    print(f"{'':10s} {'':12s} eliminated " + "; ".join(f"{name}: {rule}" for name, rule in row["eliminated"]),
                          flush=True)
        print(save_rows("models_training", f"models_{model}", done, ns.out, ns.device), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
