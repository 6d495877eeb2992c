"""epifuse under torch.distributed on two GPUs (marker `gpu`; skipped below two): NCCL runs of
the workers tests/unit/test_distributed.py runs with gloo on the CPU (tests/distributed_worker.py),
at real sizes, each under torchrun in fresh processes:

- tensor parallelism (ColwiseParallel up with GELU, RowwiseParallel down with ReLU) and FSDP2
  (fully_shard per FusedLinear and on the model), an MLP 1024 -> 4096 -> 1024 on 2048 tokens,
  trained 3 SGD steps side by side with nn.Linear + activation: loss, gradients and parameters
  within the dtype's tolerance (distributed_worker.tolerance);
- epifuse.gemm on DTensors split along M, N, K and L (epifuse.sharding's rules), values against
  float64 torch on the full tensors, placements, gradients; and what the rules refuse.

    pytest -m gpu tests/gpu/test_distributed_gpu.py

runs `python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed_worker.py
<worker> --dtype <dtype> --size large` once per case.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

WORKER = Path(__file__).resolve().parents[1] / "distributed_worker.py"


def _torchrun(worker: str, dtype: str, size: str = "large"):
    seed = int(torch.randint(2**31, ()))   # from the test's seed (conftest), which a failure prints
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(WORKER), worker, "--dtype", dtype, "--size", size, "--seed", str(seed)]
    # NVLink multicast stays off on the GPU machines (../shared/GPU.md), in torchrun's children too
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           **os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, f"{' '.join(command)}\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}"
    assert f"{worker} passed on 2 ranks (nccl, {dtype}, {size})" in out.stdout, out.stdout[-2000:]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("worker", ["tensor_parallel", "fsdp2"])
def test_mlp_trains_as_nn_linear_on_two_gpus(worker, dtype):
    _torchrun(worker, dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_ops_on_dtensors_on_two_gpus(dtype):
    _torchrun("op_sharding", dtype)


def test_op_refusals_on_two_gpus():
    _torchrun("op_refusals", "float32")
