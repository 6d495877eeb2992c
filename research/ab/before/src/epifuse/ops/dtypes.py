"""Dtype names: the one table between torch dtypes and the names epilogues and op keys use.

An epilogue writes `x.to(torch.float16)` or `x.half()`; the custom ops carry output dtypes as
names ("bfloat16"); the command line takes names too. Every such name is read here.
"""
from __future__ import annotations

import torch

# torch's own name for every dtype it has ("float16", "bfloat16", "float8_e4m3fn", ...)
_BY_NAME = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
# other spellings torch accepts for the same dtypes
_ALIASES = {"float": "float32", "half": "float16", "double": "float64"}
# the dtypes a value may be rounded through inside an epilogue (`x.to(dtype)`): floats only,
# since epilogue math stays floating point
ROUNDING = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2")
# Tensor methods that round through a dtype: x.half() is x.to(torch.float16)
CAST_METHODS = {"half": "float16", "float": "float32", "bfloat16": "bfloat16", "double": "float64"}


def dtype_from_name(name: str) -> torch.dtype | None:
    """The torch dtype a name spells ("float16", "half", ...), or None."""
    return _BY_NAME.get(_ALIASES.get(name, name))


def rounding_dtype(name: str) -> torch.dtype | None:
    """The dtype `x.to(name)` may round an epilogue value through, or None."""
    canonical = _ALIASES.get(name, name)
    return _BY_NAME[canonical] if canonical in ROUNDING else None


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of `dtype`, without the module: "float16"."""
    return str(dtype).removeprefix("torch.")


__all__ = ["dtype_from_name", "rounding_dtype", "dtype_name", "ROUNDING", "CAST_METHODS"]
