"""Two-process workers for tests/unit/test_distributed.py (torch.distributed with gloo on CPU)
and tests/gpu/test_distributed_gpu.py (NCCL on two GPUs, under torchrun): a small MLP of
FusedLinear layers under tensor parallelism or FSDP2 against the same MLP of nn.Linear +
activation, trained a few steps side by side on every rank; epifuse's ops on DTensors (the
sharding rules of epifuse.sharding) against torch on the full tensors. A worker raises on a
mismatch; torch.multiprocessing.spawn (or torchrun's exit status) raises it in the test.
Smaller workers check single layers: what tensor parallelism refuses, col() and row(),
autocast and dtypes, and epilogues with two outputs.

Every worker is `worker(rank, world, port, run)`: `run` (a Run) says the dtype, the seed,
the sizes and the device. The gloo tests spawn them with torch.multiprocessing; torchrun runs
them through main() below, which starts the process group itself (NCCL where there is a GPU,
else gloo, so the CPU runs the same path):

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed_worker.py \
        tensor_parallel --dtype bfloat16 --size large
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

STEPS = 3

# (in, hidden, out, tokens) of the MLP; (M, K, N) of the op checks
SIZES = {"small": ((16, 32, 8, 12), (12, 8, 10)),
         "large": ((1024, 4096, 1024, 2048), (512, 256, 384))}


@dataclass(frozen=True)
class Run:
    """What one run of a worker takes: the model dtype, a seed drawn by the test (fresh inputs
    every run), the sizes (SIZES) and whether Triton's interpreter runs the kernels."""

    dtype: torch.dtype = torch.float64
    seed: int = 0
    size: str = "small"
    interpreter: bool = False


def _start(rank: int, world: int, port: int | None, run: Run):
    """The 1-D device mesh of the run: a gloo group on 127.0.0.1:`port`, or the group main()
    started under torchrun."""
    from torch.distributed.device_mesh import init_device_mesh
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if run.interpreter:
            os.environ["TRITON_INTERPRET"] = "1"
        dist.init_process_group("gloo", rank=rank, world_size=world)
    return init_device_mesh(_device().type, (world,))


