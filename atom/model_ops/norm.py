"""RMSNorm, with the residual add fused in: `norm(x, residual) -> (normed, x + residual)`."""
from __future__ import annotations

import torch
from torch import nn

from atom.model_ops import kernel_backend


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # one fused op, same result
        return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        k = kernel_backend.get(x)
        if residual is None:
            return k.rms_norm(x, self.weight, self.eps) if k else rms_norm_ref(x, self.weight, self.eps)
        if k:
            return k.fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return rms_norm_ref(residual, self.weight, self.eps), residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
