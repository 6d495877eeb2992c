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
from . import debug, epilogues, nn, ops, torch_ops
from .api import EpilogueArguments, GemmArguments, GroupedGemmArguments, gemm, get_kernels, kernel_statuses
from .errors import EpilogueError, InternalError
from .fused import FusedGemm
from .version import __version__

__all__ = ["EpilogueArguments", "GemmArguments", "GroupedGemmArguments", "get_kernels", "kernel_statuses",
           "gemm", "EpilogueError", "InternalError", "FusedGemm", "ops", "nn", "torch_ops", "epilogues",
           "debug", "__version__"]
