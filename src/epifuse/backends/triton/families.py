"""Kernel families: what differs between the generated GEMMs, as data and small functions.

A kernel is a family and a config (configs.py). A family says which template renders it
(source.SourceSpec), what it refuses beyond the checks every Triton kernel makes, and how a
launch is laid out: the main loop's runtime values, the family's constexprs and the grid, and
what the launch owns (split-K's workspace) or converts (the Gluon kernels' TMA descriptors).

    tiled        one program per tile, pointer loads; everywhere, the CPU interpreter included
    splitk       the tiled kernel with each tile's K loop shared by SPLIT_K programs, for
                 grids too small to fill the GPU (one launch, bitwise the same run to run)
    persistent   one program per SM looping over tiles, A and B through device-side TMA
                 descriptors (Hopper; the interpreter runs it too)
    pingpong     Gluon: two consumer warpgroups on alternate tiles, so one's epilogue runs
                 under the other's main loop (Hopper, one GEMM, 16-bit or 8-bit inputs)
    cooperative  Gluon: both warpgroups on one 128 x 256 tile
    grouped      the tiled kernel over many GEMMs of different sizes in one launch
    planar       the tiled kernel over a planar complex GEMM: four real products per K step into
                 two accumulators, the real and imaginary parts of accum
    gated        the tiled kernel over a gated GEMM (`gate, up = accum.chunk(2, dim=-1)`): each
                 A tile times both halves of B's columns, into two accumulators

An epilogue whose reduction over N feeds later math (ir.fed_reductions) runs in one kernel of a
family whose epilogue sees whole tiles (`in_tile_refusal` None: tiled, splitk), with a config
whose tile spans N (in_tile_check); elsewhere epifuse.gemm runs it as passes (staging.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ... import staging
from ...ir import fed_reductions
from ...runtime.triton_identity import triton_version
from ...shapes import accumulator_types, misalignment
from ..base import Status, unsupported
from . import configs
from . import device as target
from .gluon_api import CONSUMER_REGS, PRODUCER_REGS, buffer_plan, descriptor_converter, tma_mode
from .rules import TL_TYPES, missing_rules
from .source import SourceSpec

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8, *FP8)
OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int8, torch.uint8, *FP8)
GLUON_INPUTS = (torch.float16, torch.bfloat16, *FP8, torch.int8)
INT32_LIMIT = 2**31
_MISSING = missing_rules()


@dataclass(frozen=True)
class Launch:
    """A family's part of a launch: runtime values by parameter name, constexprs, the grid,
    buffers the launch owns, and the converter factory (given the kernel's runtime parameter
    names) for values Triton's JIT takes in another form."""
    values: dict
    meta: dict
    grid: tuple
    owned: tuple = ()
    converter: Callable | None = None
    spec: SourceSpec | None = None   # the source, where it depends on the arguments (grouped)
    problems: list | None = None     # the groups' Problems (grouped; one GEMM's are the kernel's to make)


@dataclass(frozen=True)
class Family:
    name: str
    spec: Callable                       # config -> SourceSpec
    check: Callable                      # (args, config, cc) -> a refusal (Status), or None
    launch: Callable                     # (args, config, layout) -> Launch
    describe: Callable                   # (args, config) -> why it supports them, in words
    pieces: Callable = field(default=lambda config: 1)  # config -> the epilogue's column blocks
    consumers: int = 1                   # partitions per program that arrive at its end (zeroing)
    interpreter_config: configs.TileConfig | None = None  # the config under the interpreter
    before_launch: Callable | None = None  # called in the launching thread before every launch
    gluon: bool = False                  # written in Gluon (tuning's tie-break prefers it)
    grouped: bool = False                # runs a GroupedGemmArguments
    form: str = "real"                   # the GEMMs it runs, and only those: "real", "planar", "gated"
    # why it does not run a reduction that feeds later math in one pass; None: it does, where
    # its config's tile spans N (in_tile_check)
    in_tile_refusal: str | None = "this kernel does not run them yet"

    def __repr__(self) -> str:
        return f"Family({self.name})"


