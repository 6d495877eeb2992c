"""The kernel-class contract.

A kernel answers `supports(args)` with a `Status` (ok, and a reason either way) before any
compilation, `compile(args)` prepares it ahead of time, and `run(args)` writes every output of
the epilogue. `run` validates nothing that `supports` already checked; `epifuse.get_kernels`
only hands out kernels whose status is ok.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Status:
    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        return ("supported: " if self.ok else "not supported: ") + self.reason


def check_arguments(kernel, args, grouped: bool = False) -> None:
    """A clear error where `args` is not the arguments object a kernel runs on."""
    expected = _argument_types()[grouped]
    if not isinstance(args, expected):
        from ..errors import EpilogueArgumentError
        raise EpilogueArgumentError(f"{kernel!r} runs on {expected.__name__}, not on {type(args).__name__}.",
                                    hint=f"Pass the {expected.__name__} the kernel was chosen for.")


@functools.lru_cache(maxsize=None)
def _argument_types() -> tuple:
    from ..api import GemmArguments   # the API imports the backends: not at this module's import
    from ..grouped import GroupedGemmArguments
    return GemmArguments, GroupedGemmArguments


def supported(reason: str) -> Status:
    return Status(True, reason)


def unsupported(reason: str) -> Status:
    return Status(False, reason)


class Kernel:
    """What every kernel class provides. Subclasses set `name` and implement the three methods."""

    name = "kernel"
    gluon = False  # written in Gluon (its own warp roles, TMA ring and register split): tuning's tie-break

    def supports(self, args) -> Status:
        raise NotImplementedError

    def compile(self, args) -> None:
        raise NotImplementedError

    def run(self, args, verify: bool = False) -> None:
        """Write every output; with verify, check them against the float64 reference
        (epifuse.debug.VerificationError names the largest error and where)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{self.name}>"
