"""Benchmark driver: times every workload x shape x dtype against its baselines on one GPU.

Baselines, all in the same process and run (see BENCHMARKS.md):
  cublas    A @ B alone (for fp8_scaled: torch._scaled_mm with unit scales; for int8_scaled:
            torch._int_mm, int32 out): the denominator
  eager     A @ B, then the epilogue function on torch tensors
  cublaslt  a vendor fixed epilogue, where one exists (see workloads.py)
  inductor  torch.compile(eager, mode="max-autotune-no-cudagraphs")
  epifuse   epifuse.gemm(A, B, epilogue, **operands), with EPIFUSE_TUNE=full unless set

Times are medians of triton.testing.do_bench (which flushes L2 before each call), each the mean
of two: all baselines are compiled and tuned first, then timed in order and in reverse order;
input sets are rotated as well when one set fits in L2. Every baseline runs inside try/except: a failure records
its error string in the row and the run goes on. The epifuse output of each row is checked
against the epilogue evaluated on float64 copies on the GPU (||out - ref|| / ||ref||, the largest
over the outputs); a row above tolerance is FAIL. The JSON is rewritten after every row, so a
run cut short still leaves its rows. ``main(argv)`` is the CLI; ``dry_run()`` is the CPU check.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import sys
import time
from pathlib import Path

import torch

from . import report
from .timing import bench_ms, ClockSampler, collect_env, first_call_s, gpu_clocks, merge_summaries
from .workloads import FP8, SHAPES, WORKLOADS, bind_ops, shape_dims

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", FP8: "fp8e4m3",
               torch.int8: "int8"}
BASELINES = ("cublas", "eager", "cublaslt", "inductor", "epifuse")
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def _csv(text):
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="S2, fp16, short timing, no inductor")
    p.add_argument("--with-s4", action="store_true", help="in --quick, add the small-M shape S4")
    p.add_argument("--shapes", type=_csv, help=f"comma list of {','.join(SHAPES)} or MxNxK (a model's layer: "
                                               "1024x16384x4096)")
    p.add_argument("--workloads", type=_csv, help=f"comma list of {','.join(WORKLOADS)}")
    p.add_argument("--dtypes", type=_csv, help="comma list of fp16,bf16 (fp8_scaled is always e4m3, int8_scaled int8)")
    p.add_argument("--baselines", type=_csv, help=f"comma list of {','.join(BASELINES)}")
    p.add_argument("--no-inductor", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--prealloc", action="store_true", help="pass preallocated outputs to epifuse.gemm")
    p.add_argument("--warmup", type=float, help="do_bench warm-up, ms (default 25; quick 10)")
    p.add_argument("--rep", type=float, help="do_bench repetition time, ms (default 200; quick 50)")
    p.add_argument("--clocks", action="store_true",
                   help="sample the SM clock, power and throttle reasons (nvidia-smi, every 20 ms) while "
                        "each baseline is timed (off by default: the polling's own cost is unmeasured)")
    p.add_argument("--time-budget", type=float, help="start no new row after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON and PNG go")
    p.add_argument("--dry-run", action="store_true", help="CPU check of every workload, no GPU")
    args = p.parse_args(argv)
    args.shapes = args.shapes or (["S2", "S4"] if args.with_s4 else ["S2"] if args.quick else list(SHAPES))
    args.dtypes = args.dtypes or (["fp16"] if args.quick else list(DTYPES))
    args.workloads = args.workloads or list(WORKLOADS)
    if args.baselines is None:
        args.baselines = [b for b in BASELINES if not (b == "inductor" and args.quick)]
    if args.no_inductor:
        args.baselines = [b for b in args.baselines if b != "inductor"]
    args.warmup = args.warmup if args.warmup is not None else (10.0 if args.quick else 25.0)
    args.rep = args.rep if args.rep is not None else (50.0 if args.quick else 200.0)
    for kind, names, known in [("shape", args.shapes, SHAPES), ("workload", args.workloads, WORKLOADS),
                               ("dtype", args.dtypes, DTYPES), ("baseline", args.baselines, BASELINES)]:
        bad = [n for n in names if n not in known and not (kind == "shape" and shape_dims(n))]
        if bad:
            also = " or MxNxK with positive sizes" if kind == "shape" else ""
            p.error(f"unknown {kind} {', '.join(bad)}; choose from {', '.join(known)}{also}")
    return args


# ------------------------------------------------------------------------------ small helpers


def _short(e: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_tuple(x):
    return x if isinstance(x, tuple) else tuple(x) if isinstance(x, list) else (x,)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN or inf in out gives NaN/inf: never within tolerance)."""
    o, r = out.detach().double().reshape(-1), ref.detach().double().reshape(-1)
    if o.numel() != r.numel():
        raise ValueError(f"output has {o.numel()} elements, reference {r.numel()}")
    num, den = torch.linalg.vector_norm(o - r).item(), torch.linalg.vector_norm(r).item()
    return num / den if den > 0 else num


