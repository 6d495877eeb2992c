"""TritonKernel: a kernel family with a config, as epifuse.get_kernels hands it out.

`supports(args)` asks the checks every Triton kernel makes and the family's own; `run(args)`
builds a launch plan once per arguments object (plan.py), asks `supports` once where
`get_kernels` did not offer this kernel for these arguments, compiles the plan (a config that
needs more shared memory than the GPU has falls back to the next smaller one, before any output
is touched), prepares the reductions, launches, and finishes them. A repeated `run` on the same
arguments launches the kept plan directly, with no Triton argument binding, once it has seen
that every tensor still has the sizes, strides and address the arguments were checked with
(`GemmArguments.current`): a tensor resized since is refused, one whose memory moved is checked
again and planned anew. What that does not see, writes into a tensor's memory through another
view, say, is the caller's to keep apart, as with any kernel.

`compile(args)` also takes arguments of fake or meta tensors (planning stand-ins): Triton
specializes the launch on their dtypes and on the alignment their storage offsets give, and
the real tensors' run finds the compiled kernel. `run` refuses stand-ins.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from ... import verify as verification
from ...arguments import check_real
from ...grouped_arguments import check_arguments
from ...errors import UnsupportedError
from ...ir import fed_reductions
from ...runtime import compiled as compiled_index
from ...shapes import is_stand_in, misalignment
from ..base import Kernel, Status, supported, supported_before, unsupported
from . import configs
from . import device as target
from . import plan as plans
from . import source
from .families import Family, common_check, in_tile_check, in_tile_note
from .launch import direct_launcher
from .layout import launch_layout

# A smaller config after an out-of-resources failure, by (family, graph key, config).
_FALLBACK: dict = {}
_FALLBACK_LOCK = threading.Lock()
# Launch layouts by bound graph: they hold the user's names, so they are kept per Graph.
_LAYOUTS: dict = {}


class TritonKernel(Kernel):
    """A generated GEMM: `family` (families.py) with `config` (configs.py)."""

    def __init__(self, family: Family, config: configs.TileConfig):
        self.family, self.config = family, config
        self.name = family.name
        self.gluon = family.gluon

    def __repr__(self) -> str:
        return f"<{self.name} {self.config}>"

    # ---- support ---------------------------------------------------------------------------
    def supports(self, args, cc: int | None = None) -> Status:
        # the Gluon and grouped checks ask their own questions first (a Hopper GPU; each group)
        refusal = None if self.family.gluon or self.family.grouped else common_check(args, cc)
        if refusal is None and args.form != self.family.form:
            refusal = unsupported(f"{args.form} GEMMs run in the {args.form} kernel only (triton_{args.form})"
                                  if self.family.form == "real" else f"this kernel runs {self.family.form} GEMMs only")
        if refusal is None:  # (a refusal is a Status, which is falsy)
            refusal = self.family.check(args, self.config, cc)
        if refusal is None:
            refusal = in_tile_check(self.family, args, self.config_for(args))
        if refusal is not None:
            return refusal
        return supported(self.family.describe(args, self.config) + in_tile_note(args))

    def config_for(self, args) -> configs.TileConfig:
        """The config a launch for `args` uses: the interpreter's small tiles (as wide as N
        where a reduction over N feeds later math), a smaller fallback after an
        out-of-resources failure, or this kernel's own."""
        if self.family.interpreter_config is not None and target.uses_interpreter(_device(args)):
            return interpreter_config(self.family.interpreter_config, args)
        return _FALLBACK.get((self.family.name, args.key, self.config), self.config)

    def source(self, args, target_name: str = "cuda") -> str:
        """The generated module source this kernel runs for `args` on `target_name` ("cuda" or
        "interpret"): what to read when a kernel misbehaves."""
        config = self.config_for(args)
        spec = self.family.spec(config)
        if self.family.grouped:  # the source depends on the groups' table
            spec = self.family.launch(args, config, _layout(args.graph, args.deterministic)).spec
        return source.render(spec, args.graph, args.key, target_name, args.deterministic)

    # ---- plans -----------------------------------------------------------------------------
    def plan(self, args, cuda: bool = False) -> plans.Plan:
        """The launch plan of `args`, built once and kept on it. `cuda` renders the CUDA source
        whatever device the tensors are on (an offline compile of CPU stand-ins)."""
        kept = args.__dict__.setdefault("_plans", {})
        plan = kept.get(self)
        if plan is None:
            plan = kept[self] = self._build(args, cuda)
        return plan

    def _build(self, args, cuda: bool) -> plans.Plan:
        family, config = self.family, self.config_for(args)
        layout = _layout(args.graph, args.deterministic)
        launch = family.launch(args, config, layout)
        target_name = "cuda" if cuda or not target.uses_interpreter(_device(args)) else "interpret"
        jit = source.module(launch.spec or family.spec(config), args.graph, args.key, target_name,
                            args.deterministic).epifuse_kernel
        named = dict(launch.values)
        if launch.problems is not None:   # the groups of a grouped GEMM
            problems, first = launch.problems, args.problems[0]
            empty = launch.grid[0] == 0
        else:
            first = args
            buffers, finish = plans.reduction_buffers(args, layout, config, family.pieces(config))
            named.update(plans.epilogue_values(args, layout, buffers))
            empty = 0 in (args.M, args.N, args.L)
        meta = {**launch.meta, **plans.conversion_meta(layout, first.outputs)}
        zeroed, words = frozenset(), None
        outputs = source.zeroable(layout) if (launch.spec or family.spec(config)).zeroes else []
        if outputs:
            # nothing is launched for an empty problem: the launch before it zeroes then
            zeroed = frozenset(y.name for y in outputs if not empty and plans.zeroed_in_kernel(args, y))
            named.update(plans.zeroing_values(args, outputs, plans.arrivals(launch.grid, family.consumers)))
            meta.update(ANY_ZERO=bool(zeroed), **{f"{y.prefix.upper()}_ZERO": y.name in zeroed for y in outputs})
        names = plans.runtime_parameters(jit)
        if outputs:
            # the words are passed also where ANY_ZERO is False and the kernel never reads them
            words = plans.ZeroingWords(names.index("sync_ptr"), args.A.device)
            named["sync_ptr"] = words.first
        if launch.problems is None:
            problems = [plans.problem(args, layout, buffers, finish, zeroed)]
        values = plans.ordered(jit, named)
        convert = launch.converter(names) if launch.converter is not None else None
        owned = (*launch.owned, *((words.first,) if words is not None else ()))
        return plans.Plan(jit, layout, problems, values, meta, launch.grid, empty, convert, words, owned)

    # ---- compile and run -----------------------------------------------------------------------
    def compile(self, args) -> None:
        """Compile the kernel for `args` (stand-ins too) and load it onto the GPU. Compiling
        ahead (runtime/ahead.py) uses compile_job, which loads nothing onto the GPU: another
        thread's CUDA graph capture would not allow it; the first run loads it."""
        check_arguments(self, args, grouped=self.family.grouped)
        with target.on_device(_device(args)):
            self._loaded(args, self.plan(args))

    def compile_job(self, args):
        """The plan built in this thread (its buffers allocated on this thread's stream, the JIT
        function's per-device cache made here: Triton makes it on first use, and threads making
        it at once would each get one of their own); returns the compile and the launcher build,
        loading nothing onto the GPU, as a callable for any thread, or None where nothing is
        compiled (an empty problem, the interpreter)."""
        check_arguments(self, args, grouped=self.family.grouped)
        device = _device(args)
        with target.on_device(device):
            plan = self.plan(args)
            if plan.empty or target.uses_interpreter(device):
                return None
            values = plan.jit_values(self._warmup_values(args, plan))
            compiled_index.bind(plan.kernel)

        def job() -> None:
            with target.on_device(device):
                compiled_index.prepare(plan.kernel, values, plan.grid, plan.meta)
        return job

    def run(self, args, verify: bool = False) -> None:
        """Write every output of `args`. `verify=True` also checks them against the float64
        reference and raises epifuse.verify.VerificationError with the largest error."""
        if verify:
            run_verified = verification.run_grouped if self.family.grouped else verification.run
            return run_verified(self, args)
        plan = getattr(args, "_plans", {}).get(self)
        if plan is not None and plan.fast is not None and plan.simple and args.current():
            plan.fast()  # the common repeated call: nothing but the launch
            return
        check_arguments(self, args, grouped=self.family.grouped)
        check_real(args)
        if args.check_current():  # a tensor's memory moved: its plans (dropped) held the old addresses
            plan = None
        with target.on_device(_device(args)):
            plan = plan or self.plan(args)
            if not plan.checked:
                self._check_supported(args)
                plan.checked = True
            plan = self._loaded(args, plan)
            for p in plan.problems:
                p.before(p.args.outputs)
            if not plan.empty:
                self._launch(args, plan)
            for p in plan.problems:
                p.after(p.args.outputs)

    def _check_supported(self, args) -> None:
        """An UnsupportedError where `args` is not what this kernel was offered for (a kernel
        chosen for other arguments, or for fake tensors whose real ones differ)."""
        if supported_before(args, self):
            return
        status = self.supports(args)
        if not status:
            raise UnsupportedError(f"{self!r} does not support these arguments: {status.reason}.",
                                   hint="Run a kernel that epifuse.get_kernels(args) returns for them.")

    def _loaded(self, args, plan: plans.Plan) -> plans.Plan:
        """`plan`, or the plan of a smaller config, whose kernel is compiled and loaded: a config
        that needs more shared memory than the GPU has fails here, before any output or buffer
        is touched, so what run() initializes and finishes belongs to the plan it launches."""
        if plan.loaded or plan.empty or target.uses_interpreter(_device(args)):
            return plan
        while True:
            values = self._warmup_values(args, plan)
            compiled = compiled_index.warmup(plan.kernel, plan.jit_values(values), plan.grid, plan.meta)
            try:
                getattr(compiled, "_init_handles", lambda: None)()  # where Triton checks resources
            except _out_of_resources():
                plan = self._smaller_plan(args)
                if plan is None:
                    raise
                continue
            plan.loaded = True
            return plan

    @staticmethod
    def _warmup_values(args, plan: plans.Plan) -> list:
        """The plan's argument values as Triton's specialization reads them: a stand-in (a StandIn,
        a fake or a meta tensor) as the address of the alignment its real tensor would have."""
        if not getattr(args, "stand_in", False):
            return plan.values
        return [_Address(v) if isinstance(v, torch.Tensor) and is_stand_in(v) else v for v in plan.values]

    def _smaller_plan(self, args) -> plans.Plan | None:
        """After an out-of-resources failure: remember the next smaller config for these
        arguments and return its plan, or None when there is none."""
        smaller = configs.smaller(self.config_for(args), keep_n=bool(fed_reductions(args.graph)))
        if smaller is None:
            return None
        with _FALLBACK_LOCK:
            _FALLBACK[(self.family.name, args.key, self.config)] = smaller
        args._plans.pop(self, None)
        return self.plan(args)

    def _launch(self, args, plan: plans.Plan) -> None:
        """Launch a loaded plan: its first launch goes through Triton, which also yields the
        compiled kernel for the direct launches after it."""
        if plan.fast is not None:
            plan.fast()
            return
        device = _device(args)
        interpret = target.uses_interpreter(device)
        before = self.family.before_launch
        if before is not None and not interpret:
            before()
        values = plan.values
        if plan.sync is not None and not interpret:
            values = plan.sync.values_for(values, torch._C._cuda_getCurrentRawStream(device.index),
                                          target.capturing(device))
        with target.INTERPRETER_LOCK if interpret else contextlib.nullcontext():
            compiled = plan.kernel[plan.grid](*plan.jit_values(values), **plan.meta)
        if interpret:
            plan.launch_with = plans.interpreted_launcher(plan)
        else:
            plan.fast = direct_launcher(plan, compiled, device.index or 0, before)


