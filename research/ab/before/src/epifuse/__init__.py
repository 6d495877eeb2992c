"""epifuse: fuse Python epilogues into GPU matrix multiplications.

>>> import torch, epifuse
>>> from epifuse.ops import relu
>>> def epi(accum, alpha):
...     D = relu(accum * alpha)
...     return D
>>> epifuse.gemm(torch.ones(2, 3), -torch.ones(3, 2), epi, alpha=2.0)
tensor([[0., 0.],
        [0., 0.]])
"""
import importlib as _importlib
import importlib.util as _importlib_util
import pkgutil as _pkgutil
from typing import TYPE_CHECKING

# The custom ops load with the package: a saved graph or exported program that names
# torch.ops.epifuse.gemm loads after `import epifuse`, as torch's own ops do after `import torch`.
# They import torch and Triton (torch + about 0.3 s); torch.compile's machinery (torch._dynamo)
# waits for torch.compile.
from . import torch_ops
from . import backend as _backend  # noqa: F401 - registers backend="epifuse" for torch.compile (no torch._dynamo import)
from .errors import EpilogueError, InternalError
from .version import __version__

if TYPE_CHECKING:   # the names below as type checkers see them; at run time each loads on first use
    from . import debug, epilogues, nn, ops
    from .api import (EpilogueArguments, GemmArguments, GroupedGemmArguments, gemm, gemm_planar_complex, get_kernels,
                      kernel_statuses)
    from .backend import explain
    from .fused import FusedGemm
    from .losses import linear_cross_entropy

# What loads on first use (a module __getattr__, PEP 562): the submodules, and names by the
# module that defines them. The block above imports the same; docs/design/structure.py checks
# that the two agree. Any other submodule (epifuse.activations, epifuse.frontend, ...) also loads
# when it is first named.
_SUBMODULES = ("debug", "epilogues", "nn", "ops")
_NAMES = {"api": ("EpilogueArguments", "GemmArguments", "GroupedGemmArguments", "gemm", "gemm_planar_complex",
                  "get_kernels", "kernel_statuses"),
          "backend": ("explain",), "fused": ("FusedGemm",), "losses": ("linear_cross_entropy",)}
_HOME = {**{name: module for module, names in _NAMES.items() for name in names},
         **{module: module for module in _SUBMODULES}}

__all__ = ["EpilogueArguments", "GemmArguments", "GroupedGemmArguments", "get_kernels", "kernel_statuses",
           "gemm", "gemm_planar_complex", "linear_cross_entropy", "explain", "EpilogueError", "InternalError", "FusedGemm", "ops", "nn", "torch_ops", "epilogues",
           "debug", "__version__"]


def __getattr__(name: str):
    module = _HOME.get(name)
    if module is None:
        if name.startswith("_") or _importlib_util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        module = name
    value = _importlib.import_module(f"{__name__}.{module}")
    if name != module:
        value = getattr(value, name)
    globals()[name] = value   # later lookups find it without this function
    return value


def __dir__() -> list[str]:
    submodules = {info.name for info in _pkgutil.iter_modules(__path__) if info.name != "__main__"}
    return sorted({*__all__, *submodules, "__version__"})
