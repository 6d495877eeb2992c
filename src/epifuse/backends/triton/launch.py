"""The direct launch of a compiled kernel: the host-time fast path of a kept plan.

`direct_launcher` skips Triton's per-call argument binding and specialization (a plan's
arguments never change). Under it, `plain_launcher` calls Triton's compiled launcher without
the Python of Triton's launcher object (kernels without descriptors or scratch), and
`described_launcher` keeps the TMA descriptors Triton encoded for each tensor seen, instead
of encoding every descriptor at every launch. Both read how the installed Triton builds its
launcher (3.6 expands descriptors in Python, 3.9 in C++) and return None where it is built
otherwise: the caller then launches through Triton.
"""
from __future__ import annotations

import torch

from .gluon_api import Described

# encoded TMA descriptors kept per descriptor argument of a plan's launch (on Triton 3.9 the
# bound is shared: this many times the descriptor arguments, for all of them). Layers of one
# shape share a kept launch and so its plan: each layer's weight is another address for B's
# descriptor, and a model with more layers than the bound would re-encode it at every launch
# (all are dropped once the bound is reached). An encoding takes a few hundred bytes.
DESCRIPTORS_KEPT = 256


class _Kept:
    """Encodings by key, all dropped once `bound` are held."""

    __slots__ = ("bound", "items")

    def __init__(self, bound: int):
        self.bound, self.items = bound, {}

    def get(self, key):
        return self.items.get(key)

    def put(self, key, encoded):
        if len(self.items) >= self.bound:
            self.items.clear()
        self.items[key] = encoded
        return encoded


def direct_launcher(plan, compiled, device: int, before=None):
    """A launch of the already compiled kernel that skips Triton's per-call argument binding
    and specialization: the plan's arguments (and so their specialization) never change.
    Not used while Triton launch hooks (profilers) are installed."""
    from triton import knobs   # loaded by then: the kernel is compiled
    if compiled is None or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
        return None
    names = plan.kernel.arg_names
    constexprs = [plan.meta[n] for n in names[len(plan.values):]]
    grid = (*plan.grid, 1, 1)[:3]
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    raw_stream = torch._C._cuda_getCurrentRawStream  # what Triton's own launcher asks
    convert = plan.convert
    current_device = torch._C._cuda_getDevice
    # a kernel with host TMA descriptors: launched with the plan's values, its launcher
    # encoding the descriptors (None where it cannot: then Triton's launch, given stand-ins)
    described = None if convert is None else described_launcher(compiled, convert.descriptors)
    plain = None if convert is not None else plain_launcher(compiled)
    sync = plan.sync
    capturing = torch._C._cuda_isCurrentStreamCapturing

    def launch_with(values):
        if current_device() != device:  # the kernel is loaded on `device`: launch it there
            with torch.cuda.device(device):
                return launch_with(values)
        if before is not None:
            before()
        stream = raw_stream(device)
        if sync is not None:
            values = sync.values_for(values, stream, capturing())
        if described is not None:
            described(grid, stream, function, packed, values, constexprs)
        elif plain is not None:
            plain(grid, stream, function, packed, values, constexprs)
        else:
            if convert is not None:
                values = convert(values, False)
            run(grid[0], grid[1], grid[2], stream, function, packed, None, None, None,
                *values, *constexprs)
    plan.launch_with = launch_with
    values = list(plan.values)
    return lambda: launch_with(values)


def described_launcher(compiled, descriptors):
    """Triton's launch of `compiled`, a kernel with host TMA descriptor arguments, given the
    plan's values (tensors where the descriptors go: `descriptors` holds each one's position,
    shape and strides, as DescriptorConverter's), without encoding each descriptor anew at
    every launch as Triton's wrapper does (driver.wrap_handle_tensordesc: a
    cuTensorMapEncodeTiled per descriptor and a Python loop over every argument). It keeps, per
    argument, the encoding Triton's own make_tensordesc_arg made for each tensor address it has
    seen: a plan's descriptor shapes and strides never change, so the address is the key. None
    where the kernel has no host descriptors or needs launch scratch, its descriptors are not
    those given, or Triton's launcher is not built as this expects (the caller then launches
    through Triton)."""
    runner = compiled.run
    wrapper = getattr(runner, "launch", None)
    code, closure = getattr(wrapper, "__code__", None), getattr(wrapper, "__closure__", None)
    if code is None or not closure or getattr(runner, "global_scratch_size", 1) or \
            getattr(runner, "profile_scratch_size", 1):
        return None
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in closure)))
    if "relevant_paths" in cells:
        return _described_launcher_39(runner, cells, descriptors)
    raw, indices, metas = cells.get("launcher"), cells.get("tensordesc_indices"), cells.get("tensordesc_meta")
    if not callable(raw) or not indices or not metas or None in metas or len(metas) != len(indices) or \
            sorted(indices) != sorted(i for i, _, _ in descriptors):
        return None
    try:  # function-local: a private Triton function that may be missing
        from triton.backends.nvidia.driver import make_tensordesc_arg
    except ImportError:
        return None
    meta_of = dict(zip(sorted(indices), metas))
    # from the last position: splicing an encoding (several arguments) keeps earlier positions
    specs = []
    for i, shape, strides in sorted(descriptors, key=lambda d: d[0], reverse=True):
        kept = _Kept(DESCRIPTORS_KEPT)
        specs.append((i, kept.items, kept, meta_of[i], shape, strides))   # its dict read directly: no call
    cooperative, pdl = runner.launch_cooperative_grid, runner.launch_pdl

    def launch(grid, stream, function, packed, values, constexprs) -> None:
        args = [*values, *constexprs]
        for i, encodings, kept, meta, shape, strides in specs:
            t = args[i]
            address = t.data_ptr()
            encoded = encodings.get(address)
            if encoded is None:
                encoded = kept.put(address, make_tensordesc_arg(Described(t, shape, strides), meta))
            args[i:i + 1] = encoded
        raw(grid[0], grid[1], grid[2], stream, function, cooperative, pdl, None, None, packed, None, None, None,
            *args)
    return launch


