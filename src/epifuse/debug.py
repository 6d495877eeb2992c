"""Debugging: verify a kernel against the float64 reference, trace one tile, draw the DAG.

    report = epifuse.debug.run(kernel, args, verify=True)   # raises VerificationError on a mismatch
    t = epifuse.debug.trace(args, tile=(1, 0))               # every intermediate value of tile (1, 0)
    print(t); t["F"]                                         # a table; one value by its name
    epifuse.debug.draw(args.graph, "epilogue.svg")           # graphviz, when `dot` is installed

Verification computes the reference before the kernel runs (so in-place updates such as D = C
and `accumulate=True` reductions are checked against what the inputs were), evaluates the
epilogue's graph in float64 on `A.double() @ B.double()`, and reports per output the largest
error, where it is, and the tolerance: an element passes when
|out - ref| <= atol + rtol * (|ref| + rms(ref)), with rtol from the output dtype (and tf32 for
fp32 inputs on a GPU). NaN must be NaN and infinities must match exactly.

A trace evaluates the epilogue with the reference interpreter on the slice of one output tile
(the tile size of the kernel epifuse would pick, unless given), before optimization, so every
name the user wrote is there, and so is every unnamed sub-expression. Reductions in a trace
reduce over the tile only.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import EpilogueArgumentError
from .ir import ACCUM, AXES, CONST, INPUT, Graph, Node, Output

# ---- verification ----------------------------------------------------------------------------

_RTOL = {torch.float64: 1e-5, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2,
         torch.float8_e4m3fn: 0.13, torch.float8_e5m2: 0.26}
_TF32_RTOL = 5e-3
# tf32 rounds fp32 inputs to 10 mantissa bits: on random data 2 of 4096 conditions such as
# accum > C came out the other way; a bool output may differ in this share of its elements.
_TF32_BOOL_FLIPS = 1e-3


def _tf32(args) -> bool:
    return args.A.dtype == torch.float32 and args.precision != "highest" and args.A.device.type == "cuda"


class VerificationError(RuntimeError):
    """A kernel's outputs differ from the float64 reference by more than the tolerance."""

    def __init__(self, report: "Report"):
        self.report = report
        super().__init__(str(report))


@dataclass
class OutputCheck:
    """How one output compares with the reference."""

    name: str
    ok: bool
    max_error: float                 # the largest |out - ref| (inf for a NaN/Inf mismatch)
    index: tuple[int, ...] | None    # where the worst element is (by error over tolerance)
    got: float | None
    expected: float | None
    rtol: float
    atol: float
    rel_error: float                 # ||out - ref|| / ||ref|| over finite entries
    note: str = ""

    def __str__(self) -> str:
        where = "" if self.index is None else f" at {self.index}"
        values = "" if self.got is None else f" (got {self.got:.6g}, expected {self.expected:.6g})"
        status = "ok  " if self.ok else "FAIL"
        text = (f"{status} {self.name}: largest error {self.max_error:.3g}{where}{values}; "
                f"relative error {self.rel_error:.2e}; tolerance rtol {self.rtol:.1e}")
        if self.atol:
            text += f", atol {self.atol:g}"
        return text + (f"; {self.note}" if self.note else "")


@dataclass
class Report:
    """The checks of every output of one kernel run."""

    kernel: str
    checks: list[OutputCheck]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        head = f"{self.kernel}: " + ("matches the float64 reference" if self.ok
                                     else "DIFFERS from the float64 reference")
        return "\n".join([head, *(f"  {c}" for c in self.checks)])


def default_tolerance(args, name: str) -> tuple[float, float]:
    """(rtol, atol) for output `name`: by its dtype, looser for tf32 on a GPU."""
    dest = args.outputs[name]
    if dest.dtype == torch.bool:
        return 0.0, 0.0   # exact (a one-off would pass every bool); under tf32, see check()
    if not dest.dtype.is_floating_point:
        return 0.0, 1.0   # a tie rounded the other way
    rtol = _RTOL.get(dest.dtype, 2e-5)
    return (max(rtol, _TF32_RTOL) if _tf32(args) else rtol), 0.0


