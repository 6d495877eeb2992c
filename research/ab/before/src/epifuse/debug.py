"""Debugging, in one place to import from: which kernel runs, verify a kernel, trace one tile,
draw the DAG.

    print(epifuse.debug.which_kernel(args))                 # what epifuse.gemm runs for args: a
                                                            # fused kernel or the reference, and why
    report = epifuse.debug.run(kernel, args, verify=True)   # raises VerificationError on a mismatch
    t = epifuse.debug.trace(args, tile=(1, 0))               # every intermediate value of tile (1, 0)
    print(t); t["F"]                                         # a table; one value by its name
    epifuse.debug.draw(args.graph, "epilogue.svg")           # graphviz, when `dot` is installed

The code lives in epifuse.backends.select (which kernel), epifuse.verify (verification against
the float64 reference) and epifuse.tools (trace, draw, random problems, profiler output).
"""
from .backends.select import which_kernel
from .tools.draw import dot_available, dot_source, draw
from .tools.ncu import compiled_stats, ncu_csv_rows, parse_ncu_csv, summarize_ncu
from .tools.problems import ROLES, alignment_report, check_roles, random_arguments
from .tools.trace import Step, Trace, trace
from .verify import (OutputCheck, Report, VerificationError, check, compare, default_tolerance,
                     reference_outputs, run, run_grouped, with_verify)

__all__ = ["which_kernel", "run", "run_grouped", "with_verify", "VerificationError", "Report", "OutputCheck",
           "reference_outputs", "compare", "check", "default_tolerance", "trace", "Trace", "Step",
           "alignment_report", "dot_source", "draw", "dot_available", "random_arguments", "ROLES",
           "check_roles", "ncu_csv_rows", "parse_ncu_csv", "summarize_ncu", "compiled_stats"]