# ---- what every Triton kernel checks ------------------------------------------------------------

def common_check(args, cc: int | None) -> Status | None:
    """The reason no Triton GEMM kernel can take `args`, or None."""
    device = args.A.device
    if device.type == "cpu" and not target.interpreter_requested():
        return unsupported("CPU tensors run Triton kernels only under its interpreter: set "
                           "TRITON_INTERPRET=1 (slow; for testing)")
    if device.type not in ("cpu", "cuda"):
        return unsupported(f"tensors on {device.type} are not supported by Triton here")
    if cc is not None and cc < 80:
        return unsupported(f"compute capability {cc} is below 8.0 (Ampere)")
    if args.A.dtype != args.B.dtype and not (args.A.dtype in FP8 and args.B.dtype in FP8):
        return unsupported(f"A is {args.A.dtype} but B is {args.B.dtype}; only fp8 e4m3 and e5m2 may mix")
    if args.A.dtype not in INPUT_DTYPES:
        return unsupported(f"input dtype {args.A.dtype} is not one of fp16, bf16, fp32, int8, "
                           "fp8 e4m3fn/e5m2 (epifuse.gemm runs uint8 A or B on int8 kernels, unsigned_inputs.py; "
                           "GemmArguments with them run in the reference kernel)")
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


def in_tile_check(family: Family, args, config) -> Status | None:
    """Why `family` with `config` cannot run `args`'s reductions that feed later math in one
    pass, or None (also where there are none). Such a reduction (over N: binding.bind) is
    folded in registers over the epilogue's piece, so the piece must span N: one column tile
    (BLOCK_N >= N) whose epilogue runs whole (one piece)."""
    fed = fed_reductions(args.graph)
    if not fed:
        return None
    folded = ", ".join(sorted({f"{node.op.name}()" for node in fed}))
    if family.in_tile_refusal is not None:
        return unsupported(f"{folded} over N feeds later math, and {family.in_tile_refusal} in one pass "
                           "(triton_tiled does, where a tile spans N)")
    width = config.block_n // family.pieces(config)
    if width < args.N:
        passes = len(staging.passes(args.epilogue.program))
        return unsupported(f"N = {args.N} spans tiles ({width} columns here, {configs.WIDEST_N} at most): "
                           f"{folded} over N feeds later math, so epifuse.gemm runs this epilogue as "
                           f"{passes} passes (staging.py)")
    return None


def in_tile_note(args) -> str:
    """What a supporting kernel's status adds for a reduction that feeds later math."""
    fed = fed_reductions(args.graph)
    if not fed:
        return ""
    folded = ", ".join(sorted({f"{node.op.name}()" for node in fed}))
    return f"; one pass: {folded} over each row of N = {args.N} within its tile"


def triton_meta(args, config, pieces: int) -> dict:
    """The constexprs of the Triton (not Gluon) kernels' main loops."""
    interpret = target.uses_interpreter(args.A.device)
    return dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                GROUP_M=config.group_m, UPCAST=interpret,
                PRECISION="ieee" if args.precision == "highest" else "tf32",
                EPI_N=config.block_n // pieces, ACC_INT=args.A.dtype == torch.int8 and not interpret,
                ACC_F16=args.accumulator_type == torch.float16,
                EVEN_M=args.M % config.block_m == 0, EVEN_N=args.N % config.block_n == 0,
                num_warps=config.num_warps, num_stages=config.num_stages)


def _pointer_values(args) -> dict:
    a, b = args.a_strides, args.b_strides
    return dict(a_ptr=args.A, b_ptr=args.B, M=args.M, N=args.N, K=args.K, stride_al=a[0], stride_am=a[1],
                stride_ak=a[2], stride_bl=b[0], stride_bk=b[1], stride_bn=b[2])


def _tile_grid(args, config) -> tuple:
    return (target.cdiv(args.M, config.block_m) * target.cdiv(args.N, config.block_n), args.L)


