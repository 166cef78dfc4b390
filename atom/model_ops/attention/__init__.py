"""The attention layer: hands q, k, v to its backend, which writes this step's K/V into the
paged cache (the one place per backend that does) and attends.

A backend per attention kind: `TorchAttentionBackend` (the reference: CPU) and, on GPUs,
`TritonAttentionBackend` (the unified kernel behind a custom op); each declares the KV-cache
spec of the layers it serves (`kv_cache_spec`). The runner gives every layer its backend and
binds its cache views through the `KVCacheManager`. The layer reads the per-forward
`AttentionMetadata`.
"""
from __future__ import annotations

import torch
from torch import nn

from atom.distributed.state import current_parallel_state
from atom.model_ops.attention.metadata import (AttentionMetadata, current_forward_context, forward_context,
                                               get_forward_context, set_forward_context)
from atom.model_ops.attention.torch_backend import TorchAttentionBackend

__all__ = ["Attention", "AttentionMetadata", "TorchAttentionBackend", "forward_context", "get_forward_context",
           "current_forward_context", "set_forward_context"]


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int,
                 tp=None):
        """`num_heads` / `num_kv_heads`: the model's; the layer keeps this tensor-parallel
        rank's (`tp`, default: the model being built, `atom.distributed.building`)."""
        super().__init__()
        tp = tp if tp is not None else current_parallel_state()
        num_heads = tp.split(num_heads, "num_attention_heads")
        num_kv_heads = tp.kv_heads(num_kv_heads)[0]
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend = TorchAttentionBackend()

    def kv_cache_spec(self, dtype: torch.dtype):
        """What this layer stores per token (its backend decides the layout)."""
        return self.backend.kv_cache_spec(self, dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                rotary: tuple | None = None) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D]. k = v = None: this step's keys and values
        are in the cache already (a fused kernel wrote them; Triton backend only).
        `rotary` = (cos_sin_cache, q norm weight, k norm weight, eps) (decode steps, Triton
        backend only): q and k are unrotated; the attention kernel rotates them, after the
        norms where their weights are not None, and writes k and v into the cache."""
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        if k is not None:
            k = k.view(T, self.num_kv_heads, self.head_dim)
            v = v.view(T, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(self, q, k, v, rotary)
        return out.view(T, -1)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"backend={self.backend.name}, cache={tuple(self.k_cache.shape)}")
