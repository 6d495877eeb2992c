"""TritonTiled: one program per output tile, the K loop, then the whole epilogue in registers.

Runs everywhere Triton runs, the CPU interpreter included (with small tiles there). The
kernel source is generated from the Graph once per (graph, target) and imported from the
disk cache; the launcher passes arguments in the order `codegen.launch_layout` fixes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from ...ops import OPS
from ...runtime.cache import load_kernel_module
from ..base import Kernel, Status, supported, unsupported
from .codegen import REDUCE_IDENTITY, emit_tiled, launch_layout
from .rules import missing_rules

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT32_LIMIT = 2**31


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k} group {self.group_m}, "
                f"{self.num_warps} warps, {self.num_stages} stages")


INTERPRETER_CONFIG = TileConfig(32, 32, 32, group_m=2, num_warps=1, num_stages=1)
CUDA_CONFIGS = (
    TileConfig(128, 128, 64, 8, 8, 3),
    TileConfig(128, 256, 64, 8, 8, 3),
    TileConfig(128, 64, 64, 8, 4, 4),
    TileConfig(64, 128, 64, 8, 4, 4),
    TileConfig(64, 64, 64, 8, 4, 4),
)


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def uses_interpreter(device: torch.device) -> bool:
    return device.type == "cpu" or interpreter_requested()


def _max_offset(t: torch.Tensor, dims) -> int:
    return sum((t.shape[d] - 1) * abs(t.stride(d)) for d in dims if t.shape[d] > 0)


class TritonTiled(Kernel):
    name = "triton_tiled"

    def __init__(self, config: TileConfig):
        self.config = config

    def __repr__(self) -> str:
        return f"<triton_tiled {self.config}>"

    # ---- support ---------------------------------------------------------------------------
    def supports(self, args, cc: int | None = None) -> Status:
        device = args.A.device
        if device.type == "cpu" and not interpreter_requested():
            return unsupported("CPU tensors run Triton kernels only under its interpreter "
                               "(set TRITON_INTERPRET=1); the reference kernel runs instead")
        if device.type not in ("cpu", "cuda"):
            return unsupported(f"tensors on {device.type} are not supported by Triton here")
        if cc is not None and cc < 80:
            return unsupported(f"compute capability {cc} is below 8.0 (Ampere)")
        if args.A.dtype != args.B.dtype:
            return unsupported(f"A is {args.A.dtype} but B is {args.B.dtype}; mixed inputs are not supported")
        if args.A.dtype not in INPUT_DTYPES:
            return unsupported(f"input dtype {args.A.dtype} is not one of fp16, bf16, fp32")
        if args.accumulator_type != torch.float32:
            return unsupported(f"accumulator type {args.accumulator_type} is not float32")
        if args.compute_dtype != torch.float32:
            return unsupported(f"compute dtype {args.compute_dtype}: this kernel computes in float32")
        missing = missing_rules()
        for node in args.graph.nodes():
            if node.op in missing and OPS[node.op].kind != "reduce":
                return unsupported(f"op {node.op} has no Triton lowering: {missing[node.op]}")
        for name, dest in args.outputs.items():
            if dest.dtype not in OUTPUT_DTYPES:
                return unsupported(f"output {name} has dtype {dest.dtype}; this kernel stores fp32, fp16, bf16")
        if args.deterministic and args.reductions:
            return unsupported("deterministic reductions are not implemented in this kernel yet")
        for label, t in self._tensors(args):
            if _max_offset(t, range(t.dim() - 2, t.dim()) if t.dim() >= 2 else range(t.dim())) >= INT32_LIMIT:
                return unsupported(f"{label} spans 2**31 elements or more within one matrix")
        if device.type == "cuda" and self.config.block_m > 64 and args.M <= 64:
            return supported(f"tiled {self.config} (M={args.M} is small for this tile)")
        return supported(f"tiled {self.config}")

    @staticmethod
    def _tensors(args):
        yield "A", args.A
        yield "B", args.B
        for name, value in args.operands.items():
            if isinstance(value, torch.Tensor):
                yield f"operand {name}", value
        for name, value in args.outputs.items():
            yield f"output {name}", value

    # ---- build and launch -------------------------------------------------------------------
    _built: dict = {}

    def _module(self, args):
        """The generated kernel module and its launch layout, built once per graph and target."""
        interpret = uses_interpreter(args.A.device)
        target = "interpret" if interpret else "cuda"
        built = self._built.get((args.key, target))
        if built is None:
            source = emit_tiled(args.graph, target, args.key)
            module = load_kernel_module(f"tiled_{args.key}_{target}", source, interpret)
            built = self._built[(args.key, target)] = (module, launch_layout(args.graph))
        return built

    def _launch_args(self, args, layout):
        cfg = self.config if not uses_interpreter(args.A.device) else INTERPRETER_CONFIG
        values: list = [args.A, args.B, args.M, args.N, args.K, *args.a_strides, *args.b_strides]
        for o in layout.operands:
            value = args.operands[o.name]
            if o.kind == "number":
                values.append(float(value))
            else:
                strides = args.strides[o.name]
                values.append(value)
                values.extend(strides[a] for a in o.axes)
        for y in layout.outputs:
            strides = args.strides[y.name]
            values.append(args.outputs[y.name])
            values.extend(strides[a] for a in y.axes)
            if y.reduce == "mean":
                values.append(1.0 / max(args.reduced_count(y.name), 1))
        upcast = uses_interpreter(args.A.device)
        precision = "ieee" if args.precision == "highest" else "tf32"
        meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                    GROUP_M=cfg.group_m, UPCAST=upcast, PRECISION=precision,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        grid = (triton.cdiv(args.M, cfg.block_m) * triton.cdiv(args.N, cfg.block_n), args.L)
        return values, meta, grid

    def compile(self, args) -> None:
        module, layout = self._module(args)
        if not uses_interpreter(args.A.device):
            values, meta, grid = self._launch_args(args, layout)
            module.epifuse_kernel.warmup(*values, grid=grid, **meta)

    def run(self, args) -> None:
        module, layout = self._module(args)
        values, meta, grid = self._launch_args(args, layout)
        if args.reductions and not args.accumulate:
            if not uses_interpreter(args.A.device):
                module.epifuse_kernel.warmup(*values, grid=grid, **meta)  # fail before touching outputs
            for name, kind in args.reductions.items():
                args.outputs[name].fill_(REDUCE_IDENTITY[kind])
        if args.M == 0 or args.N == 0 or args.L == 0:
            return
        module.epifuse_kernel[grid](*values, **meta)