# ---- tiled --------------------------------------------------------------------------------------

def _tiled_launch(args, config, layout) -> Launch:
    meta = dict(triton_meta(args, config, 1), EVEN_K=args.K % config.block_k == 0)
    return Launch(_pointer_values(args), meta, _tile_grid(args, config))


def _said(label: str):
    return lambda args, config: f"{label} {config}"


TILED = Family("triton_tiled", lambda config: SourceSpec("pointer", "tiled", zeroes=True),
               lambda args, config, cc: None, _tiled_launch, _said("tiled"), interpreter_config=configs.INTERPRETER,
               in_tile_refusal=None)


# ---- planar complex -----------------------------------------------------------------------------

def _planar_check(args, config, cc) -> Status | None:
    if args.A.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return unsupported(f"the planar complex kernel takes fp16, bf16 or fp32 planes, not {args.A.dtype}")
    if args.accumulator_type != torch.float32:
        return unsupported("the planar complex kernel accumulates in fp32 only")
    return None


def _planar_launch(args, config, layout) -> Launch:
    """The tiled launch, and the imaginary planes, which share the real planes' strides."""
    meta = dict(triton_meta(args, config, 1), EVEN_K=args.K % config.block_k == 0)
    values = dict(_pointer_values(args), ai_ptr=args.A_imag, bi_ptr=args.B_imag)
    return Launch(values, meta, _tile_grid(args, config))


PLANAR = Family("triton_planar", lambda config: SourceSpec("pointer", "planar", zeroes=True), _planar_check,
                _planar_launch, _said("planar complex (4 real MMAs per K step)"),
                interpreter_config=configs.INTERPRETER, form="planar")


# ---- gated ----------------------------------------------------------------------------------------

def _gated_launch(args, config, layout) -> Launch:
    """The tiled launch over B's first half of columns (args.B) and the second (args.B_up,
    the same strides)."""
    meta = dict(triton_meta(args, config, 1), EVEN_K=args.K % config.block_k == 0)
    return Launch(dict(_pointer_values(args), bu_ptr=args.B_up), meta, _tile_grid(args, config))


GATED = Family("triton_gated", lambda config: SourceSpec("pointer", "gated", zeroes=True),
               lambda args, config, cc: None, _gated_launch, _said("gated (two halves of B's columns)"),
               interpreter_config=configs.INTERPRETER, form="gated")


# ---- split-K ------------------------------------------------------------------------------------

def _split_k_check(args, config, cc) -> Status | None:
    """Split-K pays off only on grids too small to fill the GPU, with a K long enough to split;
    the kernel itself is correct for any shape (the interpreter runs it on small ones)."""
    interpret = target.uses_interpreter(args.A.device)
    if not interpret:
        capability = cc if cc is not None else target.capability(args.A.device)
        if capability < 80:
            return unsupported(f"split-K runs on compute capability 8.0 or newer, not {capability}")
    least_k = 2 * config.split_k * config.block_k
    if args.K < least_k:
        return unsupported(f"K = {args.K} is too short to split {config.split_k} ways: two "
                           f"{config.block_k}-deep K tiles per split need K >= {least_k}")
    if not interpret:
        tiles = target.output_tiles(args, config)
        sms = target.sm_count(args.A.device.index or 0)
        if tiles >= sms:
            return unsupported(f"{tiles} output tiles of {config.block_m}x{config.block_n} already fill "
                               f"the {sms} SMs; split-K is for smaller grids")
    return None


