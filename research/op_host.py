"""Host time of epifuse::gemm as a compiled graph calls it (issue 33: the op's self CPU time in
a compiled GCN step was 280-390 us a call, where a repeated epifuse.gemm takes about 30).

    PYTHONPATH=src:. python -m research.op_host

At 256 x 256 x 256 bf16 on the GPU, a BCE-like epilogue with a 0-d operand and a 0-d mean:
the op through torch.ops before and after torch._dynamo is imported (after it, torch's
custom-op wrapper runs the implementation under torch._disable_dynamo), epifuse.gemm, and the
op's pieces (op_planning.bind_operands and op_output_specs, callsite.signature and lookup, the
kept launch); then cProfile of the op
before dynamo is imported (after it, cProfile does not see inside the disabled region).
"""
from __future__ import annotations

import cProfile
import importlib
import io
import pstats

import torch

from bench.overhead import _per_call_us as us

SOURCE = """def fused_addmm(accum, x0, x1, x2):
    t0 = add(accum, x0)
    t2 = mul(sub(1.0, x1), t0)
    t3 = minimum(x2, t0)
    t8 = sub(t3, log1p(exp(neg(abs(t0)))))
    t10 = mean(sub(t2, t8))
    out0 = t0
    out1 = t10
    return out0, out1
"""


def main() -> None:
    import sys
    from epifuse import epilogue_table, op_planning
    from epifuse.runtime import callsite
    dev, dt = "cuda", torch.bfloat16
    A = torch.randn(256, 256, device=dev, dtype=dt)
    B = torch.randn(256, 256, device=dev, dtype=dt).t()
    ops = [torch.randn(256, device=dev, dtype=dt), torch.rand(256, 256, device=dev), torch.zeros((), device=dev)]
    key = epilogue_table.entry(epilogue_table.register_epilogue(SOURCE)).key
    op = torch.ops.epifuse.gemm.default

    def call():
        return op(key, A, B, ops, [], "ttt", "bfloat16,float32", torch.float32, False, "default")
    rows = {"dynamo loaded at start": "torch._dynamo" in sys.modules}
    rows["op, dynamo not imported"] = us(call)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(500):
        call()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(22)
    importlib.import_module("torch._dynamo")
    rows["op, dynamo imported"] = us(call)
    rows["torch.addmm"] = us(lambda: torch.addmm(ops[0], A, B))
    e = epilogue_table.resolve(key)
    values = op_planning.unpack(e.program.operands, ops, [], "ttt")
    rows["bind_operands"] = us(lambda: op_planning.bind_operands(e.program, A, B, values))
    program, graph, accum_shape, values, _ = op_planning.bind_operands(e.program, A, B, values)
    rows["op_output_specs"] = us(lambda: op_planning.op_output_specs(e, graph, accum_shape, A, "bfloat16,float32",
                                                                     torch.float32))
    outs = dict(zip(["out0", "out1"], call()))
    options = ("op", torch.float32, False, "default", False)
    tensors = {**values, **outs}
    rows["callsite.signature"] = us(lambda: callsite.signature(key, A, B, tensors, options))
    signed = callsite.signature(key, A, B, tensors, options)
    rows["callsite.lookup"] = us(lambda: callsite.lookup(signed))
    site = callsite.lookup(signed)
    if site is not None:
        rows["kept launch (site.call)"] = us(lambda: site.call(A, B, tensors))
    for name, value in rows.items():
        print(f"{name:32s} {value if isinstance(value, bool) else f'{value:8.1f} us'}")
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip()))


if __name__ == "__main__":
    main()
