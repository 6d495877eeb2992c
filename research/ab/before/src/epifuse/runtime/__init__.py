"""Run-time support: the on-disk cache of generated kernels."""