def _split_k_launch(args, config, layout) -> Launch:
    """The tiled launch, and the workspace each plan owns: the partials, (tiles, SPLIT_K,
    BLOCK_M, BLOCK_N), and one int32 counter per tile, zeroed once. Every launch leaves each
    counter where it found it, so nothing is re-initialized and a CUDA graph replays as is.
    Launches of one plan must not overlap (the same arguments on two streams at once share
    the workspace, as any two launches on one output race)."""
    integer = args.A.dtype == torch.int8 and not target.uses_interpreter(args.A.device)  # ACC_INT
    tiles = target.output_tiles(args, config)
    partials = torch.empty((tiles, config.split_k, config.block_m, config.block_n), device=args.A.device,
                           dtype=torch.int32 if integer else torch.float32)
    counters = torch.zeros(tiles, device=args.A.device, dtype=torch.int32)
    meta = dict(triton_meta(args, config, 1), EVEN_K=args.K % config.block_k == 0, SPLIT_K=config.split_k)
    values = dict(_pointer_values(args), ws_ptr=partials, counter_ptr=counters)
    return Launch(values, meta, (*_tile_grid(args, config), config.split_k), owned=(partials, counters))


SPLIT_K = Family("triton_splitk", lambda config: SourceSpec("pointer", "splitk"), _split_k_check, _split_k_launch,
                 _said("split-K"), in_tile_refusal=None)


# ---- persistent ---------------------------------------------------------------------------------

def _operand_a(args) -> torch.Tensor:
    """A as the kernel sees it: batched only when it really varies along L."""
    A = args.A
    return A[0] if A.dim() == 3 and A.shape[0] == 1 else A


def _operand_b(args) -> torch.Tensor:
    B = args.B
    return B[0] if B.dim() == 3 and B.shape[0] == 1 else B


