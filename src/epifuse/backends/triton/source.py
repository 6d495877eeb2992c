"""Kernel source: a family's template rendered for one Graph, and loaded as a module.

Each kernel family is one template (templates/*.py.j2) with named holes: the parameter list,
the epilogue's lines (epilogue.py), the in-kernel zeroing (macros.j2), and what the family
needs besides (a grouped kernel's table row, the Gluon kernels' shared-memory slots). The
shared @jit helpers (tile order, accumulator set-up, the multiply-add step, conversions) are in
templates/header.py.j2. `module(spec, graph, key, ...)` renders and loads a kernel module once
per spec, graph, target and options, through the on-disk source cache.
"""
from __future__ import annotations

import functools
import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

from ...runtime.cache import load_kernel_module
from .epilogue import emit_epilogue
from .gluon_api import gluon_api
from .layout import Layout, launch_layout
from .plan import ZERO_BLOCK
from .rules import helper_source

KERNEL_NAME = "epifuse_kernel"


@functools.lru_cache(maxsize=None)
def _environment():
    """The kernel templates' environment, made once (jinja2 is imported on the first render,
    not with epifuse)."""
    import jinja2
    environment = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                                     trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                                     undefined=jinja2.StrictUndefined, autoescape=False)
    environment.filters["tma_flag"] = lambda prefix: f"{prefix.upper()}_TMA"
    return environment


def _template(name: str):
    return _environment().get_template(name)


@dataclass(frozen=True)
class SourceSpec:
    """What a kernel's source depends on besides the Graph: the family's template and its
    variant (family "tiled" / "splitk" / "grouped" for the pointer template; schedule and
    epilogue pieces for Gluon), and a grouped kernel's table specialization."""
    template: str                  # "pointer", "persistent", "gluon"
    variant: str = ""              # pointer: tiled, splitk, grouped; gluon: pingpong, cooperative
    pieces: int = 1                # Gluon: the epilogue's column blocks
    zeroes: bool = False           # zeroes its small atomic reductions itself
    table: tuple = ()              # grouped: ((column, pointee, hint), ...)

    @property
    def stem(self) -> str:
        """A file name stem that tells the specs apart."""
        stem = "_".join(p for p in (self.template, self.variant, f"p{self.pieces}" if self.pieces > 1 else "") if p)
        if self.table:
            stem += "_" + hashlib.sha256(repr(self.table).encode()).hexdigest()[:10]
        return stem


@dataclass(frozen=True)
class Zeroing:
    """What the zeroing macros need: the outputs zeroed, the first program's condition, and how
    this kernel's language spells loads, a barrier and a range."""
    outputs: tuple
    first: str
    lang: str
    barrier: str
    arange: str
    block: int = ZERO_BLOCK


GEMM_PARAMS = {
    "tiled": ("a_ptr", "b_ptr", "M", "N", "K", "stride_al", "stride_am", "stride_ak",
              "stride_bl", "stride_bk", "stride_bn"),
    "persistent": ("a_ptr", "b_ptr", "M", "N", "K", "stride_al", "stride_am", "stride_ak",
                   "stride_bl", "stride_bk", "stride_bn", "L"),
}
GEMM_PARAMS["splitk"] = GEMM_PARAMS["tiled"] + ("ws_ptr", "counter_ptr")
GEMM_PARAMS["planar"] = GEMM_PARAMS["tiled"] + ("ai_ptr", "bi_ptr")
GEMM_PARAMS["gated"] = GEMM_PARAMS["tiled"] + ("bu_ptr",)
_TRITON_META = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "UPCAST", "PRECISION", "EPI_N", "ACC_INT",
                "ACC_F16", "EVEN_M", "EVEN_N")
META = {
    "tiled": _TRITON_META + ("EVEN_K",),
    "planar": _TRITON_META + ("EVEN_K",),
    "gated": _TRITON_META + ("EVEN_K",),
    "splitk": _TRITON_META + ("EVEN_K", "SPLIT_K"),
    "grouped": ("ROW",) + _TRITON_META[:7] + ("ACC_INT", "ACC_F16", "EVEN_K", "EVEN_M", "EVEN_N"),
    "persistent": _TRITON_META + ("A_BATCHED", "B_BATCHED", "B_KMAJOR", "NUM_SMS", "FLATTEN", "WARP_SPECIALIZE"),
    "gluon": ("BLOCK_M", "BLOCK_N", "BLOCK_K", "EPI_N", "GROUP_M", "STAGES", "B_KMAJOR", "INSTR_K", "ACC_INT",
              "EVEN_M", "EVEN_N", "CONSUMER_REGS", "PRODUCER_REGS", "LOAD_BYTES"),
}


