"""SiLU-and-mul: the gated MLP's activation on a packed [gate | up] input."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.model_ops import kernel_backend


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    k = kernel_backend.get(x)
    return k.silu_and_mul(x) if k else silu_and_mul_ref(x)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
