"""Every op epifuse knows, importable by name.

Inside an epilogue these names are parsed, never called. Called on torch tensors they run the
op's torch reference, so an epilogue function is also its own eager version:

>>> import torch
>>> from epifuse.ops import relu
>>> relu(torch.tensor([-1.0, 2.0]))
tensor([0., 2.])
"""
from .registry import OPS, Cost, OpDef, Reduction, Symbolic, lookup, reductions, register, spellings
from .dtypes import dtype_from_name, dtype_name, rounding_dtype
from .elementwise import *  # noqa: F401,F403  (the op objects)
from .reduce import *  # noqa: F401,F403
from .indices import *  # noqa: F401,F403
from .composite import *  # noqa: F401,F403
from .complex import *  # noqa: F401,F403
from .halves import *  # noqa: F401,F403

__all__ = ["OPS", "OpDef", "Cost", "Reduction", "Symbolic", "lookup", "register", "spellings", "reductions",
           "dtype_from_name", "dtype_name", "rounding_dtype", *OPS]
