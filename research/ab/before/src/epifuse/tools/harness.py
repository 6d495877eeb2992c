"""Where `epifuse bench` finds the benchmark harness: `bench/`, a top-level package at the root
of a source checkout, which the installed package (the wheel) does not contain.

The checkout is the current directory or a folder above it, else the checkout an editable
install imports this package from. The `epifuse` console script does not put the current
directory on sys.path (`python -m` does), so the checkout's root is added to it here.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

# what a checkout of epifuse holds: the harness's driver and the package's source
MARKERS = (Path("bench", "run.py"), Path("src", "epifuse", "__init__.py"))
# the checkout this module sits in when installed editable (src/epifuse/tools/harness.py); in
# an installed wheel, a folder of site-packages, which is no checkout
PACKAGE_CHECKOUT: Path | None = Path(__file__).resolve().parents[3]


class HarnessNotFound(FileNotFoundError):
    """No checkout with bench/ where `epifuse bench` looked; the message says what to do."""


def is_checkout(folder: Path) -> bool:
    return all((folder / marker).is_file() for marker in MARKERS)


def find_checkout(start: Path | str | None = None) -> Path | None:
    """The root of the source checkout holding bench/: the checkout the running epifuse was
    imported from (PACKAGE_CHECKOUT, an editable install or PYTHONPATH=src), so the harness
    measures the code that runs; else `start` (default the current directory) or the nearest
    folder above it that is one (an installed epifuse benchmarked by a clone's harness); None
    if none is."""
    start = (Path.cwd() if start is None else Path(start)).resolve()
    for folder in (*([PACKAGE_CHECKOUT] if PACKAGE_CHECKOUT else []), start, *start.parents):
        if is_checkout(folder):
            return folder
    return None


def not_found_message(start: Path) -> str:
    return (f"the benchmark harness (bench/) comes with epifuse's source, not with the installed "
            f"package, and neither {start} nor a folder above it is a checkout of epifuse: clone "
            f"the repository and run `epifuse bench ...` (or `python -m bench ...`) from its root")


def bench_main(start: Path | str | None = None):
    """The harness's `main(argv)` (bench/run.py), imported from the checkout find_checkout
    finds; HarnessNotFound (an OSError) when there is none."""
    root = find_checkout(start)
    if root is None:
        raise HarnessNotFound(not_found_message((Path.cwd() if start is None else Path(start)).resolve()))
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    module = importlib.import_module("bench.run")
    found = Path(module.__file__).resolve().parent
    if found != root / "bench":   # another top-level `bench` was imported first
        raise HarnessNotFound(f"`import bench` found {found}, not the harness in {root / 'bench'}: "
                              f"run `python -m bench ...` from {root}")
    return module.main


def run_bench(argv: list, start: Path | str | None = None) -> int:
    """`epifuse bench ARGS`: the harness run with `argv` (e.g. ["--quick"], ["--dry-run"])."""
    return bench_main(start)(list(argv))
