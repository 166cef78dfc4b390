"""The attention layer: writes this step's K/V into the paged cache, then attends (on a GPU
the rotary kernel may have written them already: then k = v = None).

The backend is chosen by `atom.platform` (torch reference on a CPU, the Triton unified
kernel on a GPU). The layer reads the per-forward `AttentionMetadata`; the `ModelRunner`
assigns `k_cache` / `v_cache` after it allocates the cache.
"""
from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.attention.metadata import (AttentionMetadata, forward_context,
                                               get_forward_context, set_forward_context)
from atom.model_ops.attention import torch_native

__all__ = ["Attention", "AttentionMetadata", "forward_context", "get_forward_context",
           "set_forward_context"]


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                rotary: tuple | None = None) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D]. k = v = None: this step's keys and values
        are in the cache already (written by the rotary kernel; Triton backend only).
        `rotary` = (cos_sin_cache, q norm weight, k norm weight, eps) (decode steps, Triton
        backend only): q and k are unrotated; the attention kernel rotates them, after the
        norms where their weights are not None, and writes k and v into the cache."""
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        if k is not None:
            k = k.view(T, self.num_kv_heads, self.head_dim)
            v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.backend == "triton":  # the custom op registered by attention.triton_backend
            out = torch.empty_like(q)
            torch.ops.atom.unified_attention_with_output(q, k, v, out, self.layer_idx, *(rotary or ()))
        else:
            if rotary is not None:
                raise ValueError("the rotary embedding folds into the Triton attention kernel only")
            if k is None:
                raise ValueError("the torch attention backend needs this step's k and v")
            meta = get_forward_context()
            torch_native.write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping, meta.step_cache)
            out = torch_native.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale)
        return out.view(T, -1)

    def cache_write_args(self, v: torch.Tensor) -> tuple:
        """What a kernel that writes this step's keys and values needs: (v, k_cache, v_cache,
        the forward's slot mapping)."""
        return v, self.k_cache, self.v_cache, get_forward_context().slot_mapping

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"backend={self.backend}, cache={tuple(self.k_cache.shape)}")
