"""In one process: a kept epifuse.gemm whose launch passes its tensors to Triton's compiled
launcher as addresses, against one passing the tensors themselves (which the launcher turns
into addresses by calling data_ptr and asking the driver, cuPointerGetAttribute, per tensor).
    PYTHONPATH=src:. python research/pointer_probe.py [--tune 0]
Two epilogues of the same math under different names give two sites; the second is kept
while launch.py's launchers are told of no pointers. Timed alternately, seven rounds of
bench.overhead's host time per call (best of three each); prints one JSON object with the
medians and which launch path the sites took."""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch

if "--tune" in sys.argv:
    os.environ["EPIFUSE_TUNE"] = sys.argv[sys.argv.index("--tune") + 1]

import epifuse  # noqa: E402
from bench.overhead import _per_call_us  # noqa: E402
from epifuse.backends.triton import launch  # noqa: E402
from epifuse.runtime import callsite  # noqa: E402

BODY = "(accum, bias, alpha):\n    D = relu(accum * alpha + bias)\n    return D\n"


def _path(site) -> str:
    cells = dict(zip(site.launch_with.__code__.co_freevars,
                     (c.cell_contents for c in site.launch_with.__closure__ or ())))
    if cells.get("described") is not None:
        return "described"
    return "plain" if cells.get("plain") is not None else "through Triton"


def main() -> None:
    A = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    B = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    tensors = {"bias": torch.randn(256, device="cuda", dtype=torch.float16), "alpha": 2.0,
               "D": torch.empty(256, 256, device="cuda", dtype=torch.float16)}
    options = (None, False, False, None, "default")
    addresses, objects = "def epi_addresses" + BODY, "def epi_objects" + BODY
    for _ in range(3):
        epifuse.gemm(A, B, addresses, **tensors)
    described, plain = launch.described_launcher, launch.plain_launcher
    launch.described_launcher = lambda compiled, pointers=(): described(compiled)
    launch.plain_launcher = lambda compiled, pointers=(): plain(compiled)
    try:
        for _ in range(3):
            epifuse.gemm(A, B, objects, **tensors)
    finally:
        launch.described_launcher, launch.plain_launcher = described, plain
    sites = {name: callsite.lookup(callsite.signature(src, A, B, tensors, options))
             for name, src in (("addresses", addresses), ("objects", objects))}
    expected = torch.relu(A.double() @ B.double() * 2.0 + tensors["bias"].double())
    for name, src in (("addresses", addresses), ("objects", objects)):
        out = epifuse.gemm(A, B, src, **tensors)
        torch.cuda.synchronize()
        assert (out.double() - expected).abs().max().item() < 0.5, name
    times = {"addresses": [], "objects": []}
    for _ in range(7):
        for name, src in (("addresses", addresses), ("objects", objects)):
            times[name].append(min(_per_call_us(lambda s=src: epifuse.gemm(A, B, s, **tensors), 3000)
                                   for _ in range(3)))
    print(json.dumps({"tune": os.environ.get("EPIFUSE_TUNE", "fast"),
                      "paths": {n: (_path(s) if s is not None else "not kept") for n, s in sites.items()},
                      "median_us": {n: round(statistics.median(v), 2) for n, v in times.items()},
                      "saved_us_per_round": [round(o - a, 2) for a, o in zip(times["addresses"], times["objects"])],
                      "rounds_us": {n: [round(x, 2) for x in v] for n, v in times.items()}}))


if __name__ == "__main__":
    main()
