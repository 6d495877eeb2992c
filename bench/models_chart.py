"""The chart of bench.models' table: each block's training step in every variant, as speed
relative to the better torch.compile mode of the same run (higher is faster; the issue's target,
1.15, drawn as a line), from one or more result JSONs of one GPU (a later file's block replaces
an earlier one's, as the README's table takes each block from the run that measured it whole).

    python -m bench.models_chart bench/results/models_A.json [models_B.json ...] --out chart.png

Needs matplotlib (not a dependency of epifuse: install it where the chart is drawn).
"""
from __future__ import annotations

import argparse
import json
import sys

VARIANTS = ("eager", "compile", "max_autotune", "epifuse")
TARGET = 1.15


def blocks(paths: list) -> tuple[dict, str]:
    """model -> {variant: speed relative to the better compile mode}, and the GPU's name."""
    table, gpus = {}, set()
    for path in paths:
        with open(path) as f:
            payload = json.load(f)
        gpus.add(payload.get("gpu", "?"))
        rows = {}
        for row in payload["rows"]:
            if row.get("speedup_vs_best_compile") is not None:
                rows.setdefault(row["model"], {})[row["variant"]] = row["speedup_vs_best_compile"]
        table.update(rows)
    if len(gpus) != 1:
        raise SystemExit(f"the files come from {len(gpus)} GPUs ({', '.join(sorted(gpus))}): chart one GPU at a time")
    return table, gpus.pop()


def draw(table: dict, gpu: str, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(table)
    width = 0.8 / len(VARIANTS)
    fig, ax = plt.subplots(figsize=(2.2 * len(models) + 2, 4))
    for k, variant in enumerate(VARIANTS):
        xs = [m + (k - (len(VARIANTS) - 1) / 2) * width for m in range(len(models))]
        ys = [table[model].get(variant, 0.0) for model in models]
        bars = ax.bar(xs, ys, width, label=variant.replace("_", "-"))
        for bar, y in zip(bars, ys):
            if y:
                ax.annotate(f"{y:.2f}", (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
    ax.axhline(TARGET, color="k", linestyle="--", linewidth=0.8, label=f"target {TARGET}x")
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("speed vs the better torch.compile mode")
    ax.set_title(f"Training steps under torch.compile, bf16 ({gpu})")
    ax.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="bench.models result JSONs of one GPU, earliest first")
    parser.add_argument("--out", required=True, help="the PNG to write")
    ns = parser.parse_args(argv)
    table, gpu = blocks(ns.paths)
    draw(table, gpu, ns.out)
    print(ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
