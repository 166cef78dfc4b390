"""Which implementation the layers call: the Triton kernels on a GPU, torch on a CPU.

`get(x)` returns the kernels module for tensors on a GPU when the platform chose the
Triton or the AITER backend (`kernels_for`), else None (the layer then runs its torch
reference). Set once through `atom.platform`; a notebook can flip it with
`use_kernels(False)`.
"""
from __future__ import annotations

import torch

_enabled = True
_kernels = None  # the backend's module once chosen; False: torch


def use_kernels(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def kernels_for(backend: str):
    """The kernels module of a backend ("aiter": AITER's norm and activation kernels with the
    Triton kernels for the rest; "triton"; "torch": None, the layers' torch references)."""
    if backend == "torch":
        return None
    if backend == "aiter":
        from atom.model_ops import kernels_aiter
        return kernels_aiter
    from atom.model_ops import kernels
    return kernels


def get(x):
    """Under torch.compile the torch code is returned (None): Inductor fuses it itself."""
    global _kernels
    if not (_enabled and x.is_cuda) or torch.compiler.is_compiling():
        return None
    if _kernels is None:
        from atom import platform
        _kernels = kernels_for(platform.kernel_backend()) or False
    return _kernels or None
