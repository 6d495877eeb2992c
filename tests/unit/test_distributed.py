"""epifuse under torch.distributed on CPU: two processes with the gloo backend train an MLP of
FusedLinear layers under tensor parallelism (ColwiseParallel up, RowwiseParallel down) and
under FSDP2, against the same MLP of nn.Linear + activation (tests/distributed_worker.py), and
check single layers: what tensor parallelism refuses (reductions across columns and col() on a
column-parallel layer, tensor operands, several outputs), autocast and output dtypes.
Without TRITON_INTERPRET the CPU runs epifuse's reference kernel; the interpreter runs the
Triton kernels (slow: marked so)."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import distributed_worker
import epifuse.nn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(worker, interpreter=False, dtype=torch.float64):
    seed = int(torch.randint(2**31, ()))   # from the test's seed (conftest), which a failure prints
    mp.spawn(worker, args=(2, _free_port(), interpreter, dtype, seed), nprocs=2, join=True)


def test_fused_linear_is_an_nn_linear_with_the_same_state():
    layer = epifuse.nn.FusedLinear(4, 3, epilogue="relu")
    assert isinstance(layer, nn.Linear)
    assert sorted(layer.state_dict()) == sorted(nn.Linear(4, 3).state_dict())
    assert "epilogue=relu" in repr(layer)


def test_tensor_parallel_trains_as_nn_linear():
    _spawn(distributed_worker.tensor_parallel)


@pytest.mark.slow   # two processes each (3 s): CI's slow run takes them
@pytest.mark.parametrize("worker", [
    distributed_worker.fsdp2,                 # trains as nn.Linear
    distributed_worker.refusals,              # what tensor parallelism cannot shard is refused
    distributed_worker.column_index,          # col() refused on column-parallel layers
    distributed_worker.autocast,              # tensor parallelism follows autocast
    distributed_worker.row_parallel_dtypes,   # row-parallel output dtype is the unsharded layer's
    distributed_worker.multiple_outputs,      # several outputs refused under torch's styles
], ids=lambda worker: worker.__name__)
def test_two_processes_on_the_reference_kernel(worker):
    _spawn(worker)


@pytest.mark.slow
@pytest.mark.parametrize("worker", [distributed_worker.tensor_parallel, distributed_worker.fsdp2],
                         ids=["tensor_parallel", "fsdp2"])
def test_the_interpreted_kernels_train_as_nn_linear(worker):
    _spawn(worker, interpreter=True, dtype=torch.float32)