def zeroable(layout: Layout) -> list:
    """The outputs a zeroing kernel may zero itself: atomic sums, means and amax."""
    return [y for y in layout.outputs if y.mode == "atomic"]


def zeroing_params(layout: Layout) -> tuple[list[str], list[str]]:
    """(runtime, constexpr) parameters the zeroing of `layout`'s atomic outputs adds."""
    outputs = zeroable(layout)
    if not outputs:
        return [], []
    return (["sync_ptr", "sync_arrivals", *(f"{y.prefix}_count" for y in outputs)],
            ["ANY_ZERO", *(f"{y.prefix.upper()}_ZERO" for y in outputs)])


def _output_meta(layout: Layout, parts) -> list[str]:
    return [f"{y.prefix.upper()}_{part}" for y in layout.outputs if y.mode == "tile" for part in parts]


def render(spec: SourceSpec, graph, key: str, target: str, deterministic: bool) -> str:
    """The module source of `spec`'s kernel for `graph` on `target` ("cuda" or "interpret")."""
    layout = launch_layout(graph, deterministic)
    if spec.template == "gluon":
        return _render_gluon(spec, graph, layout, key)
    style = "tma" if spec.template == "persistent" else "pointer"
    lines, helpers = emit_epilogue(graph, layout, style)
    zero_runtime, zero_meta = zeroing_params(layout) if spec.zeroes else ([], [])
    zeroing = None
    if zero_runtime:
        helpers = helpers | {"_load_acquire"}
        zeroing = Zeroing(tuple(zeroable(layout)), "tl.program_id(0) == 0 and tl.program_id(1) == 0", "tl",
                          "tl.debug_barrier()", f"tl.arange(0, {ZERO_BLOCK})")
    family = spec.variant or spec.template
    context = dict(key=key, target=target, libdevice=target == "cuda", helpers=helper_source(helpers, target),
                   kernel_name=KERNEL_NAME, family=family, epilogue=lines, zeroing=zeroing)
    if spec.template == "persistent":
        slots = layout.tma_candidates()
        meta = [*META["persistent"], *_output_meta(layout, ("KIND", "LO", "HI")), *(f"{p.upper()}_TMA" for p in slots)]
        params = [*GEMM_PARAMS["persistent"], *layout.param_names(), *(f"{m}: tl.constexpr" for m in meta)]
        return _template("persistent.py.j2").render(params=params, tma_slots=slots, **context)
    if family == "grouped":
        row = _bind_row(spec.table) + _mean_scales(layout)
        runtime = ["table_ptr", "NUM_GROUPS", "SEARCH_STEPS", *(o.prefix for o in layout.operands if o.kind == "number")]
    else:
        row = []
        runtime = [*GEMM_PARAMS[family], *layout.param_names(), *zero_runtime]
    meta = [*META[family], *_output_meta(layout, ("KIND", "LO", "HI")), *zero_meta]
    params = [*runtime, *(f"{m}: tl.constexpr" for m in meta)]
    return _template("pointer.py.j2").render(params=params, row=row, **context)