def check_outputs(w, outs, refs, M, N) -> dict:
    """Per-output relative error after checking count and shapes (a one-element output may be 0-d)."""
    outs, shapes = _as_tuple(outs), w.expected_shapes(M, N)
    if len(outs) != len(shapes):
        raise ValueError(f"{w.name}: expected {len(shapes)} outputs, got {len(outs)}")
    errs = {}
    for (name, _), o, r, s in zip(w.outputs, outs, refs, shapes):
        ok = o.numel() == 1 if s == (1,) else tuple(o.shape) == s
        if not ok:
            raise ValueError(f"{w.name}: output {name} has shape {tuple(o.shape)}, expected {s}")
        errs[name] = rel_err(o, r)
    return errs


def _rotating(fns):
    if len(fns) == 1:
        return fns[0]
    cycle = itertools.cycle(fns)
    return lambda: next(cycle)()


def _input_sets(w, M, N, K, dtype, device, seed, l2_bytes):
    """One input set, or enough to cover 2x L2 (at most 8) when one set fits in L2."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    sets = [w.build(M, N, K, dtype, device, gen)]
    size = sets[0].nbytes()
    if l2_bytes and size < l2_bytes:
        sets += [w.build(M, N, K, dtype, device, gen) for _ in range(min(8, math.ceil(2 * l2_bytes / size)) - 1)]
    return sets


def _epifuse_call(epifuse, w, s, prealloc):
    """A closure calling epifuse.gemm on set s, and the output buffers it passes (if any).
    fp8_scaled and int8_scaled always pass a bf16 D (outputs epifuse allocates take A's dtype, or
    float32 for integer inputs)."""
    kwargs, bufs = dict(s.operands), []
    if prealloc or w.family in ("fp8", "int8"):
        M, N = s.A.shape[0], s.B.shape[1]
        for (name, _), shape, dt in zip(w.outputs, w.expected_shapes(M, N), s.out_dtypes):
            kwargs[name] = torch.empty(shape, device=s.A.device, dtype=dt)
            bufs.append(kwargs[name])
    A, B, epi = s.A, s.B, w.epilogue
    return (lambda: epifuse.gemm(A, B, epi, **kwargs)), tuple(bufs)


# ------------------------------------------------------------------------------------ one row


def _tuning_history(epifuse):
    """epifuse's list of tuning records, imported now: the first row's tuning happens inside its
    first call, which would otherwise be the first import of epifuse.runtime.tune."""
    if epifuse is None:
        return None
    import epifuse.runtime.tune as tune
    return tune.HISTORY


def run_row(w, shape, dtype, cfg, epifuse, epifuse_import_error, env):
    """One workload x shape x dtype. Every baseline is prepared first (torch.compile's autotuning
    and epifuse's tuning happen there, in its first call); then all are timed in one order and
    again in the reverse order, and each gets the mean of its two medians. Compiling heats the
    GPU and lowers its clock: timing each baseline right after its own compile favoured
    whichever came first (cuBLAS, the denominator)."""
    M, N, K = shape_dims(shape)
    history = _tuning_history(epifuse)
    tuned_before = len(history) if history is not None else 0
    sets = _input_sets(w, M, N, K, dtype, "cuda", cfg.seed, env["l2_bytes"])
    s0, eager = sets[0], w.eager_fn()
    calls, errors, first, errs = {}, {}, {}, {}

    def prepare(name, make):
        try:
            calls[name] = _rotating([make(s) for s in sets])
        except Exception as e:  # noqa: BLE001 - one baseline's failure must not stop the run
            errors[name] = _short(e)

    if "cublas" in cfg.baselines:
        prepare("cublas", w.cublas)
    if "eager" in cfg.baselines:
        prepare("eager", lambda s: (lambda: eager(s.A, s.B, s.out_dtypes, **s.operands)))
    if "cublaslt" in cfg.baselines and w.cublaslt is not None:
        prepare("cublaslt", w.cublaslt)
    if "inductor" in cfg.baselines:
        try:
            torch._dynamo.reset()
            compiled = torch.compile(eager, mode="max-autotune-no-cudagraphs", dynamic=False)
            first["inductor"] = first_call_s(lambda: compiled(s0.A, s0.B, s0.out_dtypes, **s0.operands))
            prepare("inductor", lambda s: (lambda: compiled(s.A, s.B, s.out_dtypes, **s.operands)))
        except Exception as e:  # noqa: BLE001
            errors["inductor"] = _short(e)
    if "epifuse" in cfg.baselines:
        if epifuse is None:
            errors["epifuse"] = epifuse_import_error
        else:
            try:
                call, bufs = _epifuse_call(epifuse, w, s0, cfg.prealloc)
                first["epifuse"] = first_call_s(call)
                prepare("epifuse", lambda s: _epifuse_call(epifuse, w, s, cfg.prealloc)[0])
                result = call()
                torch.cuda.synchronize()
                outs = bufs if result is None else _as_tuple(result)
                errs = check_outputs(w, outs, w.reference(s0), M, N)
            except Exception as e:  # noqa: BLE001
                errors.setdefault("epifuse", _short(e))
    sampler = (lambda: ClockSampler(env["uuid"] or "")) if cfg.clocks else None
    times, sampled = _time_both_ways(calls, errors, cfg.warmup, cfg.rep, sampler)
    clocks, n_sets = gpu_clocks(env["uuid"] or ""), len(sets)  # the SM clock right after timing
    del sets, s0, calls
    torch.cuda.empty_cache()
    row = make_row(w, shape, dtype, times, errors, first, errs, epifuse_requested="epifuse" in cfg.baselines)
    if history is not None and len(history) > tuned_before:  # tuned in this row, not remembered
        row["epifuse_tuning"] = history[-1]  # the kernel epifuse chose and every candidate's time
    row.update(sm_mhz=(clocks or {}).get("sm_mhz"), n_input_sets=n_sets, clocks_while_timed=sampled)
    return row


def _time_both_ways(calls: dict, errors: dict, warmup: float, rep: float, sampler=None) -> tuple[dict, dict]:
    """Each call's median time in ms, the mean of a pass in order and one in reverse order;
    a call that fails is moved to `errors`. With `sampler` (a ClockSampler factory), also
    what the GPU's clock, power and throttle reasons were while each call was timed, over
    both passes (timing.merge_summaries)."""
    passes: dict = {name: [] for name in calls}
    seen: dict = {name: [] for name in calls}
    for order in (list(calls), list(reversed(calls))):
        for name in order:
            if name in errors:
                continue
            try:
                with sampler() if sampler else contextlib.nullcontext() as watch:
                    passes[name].append(bench_ms(calls[name], warmup, rep))
                seen[name].append(watch.summary if watch else None)
            except Exception as e:  # noqa: BLE001
                errors[name] = _short(e)
    times = {name: sum(t) / len(t) for name, t in passes.items() if t and name not in errors}
    return times, {name: merge_summaries(seen[name]) for name in times if sampler}


def make_row(w, shape, dtype, times, errors, first, errs, epifuse_requested=True):
    M, N, K = shape_dims(shape) or (None, None, None)
    base = times.get("cublas")
    ratios = {k: v / base for k, v in times.items() if k != "cublas" and base}
    err = max(errs.values(), key=lambda e: (e != e, e)) if errs else None  # NaN ranks highest
    tol = w.tolerance(dtype)
    if not epifuse_requested:
        status = "-"
    elif "epifuse" in errors or err is None:
        status = "ERROR"
    else:
        status = "ok" if all(e <= tol for e in errs.values()) else "FAIL"  # NaN fails
    epi, ind = ratios.get("epifuse"), times.get("inductor")
    return {
        "workload": w.name, "shape": shape, "M": M, "N": N, "K": K, "dtype": DTYPE_NAMES.get(dtype, str(dtype)),
        "times_ms": times, "ratios": ratios, "errors": errors, "first_call_s": first,
        "epifuse_rel_err": err, "epifuse_rel_err_by_output": errs, "tol": tol, "status": status,
        "target": w.target, "target_met": None if epi is None or w.target is None else epi <= w.target,
        "speedup_vs_inductor": ind / times["epifuse"] if ind and times.get("epifuse") else None,
        "cublaslt_desc": w.cublaslt_desc or None,
    }


# --------------------------------------------------------------------------------------- main


def plan(cfg):
    """(workload, shape, input dtype) in run order, shapes outermost; fp8_scaled once per shape."""
    seen, out = set(), []
    for shape, dt, name in itertools.product(cfg.shapes, cfg.dtypes, cfg.workloads):
        w = WORKLOADS[name]
        key = (name, shape, w.fixed_dtype or DTYPES[dt])
        if key not in seen:
            seen.add(key)
            out.append((w, shape, key[2]))
    return out


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if cfg.dry_run:
        names = dry_run(verbose=True)
        print(f"dry run ok: {len(names)} workloads ({', '.join(names)})")
        return 0
    if not torch.cuda.is_available():
        print("bench: no CUDA GPU (torch.cuda.is_available() is False); --dry-run checks the "
              "workloads on CPU", file=sys.stderr)
        return 2
    # epifuse is timed as full tuning leaves it (its rows' tuning records feed bench.choices);
    # EPIFUSE_TUNE set by the caller is kept and recorded in env_vars
    os.environ.setdefault("EPIFUSE_TUNE", "full")
    try:
        import epifuse
        epifuse_err = None
    except Exception as e:  # noqa: BLE001 - the other baselines still run
        epifuse, epifuse_err = None, "import epifuse failed: " + _short(e)
    env = collect_env(epifuse)
    env["clocks_start"] = gpu_clocks(env["uuid"] or "")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()}
    payload = {"schema": 1, "env": env, "config": config, "rows": [], "skipped": [], "complete": False}
    cfg.out.mkdir(parents=True, exist_ok=True)
    base = cfg.out / report.basename(env)
    t0, todo = time.perf_counter(), plan(cfg)
    for i, (w, shape, dt) in enumerate(todo):
        label = f"{w.name} {shape} {DTYPE_NAMES[dt]}"
        if cfg.time_budget is not None and time.perf_counter() - t0 > cfg.time_budget:
            payload["skipped"].append(label)
            continue
        print(f"[{time.perf_counter() - t0:7.1f}s] {i + 1}/{len(todo)} {label} ...", file=sys.stderr, flush=True)
        row = run_row(w, shape, dt, cfg, epifuse, epifuse_err, env)
        payload["rows"].append(row)
        print("          " + report.row_summary(row), file=sys.stderr, flush=True)
        report.write_json(base.with_suffix(".json"), payload)
    env["clocks_end"] = gpu_clocks(env["uuid"] or "")
    payload["complete"], payload["elapsed_s"] = True, round(time.perf_counter() - t0, 1)
    report.write_json(base.with_suffix(".json"), payload)
    report.write_png(base.with_suffix(".png"), payload["rows"], env)
    print(report.format_notes(payload))
    print(f"wrote {base.with_suffix('.json')}")
    print(report.format_table(payload["rows"], env))
    return 0 if all(r["status"] in ("ok", "-") for r in payload["rows"]) else 1


def dry_run(size=(64, 64, 32), verbose=False) -> list:
    """CPU check, no GPU: build every workload at (M, N, K) = size in float32, run its epilogue on
    torch tensors (torch ops, and epifuse.ops too when epifuse imports) as its eager version, and
    check output count, shapes and agreement with the float64 reference. Returns the names checked."""
    M, N, K = size
    sources = ["torch"]
    try:
        import epifuse.ops  # noqa: F401 - lazy: only to know whether it can be checked too
        sources.append("epifuse")
    except Exception as e:  # noqa: BLE001
        if verbose:
            print(f"dry run: epifuse.ops not importable ({_short(e, 120)}); torch ops only")
    checked, rows = [], []
    try:
        for source in sources:
            bind_ops(source)
            for w in WORKLOADS.values():
                gen = torch.Generator().manual_seed(0)
                s = w.build(M, N, K, torch.float32, "cpu", gen)
                errs = check_outputs(w, w.eager_fn()(s.A, s.B, s.out_dtypes, **s.operands), w.reference(s), M, N)
                bad = {k: v for k, v in errs.items() if not v <= w.tolerance(torch.float32)}
                if bad:
                    raise AssertionError(f"{w.name} ({source} ops): eager vs float64 reference error {bad}")
                if verbose:
                    print(f"dry run: {w.name:<11} {source:<7} ops  max rel err {max(errs.values()):.1e}")
                rows.append(make_row(w, "dry", torch.float32, {}, {}, {}, errs))
                if w.name not in checked:
                    checked.append(w.name)
    finally:
        bind_ops("torch")
    report.format_table(rows, None)  # the report path runs on CPU too
    return checked
