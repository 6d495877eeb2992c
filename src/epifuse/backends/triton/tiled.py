"""TritonTiled: one program per output tile, the K loop, then the whole epilogue in registers.

Runs everywhere Triton runs, the CPU interpreter included (with small tiles there). The
kernel source is generated from the Graph once per (graph, target) and imported from the
disk cache; the launcher passes arguments in the order `codegen.launch_layout` fixes.

Small atomic reductions (sums, means and amax into contiguous fp32 destinations, not
accumulated into) are zeroed by the kernel's first program rather than by a launch before
it (`codegen.zeroing`; the Gluon kernels do the same): the plan owns the two words that
order the zeros before every program's atomics, a pair for each CUDA stream it is launched on
and for each CUDA graph capture (_StreamWords), so that overlapping launches of one plan never
count themselves by each other's arrivals, which could make their programs wait forever for
zeros no program stores (docs/kernels.md).
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

import torch
import triton

from ...runtime import compiled as compiled_index
from ...runtime.cache import load_kernel_module
from ... import verify as verification
from ...arguments import check_arguments
from ..base import Kernel, Status, supported, unsupported
from ...ir import AXES
from ...shapes import accumulator_types, output_strides
from ...reference import FP8_MAX, saturate
from .codegen import ZEROING_SHAPES, emit_kernel, launch_layout, zeroable
from .launch import direct_launcher
from .rules import missing_rules

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8, *FP8)
OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int8, torch.uint8, *FP8)
# The tensors a Triton kernel loads, by the element type it gives their pointers.
TL_TYPES = {
    torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
    torch.float64: "tl.float64", torch.int8: "tl.int8", torch.uint8: "tl.uint8",
    torch.int16: "tl.int16", torch.int32: "tl.int32", torch.int64: "tl.int64",
    torch.float8_e4m3fn: "tl.float8e4nv", torch.float8_e5m2: "tl.float8e5",
}
INT32_LIMIT = 2**31
ZERO_LIMIT = 1 << 16  # the most elements of a reduction the kernel zeroes (a launch zeroes larger ones)
_MISSING = missing_rules()
# Triton's interpreter patches triton.language globally while a kernel runs: one at a time.
_INTERPRETER_LOCK = threading.Lock()


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    flatten: bool = False  # persistent kernels: fuse the tile and K loops for pipelining
    warp_specialize: bool = False  # persistent kernels: producer/consumer warps
    epilogue_pieces: int = 1  # the Gluon kernel: its epilogue runs on this many column blocks in turn

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k} group {self.group_m}, "
                f"{self.num_warps} warps, {self.num_stages} stages" + (", flat" if self.flatten else "")
                + (", ws" if self.warp_specialize else "")
                + (f", epilogue in {self.epilogue_pieces}" if self.epilogue_pieces > 1 else ""))


INTERPRETER_CONFIG = TileConfig(32, 32, 32, group_m=2, num_warps=1, num_stages=1)
CUDA_CONFIGS = (
    TileConfig(128, 128, 64, 8, 8, 3),
    TileConfig(128, 256, 64, 8, 8, 3),
    TileConfig(64, 128, 64, 8, 4, 4),
)
BYTE_CONFIGS = (  # fp8 and int8: 128-byte rows per stage, as fp16's 64-deep K tiles have
    TileConfig(128, 128, 128, 8, 8, 3),
    TileConfig(128, 256, 128, 8, 8, 3),
    TileConfig(64, 128, 128, 8, 4, 4),
)


def cuda_configs(dtype: torch.dtype) -> tuple:
    return BYTE_CONFIGS if dtype.itemsize == 1 else CUDA_CONFIGS


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def uses_interpreter(device: torch.device) -> bool:
    return device.type == "cpu" or interpreter_requested()


class TritonTiled(Kernel):
    name = "triton_tiled"

    def __init__(self, config: TileConfig):
        self.config = config

    def __repr__(self) -> str:
        return f"<triton_tiled {self.config}>"

    # ---- support ---------------------------------------------------------------------------
    def supports(self, args, cc: int | None = None) -> Status:
        refusal = self._common_support(args, cc)
        return refusal if refusal is not None else supported(f"{self.shape} {self.config}")

    def _common_support(self, args, cc: int | None) -> Status | None:
        """The reason no Triton GEMM kernel can take `args`, or None."""
        device = args.A.device
        if device.type == "cpu" and not interpreter_requested():
            return unsupported("CPU tensors run Triton kernels only under its interpreter "
                               "(set TRITON_INTERPRET=1); the reference kernel runs instead")
        if device.type not in ("cpu", "cuda"):
            return unsupported(f"tensors on {device.type} are not supported by Triton here")
        if cc is not None and cc < 80:
            return unsupported(f"compute capability {cc} is below 8.0 (Ampere)")
        if args.A.dtype != args.B.dtype and not (args.A.dtype in FP8 and args.B.dtype in FP8):
            return unsupported(f"A is {args.A.dtype} but B is {args.B.dtype}; only fp8 e4m3 and e5m2 may mix")
        if args.A.dtype not in INPUT_DTYPES:
            return unsupported(f"input dtype {args.A.dtype} is not one of fp16, bf16, fp32, int8, "
                               "fp8 e4m3fn/e5m2 (uint8 GEMMs run in the reference kernel)")
        allowed = accumulator_types(args.A.dtype, args.B.dtype)
        if args.accumulator_type not in allowed:
            return unsupported(f"accumulator type {args.accumulator_type}: this kernel accumulates "
                               f"{args.A.dtype} in {' or '.join(str(t) for t in allowed)}")
        if args.A.dtype in FP8 and cc is not None and cc < 89:
            return unsupported(f"fp8 inputs need compute capability 8.9 or newer, not {cc}")
        if args.compute_dtype != torch.float32:
            return unsupported(f"compute dtype {args.compute_dtype}: this kernel computes in float32")
        for node in args.graph.nodes():
            if node.op in _MISSING:
                return unsupported(f"op {node.op.name} has no Triton lowering: {_MISSING[node.op]}")
        for name, dest in args.outputs.items():
            if dest.dtype not in OUTPUT_DTYPES:
                return unsupported(f"output {name} has dtype {dest.dtype}; this kernel stores fp32, "
                                   "fp16, bf16, int32, int8, uint8, fp8")
        for name, value in args.operands.items():
            if isinstance(value, torch.Tensor) and value.dtype not in TL_TYPES:
                return unsupported(f"operand {name} has dtype {value.dtype}, which this kernel cannot load")
        if args.largest_span >= INT32_LIMIT:
            return unsupported("a tensor spans 2**31 elements or more; this kernel indexes in int32")
        return None

    # ---- build and launch -------------------------------------------------------------------
    shape = "tiled"
    _modules: dict = {}
    _layouts: dict = {}
    _fallback: dict = {}
    _before_launch = None  # called in the launching thread before every launch (CUDA only)

    def _module(self, args):
        """The generated kernel module (one per canonical graph and target) and the launch
        layout, which holds the user's names and so is kept per bound graph."""
        interpret = uses_interpreter(args.A.device)
        target = "interpret" if interpret else "cuda"
        cache_key = (self.shape, args.key, target, args.deterministic)
        module = self._modules.get(cache_key)
        if module is None:
            source = self._source(args, target)
            stem = f"{self.shape}_{args.key}_{target}" + ("_det" if args.deterministic else "")
            module = self._modules[cache_key] = load_kernel_module(stem, source, interpret)
        entry = self._layouts.get((id(args.graph), args.deterministic))
        if entry is None or entry[0] is not args.graph:
            entry = (args.graph, launch_layout(args.graph, args.deterministic))
            self._layouts[(id(args.graph), args.deterministic)] = entry
        return module, entry[1]

    def _source(self, args, target: str) -> str:
        return emit_kernel(args.graph, self.shape, target, args.key, args.deterministic)

    def _config(self, args) -> TileConfig:
        """The config this launch uses: the interpreter's small tiles, a smaller fallback after
        an out-of-resources failure, or this kernel's own."""
        if uses_interpreter(args.A.device):
            return INTERPRETER_CONFIG
        return self._fallback.get((args.key, self.config), self.config)

    def _gemm_values(self, args) -> list:
        return [args.A, args.B, args.M, args.N, args.K, *args.a_strides, *args.b_strides]

    subtiles = 1  # the epilogue runs on (BLOCK_M, BLOCK_N / subtiles) pieces

    def _shape_meta(self, args, cfg, layout) -> tuple[dict, tuple]:
        """The kernel-shape-specific constexprs and the launch grid."""
        meta = dict(EVEN_K=args.K % cfg.block_k == 0)
        return meta, (triton.cdiv(args.M, cfg.block_m) * triton.cdiv(args.N, cfg.block_n), args.L)

    def _launch_args(self, args, layout, buffers):
        cfg = self._config(args)
        values = self._gemm_values(args) + epilogue_values(args, layout, buffers)
        precision = "ieee" if args.precision == "highest" else "tf32"
        interpret = uses_interpreter(args.A.device)
        meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                    GROUP_M=cfg.group_m, UPCAST=interpret, PRECISION=precision,
                    EPI_N=cfg.block_n // self.subtiles,
                    ACC_INT=args.A.dtype == torch.int8 and not interpret,
                    ACC_F16=args.accumulator_type == torch.float16,
                    EVEN_M=args.M % cfg.block_m == 0, EVEN_N=args.N % cfg.block_n == 0,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        for y in layout.outputs:
            if y.mode == "tile":
                meta.update(_conversion_meta(y.prefix, args.outputs[y.name].dtype))
        shape_meta, grid = self._shape_meta(args, cfg, layout)
        meta.update(shape_meta)
        return values, meta, grid

    def _reduction_buffers(self, args, layout):
        """Where each output is written by the kernel, and what to do after it (reductions)."""
        cfg = self._config(args)
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
                         "M": triton.cdiv(args.M, cfg.block_m) if "M" in y.dims else args.M,
                         "N": triton.cdiv(args.N, cfg.block_n) * self.subtiles if "N" in y.dims else args.N}
                work = torch.empty((sizes["L"], sizes["M"], sizes["N"]), device=dest.device,
                                   dtype=torch.float32)
                buffers[y.name] = (work, dict(zip(AXES, work.stride())))
                finish.append((y, work))
        return buffers, finish

    def _plan(self, args):
        """Everything a launch needs, built once per (args, kernel) and kept on args."""
        plans = args.__dict__.setdefault("_plans", {})
        plan = plans.get(self)
        if plan is None:
            module, layout = self._module(args)
            buffers, finish = self._reduction_buffers(args, layout)
            launch = self._complete_launch(args, layout, buffers)
            plan = plans[self] = _Plan(module.epifuse_kernel, layout, buffers, finish, launch,
                                       _reduction_steps(args, layout, buffers, finish, launch.zeroed))
        return plan

    def _complete_launch(self, args, layout, buffers) -> "_Launch":
        """The launch's values, constexprs and grid, with in-kernel zeroing's after the others."""
        values, meta, grid = self._launch_args(args, layout, buffers)
        convert = self._argument_converter(args, layout, values, meta)
        zeroed, sync = frozenset(), None
        outputs = zeroable(layout) if self.zeroes_reductions else []
        if outputs:
            # run() launches nothing for an empty problem: the launch before it zeroes then
            launches = args.M > 0 and args.N > 0 and args.L > 0 and all(g > 0 for g in grid)
            zeroed = frozenset(y.name for y in outputs if launches and _zeroes_in_kernel(args, y))
            # (arrivals, done), passed also where ANY_ZERO is False and the kernel never reads them
            sync = _StreamWords(len(values), args.A.device)
            values = [*values, sync.first, self._arrivals(grid),
                      *(args.outputs[y.name].numel() for y in outputs)]
            meta = dict(meta, ANY_ZERO=bool(zeroed),
                        **{f"{y.prefix.upper()}_ZERO": y.name in zeroed for y in outputs})
        return _Launch(values, meta, grid, convert, zeroed, sync)

    @property
    def zeroes_reductions(self) -> bool:
        """Whether the kernel zeroes its small atomic reductions itself (codegen.zeroing,
        whose parameters its source takes) instead of a launch before it."""
        return self.shape in ZEROING_SHAPES

    def _arrivals(self, grid) -> int:
        """How many programs of `grid` arrive at the end (codegen.zeroing)."""
        return grid[0] * grid[1]

    def _argument_converter(self, args, layout, values, meta):
        """See _Plan.convert; the Triton kernels take their values as they are."""
        return None

    def compile(self, args) -> None:
        check_arguments(self, args)
        with on_device(args.A.device):
            self._loaded_plan(args, self._plan(args))

    def _loaded_plan(self, args, plan):
        """`plan`, or the plan of a smaller config, whose kernel is compiled and loaded: a config
        that needs more shared memory than the GPU has fails here, before any output or buffer
        is touched, so what run() initializes and finishes belongs to the plan it launches."""
        if plan.loaded or uses_interpreter(args.A.device):
            return plan
        while True:
            compiled = compiled_index.warmup(plan.kernel, plan.jit_values(plan.values), plan.grid, plan.meta)
            try:
                getattr(compiled, "_init_handles", lambda: None)()  # where Triton checks resources
            except triton.runtime.errors.OutOfResources:
                plan = _smaller_plan(self, args)
                if plan is None:
                    raise
                continue
            plan.loaded = True
            return plan

    def run(self, args, verify: bool = False) -> None:
        """Write every output of `args`. `verify=True` also checks them against the float64
        reference and raises epifuse.debug.VerificationError with the largest error."""
        if verify:
            return verification.run(self, args)
        plan = getattr(args, "_plans", {}).get(self)
        if plan is not None and plan.fast is not None and plan.simple:
            plan.fast()  # the common repeated call: no reductions, nothing else to do
            return
        check_arguments(self, args)
        with on_device(args.A.device):
            plan = self._loaded_plan(args, plan or self._plan(args))
            plan.before(args.outputs)
            if args.M > 0 and args.N > 0 and args.L > 0:
                self._launch(args, plan)
            plan.after(args.outputs)

    def _launch(self, args, plan) -> None:
        """Launch a loaded plan (see _loaded_plan): its first launch goes through Triton, which
        also yields the compiled kernel for the direct launches after it."""
        if plan.fast is not None:
            plan.fast()
            return
        interpret = uses_interpreter(args.A.device)
        if self._before_launch is not None and not interpret:
            self._before_launch()
        values = plan.values
        if plan.sync is not None and not interpret:
            device = args.A.device
            values = plan.sync.values_for(values, torch._C._cuda_getCurrentRawStream(device.index),
                                          _capturing(device))
        with _INTERPRETER_LOCK if interpret else contextlib.nullcontext():
            compiled = plan.kernel[plan.grid](*plan.jit_values(values), **plan.meta)
        if not interpret:
            plan.fast = direct_launcher(plan, compiled, args.A.device.index or 0, self._before_launch)
        else:
            plan.launch_with = _interpreted_launcher(plan)


