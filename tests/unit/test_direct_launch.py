"""The direct launch's descriptor expansion (backends/triton/launch.py) for Triton 3.6's wrapper,
on a CPU with a stand-in runner: every descriptor argument is replaced, in place, by the
encoding Triton's make_tensordesc_arg gives it (kept per address: a plan's descriptor shapes
and strides are fixed), and every other argument passes as it is, in order."""
from types import SimpleNamespace

import pytest

from epifuse.backends.triton import launch


def _runner(indices, metas, launched):
    def raw(*call):
        launched.append(call)
    launcher, tensordesc_indices, tensordesc_meta = raw, indices, metas

    def wrapper(*args):   # Triton 3.6's launch closure: the cells described_launcher reads
        return launcher, tensordesc_indices, tensordesc_meta
    return SimpleNamespace(launch=wrapper, global_scratch_size=0, profile_scratch_size=0,
                           launch_cooperative_grid=False, launch_pdl=False)


class _Tensor:
    def __init__(self, address):
        self.data_ptr = lambda: address


@pytest.mark.parametrize("indices", [(1, 3), (0, 4), (2,)])
def test_descriptor_arguments_expand_in_place_and_are_encoded_once_per_address(indices, monkeypatch):
    import triton.backends.nvidia.driver as driver
    encoded = []

    def encode(arg, meta):
        encoded.append((arg.base.data_ptr(), meta))
        return [f"enc{arg.base.data_ptr()}:{meta}", f"extent{arg.shape[0]}"]
    monkeypatch.setattr(driver, "make_tensordesc_arg", encode)
    metas = [f"m{i}" for i in indices]
    launched = []
    descriptors = tuple((i, [8 + i, 16], [16, 1]) for i in indices)
    run = launch.described_launcher(SimpleNamespace(run=_runner(list(indices), metas, launched)), descriptors)
    assert run is not None

    def values_with(address):
        return [_Tensor(address + i) if i in indices else f"v{i}" for i in range(5)]

    def expected(address):
        out = []
        for i in range(5):
            out += [f"enc{address + i}:m{i}", f"extent{8 + i}"] if i in indices else [f"v{i}"]
        return [*out, "constexpr"]
    for address in (1000, 1000, 2000):
        run((4, 2, 1), "stream", "function", "packed", values_with(address), ["constexpr"])
        assert list(launched[-1][13:]) == expected(address)
        assert launched[-1][:4] == (4, 2, 1, "stream")
    assert len(encoded) == 2 * len(indices)   # the repeated addresses reused their encodings


def test_a_plan_cycling_through_many_layers_weights_encodes_each_once(monkeypatch):
    """Layers of one shape share a kept launch: each layer's weight is another address at the
    same descriptor position. Forty layers, three steps: each weight encoded once."""
    import triton.backends.nvidia.driver as driver
    encoded = []
    monkeypatch.setattr(driver, "make_tensordesc_arg", lambda arg, meta: encoded.append(arg.base.data_ptr()) or [1])
    run = launch.described_launcher(SimpleNamespace(run=_runner([1], ["m"], [])), ((1, [64, 64], [64, 1]),))
    weights = [_Tensor(4096 * (layer + 1)) for layer in range(40)]
    for _ in range(3):
        for weight in weights:
            run((1, 1, 1), "stream", "function", "packed", ["x", weight], [])
    assert sorted(encoded) == sorted(w.data_ptr() for w in weights)


class _Recorder:
    """Stands for Triton's compiled launcher (a C function: no __code__), recording each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.mark.parametrize("cooperative", [False, True])
def test_the_plain_launch_passes_what_tritons_launcher_object_would(cooperative, monkeypatch):
    """The installed Triton's own CudaLauncher.__call__ and plain_launcher hand the compiled
    launcher the same arguments, for a kernel without descriptors or scratch; a kernel with
    scratch, or a launcher that is a Python wrapper, is left to Triton."""
    import triton.runtime
    from triton.backends.nvidia.driver import CudaLauncher
    # 3.9's __call__ reads the active driver first (a CPU machine has none); it is not used
    # for a kernel without scratch
    monkeypatch.setattr(triton.runtime, "driver", SimpleNamespace(active=None))
    runner = CudaLauncher.__new__(CudaLauncher)
    runner.launch = _Recorder()
    runner.global_scratch_size = runner.profile_scratch_size = 0
    runner.global_scratch_align = runner.profile_scratch_align = 1
    runner.num_ctas, runner.launch_cooperative_grid, runner.launch_pdl = 1, cooperative, False
    runner.gsan_enabled = False
    if "arg_annotations" in CudaLauncher.__init__.__code__.co_names:   # 3.9 keeps these
        runner.arg_annotations, runner.kernel_signature = "annotations", "kernel signature"
    compiled = SimpleNamespace(run=runner)
    plain = launch.plain_launcher(compiled)
    assert plain is not None, "this Triton's CudaLauncher is not one plain_launcher knows"
    values, constexprs = [7, "pointer", 3.5], [64, 128]
    CudaLauncher.__call__(runner, 4, 2, 1, "stream", "function", "packed", None, None, None, *values, *constexprs)
    plain((4, 2, 1), "stream", "function", "packed", values, constexprs)
    through_triton, direct = runner.launch.calls
    assert direct == through_triton
    runner.global_scratch_size = 64
    assert launch.plain_launcher(compiled) is None
    runner.global_scratch_size, runner.launch = 0, lambda *args: None
    assert launch.plain_launcher(compiled) is None
