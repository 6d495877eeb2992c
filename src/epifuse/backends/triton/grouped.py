"""TritonGrouped: every group of a GroupedGemmArguments in one launch of a tiled kernel.

The grid is the groups' tiles laid end to end (empty groups have none); each program finds
its group in a device table of addresses, sizes and strides (see grouped_codegen), then runs
the tiled kernel's main loop and epilogue. Reductions work as in the tiled kernel, each group
with its own destinations and work buffers. The table and every launch argument are built
once per GroupedGemmArguments and kept on it, so reusing the arguments only launches.
"""
from __future__ import annotations

import contextlib
import hashlib

import torch
import triton

from ...ir import AXES
from ...runtime import compiled as compiled_index
from ...runtime.cache import load_kernel_module
from ...shapes import output_strides
from ... import verify as verification
from ...arguments import check_arguments
from ..base import Kernel, Status, supported, unsupported
from .codegen import Layout, launch_layout
from .grouped_codegen import column_hints, emit_grouped_kernel, table_columns
from .launch import direct_launcher
from .tiled import (
    TL_TYPES,
    _INTERPRETER_LOCK,
    INTERPRETER_CONFIG,
    TileConfig,
    TritonTiled,
    _conversion_meta,
    finish_reduction,
    prepare_reduction,
    _smaller_plan,
    on_device,
    uses_interpreter,
)

INT32_LIMIT = 2**31


