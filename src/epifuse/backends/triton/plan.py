"""A launch plan: everything one kernel needs to run on one arguments object, built once.

A `Plan` holds the loaded kernel, its runtime values (ordered by the kernel's own parameter
list, so the source and the launch cannot drift apart), constexprs and grid, and for each
problem (one GEMM, or each group of a grouped GEMM) where its outputs are written and what
runs before and after the launch for its reductions:

- tile outputs and fp32 atomic reductions are written in place;
- other atomic reductions (sums, means, amax into fp16 or bf16, or strided) go to an fp32 work
  buffer copied out after the launch;
- per-program partials (max, min, deterministic sums) go to an (L, row tiles, column tiles)
  buffer that a finishing step folds in a fixed order.

Atomic reductions start from zero (or from the destination, with `accumulate=True`): a launch
before the kernel fills them, except small fp32 ones that a zeroing family's first program
zeroes itself. That needs two int64 words per plan and stream (ZeroingWords), which order the
zeros before every program's atomics (the protocol is in templates/macros.j2 and
docs/design/kernels.md).
"""
from __future__ import annotations

import inspect
import math
import threading

import torch

from ...errors import InternalError
from ...ir import AXES
from ...reference import FP8_MAX, saturate
from ...shapes import output_strides
from . import device as target
from .layout import Layout

ZERO_LIMIT = 1 << 16  # the most elements of a reduction the kernel zeroes (a launch zeroes larger ones)
ZERO_BLOCK = 1024     # elements the first program zeroes per step


class Problem:
    """One GEMM of a plan: its arguments, where each output is written, and the reductions to
    prepare before the launch and finish after it."""

    __slots__ = ("args", "buffers", "finish", "prepare")

    def __init__(self, args, buffers: dict, finish: list, prepare: list):
        self.args, self.buffers, self.finish, self.prepare = args, buffers, finish, prepare

    def before(self, outputs, work: dict | None = None) -> None:
        """Initialize the atomic reductions the kernel does not zero (`outputs`: name ->
        tensor, the arguments' own or a kept launch's new ones; `work`: name -> the work
        buffer a kept launch's call has of its own, in place of the plan's)."""
        _prepare(self.prepare, outputs, work, self.args.accumulate, self.args.reduced_count)

    def after(self, outputs, work: dict | None = None) -> None:
        """Write the partials or fp32 buffers (the plan's, or `work`'s) to their destinations."""
        _finish(self.finish, outputs, work, self.args.accumulate, self.args.reduced_count)

    def detached_steps(self) -> tuple:
        """(before, after) as above for a kept launch: they hold what the steps read of the
        arguments (accumulate, the reduced counts), not the arguments, whose tensors would
        otherwise stay alive with the launch."""
        prepare, finish, accumulate = self.prepare, self.finish, self.args.accumulate
        counts = {y.name: self.args.reduced_count(y.name) for y, _ in (*prepare, *finish)}
        return (lambda outputs, work=None: _prepare(prepare, outputs, work, accumulate, counts.__getitem__),
                lambda outputs, work=None: _finish(finish, outputs, work, accumulate, counts.__getitem__))


def _prepare(prepare: list, outputs, work: dict | None, accumulate: bool, count) -> None:
    for y, own in prepare:
        dest = outputs[y.name]
        buffer = dest if own is None else own if work is None else work[y.name]
        prepare_reduction(y, buffer, dest, accumulate, count(y.name))


def _finish(finish: list, outputs, work: dict | None, accumulate: bool, count) -> None:
    for y, buffer in finish:
        buffer = buffer if work is None else work[y.name]
        finish_reduction(y, buffer, outputs[y.name], accumulate, count(y.name))


