"""Rotary position embedding (rotate-half layout, as HF Llama and Qwen3 use).

The cos/sin table is built once for `max_position` positions: cos in the first D/2
columns, sin in the last D/2. Frequencies follow the config's rope type: "default"
(plain theta), "linear" (positions divided by a factor) and "llama3" (long wavelengths
divided by the factor, short kept, a smooth blend between).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from atom.model_ops import kernel_backend


def rope_parameters(hf_config) -> dict:
    """theta + scaling of a HF config, for transformers 4 (rope_theta/rope_scaling) and 5."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    for k, v in scaling.items():
        params.setdefault(k, v)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def inv_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    theta = float(params["rope_theta"])
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(mid, blended, out)
    raise ValueError(f"rope_type={rope_type!r} is not supported: use default, linear or llama3")


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D/2] -> rotated x (computed in fp32)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        self.head_dim = head_dim
        self.params = params
        # fp32 throughout, as transformers computes it, so logits match it closely
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_frequencies(head_dim, params).float())
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self._last = None  # (positions, cos, sin) of the latest forward

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_norm=None, k_norm=None, kv_cache: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq*D], k [T, Hkv*D]; optional per-head RMSNorms (Qwen3) applied first.
        `kv_cache` (Triton kernels only): (v, k_cache, v_cache, slot_mapping) to write into."""
        kern = kernel_backend.get(q)
        if kern is not None:
            kern.rotary_embedding(positions, q, k, self.cos_sin_cache, self.head_dim,
                                  q_norm.weight if q_norm is not None else None,
                                  k_norm.weight if k_norm is not None else None,
                                  q_norm.eps if q_norm is not None else 1e-6, kv_cache=kv_cache)
            return q, k
        if kv_cache is not None:
            raise ValueError("kv_cache is written by the Triton rotary kernel only")
        T, D = q.shape[0], self.head_dim
        qh, kh = q.view(T, -1, D), k.view(T, -1, D)
        if q_norm is not None:
            qh, kh = q_norm(qh), k_norm(kh)
        cos, sin = self.cos_sin(positions)
        return apply_rotary_ref(qh, cos, sin).view(T, -1), apply_rotary_ref(kh, cos, sin).view(T, -1)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D/2] of `positions`; the layers of one forward share one lookup."""
        if torch.compiler.is_compiling():
            return self.cos_sin_cache[positions].chunk(2, dim=-1)
        if self._last is None or self._last[0] is not positions:
            self._last = (positions, *self.cos_sin_cache[positions].chunk(2, dim=-1))
        return self._last[1], self._last[2]

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, {self.params}"

