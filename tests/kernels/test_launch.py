"""The direct launch path (backends/triton/launch.py): the TMA descriptors a kept launch
passes, on the CPU against Triton's own descriptor wrapper, and on the GPU by what is encoded
and computed."""
from __future__ import annotations

import pytest
import torch

from epifuse.backends.triton.launch import described_launcher
from epifuse.backends.triton.gluon_api import Described as _Described
from helpers import integer_tensor, reference_outputs
from test_gluon import AUX, _args, _check, _gpu_kernel, _problem


def test_described_launcher_passes_what_tritons_wrapper_would(monkeypatch):
    """On the CPU, with Triton's own descriptor wrapper around a recording launcher: the kept
    launch finds Triton's launcher and metadata in the wrapper, passes it exactly the arguments
    the wrapper would, and encodes each descriptor once per base address, shape and strides.
    Triton 3.6's wrapper expands the descriptors in Python; 3.9's in C++, with the launcher's
    argument annotations and kernel signature before the arguments."""
    from triton.backends.nvidia import driver
    encoded = []

    def encode(arg, meta, *base_args):
        encoded.append((arg.base.data_ptr(), tuple(arg.shape)))
        return [("tensor map", arg.base.data_ptr(), tuple(arg.shape), meta["n"]), *arg.shape, *arg.strides]
    monkeypatch.setattr(driver, "make_tensordesc_arg", encode)
    calls = []
    signature = {"a_desc": "tensordesc<fp16[64, 64]>", "M": "i32", "b_desc": "tensordesc<fp16[64, 64]>",
                 "BLOCK": "constexpr"}

    class Runner:  # what Triton's CudaLauncher keeps
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid = launch_pdl = gsan_enabled = False
        arg_annotations, kernel_signature = "annotations", "kernel signature"

        def __init__(self):
            self.launch = driver.wrap_handle_tensordesc(lambda *args: calls.append(args), signature,
                                                        [{"n": 0}, {"n": 1}])

    class Compiled:
        run = Runner()
    in_cpp = "relevant_paths" in Compiled.run.launch.__code__.co_freevars  # 3.9's wrapper
    launch = described_launcher(Compiled)
    assert launch is not None
    x, y, z = (torch.zeros(64, 64, dtype=torch.float16) for _ in range(3))
    args = [_Described(x, [64, 64], [64, 1]), 7, _Described(y, [64, 64], [64, 1]), 128]
    if in_cpp:  # as CudaLauncher.__call__ calls it
        Compiled.run.launch(2, 1, 1, 0, "function", False, False, "packed", None, None, None, None, None,
                            "annotations", "kernel signature", tuple(args))
    else:
        Compiled.run.launch(2, 1, 1, 0, "function", False, False, None, None, "packed", None, None, None, *args)
    through_triton = calls.pop()
    encoded.clear()
    for _ in range(3):
        launch((2, 1, 1), 0, "function", "packed", args)
        assert calls.pop() == through_triton
    assert encoded == [(x.data_ptr(), (64, 64)), (y.data_ptr(), (64, 64))]
    launch((2, 1, 1), 0, "function", "packed", [_Described(z, [64, 64], [64, 1]), 7, args[2], 128])
    launch((2, 1, 1), 0, "function", "packed", [_Described(x, [32, 64], [64, 1]), 7, args[2], 128])
    assert encoded[2:] == [(z.data_ptr(), (64, 64)), (x.data_ptr(), (32, 64))]
    first_argument = list(calls[-1][-1])[0] if in_cpp else calls[-1][13]
    assert first_argument == ("tensor map", x.data_ptr(), (32, 64), 0)
    encoded.clear()  # one tensor as both descriptors: each argument's metadata gets its own encoding
    both = _Described(z, [64, 64], [64, 1])
    launch((2, 1, 1), 0, "function", "packed", [both, 7, both, 128])
    maps = [a for a in (list(calls[-1][-1]) if in_cpp else calls[-1][13:]) if isinstance(a, tuple)]
    assert [m[3] for m in maps] == [0, 1], maps


@pytest.mark.gpu
def test_launches_encode_each_descriptor_once_per_tensor(monkeypatch):
    """Direct launches keep each TMA descriptor Triton encoded, per base address, shape and
    strides (launch.described_launcher): relaunching on the same tensors encodes nothing;
    tensors at new addresses are encoded once each and computed right; a second problem
    shape sharing the compiled kernel gets its own descriptors, not the first's."""
    import triton
    utils = triton.runtime.driver.active.utils  # each encoding calls its fill_tma_descriptor (3.9: _tiled)
    name = "fill_tma_descriptor_tiled" if hasattr(utils, "fill_tma_descriptor_tiled") else "fill_tma_descriptor"
    encoded = []
    real = getattr(utils, name)
    monkeypatch.setattr(utils, name, lambda *values: encoded.append(values[0]) or real(*values))
    M, N, K = 1000, 744, 520
    A, B, tensors = _problem(AUX, M, N, K, device="cuda")
    args = _args(AUX, A, B, **tensors)
    kernel = _gpu_kernel(args)
    kernel.compile(args)
    kernel.run(args)  # through Triton: it encodes every descriptor
    plan = args._plans[kernel]
    described = sum(v is not None for v in plan.values[-len(plan.layout.tile_slots()):]) + 2  # A, B
    encoded.clear()
    for _ in range(3):
        kernel.run(args)
    assert len(encoded) == described  # the first direct launch encodes; the next two reuse
    sets = []
    for _ in range(2):
        A2 = integer_tensor(M, K, device="cuda")
        C2 = integer_tensor(M, N, dtype=torch.float16, device="cuda")
        D2 = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float16)
        F2 = torch.full((M, N), float("nan"), device="cuda")
        sets.append((A2, C2, D2, F2))
    encoded.clear()
    for A2, C2, D2, F2 in sets * 2:
        D2.fill_(float("nan")), F2.fill_(float("nan"))
        swap = {id(A): A2, id(tensors["C"]): C2, id(tensors["D"]): D2, id(tensors["F"]): F2}
        plan.launch_with([swap.get(id(v), v) for v in plan.values])
        new = _args(AUX, A2, B, **dict(tensors, C=C2, D=D2, F=F2))
        torch.cuda.synchronize()
        _check(new, reference_outputs(new))
    assert len(encoded) == 2 * (described - 1)  # B is the same tensor in both sets
    A3, B3, tensors3 = _problem(AUX, 600, N, K, device="cuda")  # another M, the same kernel
    args3 = _args(AUX, A3, B3, **tensors3)
    kernel.run(args3)
    kernel.run(args3)
    torch.cuda.synchronize()
    _check(args3, reference_outputs(args3))
