"""Nsight Compute output, read: what `epifuse profile` prints from the CSV that `ncu` wrote,
and the register and spill counts Triton reports for a compiled kernel."""
from __future__ import annotations

import csv

_TIME = {"ns": 1e-9, "nsecond": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3,
         "second": 1.0, "s": 1.0}
_BYTES = {"byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
          "kibyte": 1024.0, "mibyte": 1024.0 ** 2, "gibyte": 1024.0 ** 3}


def ncu_csv_rows(text: str) -> list[list[str]]:
    """The CSV rows of `ncu --csv` output, from its '"ID"' header on (what the profiled
    program printed before it is skipped); [] where there is none."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    return [] if start is None else list(csv.reader(lines[start:]))


def parse_ncu_csv(text: str) -> dict[str, tuple[str, float]]:
    """{metric: (unit, value)} from `ncu --csv --page details` output (the first kernel)."""
    rows = ncu_csv_rows(text)
    if not rows:
        return {}
    header = rows[0]
    metrics: dict[str, tuple[str, float]] = {}
    if "Metric Name" in header:
        col = {h: i for i, h in enumerate(header)}
        first_id = None
        for row in rows[1:]:
            if len(row) != len(header):
                continue
            first_id = first_id if first_id is not None else row[col["ID"]]
            if row[col["ID"]] != first_id:
                break
            try:
                value = float(row[col["Metric Value"]].replace(",", ""))
            except ValueError:
                continue
            metrics[row[col["Metric Name"]]] = (row[col["Metric Unit"]], value)
    elif len(rows) >= 3:   # --page raw: names, units, then one row per kernel
        for name, unit, value in zip(rows[0], rows[1], rows[2]):
            try:
                metrics[name] = (unit, float(value.replace(",", "")))
            except ValueError:
                pass
    return metrics


def _scaled(metrics, name, table) -> float | None:
    if name not in metrics:
        return None
    unit, value = metrics[name]
    return value * table.get(unit.strip().lower(), 1.0)


def summarize_ncu(text: str, info: dict) -> str:
    """A few lines: time, registers and spills, DRAM traffic and bandwidth, throughput, FLOP/s.
    `info` comes from the profiled process (kernel, shape, Triton's register and spill counts)."""
    m = parse_ncu_csv(text)
    if not m:
        raise RuntimeError("ncu wrote no metrics for an epifuse kernel (was the kernel launched?)")
    seconds = _scaled(m, "gpu__time_duration.sum", _TIME)
    read = _scaled(m, "dram__bytes_read.sum", _BYTES)
    write = _scaled(m, "dram__bytes_write.sum", _BYTES)
    L, M, N, K = (info.get(k, 1) for k in ("L", "M", "N", "K"))
    lines = [f"profile of {info.get('kernel', 'the kernel')} for {info.get('name', 'the epilogue')}, "
             f"{M}x{N}x{K}" + (f" x L={L}" if L > 1 else "") + f" {info.get('dtype', '')}, on "
             f"{info.get('device', 'the GPU')} (ncu --clock-control none)"]
    lines.append(f"  time           {seconds * 1e6:10.1f} us" if seconds else "  time           n/a")
    regs = m.get("launch__registers_per_thread", (None, None))[1]
    spills = info.get("spills")
    lines.append(f"  registers      {int(regs) if regs is not None else 'n/a':>10} per thread"
                 + (f", {spills} spilled (Triton's count)" if spills is not None else ", spills n/a"))
    if read is not None and write is not None:
        rate = f", {(read + write) / seconds / 1e9:.1f} GB/s achieved" if seconds else ""
        lines.append(f"  DRAM           {read / 1e6:10.1f} MB read, {write / 1e6:.1f} MB written{rate}")
    sm = m.get("sm__throughput.avg.pct_of_peak_sustained_elapsed", (None, None))[1]
    mem = m.get("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", (None, None))[1]
    if sm is not None or mem is not None:
        lines.append(f"  throughput     SM {sm if sm is not None else float('nan'):.1f} % of peak, "
                     f"memory {mem if mem is not None else float('nan'):.1f} % of peak")
    if seconds:
        lines.append(f"  FLOP/s         {2.0 * L * M * N * K / seconds / 1e12:10.1f} TFLOP/s (2*L*M*N*K / time)")
    return "\n".join(lines)


def compiled_stats(kernel, args) -> dict:
    """Registers and spills of the compiled Triton kernel behind `kernel` for `args`, as far as
    Triton exposes them ({} when it does not)."""
    plan = getattr(args, "_plans", {}).get(kernel)
    jit = getattr(plan, "kernel", None)
    try:
        for entry in getattr(jit, "device_caches", {}).values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            for compiled in cache.values():
                if hasattr(compiled, "_init_handles"):
                    compiled._init_handles()
                return {"registers": getattr(compiled, "n_regs", None),
                        "spills": getattr(compiled, "n_spills", None)}
    except Exception:   # Triton internals differ between versions; the summary says n/a
        pass
    return {}