class Plan:
    __slots__ = ("kernel", "layout", "problems", "values", "meta", "grid", "empty", "fast", "simple",
                 "launch_with", "loaded", "checked", "owned", "convert", "sync")

    def __init__(self, kernel, layout: Layout, problems: list, values: list, meta: dict, grid: tuple,
                 empty: bool, convert=None, sync=None, owned=()):
        self.kernel, self.layout, self.problems = kernel, layout, problems
        self.values, self.meta, self.grid = values, meta, grid
        self.empty = empty          # no output element: nothing is launched
        self.fast = None            # launch with `values`, skipping Triton's binding (CUDA)
        self.launch_with = None     # launch with other values of the same specialization
        self.loaded = False         # compiled and loaded on the GPU (kernels.TritonKernel._loaded)
        self.checked = False        # its kernel supports its arguments (asked before its first run)
        # values -> the kernel's arguments, given whether Triton's JIT will bind them (the Gluon
        # kernels turn tensors into TMA descriptors); None: the values themselves
        self.convert = convert
        self.sync = sync            # in-kernel zeroing's words, per stream (ZeroingWords), or None
        # what the launch carries besides the caller's tensors: work buffers, zeroing's words,
        # split-K's workspace
        self.owned = tuple(work for p in problems for _, work in p.finish) + tuple(owned)
        # a launch and nothing else: no reduction to prepare or finish, something to launch
        self.simple = not empty and not any(p.prepare or p.finish for p in problems)

    @property
    def finish(self) -> list:
        """The (output, work buffer) pairs written after the launch (one GEMM's plan)."""
        return self.problems[0].finish

    def before(self, outputs, work: dict | None = None) -> None:
        self.problems[0].before(outputs, work)

    def after(self, outputs, work: dict | None = None) -> None:
        self.problems[0].after(outputs, work)

    def jit_values(self, values) -> list:
        return values if self.convert is None else self.convert(values, True)

    def argument(self, name: str):
        """The runtime value the launch passes as the kernel's parameter `name`."""
        return self.values[runtime_parameters(self.kernel).index(name)]


# ---- reductions -------------------------------------------------------------------------------

def reduction_buffers(args, layout: Layout, config, pieces: int) -> tuple[dict, list]:
    """Where the kernel writes each output of `args` ({name: (tensor, strides per axis)}) and
    the (output, work buffer) pairs to finish after it. A partials buffer holds one value per
    program along each reduced in-tile axis: (L, row tiles or M, column pieces or N)."""
    buffers, finish = {}, []
    for y in layout.outputs:
        dest = args.outputs[y.name]
        if y.mode == "tile" or (y.mode == "atomic" and dest.dtype == torch.float32):
            buffers[y.name] = (dest, args.strides[y.name])
        elif y.mode == "atomic":
            work = torch.empty(dest.shape, device=dest.device, dtype=torch.float32)
            strides = output_strides(y.name, work, args.accum_shape, work.device, y.dims, y.reduce)
            buffers[y.name] = (work, strides)
            finish.append((y, work))
        else:
            sizes = {"L": args.L,
                     "M": target.cdiv(args.M, config.block_m) if "M" in y.dims else args.M,
                     "N": target.cdiv(args.N, config.block_n) * pieces if "N" in y.dims else args.N}
            work = torch.empty((sizes["L"], sizes["M"], sizes["N"]), device=dest.device, dtype=torch.float32)
            buffers[y.name] = (work, dict(zip(AXES, work.stride())))
            finish.append((y, work))
    return buffers, finish


def zeroed_in_kernel(args, y) -> bool:
    """Whether a zeroing kernel zeroes atomic output `y` at its start: an fp32 contiguous
    destination it starts from zero (not accumulated into), of at most ZERO_LIMIT elements."""
    dest = args.outputs[y.name]
    return (not args.accumulate and dest.dtype == torch.float32 and dest.is_contiguous()
            and dest.numel() <= ZERO_LIMIT)


def problem(args, layout: Layout, buffers: dict, finish: list, zeroed=frozenset()) -> Problem:
    """The Problem of `args`: its buffers, and the atomic outputs to initialize before the launch
    (all but those the kernel zeroes): with None as their buffer where the kernel folds into the
    destination itself."""
    prepare = []
    for y in layout.outputs:
        if y.mode == "atomic" and y.name not in zeroed:
            buffer = buffers[y.name][0]
            prepare.append((y, None if buffer is args.outputs[y.name] else buffer))
    return Problem(args, buffers, finish, prepare)


