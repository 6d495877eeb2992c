"""Reporting: the printed table, the JSON file and the PNG chart of one benchmark run.

A row (built by ``run.make_row``) holds raw times in ms per baseline, ratios to ``cublas``,
per-baseline error strings, first-call seconds, epifuse's relative error against the float64
reference and a status (ok / FAIL / ERROR / -). The JSON keeps NaN and inf as the strings "nan",
"inf" so that it stays strict JSON. The PNG needs matplotlib; without it the chart is skipped
with a printed note.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

RATIO_COLS = ("eager", "cublaslt", "inductor", "epifuse")


def basename(env: dict) -> str:
    """``bench_<UTC date-time>_<gpu>``, e.g. bench_20261122-041233_NVIDIA-H200."""
    stamp = re.sub(r"[^0-9T]", "", env["date"][:19]).replace("T", "-")
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", env.get("gpu") or "gpu").strip("-")
    return f"bench_{stamp}_{gpu}"


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(path: Path, payload: dict) -> None:
    tmp = Path(path).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_clean(payload), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)


def _ratio_cell(row, name):
    v = row["ratios"].get(name)
    if v is not None:
        return f"{v:.2f}"
    return "err" if name in row["errors"] else "-"


def _err_cell(row):
    e = row.get("epifuse_rel_err")
    return "-" if e is None else f"{e:.1e}"


def _target_cell(row):
    met = row.get("target_met")
    return "-" if met is None else f"{row['target']:.2f} {'met' if met else 'MISS'}"


def _first_cell(row):
    s = row["first_call_s"].get("epifuse")
    return "-" if s is None else f"{s:.1f}"


def row_summary(row: dict) -> str:
    """One line for the progress log."""
    ms = row["times_ms"].get("cublas")
    parts = [f"cublas {ms:.3f} ms" if ms else "cublas -"]
    parts += [f"{k} {_ratio_cell(row, k)}" for k in RATIO_COLS if k in row["ratios"] or k in row["errors"]]
    return ", ".join(parts) + f"; err {_err_cell(row)}; {row['status']}" + _clock_note(row)


def _clock_note(row: dict) -> str:
    """'; MHz while timed: cublas 1755, epifuse 1720 (power cap)': the mean SM clock of each
    baseline's timing, and whether the power cap throttled it (bit 0x4 of the throttle reasons)."""
    sampled = {k: v for k, v in (row.get("clocks_while_timed") or {}).items() if v and v.get("sm_mhz")}
    if not sampled:
        return ""
    return "; MHz while timed: " + ", ".join(
        f"{k} {v['sm_mhz']:.0f}" + (" (power cap)" if int(v.get("throttle") or "0x0", 16) & 0x4 else "")
        for k, v in sampled.items())


def format_table(rows: list, env: dict | None) -> str:
    head = ["workload", "shape", "dtype", "cublas ms", *RATIO_COLS, "target", "epi err", "1st s", "status"]
    body = []
    for r in rows:
        ms = r["times_ms"].get("cublas")
        body.append([r["workload"], r["shape"], r["dtype"],
                     f"{ms:.4f}" if ms else ("err" if "cublas" in r["errors"] else "-"),
                     *(_ratio_cell(r, k) for k in RATIO_COLS),
                     _target_cell(r), _err_cell(r), _first_cell(r), r["status"]])
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    left = 3  # workload, shape, dtype are left-aligned; numbers right-aligned

    def line(cells):
        return "  ".join(str(c).ljust(w) if i < left else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))
    out = []
    if env:
        mhz = sorted(r["sm_mhz"] for r in rows if r.get("sm_mhz"))
        top = (env.get("clocks_start") or {}).get("max_sm_mhz", "?")
        seen = f"{mhz[0]}-{mhz[-1]}" if mhz else "?"
        out.append(f"{env.get('gpu')}  SM clock after timing {seen} MHz (max {top})  "
                   f"torch {env.get('torch')}  triton {env.get('triton')}  epifuse {env.get('epifuse')}  "
                   f"{env.get('date')}")
        out.append("ratios = time / cublas time in this run (fp8_scaled: / _scaled_mm with unit scales; int8_scaled: / _int_mm)")
    out += [line(head), line(["-" * w for w in widths])] + [line(b) for b in body]
    return "\n".join(out)


def format_notes(payload: dict) -> str:
    """Baseline errors and skipped rows, one per line (printed before the table)."""
    lines = [f"error: {r['workload']} {r['shape']} {r['dtype']} {name}: {msg}"
             for r in payload["rows"] for name, msg in r["errors"].items()]
    if payload.get("skipped"):
        lines.append(f"skipped (time budget): {', '.join(payload['skipped'])}")
    descs = {r["workload"]: r["cublaslt_desc"] for r in payload["rows"] if r.get("cublaslt_desc")}
    lines += [f"cublaslt for {k}: {v}" for k, v in descs.items()]
    return "\n".join(lines)


def write_png(path: Path, rows: list, env: dict) -> Path | None:
    """Grouped bars of the ratios to cublas, one panel per shape (log scale). None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        print("note: matplotlib is not importable; PNG chart skipped")
        return None
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    if not shapes:
        return None
    widest = max(sum(1 for r in rows if r["shape"] == s) for s in shapes)
    fig, axes = plt.subplots(len(shapes), 1, figsize=(max(8, 1.1 * widest), 3.6 * len(shapes)), squeeze=False)
    bar = 0.8 / len(RATIO_COLS)
    for ax, shape in zip(axes[:, 0], shapes):
        sub = [r for r in rows if r["shape"] == shape]
        for j, name in enumerate(RATIO_COLS):
            xs = [i + (j - (len(RATIO_COLS) - 1) / 2) * bar for i in range(len(sub))]
            ys = [r["ratios"].get(name) or math.nan for r in sub]  # a missing bar is not drawn
            bars = ax.bar(xs, ys, bar, label=name)
            if name == "epifuse":
                ax.bar_label(bars, labels=[f"{y:.2f}" if y == y else "" for y in ys], fontsize=7)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
        ax.set_xticks(range(len(sub)))
        ax.set_xticklabels([f"{r['workload']}\n{r['dtype']}" + (" FAIL" if r["status"] == "FAIL" else "")
                            for r in sub], fontsize=8)
        ax.set_ylabel("time / cublas")
        ax.set_title(f"{shape}  (M,N,K)=({sub[0]['M']},{sub[0]['N']},{sub[0]['K']})", fontsize=9)
    axes[0, 0].legend(ncol=len(RATIO_COLS), fontsize=8)
    fig.suptitle(f"epifuse bench: {env.get('gpu')}, torch {env.get('torch')}, {env.get('date')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
