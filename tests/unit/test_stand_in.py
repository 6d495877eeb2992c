"""Stand-ins (stand_in.py): metadata on a GPU device without memory, from which the backward's
kernels are planned ahead (runtime/ahead.py). They must lay out views as real tensors do, make
stand-ins of GPU factory calls inside `stand_ins()` (so planning allocates and launches
nothing), leave real tensors' ops alone, and never import torch._dynamo (FakeTensorMode's cost
that they replace)."""
import subprocess
import sys
import textwrap

import torch

from epifuse.shapes import address, is_stand_in, misalignment
from epifuse.stand_in import StandIn, stand_in, stand_ins

GPU = torch.device("cuda", 0)


def test_views_of_a_stand_in_are_laid_out_as_the_real_views():
    real = torch.empty(64, 96, dtype=torch.bfloat16)[3:, 8:]
    s = stand_in(real.shape, real.stride(), real.storage_offset(), real.dtype, real.device)
    assert isinstance(s, StandIn) and is_stand_in(s) and not is_stand_in(real)
    for view in (lambda t: t.t(), lambda t: t[..., :0], lambda t: t[..., :0, :], lambda t: t.reshape(-1, 88)[1:],
                 lambda t: t.unsqueeze(0).expand(3, -1, -1), lambda t: t.mT[2:, 5:]):
        want = view(real)
        got = view(s)
        assert isinstance(got, StandIn)
        assert (got.shape, got.stride(), got.storage_offset(), got.dtype) == \
            (want.shape, want.stride(), want.storage_offset(), want.dtype)
        assert misalignment(got) == misalignment(want)   # (a CPU allocation starts 16-byte aligned)
    on_gpu = stand_in((16, 24), (24, 1), 4, torch.float16, GPU)
    rows = on_gpu.narrow(0, 1, 15)   # (Python indexing of a CUDA-device tensor needs a CUDA build)
    assert on_gpu.device == GPU and on_gpu.t().device == GPU and rows.device == GPU
    assert misalignment(on_gpu) == 8 and misalignment(rows) == (4 + 24) * 2 % 16
    # views share their stand-in's (meta) storage, and only those can overlap
    assert address(on_gpu.t())[0] == address(on_gpu)[0] != address(stand_in((2,), (1,), 0, torch.float16, GPU))[0]


def test_gpu_factory_calls_inside_stand_ins_make_stand_ins_and_real_ones_stay_real():
    s = stand_in((8, 16), (16, 1), 0, torch.bfloat16, GPU)
    with stand_ins():
        made = [torch.ops.aten.empty.memory_format([2, 3], device=GPU, dtype=torch.float16),
                torch.ops.aten.zeros.default([4], device=GPU, dtype=torch.int64),
                torch.zeros_like(s), s.new_empty((5,)), torch.empty_like(s.t())]
        assert all(isinstance(t, StandIn) and t.device.type == "cuda" for t in made)
        assert made[1].unbind()[0].device.type == "cuda" and made[4].stride() == torch.empty_like(torch.empty(8, 16).t()).stride() == (1, 16)
        real = torch.arange(6, dtype=torch.float32).reshape(2, 3) * 2
        assert type(real) is torch.Tensor and real.sum().item() == 30.0
    assert type(torch.empty(2)) is torch.Tensor   # outside the context, as ever


def test_planning_a_backward_from_stand_ins_imports_no_compiler():
    """The whole plan of a bias + GELU forward's backward, from layouts, in a fresh interpreter:
    torch._dynamo and sympy stay unloaded (FakeTensorMode would load both: 1.7 s here, 5 s on a
    host without .pyc files)."""
    code = textwrap.dedent("""
        import json, sys, torch
        from epifuse import backward_ahead, torch_ops
        source = "def e(accum, bias):\\n    D = gelu(accum + bias)\\n    return D\\n"
        key = torch_ops._describe(source, True)[0]
        layouts = [((32, 24), (24, 1), 0, torch.float32, torch.device("cpu")),
                   ((24, 40), (1, 24), 0, torch.float32, torch.device("cpu")),
                   ((40,), (1,), 0, torch.float32, torch.device("cpu"))]
        compiled = backward_ahead.backward_from_stand_ins(key, layouts, [], "t", "", (torch.float32, False, "default"),
                                                          (True, True, (True,)))
        assert compiled, "nothing planned"
        print(json.dumps([n for n in ("torch._dynamo", "sympy", "torch._subclasses.fake_tensor.FakeTensorMode")
                          if n in sys.modules]))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-1] == "[]"