class _Address:
    """What Triton's specialization reads of a tensor argument, for a stand-in with no memory:
    its dtype and an address of the alignment the real tensor of its metadata has."""

    def __init__(self, t: torch.Tensor):
        self.dtype, self.shape, self._strides = t.dtype, tuple(t.shape), t.stride()
        self._address = (1 << 20) + misalignment(t)

    def data_ptr(self) -> int:
        return self._address

    def stride(self, dim: int | None = None):
        return self._strides if dim is None else self._strides[dim]

    def element_size(self) -> int:
        return self.dtype.itemsize


def interpreter_config(config: configs.TileConfig, args) -> configs.TileConfig:
    """`config` as the interpreter runs it for `args`: tiles as wide as N where a reduction over
    N feeds later math (and N fits one tile), so the in-tile reduction is what runs there too."""
    grouped = hasattr(args, "problems")
    return configs.spanning(config, args.N) if not grouped and fed_reductions(args.graph) else config


def _device(args) -> torch.device:
    return args.device if hasattr(args, "problems") else args.A.device


def _layout(graph, deterministic: bool):
    entry = _LAYOUTS.get((id(graph), deterministic))
    if entry is None or entry[0] is not graph:
        entry = _LAYOUTS[(id(graph), deterministic)] = (graph, launch_layout(graph, deterministic))
    return entry[1]


def _out_of_resources() -> type:
    """Triton's error for a config that needs more shared memory or registers than the GPU has
    (imported here: Triton is loaded once a kernel is built, not with epifuse)."""
    from triton.runtime.errors import OutOfResources
    return OutOfResources


__all__ = ["TritonKernel"]

