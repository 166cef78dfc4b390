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


def gpt_oss_swiglu(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """GPT-OSS's clamped gated activation on a packed [gate | up] input (halves, as the MoE
    layer stacks them; the checkpoint interleaves them and the loader de-interleaves):
    gate clamped above at `limit`, up clamped to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate), as transformers' `GptOssExperts._apply_gate`."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
