"""epifuse under torch.distributed on CPU: two processes with the gloo backend train an MLP of
FusedLinear layers under tensor parallelism (ColwiseParallel up, RowwiseParallel down) and
under FSDP2, against the same MLP of nn.Linear + activation (tests/distributed_worker.py), and
check single layers: what tensor parallelism refuses (reductions across columns and col() on a
column-parallel layer, tensor operands, several outputs), autocast and output dtypes. DTensors
passed straight to epifuse.gemm run by epifuse.sharding's rules: the rules themselves are
checked here in one process, their values, placements, gradients and refusals in two.
Without TRITON_INTERPRET the CPU runs epifuse's reference kernel, as it does for float64
under the interpreter; the interpreter runs float32's Triton kernels (slow: marked so). The
torchrun entry of the GPU tests (tests/gpu/test_distributed_gpu.py) runs here with gloo."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import distributed_worker
import epifuse.nn
from distributed_worker import Run
from epifuse import sharding
from epifuse.arguments import epilogue_program
from epifuse.errors import UnsupportedError

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

TESTS = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(worker, interpreter=False, dtype=torch.float64):
    seed = int(torch.randint(2**31, ()))   # from the test's seed (conftest), which a failure prints
    run = Run(dtype, seed, "small", interpreter)
    mp.spawn(distributed_worker.spawned, args=(worker.__name__, 2, _free_port(), run), nprocs=2, join=True)


def test_fused_linear_is_an_nn_linear_with_the_same_state():
    layer = epifuse.nn.FusedLinear(4, 3, epilogue="relu")
    assert isinstance(layer, nn.Linear)
    assert sorted(layer.state_dict()) == sorted(nn.Linear(4, 3).state_dict())
    assert "epilogue=relu" in repr(layer)


@pytest.mark.slow   # two processes (about 3 s); the README's run keeps the import-rules test
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
    distributed_worker.op_refusals,           # what epifuse's ops cannot split is refused by name
], ids=lambda worker: worker.__name__)
def test_two_processes_on_the_reference_kernel(worker):
    _spawn(worker)


@pytest.mark.slow
@pytest.mark.parametrize("worker", [distributed_worker.tensor_parallel, distributed_worker.fsdp2,
                                    distributed_worker.op_sharding],
                         ids=["tensor_parallel", "fsdp2", "op_sharding"])
def test_the_interpreted_kernels_train_as_nn_linear(worker):
    _spawn(worker, interpreter=True, dtype=torch.float32)


# ---- epifuse's ops on DTensors: the rules (one process), then two processes ----------------------

R = sharding.REPLICATE


def _problem(source: str, a_shape, b_shape, **operands):
    """sharding.problem of `source` with tensor operands given by shape, numbers as numbers."""
    program = epilogue_program(source)
    kinds = "".join("t" if isinstance(operands[name], tuple) else "n" for name in program.operands)
    shapes = [operands[name] for name in program.operands if isinstance(operands[name], tuple)]
    return sharding.problem(program, kinds, a_shape, b_shape, shapes)


FOLDS = ("def folds(accum, bias, c, s):\n    D = relu(accum + bias) * c * s\n    rows = sum(D, dim=1)\n"
         "    cols = sum(D, dim=0)\n    top = amax(D, dim=0)\n    low = min(accum, dim=1)\n"
         "    avg = mean(D, dim=0)\n    return D, rows, cols, top, low, avg\n")


def test_rules_split_tiles_and_fold_reductions_as_partials():
    p = _problem(FOLDS, (8, 6), (6, 10), bias=(10,), c=(8, 1), s=2.0)
    found, refused = sharding.ways(p, 2)
    assert set(found) == {"", "M", "N"} and set(refused) == {"K"}
    assert found[""] == sharding.Way("", (R,) * 6, R, R, (R, R))
    assert found["M"] == sharding.Way(
        "M", (("S", 0), ("S", 0), ("P", "sum"), ("P", "max"), ("S", 0), ("P", "avg")),
        ("S", 0), R, (R, ("S", 0)))   # the bias row replicated, the column c split with the rows
    assert found["N"] == sharding.Way(
        "N", (("S", 1), ("P", "sum"), ("S", 0), ("S", 0), ("P", "min"), ("S", 0)),
        R, ("S", 1), (("S", 0), R))
    assert "not the identity" in refused["K"]


def test_rules_split_k_only_for_the_identity_and_l_for_batches():
    identity = _problem("def ident(accum):\n    return accum\n", (8, 6), (6, 10))
    found, _ = sharding.ways(identity, 2)
    assert found["K"] == sharding.Way("K", (("P", "sum"),), ("S", 1), ("S", 0), ())
    batched = _problem("def b(accum, C, r):\n    D = accum * C + r\n    per = sum(D, dim=(1, 2))\n"
                       "    over = max(D, dim=0)\n    return D, per, over\n",
                       (3, 8, 6), (6, 10), C=(3, 1, 10), r=(8, 1))
    found, refused = sharding.ways(batched, 2)
    assert found["L"] == sharding.Way("L", (("S", 0), ("S", 0), ("P", "max")), ("S", 0), R, (("S", 0), R))
    assert found["N"].operands == (("S", 2), R) and found["M"].operands == (R, ("S", 0))
    assert found["N"].b == ("S", 1) and found["M"].a == ("S", 1)   # B is 2-D, A batched
    assert "K" in refused


@pytest.mark.parametrize("source, shape, axis, words", [
    ("def e(accum):\n    D = accum + col()\n    return D\n", (8, 10), "N", "reads col(), the global index of columns"),
    ("def e(accum):\n    D = accum * row()\n    return D\n", (8, 10), "M", "reads row(), the global index of rows"),
    ("def e(accum):\n    m = mean(accum, dim=0)\n    return m\n", (7, 10), "M",
     "mean over M=7, which does not split evenly over 2 ranks"),
    ("def e(accum):\n    m = max(accum, dim=0)\n    return m\n", (5, 10), "M", None),
    ("def e(accum):\n    D = relu(accum)\n    return D\n", (8, 10), "K", "the epilogue is not the identity"),
    ("def e(accum):\n    D = relu(accum)\n    return D\n", (1, 10), "M", "M=1 is smaller than the 2 ranks"),
], ids=["col", "row", "uneven mean", "empty max shard", "nonlinear K", "too small"])
def test_rules_refuse_what_no_partial_combines(source, shape, axis, words):
    M, N = shape
    p = _problem(source, (M, 6), (6, N))
    ranks = 4 if words is None else 2
    found, refused = sharding.ways(p, ranks)
    assert axis not in found
    assert (words or "would fold an empty shard on some rank (M=5 over 4 ranks)") in refused[axis], refused[axis]


def test_a_log_sum_exp_over_the_split_axis_is_a_log_sum_exp_partial():
    p = _problem("def e(accum):\n    D = relu(accum)\n    r = logsumexp(accum, dim=1)\n    return D, r\n",
                 (8, 6), (6, 10))
    found, _ = sharding.ways(p, 2)
    assert found["N"].outputs == (("S", 1), ("P", "logsumexp"))
    assert found["M"].outputs == (("S", 0), ("S", 0))


def test_choose_refuses_inputs_split_only_where_the_epilogue_cannot_be():
    p = _problem("def e(accum, bias):\n    D = accum + bias + col()\n    return D\n", (8, 6), (6, 10), bias=(10,))
    with pytest.raises(UnsupportedError) as info:
        sharding.choose("epifuse::gemm", p, (2,), ((R, ("S", 1)),))
    message = str(info.value)
    assert "epifuse::gemm cannot split N (columns) across ranks, as B is sharded along it on mesh dim 0" in message
    assert "reads col()" in message and "Redistribute to Replicate" in message and "shard along M" in message
    ways = sharding.choose("epifuse::gemm", p, (2,), ((("S", 0), ("S", 1)),))   # A split along M: M runs
    assert sorted(combo[0].axis for combo in ways) == ["", "M"]
    ways = sharding.choose("epifuse::gemm", p, (2,), ((R, R),))   # replicated in, replicated out
    assert [combo[0].axis for combo in ways] == [""]
    ways = sharding.choose("epifuse::gemm", p, (2, 2), ((("S", 0), R), (("P", "sum"), R)))   # a 2-D mesh
    pairs = [(a.axis, b.axis) for a, b in ways]
    assert ("M", "") in pairs and ("", "M") in pairs and ("M", "M") not in pairs


def test_choose_keeps_the_given_outputs_of_gemm_out():
    p = _problem("def e(accum):\n    D = relu(accum)\n    cols = sum(D, dim=0)\n    return D, cols\n", (8, 6), (6, 10))
    ways = sharding.choose("epifuse::gemm_out", p, (2,), ((("S", 0), R),), ((("S", 0),), (("P", "sum"),)))
    assert [combo[0].axis for combo in ways] == ["M"]
    with pytest.raises(UnsupportedError, match="epifuse::gemm_out writes its outputs in place"):
        sharding.choose("epifuse::gemm_out", p, (2,), ((("S", 0), R),), ((("S", 0),), (R,)))


@pytest.mark.slow   # two processes (about 3 s)
def test_ops_on_dtensors_split_reduce_and_differentiate():
    _spawn(distributed_worker.op_sharding)


@pytest.mark.slow   # among the longest of the README's run (2-3 s or more each): CI runs it with -m slow
def test_import_registers_the_rules_only_where_dtensors_are_loaded():
    """`import epifuse` leaves torch.distributed.tensor unloaded (0.4 s); after it, its rules are
    registered when torch_ops loads."""
    registered = ("from torch.distributed.tensor import DTensor; "
                  "print(torch.ops.epifuse.gemm.default in DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs)")
    probe = {"lazy": "import sys, epifuse; print('torch.distributed.tensor' in sys.modules)",
             "loaded": f"import torch, torch.distributed.tensor, epifuse; {registered}"}
    for name, code in probe.items():
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[-1] == ("False" if name == "lazy" else "True"), (name, out.stdout, out.stderr)


@pytest.mark.slow   # torchrun starts two fresh processes for each (3-4 s)
@pytest.mark.parametrize("worker", distributed_worker.TORCHRUN)
def test_the_gpu_tests_torchrun_entry_runs_on_gloo(worker):
    """tests/gpu/test_distributed_gpu.py's command, with gloo on the CPU: the same workers."""
    seed = int(torch.randint(2**31, ()))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(TESTS / "distributed_worker.py"), worker, "--dtype", "float64", "--seed", str(seed)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"{worker} passed on 2 ranks (gloo, float64, small)" in out.stdout


def test_a_log_sum_exp_partial_pickles_and_prints_as_itself():
    import pickle
    from torch.distributed.tensor import Partial
    placement = sharding.log_sum_exp_partial()
    assert pickle.loads(pickle.dumps(placement)) == placement
    assert placement != Partial("sum") and placement.reduce_op == "logsumexp"
    text, names = placement.__fx_repr__()
    assert eval(text, names) == placement
    assert sharding._name(("?", "_NormPartial(2)")) == "_NormPartial(2)"