@dataclass(frozen=True)
class _Launch:
    values: list
    meta: dict
    grid: tuple
    convert: object      # see _Plan.convert
    zeroed: frozenset    # the outputs the kernel zeroes itself (codegen.zeroing)
    sync: object         # their (arrivals, done) words (_StreamWords), or None


_WORDS_LOCK = threading.Lock()


class _StreamWords:
    """In-kernel zeroing's (arrivals, done) words of a plan: a pair for each CUDA stream that
    launches it eagerly and one for each CUDA graph capture of a launch. A launch counts itself
    by its own pair's arrivals, so launches of one plan may overlap (the same GemmArguments run
    from two threads, two graphs replayed at once, a replay beside an eager call): with one
    shared pair a launch that started before the other's programs had all arrived would take
    the other's number, and programs of it would wait forever for a `done` no program stores.
    Their outputs still race, as those of any kernel run twice at once on one output do.

    The plan's own pair is zeroed with the plan and serves the stream that made it (and the
    interpreter); any other stream's pair is zeroed on that stream before its first launch, so
    that no work on another stream needs to be ordered before it. A capture takes a pair of
    its own, never reused: one of SPARES zeroed with the plan (torch.cuda.graph, its graphed
    callables and torch.compile's graph trees synchronize before capturing; a raw
    CUDAGraph.capture_begin on a stream not ordered after the plan's must do so itself), or
    else one zeroed inside the graph, at every replay. What stays unsafe: one graph replayed
    on two streams at once, and a stream handle that a destroyed stream's unfinished launch
    used being given to a new stream."""

    SPARES = 4
    __slots__ = ("index", "first", "home", "spares", "by_stream", "captured")

    def __init__(self, index: int, device: torch.device):
        self.index = index  # the words' position in the launch's values
        # Zeros queued while a graph is captured happen only when that graph replays: a plan
        # made during a capture has no home stream and no spares (each capture then zeroes
        # its own pair in its own graph).
        captured = _capturing(device)
        first, *spares = torch.zeros(1 if captured else 1 + self.SPARES, 2, device=device, dtype=torch.int64).unbind()
        self.first, self.spares = first, spares  # the plan's values carry `first`
        # the stream the plan's zeros were queued on
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
            # zeros queued on this stream, before its first launch
            words = self.by_stream[stream] = self.first if stream == self.home else torch.zeros_like(self.first)
        return words


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of `device` (the current device) is capturing a CUDA graph."""
    return device.type == "cuda" and torch._C._cuda_isCurrentStreamCapturing()


def _zeroes_in_kernel(args, y) -> bool:
    """Whether the kernel zeroes output `y` (an atomic reduction) at its start: an fp32
    contiguous destination it starts from zero (not accumulated into), of at most ZERO_LIMIT
    elements."""
    dest = args.outputs[y.name]
    return (not args.accumulate and dest.dtype == torch.float32 and dest.is_contiguous()
            and dest.numel() <= ZERO_LIMIT)


class _Plan:
    __slots__ = ("kernel", "layout", "buffers", "finish", "values", "meta", "grid", "fast", "simple",
                 "launch_with", "loaded", "before", "after", "owned", "convert", "sync")

    def __init__(self, kernel, layout, buffers, finish, launch: _Launch, steps):
        self.kernel, self.layout, self.buffers, self.finish = kernel, layout, buffers, finish
        self.values, self.meta, self.grid = launch.values, launch.meta, launch.grid
        self.fast = None          # launch with `values`, skipping Triton's binding (CUDA)
        self.launch_with = None   # launch with other values of the same specialization
        self.loaded = False       # compiled and loaded on the GPU (see _loaded_plan)
        # a launch and nothing else: no reduction to initialize (but those the kernel zeroes)
        # or finish, a non-empty grid
        self.simple = not finish and all(y.mode == "tile" or y.name in launch.zeroed
                                         for y in layout.outputs) and all(g > 0 for g in self.grid)
        # the reductions' work buffers and in-kernel zeroing's words
        self.owned = tuple(work for _, work in finish) + ((launch.sync.first,) if launch.sync is not None else ())
        self.sync = launch.sync  # in-kernel zeroing's words, per stream (_StreamWords), or None
        self.before, self.after = steps  # see _reduction_steps
        # values -> the kernel's arguments, given whether Triton's JIT will bind them
        # (the Gluon kernel turns tensors into TMA descriptors); None: the values themselves
        self.convert = launch.convert

    def jit_values(self, values) -> list:
        return values if self.convert is None else self.convert(values, True)


def epilogue_values(args, layout, buffers) -> list:
    """The epilogue's launch arguments, in `layout.param_names()` order."""
    values: list = []
    for o in layout.operands:
        value = args.operands[o.name]
        if o.kind == "number":
            values.append(float(value))
        else:
            values.append(value)
            values.extend(args.strides[o.name][a] for a in o.axes)
    for y in layout.outputs:
        tensor, strides = buffers[y.name]
        values.append(tensor)
        values.extend(strides[a] for a in y.axes)
        if y.scaled:
            values.append(1.0 / max(args.reduced_count(y.name), 1))
    return values


