"""Two-process workers for tests/unit/test_distributed.py (torch.distributed with gloo on CPU):
a small MLP of FusedLinear layers under tensor parallelism or FSDP2 against the same MLP of
nn.Linear + activation, trained a few steps side by side on every rank. A worker raises on a
mismatch; torch.multiprocessing.spawn raises it in the test. Smaller workers check single
layers: what tensor parallelism refuses, col() and row(), autocast and dtypes, and epilogues
with two outputs."""
from __future__ import annotations

import copy
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

STEPS = 3


def _start(rank: int, world: int, port: int, interpreter: bool):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if interpreter:
        os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (world,))


def _finish():
    """Leave the process group once every rank is done. The barrier waits (without the GIL) for
    this rank's collectives too: gloo's threads free a finished collective's tensors, which
    needs the GIL, and a thread that asks for it once Python is finalizing aborts the process."""
    dist.barrier()
    dist.destroy_process_group()


def _models(dtype):
    import epifuse.nn
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 8), nn.ReLU()).to(dtype)
    fused = nn.Sequential(epifuse.nn.FusedLinear.from_linear(copy.deepcopy(ref[0]), "gelu_tanh"),
                          epifuse.nn.FusedLinear.from_linear(copy.deepcopy(ref[2]), "relu"))
    return ref, fused


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train_side_by_side(ref, fused, dtype, tol, rank):
    """STEPS of SGD on both models with the same inputs (a fresh draw each step, the same on
    every rank); loss, gradients and parameters must agree within `tol` (relative)."""
    opt = torch.optim.SGD(fused.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(STEPS):
        x = torch.randn(12, 16, generator=torch.Generator().manual_seed(100 + step)).to(dtype)
        out = fused(x)
        out = _full(out)
        loss = out.square().mean()
        loss.backward()
        expected = ref(x).square().mean()
        expected.backward()
        assert torch.allclose(loss, expected, rtol=tol, atol=tol), (rank, step, float(loss), float(expected))
        for (name, p), (_, q) in zip(fused.named_parameters(), ref.named_parameters()):
            grad = _full(p.grad)
            assert torch.allclose(grad, q.grad, rtol=tol, atol=tol * float(q.grad.abs().max())), \
                (rank, step, name, float((grad - q.grad).abs().max()))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for (name, p), (_, q) in zip(fused.named_parameters(), ref.named_parameters()):
        assert torch.allclose(_full(p.detach()), q.detach(), rtol=tol, atol=tol), (rank, name)


def tensor_parallel(rank, world, port, interpreter, dtype, seed):
    """up: ColwiseParallel (GELU on each rank's columns); down: RowwiseParallel (ReLU after the
    all-reduce)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = _start(rank, world, port, interpreter)
    ref, fused = _models(dtype)
    parallelize_module(fused, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    assert type(fused[0].weight).__name__ == "DTensor"
    _train_side_by_side(ref, fused, dtype, 1e-10 if dtype == torch.float64 else 2e-5, rank)
    _finish()


def fsdp2(rank, world, port, interpreter, dtype, seed):
    """fully_shard on each FusedLinear and on the model (from fuse_linear_activations)."""
    import epifuse.nn
    from torch.distributed.fsdp import fully_shard
    mesh = _start(rank, world, port, interpreter)
    ref, _ = _models(dtype)
    fused = epifuse.nn.fuse_linear_activations(copy.deepcopy(ref))
    for layer in fused:
        if isinstance(layer, epifuse.nn.FusedLinear):
            fully_shard(layer, mesh=mesh)
    fully_shard(fused, mesh=mesh)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*returned a view tensor.*")   # FSDP's hooks see our outputs
        _train_side_by_side(ref, fused, dtype, 1e-10 if dtype == torch.float64 else 2e-5, rank)
    _finish()


def refusals(rank, world, port, interpreter, dtype, seed):
    """What tensor parallelism cannot run yet is refused by name, on every rank."""
    import epifuse.nn
    from epifuse.errors import UnsupportedError
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = _start(rank, world, port, interpreter)
    summed = "def rowsum(accum, bias):\n    D = accum + bias\n    r = sum(D, dim=1)\n    return D, r\n"
    model = nn.Sequential(epifuse.nn.FusedLinear(16, 32, epilogue=summed).to(dtype))
    parallelize_module(model, mesh, {"0": ColwiseParallel()})
    x = torch.randn(4, 16, dtype=dtype)
    try:
        model(x)
    except UnsupportedError as error:
        assert "reduces across columns (r)" in str(error), error
    else:
        raise AssertionError("a column-parallel row sum ran")
    scaled = "def scaled(accum, C):\n    D = accum * C\n    return D\n"
    model = nn.Sequential(epifuse.nn.FusedLinear(16, 8, bias=False, epilogue=scaled).to(dtype))
    parallelize_module(model, mesh, {"0": RowwiseParallel()})
    try:
        model[0](x[:, 8 * rank:8 * rank + 8], C=torch.ones(4, 8, dtype=dtype))   # a row-parallel layer takes its shard of x
    except UnsupportedError as error:
        assert "takes no tensor operands yet (got C)" in str(error), error
    else:
        raise AssertionError("a tensor operand ran under tensor parallelism")
    _finish()


def _refused(call, words: str):
    """`call()` must raise epifuse's UnsupportedError naming `words`."""
    from epifuse.errors import UnsupportedError
    try:
        call()
    except UnsupportedError as error:
        assert words in str(error), error
    else:
        raise AssertionError(f"ran, but should have been refused with {words!r}")


def _linear_pair(out_features: int, epilogue: str, dtype, seed: int, bias: bool = True):
    """An nn.Linear and a FusedLinear with the same parameters, the same on every rank (the
    FusedLinear in an nn.Sequential, as parallelize_module takes it)."""
    import epifuse.nn
    torch.manual_seed(seed)
    ref = nn.Linear(16, out_features, bias=bias).to(dtype)
    return ref, nn.Sequential(epifuse.nn.FusedLinear.from_linear(copy.deepcopy(ref), epilogue))


def _x(rows: int, dtype, seed: int):
    """The same random input on every rank, fresh in each test run (`seed` is drawn by the test)."""
    return torch.randn(rows, 16, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)   # not the parameters' draws


def column_index(rank, world, port, interpreter, dtype, seed):
    """col() is the global column index: a column-parallel layer would count each rank's
    columns from 0, so it is refused there; a row-parallel layer sees every column. row() is
    exact on both (every rank has all rows)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = _start(rank, world, port, interpreter)
    x = _x(6, dtype, seed)
    rows = torch.arange(6, dtype=dtype)[:, None]
    ref, fused = _linear_pair(32, "def by_col(accum):\n    D = relu(accum) + col()\n    return D\n", dtype, seed)
    parallelize_module(fused, mesh, {"0": ColwiseParallel(use_local_output=False)})
    _refused(lambda: fused(x), "reads col(), the global column index")
    ref, fused = _linear_pair(32, "def by_row(accum):\n    D = relu(accum) + 0.5 * row()\n    return D\n", dtype, seed)
    parallelize_module(fused, mesh, {"0": ColwiseParallel(use_local_output=False)})
    y, expected = _full(fused(x)), torch.relu(ref(x)) + 0.5 * rows
    assert torch.allclose(y, expected, rtol=1e-12, atol=1e-12), (rank, float((y - expected).abs().max()))
    ref, fused = _linear_pair(8, "def by_col(accum):\n    D = relu(accum) + col() - 2.0 * row()\n    return D\n", dtype, seed)
    parallelize_module(fused, mesh, {"0": RowwiseParallel()})
    y = _full(fused(x[:, 8 * rank:8 * rank + 8]))
    expected = torch.relu(ref(x)) + torch.arange(8, dtype=dtype) - 2.0 * rows
    assert torch.allclose(y, expected, rtol=1e-12, atol=1e-12), (rank, float((y - expected).abs().max()))
    _finish()


def autocast(rank, world, port, interpreter, dtype, seed):
    """The MLP of tensor_parallel (a float32 model) under bf16 autocast: both layers return
    bf16 as nn.Linear does (the row-parallel one casts x and W as the unsharded layer), with
    bf16's error; gradients likewise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = _start(rank, world, port, interpreter)
    ref, fused = _models(torch.float32)
    parallelize_module(fused, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    x = _x(12, torch.float32, seed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden, expected_hidden = fused[0](x), ref[1](ref[0](x))[:, 16 * rank:16 * rank + 16]   # this rank's columns
        out, expected = _full(fused(x)), ref(x)
    for got, want in ((hidden, expected_hidden), (out, expected)):
        assert want.dtype == torch.bfloat16 and got.dtype == want.dtype, (rank, got.dtype, want.dtype)
        assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2), \
            (rank, float((got.float() - want.float()).abs().max()))
    out.float().square().mean().backward()
    expected.float().square().mean().backward()
    for (name, p), (_, q) in zip(fused.named_parameters(), ref.named_parameters()):
        grad = _full(p.grad)
        assert grad.dtype == q.grad.dtype, (rank, name, grad.dtype, q.grad.dtype)
        assert torch.allclose(grad, q.grad, rtol=5e-2, atol=5e-2 * float(q.grad.abs().max())), \
            (rank, name, float((grad - q.grad).abs().max()))
    _finish()


def row_parallel_dtypes(rank, world, port, interpreter, dtype, seed):
    """A float64 layer given float32 x (no autocast): a row-parallel layer returns what the
    unsharded FusedLinear does, x's dtype, computed in float64."""
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
    mesh = _start(rank, world, port, interpreter)
    ref, fused = _linear_pair(8, "relu", torch.float64, seed)
    unsharded = copy.deepcopy(fused[0])
    parallelize_module(fused, mesh, {"0": RowwiseParallel()})
    x = _x(12, torch.float32, seed)
    y, whole = _full(fused(x[:, 8 * rank:8 * rank + 8])), unsharded(x)
    assert whole.dtype == torch.float32 and y.dtype == whole.dtype, (rank, y.dtype, whole.dtype)
    expected = torch.relu(ref(x.double()))
    assert torch.allclose(y.double(), expected, rtol=1e-6, atol=1e-6), (rank, float((y - expected).abs().max()))
    _finish()


def multiple_outputs(rank, world, port, interpreter, dtype, seed):
    """torch's ColwiseParallel and RowwiseParallel lay out one output tensor: an epilogue with
    two is refused on a sharded weight, and still runs under FSDP2."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = _start(rank, world, port, interpreter)
    x = _x(6, dtype, seed)
    two_tiles = "def two(accum):\n    D = relu(accum)\n    E = accum * 2.0\n    return D, E\n"
    _, fused = _linear_pair(32, two_tiles, dtype, seed)
    parallelize_module(fused, mesh, {"0": ColwiseParallel()})
    _refused(lambda: fused(x), "returns 2 outputs (D, E); torch's tensor-parallel styles")
    tile_and_sum = "def tile_and_sum(accum):\n    D = relu(accum)\n    r = sum(D, dim=1)\n    return D, r\n"
    _, fused = _linear_pair(8, tile_and_sum, dtype, seed)
    parallelize_module(fused, mesh, {"0": RowwiseParallel()})
    _refused(lambda: fused(x[:, 8 * rank:8 * rank + 8]), "returns 2 outputs (D, r); torch's tensor-parallel styles")
    ref, fused = _linear_pair(8, tile_and_sum, dtype, seed)
    fully_shard(fused[0], mesh=mesh)
    D, r = fused(x)
    expected = torch.relu(ref(x))
    assert torch.allclose(D, expected, rtol=1e-12, atol=1e-12), (rank, float((D - expected).abs().max()))
    assert torch.allclose(r, expected.sum(1), rtol=1e-12, atol=1e-12), (rank, float((r - expected.sum(1)).abs().max()))
    _finish()
