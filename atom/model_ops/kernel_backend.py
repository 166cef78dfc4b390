"""Which implementation the layers call: the Triton kernels on a GPU, torch on a CPU.

`get(x)` returns the kernels module for tensors on a GPU when the platform chose the
Triton backend, else None (the layer then runs its torch reference). Set once by the
`ModelRunner` through `atom.platform`; a notebook can flip it with `use_kernels(False)`.
"""
from __future__ import annotations

import torch

_enabled = True
_kernels = None


def use_kernels(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def get(x):
    """Under torch.compile the torch code is returned (None): Inductor fuses it itself."""
    global _kernels
    if not (_enabled and x.is_cuda) or torch.compiler.is_compiling():
        return None
    if _kernels is None:
        from atom import platform
        if platform.kernel_backend() == "torch":
            return None
        from atom.model_ops import kernels
        _kernels = kernels
    return _kernels
