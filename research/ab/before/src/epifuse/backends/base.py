"""The kernel contract.

A kernel answers `supports(args)` with a `Status` (ok, and a reason either way) before any
compilation, `compile(args)` prepares it ahead of time, and `run(args)` writes every output of
the epilogue. `epifuse.get_kernels` only hands out kernels whose status is ok and notes them on
the arguments (remember_supported); a kernel run on arguments it was not handed out for asks
`supports` first.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Status:
    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        return ("supported: " if self.ok else "not supported: ") + self.reason


def supported(reason: str) -> Status:
    return Status(True, reason)


def unsupported(reason: str) -> Status:
    return Status(False, reason)


def remember_supported(args, kernels) -> None:
    """Note on `args` the kernels found to support them (on this machine's GPU), so that
    running one of them asks nothing again."""
    args.__dict__.setdefault("_supported", set()).update(kernels)


def supported_before(args, kernel) -> bool:
    """Whether `kernel` was found to support `args` (remember_supported)."""
    return kernel in args.__dict__.get("_supported", ())


class Kernel:
    """What every kernel provides: `name`, and supports / compile / run."""

    name = "kernel"
    gluon = False  # written in Gluon (its own warp roles, TMA ring and register split): tuning's tie-break

    def supports(self, args, cc: int | None = None) -> Status:
        raise NotImplementedError

    def compile(self, args) -> None:
        """Compile for `args` (stand-ins too) ahead of run()."""
        raise NotImplementedError

    def compile_job(self, args):
        """Compile for `args` in two parts: what must happen in this thread, done now, and the
        rest (the compile proper, loading nothing onto the GPU) returned as a callable for a
        worker thread, or None when nothing is left (tuning's pool, runtime/ahead.py)."""
        self.compile(args)
        return None

    def run(self, args, verify: bool = False) -> None:
        """Write every output; with verify, check them against the float64 reference
        (epifuse.verify.VerificationError names the largest error and where)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{self.name}>"