def reference_outputs(args, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Every output of `args` by the reference interpreter in `dtype`, in its destination's
    shape, folded into the destination's current value for `accumulate=True` reductions."""
    from .reference import reference_accum, saturate
    from .reference import evaluate
    if args.A.device.type == "meta":
        raise EpilogueArgumentError("verify=True compares values, and tensors on the meta device have none.",
                                    hint="Run without verify, or on cpu or cuda tensors.")
    accum = reference_accum(args.A, args.B, dtype, args.accumulator_type).to(dtype).reshape(args.accum_shape)
    operands = {k: (v.to(dtype) if isinstance(v, torch.Tensor) else v) for k, v in args.operands.items()}
    results = evaluate(args.graph, accum, operands, dtype)
    out = {}
    for name, value in results.items():
        dest = args.outputs[name]
        value = value.reshape(dest.shape)
        op = args.reduction_op(name)
        if op is not None and args.accumulate:
            value = op.reduction.merge(dest.to(dtype), value)
        if dest.dtype == torch.bool:
            value = (value != 0).to(dtype)   # NaN is true, as torch converts it
        elif not dest.dtype.is_floating_point:
            value = saturate(value, dest.dtype).to(dtype)
        out[name] = value
    return out


def compare(name: str, out: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float = 0.0) -> OutputCheck:
    """Check `out` against `ref` elementwise; see the module docstring for the rule."""
    out = out.detach().to(torch.float64)
    ref = ref.detach().to(device=out.device, dtype=torch.float64).reshape(out.shape)
    nan_out, nan_ref = torch.isnan(out), torch.isnan(ref)
    finite = torch.isfinite(ref)
    both = finite & torch.isfinite(out)
    diff = torch.where(both, (out - ref).abs(), torch.zeros_like(out))
    scale = float(ref[finite].square().mean().sqrt()) if bool(finite.any()) else 0.0
    allowed = atol + rtol * (ref.abs().where(finite, torch.zeros_like(ref)) + scale)
    ratio = torch.where(allowed > 0, diff / allowed.clamp_min(1e-300),
                        torch.where(diff > 0, torch.full_like(diff, math.inf), torch.zeros_like(diff)))
    # Mismatched NaN, or an infinity where the other is different, fails outright.
    special = (nan_out != nan_ref) | (~finite & ~nan_ref & (out != ref)) | (finite & ~torch.isfinite(out))
    ratio = torch.where(special, torch.full_like(ratio, math.inf), ratio)
    norm = float(ref[finite].norm()) if bool(finite.any()) else 0.0
    diff_norm = float(diff[finite].norm()) if bool(finite.any()) else 0.0
    rel = diff_norm / norm if norm > 0 else diff_norm
    if out.numel() == 0:
        return OutputCheck(name, True, 0.0, None, None, None, rtol, atol, 0.0)
    flat = int(torch.argmax(ratio.reshape(-1)))
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), out.shape)) if out.dim() else ()
    worst = float(ratio.reshape(-1)[flat])
    got, expected = float(out.reshape(-1)[flat]), float(ref.reshape(-1)[flat])
    note = ""
    if bool(special.reshape(-1)[flat]):
        note = "NaN or Inf where the reference differs"
    max_error = math.inf if bool(special.any()) else float(diff.max())
    return OutputCheck(name, worst <= 1.0, max_error, index, got, expected, rtol, atol, rel, note)


def check(args, references: dict, rtol: float | None = None, atol: float | None = None,
          kernel: str = "kernel") -> Report:
    checks = []
    for name, ref in references.items():
        r, a = default_tolerance(args, name)
        c = compare(name, args.outputs[name], ref, r if rtol is None else rtol, a if atol is None else atol)
        out = args.outputs[name]
        if not c.ok and out.dtype == torch.bool and _tf32(args) and rtol is None and atol is None:
            flips = int((out.cpu() != ref.cpu().reshape(out.shape).bool()).sum())
            if flips <= max(1, out.numel() * _TF32_BOOL_FLIPS):
                c = dataclasses.replace(c, ok=True, note=f"{flips} of {out.numel()} flipped: tf32's rounding of "
                                                         "the inputs moves conditions near their threshold")
        checks.append(c)
    return Report(kernel, checks)