def plain_launcher(compiled):
    """Triton's launch of `compiled`, a kernel without host TMA descriptors, scratch or GSan,
    calling the compiled launcher as CudaLauncher.__call__ would, without the Python of
    __call__ itself (its scratch allocators, which such a kernel does not use, and its
    argument repacking). None where the launcher or __call__ is not as Triton 3.5-3.6 or 3.9
    build them (the caller then launches through Triton)."""
    runner = compiled.run
    raw = getattr(runner, "launch", None)
    code = getattr(getattr(type(runner), "__call__", None), "__code__", None)
    # a Python function is Triton's descriptor wrapper, not the compiled launcher itself
    if raw is None or not callable(raw) or hasattr(raw, "__code__") or code is None or \
            getattr(runner, "global_scratch_size", 1) or getattr(runner, "profile_scratch_size", 1) or \
            getattr(runner, "gsan_enabled", False) or getattr(runner, "_tvmffi_host_launch", None) is not None:
        return None
    cooperative, pdl = getattr(runner, "launch_cooperative_grid", None), getattr(runner, "launch_pdl", None)
    if cooperative is None or pdl is None:
        return None
    annotations = getattr(runner, "arg_annotations", None)
    if code.co_argcount == 6 and annotations is None:   # 3.5-3.6: __call__(self, gridX, ..., function, *args)
        def launch(grid, stream, function, packed, values, constexprs) -> None:
            raw(grid[0], grid[1], grid[2], stream, function, cooperative, pdl, None, None, packed, None, None, None,
                *values, *constexprs)
        return launch
    if code.co_argcount == 10 and annotations is not None:   # 3.9: the hooks named, the arguments as a tuple
        kernel_signature = runner.kernel_signature

        def launch(grid, stream, function, packed, values, constexprs) -> None:
            raw(grid[0], grid[1], grid[2], stream, function, cooperative, pdl, packed, None, None, None, None, None,
                annotations, kernel_signature, (*values, *constexprs))
        return launch
    return None


def _described_launcher_39(runner, cells, descriptors):
    """described_launcher for Triton 3.9's wrapper (wrap_handle_tensordesc_impl), which expands
    the descriptors in C++ (make_tensordesc_args) through a Python encoder per descriptor: the
    same expansion, through an encoder that keeps what Triton's made per descriptor argument
    (its metadata) and address. None where the wrapper or the launcher is not as expected."""
    try:  # function-local: a private Triton function that may be missing
        from triton._C.libtriton import make_tensordesc_args
    except ImportError:
        return None
    raw, signature, paths, metas, encode = (cells.get(name) for name in (
        "launcher", "signature", "relevant_paths", "tensordesc_meta", "make_tensordesc_arg"))
    annotations, kernel_signature = getattr(runner, "arg_annotations", None), getattr(runner, "kernel_signature", None)
    if not callable(raw) or not callable(encode) or not metas or None in metas or kernel_signature is None or \
            getattr(runner, "gsan_enabled", True) or not isinstance(signature, tuple) or \
            any(meta.get("is_im2col") for meta in metas) or not isinstance(paths, dict) or \
            any(paths.values()) or sorted(paths) != sorted(i for i, _, _ in descriptors):
        return None   # descriptors nested in tuples, or not at the positions given
    kept = _Kept(DESCRIPTORS_KEPT * len(metas))

    def keep(arg, meta, base_args):   # arg: a Described of launch's, its shape and strides the plan's
        key = (id(meta), arg.base.data_ptr())
        return kept.get(key) or kept.put(key, encode(arg, meta, base_args))
    cooperative, pdl = runner.launch_cooperative_grid, runner.launch_pdl

    def launch(grid, stream, function, packed, values, constexprs) -> None:
        args = [*values, *constexprs]
        for i, shape, strides in descriptors:
            args[i] = Described(args[i], shape, strides)
        base = (grid[0], grid[1], grid[2], stream, function, cooperative, pdl, packed, None, None, None, None, None,
                annotations, kernel_signature)
        raw(*base, make_tensordesc_args(tuple(args), signature, paths, metas, base, keep))
    return launch


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is installed: a function, or (Triton >= 3.5) a HookChain
    object, which is always truthy, with functions in its `calls`."""
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else hook is not None
