"""epifuse's product benchmark (see BENCHMARKS.md in the project notes and README.md here).

Run from the repository root:

    PYTHONPATH=src:. python -m bench --quick            # S2, fp16, no inductor: a few minutes
    PYTHONPATH=src:. python -m bench                    # S1-S4, fp16 and bf16, all baselines
    PYTHONPATH=src:. python -m bench --dry-run          # CPU check of the workloads, no GPU
    PYTHONPATH=src:. python -m bench --quick --clocks   # also the SM clock, power and throttle
                                                        # reasons while each baseline is timed

Modules: ``workloads`` (the eight epilogues, operand builders, baselines), ``run`` (the driver,
``main(argv)`` and ``dry_run()``), ``timing`` (do_bench, clocks, versions), ``report`` (table,
JSON, PNG); ``overhead`` (host cost per call), ``startup`` (cold and warm starts) and
``training`` (training steps) measure the other targets. The research probes behind the design
decisions live in ``research/`` (research/README.md).
"""
from .run import dry_run, main

__all__ = ["main", "dry_run"]