def prepare_reduction(y, buffer: torch.Tensor, dest: torch.Tensor, accumulate: bool, count: int) -> None:
    """Start an atomic reduction's buffer from zero, or from what its destination holds when
    accumulating (a work buffer gets a copy of it; for amax with its NaNs made positive, as the
    integer atomic max needs); a mean over nothing is NaN (0 / 0, as torch)."""
    reduction = y.reduce.reduction
    if not accumulate:
        buffer.fill_(0.0)
    else:
        if buffer is not dest:
            buffer.copy_(dest)
        if reduction.magnitude:  # a NaN with its sign set would order below every |x| (layout.reduction_mode)
            buffer.masked_fill_(buffer.isnan(), float("nan"))
    if reduction.mean and count == 0:
        buffer.fill_(float("nan"))


def finish_reduction(y, work: torch.Tensor, dest: torch.Tensor, accumulate: bool, count: int) -> None:
    """Write a reduction computed into `work` (partials or an fp32 atomic buffer) to `dest`."""
    if y.mode == "partials":
        reduction = y.reduce.reduction
        dims = tuple(AXES.index(a) for a in AXES if a in y.dims)
        result = reduction.fold(work, dims)
        if reduction.mean:
            result = result / count  # 0 / 0 = NaN over an empty dim, as torch
        result = result.reshape(dest.shape)
        if accumulate:
            result = reduction.merge(dest.to(torch.float32), result)
    else:
        result = work
    dest.copy_(saturate(result, dest.dtype))


# ---- values ---------------------------------------------------------------------------------------

def epilogue_values(args, layout: Layout, buffers: dict) -> dict:
    """The epilogue's runtime arguments by name (`Layout.param_names`)."""
    values: dict = {}
    for o in layout.operands:
        value = args.operands[o.name]
        if o.kind == "number":
            values[o.prefix] = float(value)
        else:
            values[f"{o.prefix}_ptr"] = value
            values.update({f"{o.prefix}_s{a.lower()}": args.strides[o.name][a] for a in o.axes})
    for y in layout.outputs:
        tensor, strides = buffers[y.name]
        values[f"{y.prefix}_ptr"] = tensor
        values.update({f"{y.prefix}_s{a.lower()}": strides[a] for a in y.axes})
        if y.scaled:
            values[f"{y.prefix}_scale"] = 1.0 / max(args.reduced_count(y.name), 1)
    return values


def conversion_meta(layout: Layout, outputs: dict) -> dict:
    """How the kernel converts fp32 to each tile output's dtype: KIND 0 plain (floats round to
    nearest even), 1 integer (round to nearest even, saturate, NaN to 0), 2 fp8 (saturate),
    with the bounds LO, HI."""
    meta = {}
    for y in layout.outputs:
        if y.mode != "tile":
            continue
        upper, dtype = y.prefix.upper(), outputs[y.name].dtype
        if dtype in FP8_MAX:
            kind, lo, hi = 2, -FP8_MAX[dtype], FP8_MAX[dtype]
        elif not dtype.is_floating_point:
            info = torch.iinfo(dtype)
            kind, lo, hi = 1, float(info.min), float(info.max)
        else:
            kind, lo, hi = 0, 0.0, 0.0
        meta.update({f"{upper}_KIND": kind, f"{upper}_LO": lo, f"{upper}_HI": hi})
    return meta


def runtime_parameters(kernel) -> list[str]:
    """The names of the kernel's non-constexpr parameters, in order (a JIT function's, or one
    Triton's interpreter wraps, which keeps only the Python signature)."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return [p.name for p in params if not p.is_constexpr]
    signature = inspect.signature(kernel.fn).parameters.values()
    return [p.name for p in signature if "constexpr" not in getattr(p.annotation, "__name__", str(p.annotation))]


def ordered(kernel, named: dict) -> list:
    """The runtime values in the order of the kernel's own non-constexpr parameters."""
    names = runtime_parameters(kernel)
    missing = [n for n in names if n not in named]
    if missing:
        raise InternalError(f"no value for the kernel parameters {missing}")
    return [named[n] for n in names]


# ---- in-kernel zeroing ------------------------------------------------------------------------------

_WORDS_LOCK = threading.Lock()