def _device() -> torch.device:
    """This rank's GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _finish():
    """Leave the process group once every rank is done. The barrier waits (without the GIL) for
    this rank's collectives too: gloo's threads free a finished collective's tensors, which
    needs the GIL, and a thread that asks for it once Python is finalizing aborts the process."""
    dist.barrier()
    dist.destroy_process_group()


def spawned(rank, name: str, world: int, port: int, run: Run):
    """torch.multiprocessing.spawn's entry: the worker `name`, then the process ends without
    Python's and C++'s teardown (os._exit), as main() does under torchrun. That teardown, after
    every check had passed and the group was destroyed, aborted about one run in ten of the
    op workers ('terminate called without an active exception', no Python frame on the stack).
    A worker that raises returns the error to spawn as before."""
    WORKERS[name](rank, world, port, run)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def tolerance(dtype: torch.dtype, device: torch.device) -> float:
    """Relative tolerance of the fused model against nn.Linear in the same dtype. On the CPU
    (the reference kernel in float64, Triton's interpreter in float32) 1e-10 and 2e-5. On a GPU
    8 units of roundoff of the format the GEMMs multiply in, 2**-bits for its significant bits:
    bfloat16 8, float16 11, float32 11 (epifuse multiplies float32 in tf32 by default, where
    nn.Linear keeps float32's 24), float64 53: bfloat16 3.1e-2, float32 3.9e-3."""
    if device.type == "cpu":
        return 1e-10 if dtype == torch.float64 else 2e-5
    bits = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 11, torch.float64: 53}[dtype]
    return 8 * 2.0 ** -bits


def _models(run: Run):
    """nn.Linear + GELU(tanh) + nn.Linear + ReLU, and the same MLP of FusedLinear layers with
    copies of its parameters, on this rank's device, the same on every rank."""
    import epifuse.nn
    d_in, hidden, d_out, _ = SIZES[run.size][0]
    torch.manual_seed(run.seed)
    ref = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, d_out),
                        nn.ReLU()).to(_device(), run.dtype)
    fused = nn.Sequential(epifuse.nn.FusedLinear.from_linear(copy.deepcopy(ref[0]), "gelu_tanh"),
                          epifuse.nn.FusedLinear.from_linear(copy.deepcopy(ref[2]), "relu"))
    return ref, fused


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _wide(t):
    """16-bit values in float32 (the loss sums many), others as they are."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _train_side_by_side(ref, fused, run: Run, rank: int):
    """STEPS of SGD on both models with the same inputs (a fresh draw each step, the same on
    every rank); loss, gradients and parameters must agree within tolerance() (relative)."""
    device = _device()
    tol = tolerance(run.dtype, device)
    d_in, _, _, tokens = SIZES[run.size][0]
    opt = torch.optim.SGD(fused.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(STEPS):
        x = torch.randn(tokens, d_in, generator=torch.Generator().manual_seed(run.seed + 100 + step))
        x = x.to(device, run.dtype)
        out = fused(x)
        out = _full(out)
        loss = _wide(out).square().mean()
        loss.backward()
        expected = _wide(ref(x)).square().mean()
        expected.backward()
        assert torch.allclose(loss, expected, rtol=tol, atol=tol * float(expected)), \
            (rank, step, float(loss), float(expected))
        for (name, p), (_, q) in zip(fused.named_parameters(), ref.named_parameters()):
            grad = _full(p.grad)
            assert torch.allclose(grad, q.grad, rtol=tol, atol=tol * float(q.grad.abs().max())), \
                (rank, step, name, float((grad - q.grad).abs().max()), float(q.grad.abs().max()))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for (name, p), (_, q) in zip(fused.named_parameters(), ref.named_parameters()):
        assert torch.allclose(_full(p.detach()), q.detach(), rtol=tol, atol=tol * float(q.abs().max())), \
            (rank, name, float((_full(p.detach()) - q.detach()).abs().max()))


def tensor_parallel(rank, world, port, run):
    """up: ColwiseParallel (GELU on each rank's columns); down: RowwiseParallel (ReLU after the
    all-reduce)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = _start(rank, world, port, run)
    ref, fused = _models(run)
    parallelize_module(fused, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    assert type(fused[0].weight).__name__ == "DTensor"
    _train_side_by_side(ref, fused, run, rank)
    _finish()


def fsdp2(rank, world, port, run):
    """fully_shard on each FusedLinear and on the model (from fuse_linear_activations)."""
    import epifuse.nn
    from torch.distributed.fsdp import fully_shard
    mesh = _start(rank, world, port, run)
    ref, _ = _models(run)
    fused = epifuse.nn.fuse_linear_activations(copy.deepcopy(ref))
    for layer in fused:
        if isinstance(layer, epifuse.nn.FusedLinear):
            fully_shard(layer, mesh=mesh)
    fully_shard(fused, mesh=mesh)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*returned a view tensor.*")   # FSDP's hooks see our outputs
        _train_side_by_side(ref, fused, run, rank)
    _finish()


def refusals(rank, world, port, run):
    """What tensor parallelism cannot run yet is refused by name, on every rank."""
    dtype = run.dtype
    import epifuse.nn
    from epifuse.errors import UnsupportedError
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = _start(rank, world, port, run)
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


def column_index(rank, world, port, run):
    """col() is the global column index: a column-parallel layer would count each rank's
    columns from 0, so it is refused there; a row-parallel layer sees every column. row() is
    exact on both (every rank has all rows)."""
    dtype, seed = run.dtype, run.seed
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = _start(rank, world, port, run)
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


def autocast(rank, world, port, run):
    """The MLP of tensor_parallel (a float32 model) under bf16 autocast: both layers return
    bf16 as nn.Linear does (the row-parallel one casts x and W as the unsharded layer), with
    bf16's error; gradients likewise."""
    seed = run.seed
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = _start(rank, world, port, run)
    ref, fused = _models(Run(torch.float32, seed))
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


def row_parallel_dtypes(rank, world, port, run):
    """A float64 layer given float32 x (no autocast): a row-parallel layer returns what the
    unsharded FusedLinear does, x's dtype, computed in float64."""
    seed = run.seed
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
    mesh = _start(rank, world, port, run)
    ref, fused = _linear_pair(8, "relu", torch.float64, seed)
    unsharded = copy.deepcopy(fused[0])
    parallelize_module(fused, mesh, {"0": RowwiseParallel()})
    x = _x(12, torch.float32, seed)
    y, whole = _full(fused(x[:, 8 * rank:8 * rank + 8])), unsharded(x)
    assert whole.dtype == torch.float32 and y.dtype == whole.dtype, (rank, y.dtype, whole.dtype)
    expected = torch.relu(ref(x.double()))
    assert torch.allclose(y.double(), expected, rtol=1e-6, atol=1e-6), (rank, float((y - expected).abs().max()))
    _finish()


def multiple_outputs(rank, world, port, run):
    """torch's ColwiseParallel and RowwiseParallel lay out one output tensor: an epilogue with
    two is refused on a sharded weight, and still runs under FSDP2."""
    dtype, seed = run.dtype, run.seed
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = _start(rank, world, port, run)
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


# ---- epifuse's ops on DTensors (epifuse.sharding) ------------------------------------------------

_FOLDS = ("def folds(accum, bias, c):\n    D = relu(accum + bias) * c\n    rows = sum(D, dim=1)\n"
          "    cols = sum(D, dim=0)\n    top = max(D, dim=0)\n    low = min(accum, dim=1)\n"
          "    avg = mean(D, dim=0)\n    return D, rows, cols, top, low, avg\n")


def _folds_expected(A, B, bias, c):
    accum = A.double() @ B.double()
    D = torch.relu(accum + bias.double()) * c.double()
    return D, D.sum(1), D.sum(0), D.amax(0), accum.amin(1), D.mean(0)


def _draw(seed: int, *shape, device=None, dtype=torch.float64):
    """The same fresh random tensor on every rank (no zeros: a normal draw)."""
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return t.to(device or _device(), dtype)


def _check(got, want, placements, tol: float, what):
    """A DTensor output: its placements, and its full value against the float64 `want`
    (relative to want's largest magnitude)."""
    assert tuple(got.placements) == tuple(placements), (what, got.placements, placements)
    full = got.full_tensor().double()
    scale = float(want.abs().max()) + 1e-30
    error = float((full - want).abs().max()) / scale
    assert full.shape == want.shape and error <= tol, (what, tuple(full.shape), tuple(want.shape), error)


def _op_tolerance(run: Run, device: torch.device) -> float:
    """Error relative to an output's largest magnitude: float64 on the CPU to 1e-12; 16-bit
    inputs round their products' inputs, float32 on a GPU to tf32, and outputs store in the
    inputs' dtype."""
    if run.dtype == torch.float64:
        return 1e-12
    return 2e-5 if device.type == "cpu" else tolerance(run.dtype, device)


def op_sharding(rank, world, port, run):
    """epifuse.gemm on DTensors: each way epifuse.sharding allows gives the full tensors'
    values, with tiles Shard and reductions over the split axis Partial (sum, max, min, avg);
    replicated inputs give replicated outputs; gradients flow as torch's."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    import epifuse
    mesh = _start(rank, world, port, run)
    device, seed = _device(), run.seed
    tol = _op_tolerance(run, device)
    M, K, N = SIZES[run.size][1]
    A, B = _draw(seed, M, K, dtype=run.dtype), _draw(seed + 1, K, N, dtype=run.dtype)
    bias, c = _draw(seed + 2, N, dtype=run.dtype), _draw(seed + 3, M, 1, dtype=run.dtype)
    expected = _folds_expected(A, B, bias, c)

    def put(t, *placements):
        return distribute_tensor(t, mesh, list(placements))

    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    cases = {   # A's, B's placements (the operands' are redistributed by DTensor) -> the outputs'
        "split M": ((S0, R), (S0, S0, Partial("sum"), Partial("max"), S0, Partial("avg"))),
        "split N": ((R, S1), (S1, Partial("sum"), S0, S0, Partial("min"), S0)),
        "replicated": ((R, R), (R,) * 6),
    }
    for label, ((pa, pb), placed) in cases.items():
        outs = epifuse.gemm(put(A, pa), put(B, pb), _FOLDS, bias=put(bias, R), c=put(c, R))
        for name, got, want, placement in zip(("D", "rows", "cols", "top", "low", "avg"), outs, expected, placed):
            _check(got, want, (placement,), tol, (rank, label, name))
    # uneven shards (M and N odd): sums, maxima and minima still combine exactly
    A7, B9, bias9, c7 = A[:M - 1 - M % 2], B[:, :N - 1 - N % 2], bias[:N - 1 - N % 2], c[:M - 1 - M % 2]
    odd = ("def odd(accum, bias, c):\n    D = relu(accum + bias) * c\n    cols = sum(D, dim=0)\n"
           "    top = max(D, dim=0)\n    low = min(accum, dim=1)\n    return D, cols, top, low\n")
    want = _folds_expected(A7, B9, bias9, c7)
    outs = epifuse.gemm(put(A7, S0), put(B9, R), odd, bias=put(bias9, R), c=put(c7, S0))
    for name, got, w, placement in zip(("D", "cols", "top", "low"), outs, (want[0], want[2], want[3], want[4]),
                                       (S0, Partial("sum"), Partial("max"), S0)):
        _check(got, w, (placement,), tol, (rank, "odd split M", name))
    # split K: the identity epilogue gives a Partial accum
    D = epifuse.gemm(put(A, S1), put(B, S0))
    _check(D, A.double() @ B.double(), (Partial("sum"),), tol, (rank, "split K"))
    # batched, split along L: per-batch sums Shard, the sum over L Partial
    L = 3
    A3 = _draw(seed + 4, L, M, K, dtype=run.dtype)
    batched = ("def batched(accum, s):\n    D = sigmoid(accum) * s\n    per = sum(D, dim=(1, 2))\n"
               "    over = sum(D, dim=0)\n    return D, per, over\n")
    # sigmoid's outputs are bounded while its input's rounding grows with accum: in full fp32
    # products, so the tolerance (relative to the outputs) is not spent on tf32's inputs
    highest = "highest" if run.dtype == torch.float32 else "default"
    D3, per, over = epifuse.gemm(put(A3, S0), put(B, R), batched, s=1.5, precision=highest)
    D3_want = torch.sigmoid(A3.double() @ B.double()) * 1.5
    for name, got, w, placement in (("D", D3, D3_want, S0), ("per", per, D3_want.sum((1, 2)), S0),
                                    ("over", over, D3_want.sum(0), Partial("sum"))):
        _check(got, w, (placement,), tol, (rank, "split L", name))
    _log_sum_exps(put, A, B, run, tol, rank)
    _op_gradients(mesh, run, tol, rank)
    _finish()


def _log_sum_exps(put, A, B, run: Run, tol: float, rank: int):
    """A log-sum-exp over a vocabulary split across ranks (B Shard along N): one pass gives
    each rank the log-sum-exp of its columns, a LogSumExpPartial whose full value is the whole
    row's; softmax and log-softmax normalized by it run as two passes, the second reading the
    combined statistic; the gradient of a loss through the log-sum-exp is the row softmax."""
    from torch.distributed.tensor import Replicate, Shard
    import epifuse
    from epifuse import sharding, torch_ops
    R, S1 = Replicate(), Shard(1)
    LSE = sharding.log_sum_exp_partial()
    accum = A.double() @ B.double()
    lse = "def lse(accum, t):\n    D = relu(accum)\n    r = logsumexp(accum * t, dim=1)\n    return D, r\n"
    D, r = epifuse.gemm(put(A, R), put(B, S1), lse, t=0.5)
    _check(D, torch.relu(accum), (S1,), tol, (rank, "lse D"))
    _check(r, torch.logsumexp(accum * 0.5, 1), (LSE,), tol, (rank, "lse r"))
    # the statistic redistributed straight to a Shard of rows (reduce-scatter of its parts)
    rows = r.redistribute(r.device_mesh, [Shard(0)])
    _check(rows, torch.logsumexp(accum * 0.5, 1), (Shard(0),), tol, (rank, "lse r to Shard(0)"))
    normalized = ("def normalized(accum):\n    z = logsumexp(accum, dim=1)\n    P = exp(accum - z)\n"
                  "    logp = accum - z\n    return P, logp\n")
    # exp(accum - z) turns accum's absolute error into P's relative error: tf32 inputs give
    # accum an error near 2**-11 of its magnitude (here tens), past the tolerance, so float32
    # multiplies in full precision and the check measures the statistic's combination
    highest = "highest" if run.dtype == torch.float32 else "default"
    P, logp = epifuse.gemm(put(A, R), put(B, S1), normalized, precision=highest)
    _check(P, torch.softmax(accum, 1), (S1,), tol, (rank, "softmax"))
    _check(logp, torch.log_softmax(accum, 1), (S1,), tol, (rank, "log_softmax"))
    # gradients: d(sum(g * lse)) / dB = A^T (g * softmax), through the combined statistic
    g = _draw(run.seed + 30, A.shape[0])
    a = A.detach().double()
    b = B.detach().double().requires_grad_()
    (torch.logsumexp(a @ b, 1) * g).sum().backward()
    dB = put(B, S1).requires_grad_()
    only = "def only(accum):\n    r = logsumexp(accum, dim=1)\n    return r\n"
    r = torch_ops.gemm(put(A, R), dB, only)
    (r.full_tensor().double() * g).sum().backward()
    full = dB.grad.full_tensor().double()
    error = float((full - b.grad).abs().max()) / float(b.grad.abs().max())
    assert error <= 4 * tol, (rank, "lse gradient", error)


def _op_gradients(mesh, run: Run, tol: float, rank: int):
    """Gradients of A, B and the bias through the op on DTensors split along M and along N,
    against torch's autograd in float64 on the full tensors: a sum over the rows from a saved
    accum (the backward's GEMM takes K = 0 factors laid out as accum is: zero_k_factors), and a
    maximum over the columns with accum recomputed in full precision (the backward recomputes
    the maxima, a Partial('max') when split along N; an accum rounded to 16 bits could pick
    another column than float64 where two are that close)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from epifuse import torch_ops
    M, K, N = SIZES["small"][1] if run.size == "small" else (128, 64, 96)
    seed = run.seed + 10
    A, B, bias = (_draw(seed, M, K, dtype=run.dtype), _draw(seed + 1, K, N, dtype=run.dtype),
                  _draw(seed + 2, N, dtype=run.dtype))
    gD, g_top, g_cols = _draw(seed + 3, M, N), _draw(seed + 4, M), _draw(seed + 5, N)
    summed = "def summed(accum, bias):\n    D = gelu(accum + bias)\n    cols = sum(D, dim=0)\n    return D, cols\n"
    topped = "def topped(accum, bias):\n    D = gelu(accum + bias)\n    top = max(D, dim=1)\n    return D, top\n"
    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    for source, g_fold, fold, options in ((summed, g_cols, lambda D: D.sum(0), {}),
                                          (topped, g_top, lambda D: D.amax(1), {"recompute": True,
                                                                                "precision": "highest"})):
        a, b, bb = (t.detach().double().requires_grad_() for t in (A, B, bias))
        D_ref = torch.nn.functional.gelu(a @ b + bb)
        ((D_ref * gD).sum() + (fold(D_ref) * g_fold).sum()).backward()
        for label, (pa, pb, pbias) in {"split M": (S0, R, R), "split N": (R, S1, S0)}.items():
            dA, dB, dbias = (distribute_tensor(t, mesh, [p]).requires_grad_()
                             for t, p in ((A, pa), (B, pb), (bias, pbias)))
            D, folded = torch_ops.gemm(dA, dB, source, bias=dbias, **options)
            loss = (D.full_tensor().double() * gD).sum() + (folded.full_tensor().double() * g_fold).sum()
            loss.backward()
            for name, got, want in (("A", dA.grad, a.grad), ("B", dB.grad, b.grad), ("bias", dbias.grad, bb.grad)):
                full = got.full_tensor().double()
                error = float((full - want).abs().max()) / float(want.abs().max())
                assert error <= 4 * tol, (rank, source.split("(")[0], label, name, error)


def op_refusals(rank, world, port, run):
    """What the ops cannot split is refused with epifuse's UnsupportedError, naming the op and
    the reason, before anything runs (on every rank alike): col() split along N, row() along M,
    an uneven mean, a non-identity epilogue split along K,
    DTensors mixed with plain tensors. A straight call of the op gets the same refusal inside
    DTensor's RuntimeError. Replicated inputs run the same epilogues; gemm_out writes outputs
    placed as the op gives them, and refuses others."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    import epifuse
    from epifuse import torch_ops
    from epifuse.errors import UnsupportedError
    mesh = _start(rank, world, port, run)
    seed = run.seed
    tol = _op_tolerance(run, _device())
    M, K, N = SIZES[run.size][1]
    A, B = _draw(seed, M, K, dtype=run.dtype), _draw(seed + 1, K, N, dtype=run.dtype)
    R, S0, S1 = Replicate(), Shard(0), Shard(1)

    def put(t, placement):
        return distribute_tensor(t, mesh, [placement])

    by_col = "def by_col(accum):\n    D = accum + col()\n    return D\n"
    by_row = "def by_row(accum):\n    D = accum * row()\n    return D\n"
    averaged = "def averaged(accum):\n    m = mean(accum, dim=0)\n    return m\n"
    for label, call, words in (
            ("col() split N", lambda: epifuse.gemm(put(A, R), put(B, S1), by_col),
             "cannot split N (columns) across ranks, as B is sharded along it on mesh dim 0: the epilogue reads col()"),
            ("row() split M", lambda: epifuse.gemm(put(A, S0), put(B, R), by_row),
             "cannot split M (rows) across ranks, as A is sharded along it on mesh dim 0: the epilogue reads row()"),
            ("uneven mean", lambda: epifuse.gemm(put(A[:M - 1 - M % 2], S0), put(B, R), averaged),
             f"mean over M={M - 1 - M % 2}, which does not split evenly over {world} ranks"),
            ("relu split K", lambda: epifuse.gemm(put(A, S1), put(B, S0), "relu"),
             "cannot split K (the inner dimension) across ranks, as A and B are sharded along it"),
            ("mixed", lambda: epifuse.gemm(put(A, S0), B, "relu"), "got DTensors and plain tensors (B) together")):
        try:
            call()
        except UnsupportedError as error:
            assert words in str(error), (rank, label, str(error))
            assert "epifuse::gemm" in str(error), (rank, label, str(error))
        else:
            raise AssertionError(f"{label} ran, but should have been refused with {words!r}")
    # the op itself, past epifuse.gemm's check: DTensor's dispatch wraps the same refusal
    key = torch_ops.entry(torch_ops.register_epilogue(by_col)).key
    try:
        torch.ops.epifuse.gemm(key, put(A, R), put(B, S1), [], [], "", "", torch.float64, False, "default")
    except RuntimeError as error:
        assert "the epilogue reads col()" in str(error), (rank, str(error))
        assert isinstance(error.__cause__, UnsupportedError), (rank, type(error.__cause__))
    else:
        raise AssertionError("torch.ops.epifuse.gemm split col() along N")
    # replicated inputs run what a split refuses
    want = A.double() @ B.double() + torch.arange(N, dtype=torch.float64, device=A.device)
    _check(epifuse.gemm(put(A, R), put(B, R), by_col), want, (R,), tol, (rank, "col() replicated"))
    # gemm_out: outputs given with the placements of the split along M
    folds = "def folds(accum):\n    D = relu(accum)\n    cols = sum(D, dim=0)\n    return D, cols\n"
    local_rows = put(A, S0).to_local().shape[0]
    D = DTensor.from_local(torch.empty(local_rows, N, dtype=run.dtype, device=A.device), mesh, [S0],
                           run_check=False, shape=torch.Size((M, N)), stride=(N, 1))
    cols = DTensor.from_local(torch.empty(N, dtype=torch.float32 if run.dtype != torch.float64 else run.dtype,
                                          device=A.device), mesh, [Partial("sum")], run_check=False)
    with torch.no_grad():
        epifuse.gemm(put(A, S0), put(B, R), folds, D=D, cols=cols)
    relu = torch.relu(A.double() @ B.double())
    _check(D, relu, (S0,), tol, (rank, "gemm_out D"))
    _check(cols, relu.sum(0), (Partial("sum"),), tol, (rank, "gemm_out cols"))
    local_cols = put(B, S1).to_local().shape[1]
    wrong = DTensor.from_local(torch.empty(M, local_cols, dtype=run.dtype, device=A.device), mesh, [S1],
                               run_check=False, shape=torch.Size((M, N)), stride=(N, 1))
    try:
        with torch.no_grad():
            epifuse.gemm(put(A, S0), put(B, R), by_col, D=wrong)
    except UnsupportedError as error:
        assert "epifuse::gemm_out writes its outputs in place" in str(error), (rank, str(error))
    else:
        raise AssertionError("gemm_out wrote an output whose placement no way of running gives")
    _finish()


WORKERS = {w.__name__: w for w in (tensor_parallel, fsdp2, refusals, column_index, autocast, row_parallel_dtypes,
                                     multiple_outputs, op_sharding, op_refusals)}
TORCHRUN = ("tensor_parallel", "fsdp2", "op_sharding", "op_refusals")   # device-generic: main() runs them


def main(argv=None) -> None:
    """One worker on this rank under torchrun (which sets RANK, WORLD_SIZE, LOCAL_RANK and the
    rendezvous): NCCL on this rank's GPU where there is one, else gloo on the CPU."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("worker", choices=TORCHRUN)
    parser.add_argument("--dtype", default="float32", choices=["float64", "float32", "bfloat16", "float16"])
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    run = Run(getattr(torch, args.dtype), args.seed, args.size)
    backend = dist.get_backend()
    WORKERS[args.worker](rank, world, None, run)
    if rank == 0:
        print(f"{args.worker} passed on {world} ranks ({backend}, {args.dtype}, {args.size})", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # without the teardown that aborts now and then (see spawned)


if __name__ == "__main__":
    main()