def run(kernel, args, verify: bool = True, rtol: float | None = None, atol: float | None = None,
        raise_on_mismatch: bool = True) -> Report | None:
    """`kernel.run(args)`, then (with verify) check every output against the float64 reference.

    Raises VerificationError naming the largest error and where it is, unless
    `raise_on_mismatch=False` (then the Report says). Returns the Report (None without verify).
    """
    if not verify:
        kernel.run(args)
        return None
    from .backends.base import check_arguments
    check_arguments(kernel, args)
    references = reference_outputs(args)   # before the run: outputs may alias operands
    kernel.run(args)
    report = check(args, references, rtol, atol, repr(kernel))
    if raise_on_mismatch and not report.ok:
        raise VerificationError(report)
    return report


def with_verify(run_method: Callable) -> Callable:
    """Give a kernel class's `run(self, args)` a `verify=False` keyword (and rtol, atol):

        class MyKernel(Kernel):
            @with_verify
            def run(self, args): ...
    """
    @functools.wraps(run_method)
    def wrapped(self, args, verify: bool = False, rtol: float | None = None, atol: float | None = None):
        if not verify:
            return run_method(self, args)
        references = reference_outputs(args)
        run_method(self, args)
        report = check(args, references, rtol, atol, repr(self))
        if not report.ok:
            raise VerificationError(report)
        return report
    return wrapped


# ---- trace: every intermediate value of one tile ----------------------------------------------


@dataclass
class Step:
    label: str            # the user's name, or the expression for an unnamed value
    expression: str       # op(sources) with the sources' labels
    value: torch.Tensor

    def summary(self) -> str:
        v = self.value
        if v.dtype == torch.bool:
            return f"{int(v.sum())} of {v.numel()} true"
        finite = v[torch.isfinite(v)]
        nans = int(torch.isnan(v).sum())
        text = (f"min {float(finite.min()):.4g}  max {float(finite.max()):.4g}  mean {float(finite.mean()):.4g}"
                if finite.numel() else "no finite values")
        return text + (f"  ({nans} NaN)" if nans else "")


@dataclass
class Trace:
    """The epilogue's values on one tile: `trace["F"]`, `trace.steps`, `print(trace)`."""

    tile: tuple[int, int]
    rows: range
    cols: range
    values: dict[str, torch.Tensor]
    steps: list[Step]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.values[name]

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def __str__(self) -> str:
        head = (f"tile {self.tile}: rows {self.rows.start}..{self.rows.stop - 1}, "
                f"columns {self.cols.start}..{self.cols.stop - 1}")
        texts = [s.label if s.expression == s.label else f"{s.label} = {s.expression}" for s in self.steps]
        texts = [t if len(t) <= 56 else t[:53] + "..." for t in texts]
        width = max((len(t) for t in texts), default=0)
        lines = [head]
        for text, s in zip(texts, self.steps):
            lines.append(f"  {text:<{width}}  {str(tuple(s.value.shape)):>12}  {s.summary()}")
        return "\n".join(lines)


def _default_tile_shape(args) -> tuple[int, int]:
    from .api import get_kernels
    from .backends.triton import tiled
    if tiled.uses_interpreter(args.A.device) and args.A.device.type == "cpu" and not tiled.interpreter_requested():
        return (tiled.INTERPRETER_CONFIG.block_m, tiled.INTERPRETER_CONFIG.block_n)
    for kernel in get_kernels(args):
        config = getattr(kernel, "config", None)
        if config is not None:
            if tiled.uses_interpreter(args.A.device):
                config = tiled.INTERPRETER_CONFIG
            return config.block_m, config.block_n
    return (64, 64)


