"""uint8 A and B through the int8 kernels.

Triton's `tl.dot` multiplies int8 but not uint8 (Hopper's wgmma has u8 x u8 and u8 x s8; Triton
does not expose them), so `epifuse.gemm` runs a GEMM with a uint8 input on int8 ones. A uint8
x is x' + 128 with x' = x ^ 0x80 read as int8 (exact; one pass over the input), so

    A @ B = A' @ B' + 128 colsum(B')   where A is uint8
                    + 128 rowsum(A')   where B is uint8
                    + 128 * 128 * K    where both are

(A' = A, B' = B for an int8 input). The int8 kernel accumulates A' @ B' in int32; the two
corrections, an (M, 1) and a (1, N) int32 column and row (per batch for batched inputs), are
added to accum as the epilogue's first step, in its compute dtype like every accum: exact while
every partial sum is an integer float32 holds (below 2**24 in magnitude: K up to 512 for any
inputs, and larger K where the values are), rounded as float32 rounds beyond. The passes cost one
read and write of each uint8 input and one read of each input for its sums, all memory-bound.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .errors import UnsupportedError
from .program import ACCUMULATORS, Expr, Program, Statement, rename

INTEGER_INPUTS = (torch.uint8, torch.int8)
OFFSET = 128


def applies(A, B) -> bool:
    """Whether (A, B) is a uint8 GEMM this module turns into an int8 one: tensors, one uint8,
    the other uint8 or int8 (other mixes are left to the checks that refuse them)."""
    return (isinstance(A, torch.Tensor) and isinstance(B, torch.Tensor)
            and A.dtype in INTEGER_INPUTS and B.dtype in INTEGER_INPUTS and torch.uint8 in (A.dtype, B.dtype))


def _signed(x: torch.Tensor) -> torch.Tensor:
    """x - 128 as int8, for a uint8 x (its bits with the top one flipped), in x's layout."""
    return torch.bitwise_xor(x, OFFSET).view(torch.int8)


def as_int8(program: Program, A: torch.Tensor, B: torch.Tensor) -> tuple[Program, torch.Tensor, torch.Tensor, dict]:
    """The int8 GEMM that computes the uint8 one: the program reading the corrected accum, the
    int8 inputs, and the correction operands to pass by name."""
    rewritten, rows_name, cols_name = corrected_program(program)
    A8 = _signed(A) if A.dtype == torch.uint8 else A
    B8 = _signed(B) if B.dtype == torch.uint8 else B
    K = A.shape[-1]
    batch_a, batch_b = tuple(A8.shape[:-2]), tuple(B8.shape[:-2])
    rows = torch.zeros((*batch_a, A8.shape[-2], 1), dtype=torch.int32, device=A8.device)
    cols = torch.zeros((*batch_b, 1, B8.shape[-1]), dtype=torch.int32, device=B8.device)
    if B.dtype == torch.uint8:
        rows += OFFSET * A8.sum(-1, keepdim=True, dtype=torch.int32)
    if A.dtype == torch.uint8:
        cols += OFFSET * B8.sum(-2, keepdim=True, dtype=torch.int32)
    if A.dtype == torch.uint8 and B.dtype == torch.uint8:
        rows += OFFSET * OFFSET * K
    return rewritten, A8, B8, {rows_name: rows, cols_name: cols}


@functools.lru_cache(maxsize=256)
def corrected_program(program: Program) -> tuple[Program, str, str]:
    """`program` with every read of accum reading `accum + rows + cols` instead, and the names
    of the two operands it gained (made unlike any name it uses)."""
    for leaf in ACCUMULATORS[1:]:
        if leaf in program.params:
            raise UnsupportedError(
                f"uint8 inputs in an epilogue that reads {leaf} (a {'planar complex' if leaf == 'accum_imag' else 'gated'} "
                "GEMM): only plain GEMMs take uint8 A or B.",
                program.param_locs[program.params.index(leaf)],
                "Pass int8 inputs (x - 128 as int8, and correct the result), or float ones.")
    if any(name == "accum" for name, _ in program.outputs):
        raise UnsupportedError(
            "uint8 inputs with accum itself returned: the int8 kernel's accum is corrected first, under "
            "another name.", program.outputs[0][1], "Return a copy instead: `D = accum; return D`.")
    taken = {*program.params, *(s.target for s in program.statements)}
    corrected, rows, cols = (_fresh(base, taken) for base in ("_u8_accum", "_u8_rows", "_u8_cols"))
    loc = program.param_locs[0] if program.param_locs else program.outputs[0][1]
    total = Expr("call", "add", (Expr("call", "add", (Expr("name", "accum", loc=loc), Expr("name", rows, loc=loc)),
                                      loc=loc), Expr("name", cols, loc=loc)), loc=loc)
    statements = (Statement(corrected, total, loc),
                  *(dataclasses.replace(s, expr=rename(s.expr, {"accum": corrected})) for s in program.statements))
    rewritten = dataclasses.replace(program, params=(*program.params, rows, cols),
                                    param_locs=(*program.param_locs, loc, loc), statements=statements)
    return rewritten, rows, cols


def _fresh(base: str, taken: set) -> str:
    name, n = base, 0
    while name in taken:
        n += 1
        name = f"{base}{n}"
    taken.add(name)
    return name
