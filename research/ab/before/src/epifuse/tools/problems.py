"""Problems to try an epilogue on: random arguments for given roles, and a report of what a
problem's layout allows (the command line's `kernels`, `verify` and `profile` use them)."""
from __future__ import annotations

import math
from typing import Any

import torch

from ..allocation import allocate_outputs
from ..arguments import EpilogueArguments, GemmArguments, epilogue_program
from ..errors import EpilogueArgumentError, did_you_mean
from ..ops import dtype_name
from .roles import ROLES


def check_roles(program, roles: dict) -> None:
    """Every name given a role is an operand of `program` (a typo would be drawn as a tile)."""
    unknown = [n for n in roles if n not in program.operands]
    if unknown:
        raise EpilogueArgumentError(f"--role names {unknown[0]!r}, which is not an operand of {program.name}.",
                                    hint=did_you_mean(unknown[0], program.operands) or
                                    f"Its operands: {', '.join(program.operands) or 'none'}.")


def random_arguments(epilogue: Any, M: int, N: int, K: int, *, L: int | None = None,
                     dtype: torch.dtype = torch.float16, roles: dict[str, str] | None = None,
                     device: str | torch.device | None = None, out_dtype: torch.dtype | None = None,
                     seed: int = 0, fill: bool = True, layout_a: str = "row", layout_b: str = "row",
                     precision: str = "default"):
    """GemmArguments with random A, B and operands for `epilogue` (a function, string, activation
    name or Program). `roles` maps an operand to number, scalar (a one-element tensor), row (N,),
    col (M, 1), tile, or batch (L, 1, 1); the default is a tile. A/B layouts: "row" (K or N
    contiguous) or "col" (a transposed view)."""
    for name, layout in (("layout_a", layout_a), ("layout_b", layout_b)):
        if layout not in ("row", "col"):
            raise EpilogueArgumentError(f"{name} must be 'row' or 'col', not {layout!r}.")
    program = epilogue_program(epilogue)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator().manual_seed(seed)
    batch = (L,) if L is not None else ()
    make = (lambda *s: torch.randn(*s, generator=gen)) if fill else (lambda *s: torch.empty(*s))

    def matrix(rows, cols, layout, scale=1.0):
        t = make(*batch, rows, cols) * scale if layout == "row" else (make(*batch, cols, rows) * scale).transpose(-1, -2)
        return t.to(device=device, dtype=dtype)

    A = matrix(M, K, layout_a)
    B = matrix(K, N, layout_b, 1.0 / math.sqrt(max(K, 1)))
    roles = {**dict(getattr(epilogue, "roles", {}) or {}), **(roles or {})}
    check_roles(program, roles)
    shapes = {"scalar": (1,), "row": (N,), "col": (M, 1), "tile": (*batch, M, N), "batch": (L or 1, 1, 1)}
    tensors: dict[str, Any] = {}
    for name in program.operands:
        role = roles.get(name, "tile")
        if role not in ROLES:
            raise EpilogueArgumentError(f"Unknown role {role!r} for {name}.", hint=f"Roles: {', '.join(ROLES)}.")
        if role == "number":
            tensors[name] = round(0.5 + float(torch.rand((), generator=gen)), 3)
        else:
            tensors[name] = make(*shapes[role]).to(device=device, dtype=torch.float32)
    tensors = allocate_outputs(program, A, B, tensors, out_dtype)
    epi = EpilogueArguments(program, **tensors)
    return GemmArguments(A, B, epilogue=epi, precision=precision)


def alignment_report(args) -> list[tuple[str, bool, str]]:
    """(tensor, ok, explanation) for A, B and every tensor operand and output: the 16-byte base
    and leading-stride alignment TMA needs, and which dimension is contiguous."""
    tensors = [("A", args.A), ("B", args.B)]
    tensors += [(n, v) for n, v in args.operands.items() if isinstance(v, torch.Tensor) and v.numel() > 1]
    tensors += list(args.outputs.items())
    rows = []
    for name, t in tensors:
        size = t.element_size()
        problems = []
        base = t.data_ptr() % 16
        if base:
            problems.append(f"base address is {t.data_ptr() % 16} bytes past a 16-byte boundary")
        strides = [s for s, n in zip(t.stride(), t.shape) if n > 1]
        inner = [d for d, (s, n) in enumerate(zip(t.stride(), t.shape)) if s == 1 and n > 1]
        if t.dim() >= 2 and t.shape[-1] > 1 and t.stride(-1) != 1 and not (name == "B" and t.stride(-2) == 1):
            problems.append("last dimension is not contiguous")
        leading = [s for s in strides if s != 1]
        bad = [s for s in leading if (s * size) % 16]
        if bad:
            problems.append(f"stride {bad[0]} ({bad[0] * size} bytes) is not a multiple of 16 bytes")
        layout = ("contiguous along dim " + ", ".join(map(str, inner))) if inner else "no unit stride"
        desc = f"{tuple(t.shape)} {dtype_name(t.dtype)}, strides {tuple(t.stride())}, {layout}"
        if problems:
            rows.append((name, False, f"{desc}: {'; '.join(problems)} (TMA kernels cannot use it; "
                                      "the tiled kernel loads it with pointers)"))
        else:
            rows.append((name, True, f"{desc}: 16-byte aligned"))
    return rows
