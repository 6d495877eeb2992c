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
from . import ops
from .api import EpilogueArguments, GemmArguments, gemm, get_kernels, kernel_statuses
from .errors import EpilogueError, InternalError
from . import nn, torch_ops  # noqa: E402  (registers the epifuse:: custom ops)
from . import debug, epilogues  # noqa: E402
from .fused import FusedGemm  # noqa: E402
from .grouped import GroupedGemmArguments  # noqa: E402

__version__ = "0.1.0"

__all__ = ["EpilogueArguments", "GemmArguments", "get_kernels", "kernel_statuses", "gemm",
           "EpilogueError", "InternalError", "ops", "nn", "torch_ops", "__version__",
           "FusedGemm", "epilogues", "debug", "GroupedGemmArguments"]