def trace(args, tile: tuple[int, int] = (0, 0), tile_shape: tuple[int, int] | None = None,
          dtype: torch.dtype = torch.float64) -> Trace:
    """Every intermediate value of the epilogue of `args` on output tile `tile` = (i, j): rows
    i*BM ... and columns j*BN ... of accum (all batches), BM x BN = `tile_shape`."""
    from .api import GemmArguments
    from .reference import reference_accum
    from .binding import bind
    from .reference import evaluate
    from .shapes import classify_operand
    if not isinstance(args, GemmArguments):
        raise EpilogueArgumentError(f"trace takes a GemmArguments, not {type(args).__name__}.")
    if args.A.device.type == "meta":
        raise EpilogueArgumentError("trace computes values, and tensors on the meta device have none.")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise EpilogueArgumentError(f"trace's dtype must be a floating torch.dtype, not {dtype!r}.")
    for what, pair, low in (("tile", tile, 0), ("tile_shape", tile_shape, 1)):
        if (pair is not None or what == "tile") and not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= low for v in pair)):
            raise EpilogueArgumentError(f"{what} must be two ints of {low} or more, not {pair!r}.")
    bm, bn = tile_shape or _default_tile_shape(args)
    grid = (math.ceil(args.M / bm), math.ceil(args.N / bn))
    i, j = tile
    if not (0 <= i < grid[0] and 0 <= j < grid[1]):
        raise EpilogueArgumentError(f"Tile {tuple(tile)} is outside the {grid[0]} x {grid[1]} grid of "
                                    f"{bm} x {bn} tiles of accum {tuple(args.accum_shape)}.",
                                    hint=f"Pick i in [0, {grid[0] - 1}] and j in [0, {grid[1] - 1}], or pass tile_shape=.")
    rows, cols = range(i * bm, min((i + 1) * bm, args.M)), range(j * bn, min((j + 1) * bn, args.N))
    r, c = slice(rows.start, rows.stop), slice(cols.start, cols.stop)
    accum = reference_accum(args.A[..., r, :], args.B[..., :, c], dtype, args.accumulator_type).to(dtype)
    accum = accum.reshape(*args.accum_shape[:-2], len(rows), len(cols))
    operands, roles = {}, {}
    for name, value in args.epilogue.operands.items():
        roles[name] = classify_operand(name, value, args.accum_shape, args.A.device)[0]
        if isinstance(value, torch.Tensor) and value.numel() > 1:
            value = torch.broadcast_to(value, args.accum_shape)[..., r, c]
        operands[name] = value.to(dtype) if isinstance(value, torch.Tensor) else value
    program = args.epilogue.program
    named = dataclasses.replace(program, outputs=tuple((s.target, s.loc) for s in program.statements))
    graph = bind(named, roles, len(args.accum_shape))     # not optimized: the user's own steps
    env = {o.name: o.node for o in graph.outputs}
    nodes = [n for n in graph.nodes() if n.op is not CONST]
    every = Graph(tuple(Output(f"#{k}", n) for k, n in enumerate(nodes)), graph.operands,
                  graph.names, graph.locs)
    results = evaluate(every, accum, operands, dtype)
    value_of = {id(n): results[f"#{k}"] for k, n in enumerate(nodes)}
    labels: dict[int, str] = {}
    steps = []
    for node in nodes:
        label = _label(node, graph, labels)
        labels[id(node)] = label
        steps.append(Step(label, _expression(node, labels), value_of[id(node)]))
    values = {"accum": accum}
    for name in program.operands:
        value = operands[name]
        values[name] = value if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=dtype)
    for name, node in env.items():   # a name bound to a literal has no step of its own
        values[name] = value_of[id(node)] if id(node) in value_of else torch.tensor(node.arg, dtype=dtype)
    return Trace(tuple(tile), rows, cols, values, steps)


def _label(node: Node, graph: Graph, labels: dict) -> str:
    if node.op is ACCUM:
        return "accum"
    if node.op is INPUT:
        return node.arg.name
    return graph.name_of(node) or _expression(node, labels)


def _expression(node: Node, labels: dict) -> str:
    if node.op is ACCUM:
        return "accum"
    if node.op is INPUT:
        return node.arg.name
    if node.op is CONST:
        return repr(node.arg)
    parts = [labels.get(id(s)) or (repr(s.arg) if s.op is CONST else "?") for s in node.src]
    parts += [f"{k}={v!r}" for k, v in node.params.items()]
    text = f"{node.op.name}({', '.join(parts)})"
    return text if len(text) <= 72 else text[:69] + "..."


# ---- alignment --------------------------------------------------------------------------------


