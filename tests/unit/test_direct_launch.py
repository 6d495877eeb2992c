"""The direct launch's descriptor expansion (backends/triton/launch.py) for Triton 3.6's wrapper,
on a CPU with a stand-in runner: every descriptor argument is replaced, in place, by the
encoding Triton's make_tensordesc_arg gives it (kept per base address, shape and strides), and
every other argument passes as it is, in order."""
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


class _Descriptor:
    def __init__(self, address, shape, strides):
        self.base = SimpleNamespace(data_ptr=lambda: address)
        self.shape, self.strides = shape, strides


@pytest.mark.parametrize("indices", [(1, 3), (0, 4), (2,)])
def test_descriptor_arguments_expand_in_place_and_are_encoded_once_per_layout(indices, monkeypatch):
    import triton.backends.nvidia.driver as driver
    encoded = []

    def encode(arg, meta):
        encoded.append((arg.base.data_ptr(), meta))
        return [f"enc{arg.base.data_ptr()}:{meta}", f"extent{arg.shape[0]}"]
    monkeypatch.setattr(driver, "make_tensordesc_arg", encode)
    metas = [f"m{i}" for i in indices]
    launched = []
    run = launch.described_launcher(SimpleNamespace(run=_runner(list(indices), metas, launched)))
    assert run is not None

    def args_with(address):
        return [_Descriptor(address + i, (8 + i, 16), (16, 1)) if i in indices else f"v{i}" for i in range(5)]

    def expected(address):
        out = []
        for i in range(5):
            out += [f"enc{address + i}:m{i}", f"extent{8 + i}"] if i in indices else [f"v{i}"]
        return out
    for address in (1000, 1000, 2000):
        run((4, 2, 1), "stream", "function", "packed", args_with(address))
        assert list(launched[-1][13:]) == expected(address)
        assert launched[-1][:4] == (4, 2, 1, "stream")
    assert len(encoded) == 2 * len(indices)   # the repeated layout reused its encodings
