"""The Triton norm and activation kernels as registered ops, for compiled graphs (level 3).

Under torch.compile a layer's torch code is what Inductor sees, and it generates its own
kernels for it; for the decoder layer's RMSNorms (with the residual add) and SiLU-and-mul
on prefill-sized inputs those were slower than the engine's kernels (docs/perf has the
profiles). Registered ops are opaque to the compiler, so a compiled graph that calls these
runs the engine's kernels, as level 0 does (`tuning.fusions`, compiled branch).
Each op is functional (fresh outputs, nothing mutated), so Inductor needs no copies around it.
"""
from __future__ import annotations

import torch

from atom.model_ops.kernels.activation import silu_and_mul as _silu_and_mul
from atom.model_ops.kernels.rmsnorm import fused_add_rms_norm as _fused_add_rms_norm
from atom.model_ops.kernels.rmsnorm import rms_norm as _rms_norm


@torch.library.custom_op("atom::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (`kernels.rms_norm`)."""
    return _rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("atom::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) (`kernels.fused_add_rms_norm`)."""
    return _fused_add_rms_norm(x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape), residual.new_empty(residual.shape)


@torch.library.custom_op("atom::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:] (`kernels.silu_and_mul`)."""
    return _silu_and_mul(x)


@silu_and_mul.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


def norm(norm_layer, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """An `RMSNorm` layer's (normed, residual) through the ops: no add when `residual` is None
    (the residual is then x)."""
    if residual is None:
        return torch.ops.atom.rms_norm(x, norm_layer.weight, norm_layer.eps), x
    return torch.ops.atom.fused_add_rms_norm(x, residual, norm_layer.weight, norm_layer.eps)
