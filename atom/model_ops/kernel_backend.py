"""Which implementation the layers call: the Triton (or AITER) kernels on a GPU, torch on a CPU.

`get(x)` returns the kernels module for tensor `x`, or None (the layer then runs its torch
reference). Inside a forward the engine's `KernelPlan` decides (it travels in the
per-forward context, so each engine has its own); outside one (a layer called by hand, the
sampler) the platform's choice holds for tensors on a GPU.
"""
from __future__ import annotations

import torch


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
    if torch.compiler.is_compiling():
        return None
    from atom.model_ops.attention.metadata import current_forward_context
    ctx = current_forward_context()
    if ctx is not None and ctx.plan is not None:
        return ctx.plan.kernels_for(x)
    if not x.is_cuda:
        return None
    from atom import platform
    return kernels_for(platform.kernel_backend())