def _reduction_steps(args, layout, buffers, finish, zeroed):
    """What runs before and after the launch for the reductions, as functions of the outputs
    (a name -> tensor mapping: the arguments' own, or a kept launch's new ones): initialize the
    atomic buffers the kernel does not zero (`zeroed`), then write the partials or the fp32
    buffers to their destinations."""
    accumulate = args.accumulate
    atomic = [(y, buffers[y.name][0], args.outputs[y.name], args.reduced_count(y.name))
              for y in layout.outputs if y.mode == "atomic" and y.name not in zeroed]
    atomic = [(y, None if buffer is dest else buffer, count) for y, buffer, dest, count in atomic]
    finishing = [(y, work, args.reduced_count(y.name)) for y, work in finish]

    def before(outputs) -> None:
        for y, own, count in atomic:
            dest = outputs[y.name]
            prepare_reduction(y, dest if own is None else own, dest, accumulate, count)

    def after(outputs) -> None:
        for y, work, count in finishing:
            finish_reduction(y, work, outputs[y.name], accumulate, count)
    return before, after


def on_device(device: torch.device):
    """Run a kernel's compile and launch with its tensors' GPU current: Triton compiles, loads
    and launches on the current device (the tensors may be on another one, cuda:1 in a
    process whose current device is cuda:0)."""
    if device.type != "cuda" or device.index is None or device.index == torch._C._cuda_getDevice():
        return contextlib.nullcontext()
    return torch.cuda.device(device.index)


