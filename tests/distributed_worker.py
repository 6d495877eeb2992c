"""Two-process workers for tests/unit/test_distributed.py (torch.distributed with gloo on CPU):
a small MLP of FusedLinear layers under tensor parallelism or FSDP2 against the same MLP of
nn.Linear + activation, trained a few steps side by side on every rank. A worker raises on a
mismatch; torch.multiprocessing.spawn raises it in the test."""
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


def tensor_parallel(rank, world, port, interpreter, dtype):
    """up: ColwiseParallel (GELU on each rank's columns); down: RowwiseParallel (ReLU after the
    all-reduce)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = _start(rank, world, port, interpreter)
    ref, fused = _models(dtype)
    parallelize_module(fused, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    assert type(fused[0].weight).__name__ == "DTensor"
    _train_side_by_side(ref, fused, dtype, 1e-10 if dtype == torch.float64 else 2e-5, rank)
    dist.destroy_process_group()


def fsdp2(rank, world, port, interpreter, dtype):
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
    dist.destroy_process_group()


def refusals(rank, world, port, interpreter, dtype):
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
    dist.destroy_process_group()