def _render_gluon(spec: SourceSpec, graph, layout: Layout, key: str) -> str:
    pieces, schedule = spec.pieces, spec.variant
    if pieces < 1 or pieces & (pieces - 1):
        raise ValueError(f"an epilogue in {pieces} pieces: a power of two is needed")
    consumers, warps = (2, 4) if schedule == "pingpong" else (1, 8)
    api = gluon_api()
    lines, helpers = emit_epilogue(graph, layout, "gluon")
    zero_runtime, zero_meta = zeroing_params(layout)
    zeroing = None
    if zero_runtime:
        helpers = helpers | {"_load_acquire"}
        zeroing = Zeroing(tuple(zeroable(layout)), "pid == 0 and CID == 0", "gl", f"{api.barrier}()",
                          f"gl.arange(0, {ZERO_BLOCK}, layout=gl.BlockedLayout([4], [32], [{warps}], [0]))")
    slots = layout.tma_candidates()
    stores = [y.prefix for y in layout.outputs if y.mode == "tile"]
    loads = [p for p in slots if p not in stores]
    meta = [*META["gluon"], *(f"{p.upper()}_{part}" for p in slots for part in ("TMA", "BUF")),
            *_output_meta(layout, ("KIND", "LO", "HI", "WAIT")), *zero_meta]
    runtime = ["M", "N", "K", *layout.param_names(), *(f"{p}_desc" for p in slots), *zero_runtime]
    consumer = ["a_bufs", "b_bufs", "ready_bars", "empty_bars", "turn_bars", "load_bars", *runtime,
                *(f"{p}_bufs" for p in slots)]
    split_lines, values = _split_lines(pieces)
    return _template("gluon.py.j2").render(
        key=key, target=f"cuda (Gluon {schedule}, sm_90)", libdevice=True, helpers=helper_source(helpers, "cuda"),
        kernel_name=KERNEL_NAME, schedule=schedule, warps=warps, consumers=consumers, pieces=pieces,
        api=api, slots=slots, loads=loads, stores=stores, epilogue=lines, zeroing=zeroing,
        consumer_params=[*consumer, *(f"{m}: gl.constexpr" for m in meta)], consumer_args=[*consumer, *meta],
        kernel_params=["a_desc", "b_desc", *runtime, *(f"{m}: gl.constexpr" for m in meta)],
        split_lines=split_lines, piece_values=values)


def _split_lines(pieces: int) -> tuple[list[str], list[str]]:
    """Lines splitting `acc` into `pieces` (a power of two) column blocks by halving every block
    in turn, and the blocks' names in column order."""
    names, lines = ["acc"], []
    while len(names) < pieces:
        half = f"{pieces // (2 * len(names))} * EPI_N"
        lines += [f"{name}_0, {name}_1 = gl.split({name}.reshape([BLOCK_M, 2, {half}]).permute((0, 2, 1)))"
                  for name in names]
        names = [f"{name}_{i}" for name in names for i in (0, 1)]
    return lines, names


def _bind_row(table: tuple) -> list[str]:
    """Bind every column of a group's table row (grouped.py: table_columns). A column's hint
    says what holds in every group of the launch, as Triton's specialization of kernel
    arguments would: "zero" or "one" (a stride bound as that literal), "div16" (a multiple of
    16: bytes for an address, elements for a size or stride), so loads can be vectorized."""
    lines = []
    for i, (name, pointee, hint) in enumerate(table):
        field = f"tl.load(row_ptr + {i})"
        if name == "tile_start":
            lines.append(f"pid = (tile_id - {field}).to(tl.int32)")
            continue
        if hint in ("zero", "one"):
            lines.append(f"{name} = {int(hint == 'one')}")
            continue
        value = f"{field}.to(tl.pointer_type({pointee}))" if pointee else f"{field}.to(tl.int32)"
        lines.append(f"{name} = tl.multiple_of({value}, 16)" if hint == "div16" else f"{name} = {value}")
    return lines + ["stride_al = 0", "stride_bl = 0", "pid_l = 0"]


def _mean_scales(layout: Layout) -> list[str]:
    """An atomic mean folds each partial sum times 1 / (elements reduced), which varies by group."""
    size = {"M": "M.to(tl.float32)", "N": "N.to(tl.float32)", "L": "1.0"}
    return [f"{y.prefix}_scale = 1.0 / tl.maximum({' * '.join(size[a] for a in y.dims)}, 1.0)"
            for y in layout.outputs if y.scaled]


_MODULES: dict = {}
_LOCK = threading.Lock()


def module(spec: SourceSpec, graph, key: str, target: str, deterministic: bool):
    """The loaded kernel module of `spec` for `graph` (hashed as `key`) on `target`."""
    cache_key = (spec, key, target, deterministic)
    found = _MODULES.get(cache_key)
    if found is None:
        source = render(spec, graph, key, target, deterministic)
        stem = f"{spec.stem}_{key}_{target}" + ("_det" if deterministic else "")
        found = load_kernel_module(stem, source, target == "interpret")
        with _LOCK:
            _MODULES[cache_key] = found
    return found