class TritonGrouped(Kernel):
    name = "triton_grouped"
    _modules: dict = {}
    _fallback: dict = {}

    def __init__(self, config: TileConfig):
        self.config = config
        self._single = TritonTiled(config)  # its checks of dtypes, ops and spans, per group

    def __repr__(self) -> str:
        return f"<triton_grouped {self.config}>"

    # ---- support ---------------------------------------------------------------------------
    def supports(self, grouped, cc: int | None = None) -> Status:
        for i, problem in enumerate(grouped.problems):
            refusal = self._single._common_support(problem, cc)
            if refusal is not None:
                return unsupported(f"group {i}: {refusal.reason}")
        cfg = self._config(grouped)
        if _tile_count(grouped.problems, cfg) >= INT32_LIMIT:
            return unsupported("the groups have 2**31 tiles or more, more than one launch can number")
        return supported(f"grouped tiled {self.config}, {len(grouped)} groups in one launch")

    # ---- build ------------------------------------------------------------------------------
    def _config(self, grouped) -> TileConfig:
        if uses_interpreter(grouped.device):
            return INTERPRETER_CONFIG
        return self._fallback.get((grouped.key, self.config), self.config)

    def _module(self, grouped, pointee: dict[str, str], hints: dict[str, str]):
        """The generated module, one per (graph, target, element types, column hints)."""
        target = "interpret" if uses_interpreter(grouped.device) else "cuda"
        specialization = " ".join(f"{k}:{pointee.get(k, '')}:{hints.get(k, '')}"
                                  for k in sorted({*pointee, *hints}))
        cache_key = (grouped.key, target, grouped.deterministic, specialization)
        module = self._modules.get(cache_key)
        if module is None:
            source = emit_grouped_kernel(grouped.graph, target, grouped.key, pointee, hints,
                                         grouped.deterministic)
            digest = hashlib.sha256(specialization.encode()).hexdigest()[:10]
            stem = f"grouped_{grouped.key}_{digest}_{target}" + ("_det" if grouped.deterministic else "")
            module = self._modules[cache_key] = load_kernel_module(stem, source, target == "interpret")
        return module

    def _plan(self, grouped) -> _GroupedPlan:
        """Everything a launch needs, built once per (arguments, kernel) and kept on them."""
        plans = grouped.__dict__.setdefault("_plans", {})
        plan = plans.get(self)
        if plan is None:
            cfg = self._config(grouped)
            layout = launch_layout(grouped.graph, grouped.deterministic)
            groups = [(p, *_group_buffers(p, layout, cfg)) for p in grouped.problems]
            columns = table_columns(layout)
            rows, tiles = _table_rows(grouped, layout, groups, cfg)
            pointee = _pointee(grouped.problems[0], layout, groups[0][1])
            kernel = self._module(grouped, pointee, column_hints(columns, rows)).epifuse_grouped_kernel
            table = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), len(columns))
            values = [table.to(grouped.device), len(rows), _bisection_steps(len(rows)),
                      *(float(grouped.problems[0].operands[o.name]) for o in layout.operands
                        if o.kind == "number")]
            meta = self._meta(grouped, layout, cfg, len(columns))
            plan = plans[self] = _GroupedPlan(kernel, layout, groups, values, meta, (tiles,))
        return plan

    def _meta(self, grouped, layout: Layout, cfg: TileConfig, row: int) -> dict:
        first = grouped.problems[0]
        interpret = uses_interpreter(grouped.device)
        meta = dict(ROW=row, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                    GROUP_M=cfg.group_m, UPCAST=interpret,
                    PRECISION="ieee" if grouped.precision == "highest" else "tf32",
                    EPI_N=cfg.block_n, ACC_INT=first.A.dtype == torch.int8 and not interpret,
                    ACC_F16=first.accumulator_type == torch.float16,
                    EVEN_K=all(p.K % cfg.block_k == 0 for p in grouped.problems),
                    EVEN_M=all(p.M % cfg.block_m == 0 for p in grouped.problems),
                    EVEN_N=all(p.N % cfg.block_n == 0 for p in grouped.problems),
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        for y in layout.outputs:
            if y.mode == "tile":
                meta.update(_conversion_meta(y.prefix, first.outputs[y.name].dtype))
        return meta

    # ---- run --------------------------------------------------------------------------------
    def compile(self, grouped) -> None:
        check_arguments(self, grouped, grouped=True)
        if not uses_interpreter(grouped.device):
            with on_device(grouped.device):
                plan = self._plan(grouped)
                if plan.grid[0] > 0:
                    self._launch(grouped, plan, launch=False)

    def run(self, grouped, verify: bool = False) -> None:
        """Write every output of every group; `verify=True` also checks them against the
        float64 reference (epifuse.debug.VerificationError names the group and the error)."""
        if verify:
            return verification.run_grouped(self, grouped)
        plan = getattr(grouped, "_plans", {}).get(self)
        if plan is not None and plan.simple and plan.fast is not None:
            plan.fast()  # the common repeated call: nothing but the launch
            return
        check_arguments(self, grouped, grouped=True)
        plan = plan or self._plan(grouped)
        with on_device(grouped.device):
            self._run_slow(grouped, plan)

    def _run_slow(self, grouped, plan) -> None:
        if plan.grid[0] == 0:
            _prepare_reductions(grouped, plan)
        else:
            if plan.fast is None and not uses_interpreter(grouped.device):
                # Compile before the reductions are initialized, so a failure leaves them untouched.
                plan = self._launch(grouped, plan, launch=False)
            plan = self._launch(grouped, plan)
        for problem, _, finish in plan.groups:
            for y, work in finish:
                finish_reduction(y, work, problem.outputs[y.name], problem.accumulate,
                                 problem.reduced_count(y.name))

    def _launch(self, grouped, plan: _GroupedPlan, launch: bool = True) -> _GroupedPlan:
        """Launch (or only compile); when the config needs more shared memory than the GPU has,
        retry with a smaller one, which rebuilds the plan. Returns the plan that ran."""
        interpret = uses_interpreter(grouped.device)
        while True:
            try:
                if not launch:
                    compiled_index.warmup(plan.kernel, plan.values, plan.grid, plan.meta)
                    return plan
                _prepare_reductions(grouped, plan)
                if plan.fast is not None:
                    plan.fast()
                    return plan
                with _INTERPRETER_LOCK if interpret else contextlib.nullcontext():
                    compiled = plan.kernel[plan.grid](*plan.values, **plan.meta)
                if not interpret:
                    plan.fast = direct_launcher(plan, compiled, grouped.device.index or 0)
                return plan
            except triton.runtime.errors.OutOfResources:
                plan = _smaller_plan(self, grouped)
                if plan is None:
                    raise


class _GroupedPlan:
    __slots__ = ("fast", "grid", "groups", "kernel", "launch_with", "layout", "meta", "simple", "values")
    convert = None  # its values are the kernel's arguments as they are (see tiled._Plan.convert)
    sync = None     # its reductions start from a launch before it (no in-kernel zeroing's words)

    def __init__(self, kernel, layout, groups, values, meta, grid):
        self.kernel, self.layout, self.groups = kernel, layout, groups
        self.values, self.meta, self.grid = values, meta, grid
        self.fast = None
        self.launch_with = None
        # a launch and nothing else: no reduction to initialize or finish, a non-empty grid
        self.simple = all(y.mode == "tile" for y in layout.outputs) and grid[0] > 0


def _bisection_steps(groups: int) -> int:
    """ceil(log2(groups)): enough halvings to narrow the groups down to one."""
    return max(groups - 1, 0).bit_length()


def _tile_count(problems, cfg: TileConfig) -> int:
    return sum(triton.cdiv(p.M, cfg.block_m) * triton.cdiv(p.N, cfg.block_n) for p in problems)


def _group_buffers(problem, layout: Layout, cfg: TileConfig):
    """Where the kernel writes each output of one group, and the reductions to finish after it:
    fp32 atomics go straight to fp32 destinations, other atomics to an fp32 work tensor, and
    partials to a (1, row tiles or M, column tiles or N) buffer, as in the tiled kernel."""
    buffers, finish = {}, []
    for y in layout.outputs:
        dest = problem.outputs[y.name]
        if y.mode == "tile" or (y.mode == "atomic" and dest.dtype == torch.float32):
            buffers[y.name] = (dest, problem.strides[y.name])
            continue
        if y.mode == "atomic":
            work = torch.empty(dest.shape, device=dest.device, dtype=torch.float32)
            strides = output_strides(y.name, work, problem.accum_shape, work.device, y.dims, y.reduce)
        else:
            rows = triton.cdiv(problem.M, cfg.block_m) if "M" in y.dims else problem.M
            cols = triton.cdiv(problem.N, cfg.block_n) if "N" in y.dims else problem.N
            work = torch.empty((1, rows, cols), device=dest.device, dtype=torch.float32)
            strides = dict(zip(AXES, work.stride()))
        buffers[y.name] = (work, strides)
        finish.append((y, work))
    return buffers, finish


def _pointee(problem, layout: Layout, buffers: dict) -> dict[str, str]:
    """The element type of every pointer column (the same in every group)."""
    types = {"a_ptr": TL_TYPES[problem.A.dtype], "b_ptr": TL_TYPES[problem.B.dtype]}
    for o in layout.operands:
        if o.kind == "tensor":
            types[f"{o.prefix}_ptr"] = TL_TYPES[problem.operands[o.name].dtype]
    for y in layout.outputs:
        types[f"{y.prefix}_ptr"] = TL_TYPES[buffers[y.name][0].dtype]
    return types


def _row(problem, layout: Layout, roles: dict, buffers: dict, tile_start: int) -> dict[str, int]:
    """One group's table fields by column name. An operand is read along its widest role's
    axes, with stride 0 along those it does not vary along in this group."""
    a, b = problem.a_strides, problem.b_strides
    fields = dict(tile_start=tile_start, M=problem.M, N=problem.N, K=problem.K,
                  a_ptr=problem.A.data_ptr(), stride_am=a[1], stride_ak=a[2],
                  b_ptr=problem.B.data_ptr(), stride_bk=b[1], stride_bn=b[2])
    for o in layout.operands:
        if o.kind == "tensor":
            fields[f"{o.prefix}_ptr"] = problem.operands[o.name].data_ptr()
            for axis in roles[o.name].axes:
                fields[f"{o.prefix}_s{axis.lower()}"] = problem.strides[o.name].get(axis, 0)
    for y in layout.outputs:
        tensor, strides = buffers[y.name]
        fields[f"{y.prefix}_ptr"] = tensor.data_ptr()
        fields.update({f"{y.prefix}_s{axis.lower()}": strides[axis] for axis in y.axes})
    return fields


def _table_rows(grouped, layout: Layout, groups, cfg: TileConfig) -> tuple[list[list[int]], int]:
    """The table's rows (one per group with tiles) and the launch's tile count."""
    columns = table_columns(layout)
    roles = {o.name: o for o in grouped.roles}
    rows, tiles = [], 0
    for problem, buffers, _ in groups:
        if problem.M == 0 or problem.N == 0:
            continue
        fields = _row(problem, layout, roles, buffers, tiles)
        rows.append([fields[c.name] for c in columns])
        tiles += triton.cdiv(problem.M, cfg.block_m) * triton.cdiv(problem.N, cfg.block_n)
    return rows, tiles


def _prepare_reductions(grouped, plan: _GroupedPlan) -> None:
    """Start every atomic reduction from zero, or from what its destination holds when
    accumulating (a work tensor gets a copy of it)."""
    for problem, buffers, _ in plan.groups:
        for y in plan.layout.outputs:
            if y.mode == "atomic":
                prepare_reduction(y, buffers[y.name][0], problem.outputs[y.name], grouped.accumulate,
                                  problem.reduced_count(y.name))