def tma_check(args, config, cc) -> Status | None:
    """What TMA needs of A and B: compute capability 9.0, A contiguous along K, B along N or
    K, 16-byte aligned bases and leading strides."""
    device = args.A.device
    if not target.uses_interpreter(device):
        major = (cc // 10) if cc is not None else torch.cuda.get_device_capability(device)[0]
        if major < 9:
            return unsupported(f"TMA needs compute capability 9.0 (Hopper); this GPU is {major}.x")
    A, B = _operand_a(args), _operand_b(args)
    size = A.element_size()
    if A.stride(-1) != 1:
        return unsupported("A's last dimension is not contiguous (TMA needs stride 1 along K)")
    if B.stride(-1) != 1 and B.stride(-2) != 1:
        return unsupported("B is contiguous along neither N nor K (TMA needs one of them)")
    leading = [A.stride(-2), *([A.stride(0)] if A.dim() == 3 else [])]
    b_kmajor = B.stride(-1) != 1  # the same test the kernel's B_KMAJOR makes
    leading += [B.stride(-1) if b_kmajor else B.stride(-2), *([B.stride(0)] if B.dim() == 3 else [])]
    for t, label in ((A, "A"), (B, "B")):
        if misalignment(t):
            return unsupported(f"{label} is not 16-byte aligned (TMA needs aligned base pointers)")
    if any((s * size) % 16 for s in leading):
        return unsupported("a leading stride of A or B is not a multiple of 16 bytes (TMA needs it)")
    return None


def _persistent_check(args, config, cc) -> Status | None:
    refusal = tma_check(args, config, cc)
    if refusal is None and args.A.dtype == torch.float32 and config.block_k > 32 \
            and not target.uses_interpreter(args.A.device):
        return unsupported("fp32 inputs use 32-deep K tiles in this kernel")
    return refusal


def _persistent_launch(args, config, layout) -> Launch:
    A, B = _operand_a(args), _operand_b(args)
    values = dict(a_ptr=A, b_ptr=B, M=args.M, N=args.N, K=args.K,
                  stride_al=A.stride(0) if A.dim() == 3 else 0, stride_am=A.stride(-2), stride_ak=A.stride(-1),
                  stride_bl=B.stride(0) if B.dim() == 3 else 0, stride_bk=B.stride(-2), stride_bn=B.stride(-1),
                  L=args.L)
    tiles = target.output_tiles(args, config)
    programs = (configs.INTERPRETER_PROGRAMS if target.uses_interpreter(args.A.device)
                else target.sm_count(args.A.device.index or 0))
    meta = dict(triton_meta(args, config, 2), A_BATCHED=A.dim() == 3, B_BATCHED=B.dim() == 3,
                B_KMAJOR=B.stride(-1) != 1, NUM_SMS=programs, FLATTEN=config.flatten,
                WARP_SPECIALIZE=config.warp_specialize)
    for o in layout.operands:
        if {"M", "N"} <= set(o.axes):
            meta[f"{o.prefix.upper()}_TMA"] = tma_mode(args.operands[o.name], args.strides[o.name], "L" in o.axes)
    for y in layout.outputs:
        if y.mode == "tile":
            meta[f"{y.prefix.upper()}_TMA"] = tma_mode(args.outputs[y.name], args.strides[y.name], args.L > 1)
    return Launch(values, meta, (max(1, min(programs, tiles)),))


def _scratch(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _install_allocator() -> None:
    """Device-side descriptors need scratch memory, which Triton asks this allocator for. The
    allocator is a context variable, so it is set in the launching thread every time (autograd
    runs backward kernels on its own threads)."""
    import triton   # loaded by then: the kernel is built
    triton.set_allocator(_scratch)


PERSISTENT = Family("triton_persistent", lambda config: SourceSpec("persistent"), _persistent_check,
                    _persistent_launch, _said("persistent TMA"), pieces=lambda config: 2, interpreter_config=configs.INTERPRETER,
                    before_launch=_install_allocator,
                    in_tile_refusal="this kernel, whose epilogue runs on a tile's two column halves in turn, cannot "
                                    "run them")


# ---- Gluon ping-pong and cooperative ------------------------------------------------------------

def _gluon_check(schedule: str):
    def check(args, config, cc) -> Status | None:
        if args.A.device.type != "cuda" or target.uses_interpreter(args.A.device):
            return unsupported("the Gluon kernel runs on Hopper GPUs only (Triton's interpreter cannot run it)")
        major = (cc // 10) if cc is not None else torch.cuda.get_device_capability(args.A.device)[0]
        if major != 9:
            return unsupported(f"the Gluon kernel uses wgmma, which only compute capability 9.x has; "
                               f"this GPU is {major}.x")
        if not target.gluon_available():
            return unsupported(f"triton {triton_version()} has no Gluon Hopper support")
        return gluon_problem_check(schedule, args, config, cc)
    return check


def gluon_problem_check(schedule: str, args, config, cc) -> Status | None:
    """Whether a Gluon kernel takes these dtypes, shapes and layouts on a Hopper GPU, whatever
    device the tensors are on: the question before an offline compile."""
    unchecked = sorted({node.op.name for node in args.graph.nodes()
                        if node.op.kind == "index" or (node.op.is_reduction and node.op.reduction.combine == "logsumexp")})
    if unchecked:   # their lines are checked under the interpreter, which cannot run Gluon
        return unsupported(f"the Gluon kernels do not take {', '.join(unchecked)} yet (the Triton ones do)")
    epilogue = getattr(args, "epilogue", None)   # a single GEMM's arguments (a grouped one has problems)
    updates = epilogue.program.updates if epilogue is not None else ()
    fed = fed_reductions(args.graph) if epilogue is not None else ()
    if fed:   # the in-tile reduction's lines are checked under the interpreter, which cannot run Gluon
        return unsupported(f"the Gluon kernels do not run a reduction that feeds later math "
                           f"({', '.join(sorted({node.op.name + '()' for node in fed}))} over N) in one pass yet "
                           "(triton_tiled does)")
    if updates:   # the masked store's Gluon lines have not run on a GPU yet
        return unsupported(f"the Gluon kernels do not take in-place conditional stores ({', '.join(updates)} = "
                           "where(...)) yet (the Triton ones do)")
    for check in (common_check, lambda a, c: _persistent_check(a, config, c)):
        refusal = check(args, cc)
        if refusal is not None:
            return refusal
    if args.A.dtype not in GLUON_INPUTS:
        return unsupported(f"the Gluon kernel takes fp16, bf16, fp8 or int8 inputs, not {args.A.dtype}")
    if args.A.dtype.itemsize == 1 and args.B.stride(-1) == 1:
        return unsupported(f"{args.A.dtype} inputs need B contiguous along K in the Gluon kernel "
                           "(wgmma reads 8-bit operands K-major only)")
    accumulator = torch.int32 if args.A.dtype == torch.int8 else torch.float32
    if args.accumulator_type != accumulator:
        return unsupported(f"the Gluon kernel accumulates {args.A.dtype} in {accumulator} only")
    if args.L != 1:
        return unsupported(f"the Gluon kernel runs one GEMM, not a batch of {args.L}")
    if 0 in (args.M, args.N, args.K):
        return unsupported(f"an empty GEMM ({args.M}x{args.N}x{args.K}): TMA descriptors need every "
                           "dimension positive; the other kernels take it")
    if schedule == "cooperative" and args.A.dtype == torch.int8:
        # Triton 3.6 fails to lower the m64n256k32 s8 wgmma (ConvertNVGPUToLLVM); the ping-pong
        # kernel's n128 one builds
        return unsupported("int8 inputs take the ping-pong Gluon kernel, not the cooperative one")
    return None


OFFLINE_SMS = 132  # the grid of a launch laid out without a GPU (an H100's SM count; it changes no code)


def _gluon_launch(consumers: int):
    def launch(args, config, layout) -> Launch:
        """A, B and each TMA-moved operand and output are passed as tensors, which the converter
        turns into descriptors, so a kept launch (runtime.callsite) can swap in new tensors."""
        pieces = config.epilogue_pieces
        plan = buffer_plan(args, config, layout, consumers)
        values = dict(a_desc=args.A, b_desc=args.B, M=args.M, N=args.N, K=args.K)
        for slot in layout.tile_slots():
            tensor = args.operands[slot.name] if slot.name in args.operands else args.outputs[slot.name]
            values[f"{slot.prefix}_desc"] = tensor if plan.tma[slot.prefix] else None
        meta = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                    EPI_N=config.block_n // pieces, GROUP_M=config.group_m, STAGES=plan.stages,
                    B_KMAJOR=args.B.stride(-1) != 1, INSTR_K=32 if args.A.dtype.itemsize == 1 else 16,
                    ACC_INT=args.A.dtype == torch.int8, EVEN_M=args.M % config.block_m == 0,
                    EVEN_N=args.N % config.block_n == 0, CONSUMER_REGS=CONSUMER_REGS,
                    PRODUCER_REGS=PRODUCER_REGS, num_warps=4 if consumers == 2 else 8,
                    LOAD_BYTES=plan.load_bytes)
        for p in plan.slots:
            meta[f"{p.upper()}_TMA"] = plan.tma[p]
            meta[f"{p.upper()}_BUF"] = plan.owner[p]
        for p, wait in plan.wait.items():
            meta[f"{p.upper()}_WAIT"] = wait
        tiles = target.cdiv(args.M, config.block_m) * target.cdiv(args.N, config.block_n)
        programs = target.sm_count(args.A.device.index or 0) if args.A.is_cuda else OFFLINE_SMS
        return Launch(values, meta, (max(1, min(programs, tiles)),),
                      converter=lambda names: descriptor_converter(args, layout, names, meta))
    return launch


PINGPONG = Family("gluon_pingpong", lambda config: SourceSpec("gluon", "pingpong", config.epilogue_pieces, zeroes=True),
                  _gluon_check("pingpong"), _gluon_launch(2), _said("Gluon pingpong"), pieces=lambda config: config.epilogue_pieces,
                  consumers=2, gluon=True)
COOPERATIVE = Family("gluon_cooperative",
                     lambda config: SourceSpec("gluon", "cooperative", config.epilogue_pieces, zeroes=True),
                     _gluon_check("cooperative"), _gluon_launch(1), _said("Gluon cooperative"), pieces=lambda config: config.epilogue_pieces,
                     consumers=1, gluon=True)
