"""YaRN rotary frequencies and the rotary embedding of DeepSeek's MLA (its rope dims only).

DeepSeek-V2/V3 rotate only the `qk_rope_head_dim` part of each query head and the one shared
rope key. Two conventions meet here:

- which dims pair up: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (V2 always,
  through complex multiplication; V3 when `rope_interleave` is true); with `interleaved=False`
  the pairs are (x_i, x_{i+D/2}) as in Llama ("rotate half").
- YaRN (`rope_type="yarn"`): frequencies blended between interpolation (divided by `factor`)
  and extrapolation by a linear ramp over the dims between the `beta_fast` / `beta_slow`
  correction points; cos and sin are multiplied by an attention factor
  (`mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are given), and the
  softmax scale by `mscale(factor, mscale_all_dim)**2` (`mla_softmax_scale`).

Both as transformers 5.24 computes them (`_compute_yarn_parameters`, DeepseekV2/V3 attention),
in fp32. Rotated pairs are written back interleaved (where they came from); queries and keys
share the layout, so attention scores do not depend on it.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from atom.model_ops import kernel_backend
from atom.model_ops.rotary import RotaryEmbedding, inv_frequencies


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_frequencies(dim: int, params: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2], attention_factor) of a YaRN rope over `dim` rotary dims."""
    base = float(params["rope_theta"])
    orig = params.get("original_max_position_embeddings")
    if orig is None:
        raise ValueError("rope_parameters.original_max_position_embeddings is missing: YaRN needs it")
    factor = params.get("factor") or max_position / orig
    attn_factor = params.get("attention_factor")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if attn_factor is None:
        attn_factor = (yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all)
                       if mscale and mscale_all else yarn_get_mscale(factor))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn_factor)


def rope_frequencies(dim: int, params: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_factor) for the rope types DeepSeek configs use (yarn) and the
    plain ones `atom.model_ops.rotary` knows (attention factor 1)."""
    if params["rope_type"] == "yarn":
        return yarn_frequencies(dim, params, max_position)
    return inv_frequencies(dim, params), 1.0


def mla_softmax_scale(qk_head_dim: int, params: dict) -> float:
    """qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under a scaled rope (DeepSeek)."""
    scale = qk_head_dim ** -0.5
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = yarn_get_mscale(params["factor"], params["mscale_all_dim"])
        scale = scale * m * m
    return scale


class DeepseekRotaryEmbedding(nn.Module):
    """Rotates q_pe [T, H, D] and k_pe [T, D] (D = qk_rope_head_dim) at `positions`."""

    def __init__(self, dim: int, max_position: int, params: dict, interleaved: bool = True):
        super().__init__()
        if dim % 2:
            raise ValueError(f"qk_rope_head_dim={dim} is invalid: must be even")
        self.dim, self.params, self.interleaved = dim, params, interleaved
        inv_freq, self.attention_factor = rope_frequencies(dim, params, max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        cache = torch.cat((freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D], cos / sin [T, 1, D/2] -> rotated (fp32 math, x's dtype out)."""
        xf = x.float()
        if self.interleaved:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)
        x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def forward(self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor):
        """Returns the rotated (q_pe, k_pe): with the engine's kernels, q_pe and k_pe themselves,
        rotated in place by one launch (views of the projections are fine); else new tensors."""
        kern = kernel_backend.get(q_pe)
        if kern is not None:
            kern.rotary_embedding(positions, q_pe, k_pe, self.cos_sin_cache, self.dim, interleaved=self.interleaved)
            return q_pe, k_pe
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return self.rotate(q_pe, cos, sin), self.rotate(k_pe[:, None, :], cos, sin)[:, 0]

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, interleaved={self.interleaved}, attention_factor={self.attention_factor:.4f}, "
                f"{self.params}")


class YarnRotaryEmbedding(RotaryEmbedding):
    """The rotate-half rotary (`RotaryEmbedding`: pairs (x_i, x_{i+D/2}), the same kernels)
    over YaRN frequencies, its cos and sin multiplied by the attention factor: GPT-OSS, as
    transformers' `GptOssRotaryEmbedding` + `_apply_rotary_emb` compute it (fp32 table)."""

    def __init__(self, head_dim: int, max_position: int, params: dict):
        nn.Module.__init__(self)
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} is invalid for a rotary embedding: must be even")
        self.head_dim, self.params = head_dim, params
        inv_freq, self.attention_factor = rope_frequencies(head_dim, params, max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        cache = torch.cat((freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self._last = None
