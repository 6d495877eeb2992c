"""The direct launch path (backends/triton/launch.py): the TMA descriptors a kept launch
passes, on the CPU against Triton's own descriptor wrapper, and on the GPU by what is encoded
and computed."""
from __future__ import annotations

import pytest
import torch

import epifuse
from epifuse.backends.triton.launch import described_launcher
from epifuse.errors import ShapeError
from epifuse.backends.triton.gluon_api import Described as _Described
from helpers import integer_tensor, reference_outputs
from test_gluon import AUX, _args, _check, _gpu_kernel, _problem


def test_described_launcher_passes_what_tritons_wrapper_would(monkeypatch):
    """On the CPU, with Triton's own descriptor wrapper around a recording launcher: the kept
    launch finds Triton's launcher and metadata in the wrapper, passes it exactly the arguments
    the wrapper would, given the plan's values, and encodes each descriptor once per address
    (a plan's descriptor shapes and strides are fixed; another plan keeps its own).
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
    square = ((0, [64, 64], [64, 1]), (2, [64, 64], [64, 1]))   # a plan's descriptors: position, shape, strides
    launch = described_launcher(Compiled, square)
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
        launch((2, 1, 1), 0, "function", "packed", [x, 7, y], [128])
        assert calls.pop() == through_triton
    assert encoded == [(y.data_ptr(), (64, 64)), (x.data_ptr(), (64, 64))] or \
        encoded == [(x.data_ptr(), (64, 64)), (y.data_ptr(), (64, 64))]
    launch((2, 1, 1), 0, "function", "packed", [z, 7, y], [128])
    assert encoded[2:] == [(z.data_ptr(), (64, 64))]
    # another plan of the kernel (its descriptors of another shape) keeps encodings of its own
    wide = described_launcher(Compiled, ((0, [32, 64], [64, 1]), (2, [64, 64], [64, 1])))
    wide((2, 1, 1), 0, "function", "packed", [x, 7, y], [128])
    assert (x.data_ptr(), (32, 64)) in encoded[3:]
    first_argument = list(calls[-1][-1])[0] if in_cpp else calls[-1][13]
    assert first_argument == ("tensor map", x.data_ptr(), (32, 64), 0)
    encoded.clear()  # one tensor as both descriptors: each argument's metadata gets its own encoding
    launch((2, 1, 1), 0, "function", "packed", [z, 7, z], [128])
    maps = [a for a in (list(calls[-1][-1]) if in_cpp else calls[-1][13:]) if isinstance(a, tuple)]
    assert [m[3] for m in maps] == [0, 1], maps
    # descriptors other than the kernel's (too few, or at other positions): no direct launch
    # (Triton's own launch then)
    assert described_launcher(Compiled, ((0, [64, 64], [64, 1]),)) is None
    assert described_launcher(Compiled, ((0, [64, 64], [64, 1]), (1, [64, 64], [64, 1]))) is None


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


# ---- arguments whose tensors changed after they were checked ------------------------------------

RESIZE_SRC = "def epi(accum, bias):\n    D = accum + bias\n    r = sum(D, dim=1)\n    return D, r\n"


def _resize_problem(device):
    A = integer_tensor(40, 24, dtype=torch.float32, device=device)
    B = integer_tensor(24, 36, dtype=torch.float32, device=device)
    bias = integer_tensor(36, dtype=torch.float32, device=device)
    D, r = torch.empty(40, 36, device=device), torch.empty(40, device=device)
    args = epifuse.GemmArguments(A, B, epilogue=epifuse.EpilogueArguments(RESIZE_SRC, bias=bias, D=D, r=r))
    return args


def _expected(args):
    D = args.A.double() @ args.B.double() + args.operands["bias"].double()
    return {"D": D, "r": D.sum(1)}


def _resize(args, name, shape):
    tensor = {"A": args.A, "B": args.B, "bias": args.operands["bias"], **args.outputs}[name]
    tensor.resize_(shape)


@pytest.mark.parametrize("name, shape", [("A", (20, 24)), ("A", (40, 12)), ("B", (24, 18)), ("bias", (5,)),
                                         ("D", (20, 36)), ("D", (40, 40)), ("r", (10,))])
def test_a_resized_tensor_is_refused_by_a_reused_run(name, shape, device):
    """kernel.run on arguments whose tensor was resized since they were built raises, with every
    output as it was, for every kernel (each already ran once on the arguments)."""
    args = _resize_problem(device)
    kernels = epifuse.get_kernels(args)
    for kernel in kernels:
        kernel.run(args)
    _resize(args, name, shape)
    for kernel in kernels:
        for dest in args.outputs.values():
            dest.fill_(7.0)
        with pytest.raises(ShapeError, match=f"has shape {tuple(shape)}".replace("(", r"\(").replace(")", r"\)")):
            kernel.run(args)
        assert all(bool((dest == 7.0).all()) for dest in args.outputs.values()), kernel


def test_a_tensor_in_new_memory_is_checked_again_and_read_there(device):
    """A tensor whose storage was freed (refused, no output touched) and given its size back (new
    memory, new values): the next run checks it again and computes with what it holds now."""
    args = _resize_problem(device)
    kernels = epifuse.get_kernels(args)
    for kernel in kernels:
        kernel.run(args)
    for t in (args.A, args.outputs["D"]):
        size = t.untyped_storage().nbytes()
        t.untyped_storage().resize_(0)
        for kernel in kernels:
            args.outputs["r"].fill_(7.0)
            with pytest.raises(ShapeError, match="storage holds 0 bytes"):
                kernel.run(args)
            assert bool((args.outputs["r"] == 7.0).all()), kernel
        t.untyped_storage().resize_(size)
        t.copy_(integer_tensor(*t.shape, dtype=t.dtype, device=device))
        for kernel in kernels:
            for dest in args.outputs.values():
                dest.fill_(float("nan"))
            kernel.run(args)
            expected = _expected(args)
            assert all(torch.equal(args.outputs[n].double(), expected[n]) for n in expected), kernel


def test_a_tensor_moved_onto_another_is_refused(device):
    """An output set_ onto memory that another tensor of the arguments holds, or onto memory of
    another 16-byte alignment, since the arguments were checked: refused when run."""
    args = _resize_problem(device)
    kernels = epifuse.get_kernels(args)
    for kernel in kernels:
        kernel.run(args)
    D, A = args.outputs["D"], args.A
    spare = torch.empty(40 * 36 + 1, device=device)
    D.set_(spare.untyped_storage(), 1, D.shape, D.stride())   # 4 bytes past the allocation's start
    for kernel in kernels:
        with pytest.raises(ShapeError, match="16-byte alignment"):
            kernel.run(args)
    big = torch.empty(40 * 36 + 40 * 24, device=device)
    big[:40 * 24].copy_(A.reshape(-1))
    A.set_(big.untyped_storage(), 0, A.shape, A.stride())
    D.set_(big.untyped_storage(), 40 * 20, D.shape, D.stride())   # overlaps A's last rows
    for kernel in kernels:
        with pytest.raises(ShapeError, match="Output D overlaps the GEMM input A"):
            kernel.run(args)


@pytest.mark.parametrize("name", ["A", "bias", "D"])
def test_a_tensor_given_another_dtype_is_refused(name, device):
    """`.data =` a tensor of another dtype with the same element size (and so maybe the same
    address and strides): the kernel was compiled for the old dtype and would read or write the
    new one's bits as the old one's. Refused when run, with every output as it was."""
    args = _resize_problem(device)
    kernels = epifuse.get_kernels(args)
    for kernel in kernels:
        kernel.run(args)
    tensor = {"A": args.A, "bias": args.operands["bias"], "D": args.outputs["D"]}[name]
    tensor.data = tensor.data.view(torch.int32)
    for kernel in kernels:
        for dest in args.outputs.values():
            dest.fill_(7)
        with pytest.raises(ShapeError, match="is torch.int32 on"):
            kernel.run(args)
        assert all(bool((dest == 7).all()) for dest in args.outputs.values()), kernel
