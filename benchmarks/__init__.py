"""epifuse benchmark harness (see BENCHMARKS.md in the project notes and RESULTS.md here).

Run from the repository root:

    PYTHONPATH=src:. python -m benchmarks --quick            # S2, fp16, no inductor: a few minutes
    PYTHONPATH=src:. python -m benchmarks                    # S1-S4, fp16 and bf16, all baselines
    PYTHONPATH=src:. python -m benchmarks --dry-run          # CPU check of the workloads, no GPU
    PYTHONPATH=src:. python -m benchmarks --quick --clocks   # also the SM clock, power and throttle
                                                             # reasons while each baseline is timed
    PYTHONPATH=src:. python -m benchmarks.ncu_probe --out D  # one launch each under Nsight Compute

Modules: ``workloads`` (the eight epilogues, operand builders, baselines), ``run`` (the driver,
``main(argv)`` and ``dry_run()``), ``timing`` (do_bench, clocks, versions), ``report`` (table,
JSON, PNG); ``probe``, ``ncu_probe``, ``overhead``, ``startup`` and ``training`` are the side
measurements RESULTS.md quotes.
"""
from .run import dry_run, main

__all__ = ["main", "dry_run"]