def alignment_report(args) -> list[tuple[str, bool, str]]:
    """(tensor, ok, explanation) for A, B and every tensor operand and output: the 16-byte base
    and leading-stride alignment TMA needs, and which dimension is contiguous."""
    tensors = [("A", args.A), ("B", args.B)]
    tensors += [(n, v) for n, v in args.operands.items() if isinstance(v, torch.Tensor) and v.numel() > 1]
    tensors += list(args.outputs.items())
    rows = []
    for name, t in tensors:
        size = t.element_size()
        problems = []
        base = t.data_ptr() % 16
        if base:
            problems.append(f"base address is {t.data_ptr() % 16} bytes past a 16-byte boundary")
        strides = [s for s, n in zip(t.stride(), t.shape) if n > 1]
        inner = [d for d, (s, n) in enumerate(zip(t.stride(), t.shape)) if s == 1 and n > 1]
        if t.dim() >= 2 and t.shape[-1] > 1 and t.stride(-1) != 1 and not (name == "B" and t.stride(-2) == 1):
            problems.append("last dimension is not contiguous")
        leading = [s for s in strides if s != 1]
        bad = [s for s in leading if (s * size) % 16]
        if bad:
            problems.append(f"stride {bad[0]} ({bad[0] * size} bytes) is not a multiple of 16 bytes")
        layout = ("contiguous along dim " + ", ".join(map(str, inner))) if inner else "no unit stride"
        desc = f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}, strides {tuple(t.stride())}, {layout}"
        if problems:
            rows.append((name, False, f"{desc}: {'; '.join(problems)} (TMA kernels cannot use it; "
                                      "the tiled kernel loads it with pointers)"))
        else:
            rows.append((name, True, f"{desc}: 16-byte aligned"))
    return rows


# ---- pictures ---------------------------------------------------------------------------------