class ZeroingWords:
    """In-kernel zeroing's (arrivals, done) words of a plan: a pair for each CUDA stream that
    launches it eagerly and one for each CUDA graph capture of a launch.

    Launch n of a plan begins with n * arrivals in the first word; every program reads it at
    its start and adds one when it ends, so a reader sees fewer than `arrivals` arrivals of its
    own launch, and arrivals // sync_arrivals is n wherever it is read. The first program
    writes n + 1 to `done` after its zeros; the others wait for it before their first
    reduction. Nothing is reset, so a CUDA graph replays as it is. A launch counts itself by
    its own pair's arrivals, so launches of one plan may overlap (the same GemmArguments run
    from two threads, two graphs replayed at once, a replay beside an eager call): with one
    shared pair, a launch that started before the other's programs had all arrived would take
    the other's number, and programs of it would wait forever. Their outputs still race, as
    those of any kernel run twice at once on one output do.

    The plan's own pair is zeroed with the plan and serves the stream that made it (and the
    interpreter); any other stream's pair is zeroed on that stream before its first launch. A
    capture takes a pair of its own, never reused: one of SPARES zeroed with the plan
    (torch.cuda.graph, its graphed callables and torch.compile's graph trees synchronize
    before capturing; a raw CUDAGraph.capture_begin on a stream not ordered after the plan's
    must do so itself), or else one zeroed inside the graph, at every replay. What stays
    unsafe: one graph replayed on two streams at once, and a stream handle that a destroyed
    stream's unfinished launch used being given to a new stream."""

    SPARES = 4
    __slots__ = ("index", "first", "home", "spares", "by_stream", "captured")

    def __init__(self, index: int, device: torch.device):
        self.index = index  # the words' position in the launch's values
        # Zeros queued while a graph is captured happen only when that graph replays: a plan
        # made during a capture has no home stream and no spares.
        captured = target.capturing(device)
        first, *spares = torch.zeros(1 if captured else 1 + self.SPARES, 2, device=device, dtype=torch.int64).unbind()
        self.first, self.spares = first, spares  # the plan's values carry `first`
        cuda_home = device.type == "cuda" and not captured
        self.home = torch._C._cuda_getCurrentRawStream(device.index) if cuda_home else None
        self.by_stream: dict = {}
        self.captured: list = []  # the captures' pairs, kept alive with the plan

    def values_for(self, values: list, stream: int, capturing: bool) -> list:
        """`values` with the words for a launch on `stream` (a raw CUDA stream), or for one
        being captured into a CUDA graph, in their place: the same list when they are there."""
        words = None if capturing else self.by_stream.get(stream)
        if words is None:
            with _WORDS_LOCK:
                words = self._take(stream, capturing)
        if values[self.index] is words:
            return values
        values = list(values)
        values[self.index] = words
        return values

    def _take(self, stream: int, capturing: bool) -> torch.Tensor:
        if capturing:
            words = self.spares.pop() if self.spares else torch.zeros_like(self.first)
            self.captured.append(words)
            return words
        words = self.by_stream.get(stream)
        if words is None:
            words = self.by_stream[stream] = self.first if stream == self.home else torch.zeros_like(self.first)
        return words


def zeroing_values(args, outputs, arrivals: int) -> dict:
    """The zeroing parameters' values: the plan's words (the stream's, at launch), how many
    programs arrive, and each zeroable output's element count."""
    return {"sync_ptr": None, "sync_arrivals": arrivals,
            **{f"{y.prefix}_count": args.outputs[y.name].numel() for y in outputs}}


def arrivals(grid: tuple, consumers: int) -> int:
    """How many partitions arrive at a launch's end: every program's consumers."""
    return math.prod(grid) * consumers


def interpreted_launcher(plan: Plan):
    """launch_with for the interpreter: Triton's own launch, one at a time."""
    kernel, grid, meta, convert = plan.kernel, plan.grid, plan.meta, plan.convert

    def launch_with(values):   # holds no tensor of the plan's arguments
        with target.INTERPRETER_LOCK:
            kernel[grid](*(values if convert is None else convert(values, True)), **meta)
    return launch_with