def _interpreted_launcher(plan):
    """launch_with for the interpreter: Triton's own launch, one at a time."""
    kernel, grid, meta = plan.kernel, plan.grid, plan.meta

    def launch_with(values):
        with _INTERPRETER_LOCK:
            kernel[grid](*plan.jit_values(values), **meta)
    return launch_with


def _smaller_plan(kernel, args):
    """After an out-of-resources failure: remember the next smaller config of `kernel` for
    these arguments (single or grouped) and return its plan, or None when there is none."""
    smaller = _smaller(kernel._config(args))
    if smaller is None:
        return None
    kernel._fallback[(args.key, kernel.config)] = smaller
    args._plans.pop(kernel, None)
    return kernel._plan(args)


def _smaller(cfg: TileConfig) -> TileConfig | None:
    """The next config down: fewer pipeline stages, then narrower tiles."""
    from dataclasses import replace
    if cfg.num_stages > 2:
        return replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.block_n > 64:
        return replace(cfg, block_n=cfg.block_n // 2)
    if cfg.block_m > 64:
        return replace(cfg, block_m=cfg.block_m // 2)
    return None


def _conversion_meta(prefix: str, dtype: torch.dtype) -> dict:
    """How the kernel converts fp32 to an output's dtype: 0 plain (floats round to nearest
    even), 1 integer (round to nearest even, saturate, NaN to 0), 2 fp8 (saturate)."""
    upper = prefix.upper()
    if dtype in FP8:
        limit = FP8_MAX[dtype]
        return {f"{upper}_KIND": 2, f"{upper}_LO": -limit, f"{upper}_HI": limit}
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return {f"{upper}_KIND": 1, f"{upper}_LO": float(info.min), f"{upper}_HI": float(info.max)}
    return {f"{upper}_KIND": 0, f"{upper}_LO": 0.0, f"{upper}_HI": 0.0}


def prepare_reduction(y, buffer: torch.Tensor, dest: torch.Tensor, accumulate: bool, count: int) -> None:
    """Start an atomic reduction's buffer from zero, or from what its destination holds when
    accumulating (a work buffer gets a copy of it; for amax with its NaNs made positive, as the
    integer atomic max needs); a mean over nothing is NaN (0 / 0, as torch)."""
    if not accumulate:
        buffer.fill_(0.0)
    else:
        if buffer is not dest:
            buffer.copy_(dest)
        if y.reduce.reduction.magnitude:  # a NaN with its sign set would order below every |x| (reduction_mode)
            buffer.masked_fill_(buffer.isnan(), float("nan"))
    if y.reduce.reduction.mean and count == 0:
        buffer.fill_(float("nan"))


def finish_reduction(y, work: torch.Tensor, dest: torch.Tensor, accumulate: bool, count: int) -> None:
    """Write a reduction computed into `work` (partials or an fp32 atomic buffer) to `dest`."""
    if y.mode == "partials":
        dims = tuple(AXES.index(a) for a in AXES if a in y.dims)
        reduction = y.reduce.reduction
        result = reduction.fold(work, dims)
        if reduction.mean:
            result = result / count  # 0 / 0 = NaN over an empty dim, as torch
        result = result.reshape(dest.shape)
        if accumulate:
            result = reduction.merge(dest.to(torch.float32), result)
    else:
        result = work
    dest.copy_(saturate(result, dest.dtype))