_COLORS = {"accum": "#cfe2f3", "input": "#d9ead3", "const": "#eeeeee", "reduce": "#f4cccc",
           "op": "#ffffff", "output": "#fce5cd"}


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def dot_source(graph: Graph, title: str = "epilogue") -> str:
    """The Graph as graphviz DOT: leaves at the top, outputs at the bottom."""
    if not isinstance(graph, Graph):
        raise EpilogueArgumentError(f"Drawing takes a Graph (such as GemmArguments.graph), not {type(graph).__name__}.")
    lines = [f"digraph {_quote(title)} {{", "  rankdir=TB;",
             f"  label={_quote(title)}; labelloc=t; fontname=Helvetica;",
             "  node [fontname=Helvetica, fontsize=11, style=filled];"]
    ids: dict[int, str] = {}
    for k, node in enumerate(graph.nodes()):
        ids[id(node)] = f"n{k}"
        axes = "".join(a for a in AXES if a in node.axes) or "scalar"
        if node.op is ACCUM:
            label, shape, color = "accum", "box", _COLORS["accum"]
        elif node.op is INPUT:
            label, shape, color = f"{node.arg.name}\n{node.arg.kind} [{axes}]", "box", _COLORS["input"]
        elif node.op is CONST:
            label, shape, color = repr(node.arg), "plaintext", _COLORS["const"]
        else:
            params = ", ".join(f"{k2}={v!r}" for k2, v in node.params.items())
            user = graph.name_of(node)
            label = node.op.name + (f"({params})" if params else "") + (f"\n{user}" if user else "")
            shape, color = "ellipse", _COLORS["reduce" if node.op.is_reduction else "op"]
        lines.append(f"  n{k} [label={_quote(label)}, shape={shape}, fillcolor={_quote(color)}];")
        for s in node.src:
            lines.append(f"  {ids[id(s)]} -> n{k};")
    for o in graph.outputs:
        lines.append(f"  out_{o.name} [label={_quote(o.name)}, shape=box, style=\"filled,bold\", "
                     f"fillcolor={_quote(_COLORS['output'])}];")
        lines.append(f"  {ids[id(o.node)]} -> out_{o.name};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def dot_available() -> str | None:
    """The path of graphviz's `dot`, or None."""
    return shutil.which("dot")


def draw(graph: Graph, path: str | Path, title: str = "epilogue") -> Path:
    """Write the Graph to `path`: .dot (the DOT source, no graphviz needed), .svg or .png
    (graphviz's `dot` must be on PATH, else RuntimeError saying so)."""
    path = Path(path)
    source = dot_source(graph, title)
    fmt = path.suffix.lower().lstrip(".")
    if fmt in ("dot", "gv"):
        path.write_text(source)
        return path
    if fmt not in ("svg", "png", "pdf"):
        raise EpilogueArgumentError(f"Cannot draw to {path.name}: use a .svg, .png, .pdf or .dot file.")
    dot = dot_available()
    if dot is None:
        raise RuntimeError("graphviz's `dot` is not on PATH; install graphviz, or write the DOT "
                           "source with a .dot file name")
    result = subprocess.run([dot, f"-T{fmt}", "-o", str(path)], input=source.encode(),
                            capture_output=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"dot failed: {result.stderr.decode(errors='replace').strip()[:200]}")
    return path


# ---- random arguments (the CLI's verify, kernels and profile) ---------------------------------

ROLES = ("number", "scalar", "row", "col", "tile", "batch")


def check_roles(program, roles: dict) -> None:
    """Every name given a role is an operand of `program` (a typo would be drawn as a tile)."""
    unknown = [n for n in roles if n not in program.operands]
    if unknown:
        from .errors import did_you_mean
        raise EpilogueArgumentError(f"--role names {unknown[0]!r}, which is not an operand of {program.name}.",
                                    hint=did_you_mean(unknown[0], program.operands) or
                                    f"Its operands: {', '.join(program.operands) or 'none'}.")


def random_arguments(epilogue: Any, M: int, N: int, K: int, *, L: int | None = None,
                     dtype: torch.dtype = torch.float16, roles: dict[str, str] | None = None,
                     device: str | torch.device | None = None, out_dtype: torch.dtype | None = None,
                     seed: int = 0, fill: bool = True, layout_a: str = "row", layout_b: str = "row",
                     precision: str = "default"):
    """GemmArguments with random A, B and operands for `epilogue` (a function, string or
    Program). `roles` maps an operand to number, scalar (a one-element tensor), row (N,),
    col (M, 1), tile, or batch (L, 1, 1); the default is a tile. A/B layouts: "row" (K or N
    contiguous) or "col" (a transposed view)."""
    from .api import EpilogueArguments, GemmArguments
    from .frontend import Program, parse
    from .fused import allocate_outputs
    for name, layout in (("layout_a", layout_a), ("layout_b", layout_b)):
        if layout not in ("row", "col"):
            raise EpilogueArgumentError(f"{name} must be 'row' or 'col', not {layout!r}.")
    program = epilogue if isinstance(epilogue, Program) else parse(epilogue)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator().manual_seed(seed)
    batch = (L,) if L is not None else ()
    make = (lambda *s: torch.randn(*s, generator=gen)) if fill else (lambda *s: torch.empty(*s))

    def matrix(rows, cols, layout, scale=1.0):
        t = make(*batch, rows, cols) * scale if layout == "row" else (make(*batch, cols, rows) * scale).transpose(-1, -2)
        return t.to(device=device, dtype=dtype)

    A = matrix(M, K, layout_a)
    B = matrix(K, N, layout_b, 1.0 / math.sqrt(max(K, 1)))
    roles = {**dict(getattr(epilogue, "roles", {}) or {}), **(roles or {})}
    check_roles(program, roles)
    shapes = {"scalar": (1,), "row": (N,), "col": (M, 1), "tile": (*batch, M, N), "batch": (L or 1, 1, 1)}
    tensors: dict[str, Any] = {}
    for name in program.operands:
        role = roles.get(name, "tile")
        if role not in ROLES:
            raise EpilogueArgumentError(f"Unknown role {role!r} for {name}.", hint=f"Roles: {', '.join(ROLES)}.")
        if role == "number":
            tensors[name] = round(0.5 + float(torch.rand((), generator=gen)), 3)
        else:
            tensors[name] = make(*shapes[role]).to(device=device, dtype=torch.float32)
    tensors = allocate_outputs(program, A, B, tensors, out_dtype)
    epi = EpilogueArguments(program, **tensors)
    return GemmArguments(A, B, epilogue=epi, precision=precision)


# ---- profiling (the CLI's `profile` runs ncu; these read what it wrote) ------------------------

_TIME = {"ns": 1e-9, "nsecond": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3,
         "second": 1.0, "s": 1.0}
_BYTES = {"byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
          "kibyte": 1024.0, "mibyte": 1024.0 ** 2, "gibyte": 1024.0 ** 3}


def ncu_csv_rows(text: str) -> list[list[str]]:
    """The CSV rows of `ncu --csv` output, from its '"ID"' header on (what the profiled
    program printed before it is skipped); [] where there is none."""
    import csv
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


__all__ = ["run", "with_verify", "VerificationError", "Report", "OutputCheck", "reference_outputs",
           "compare", "check", "default_tolerance", "trace", "Trace", "Step", "alignment_report",
           "dot_source", "draw", "dot_available", "random_arguments", "ncu_csv_rows", "parse_ncu_csv",
           "summarize_ncu", "compiled_stats"]
