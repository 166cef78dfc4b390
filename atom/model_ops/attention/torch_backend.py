"""The torch attention backend (CPU, and any device without the Triton kernels).

Full keys and values per KV head in the paged cache (`FullAttentionSpec`); `write_kv` is the
one place that writes them; attention is the reference in `torch_native`.
"""
from __future__ import annotations

import torch

from atom.model_engine.kv_cache import FullAttentionSpec
from atom.model_ops.attention import torch_native
from atom.model_ops.attention.metadata import get_forward_context


class TorchAttentionBackend:
    name = "torch"

    def kv_cache_spec(self, layer, dtype: torch.dtype) -> FullAttentionSpec:
        return FullAttentionSpec(layer.num_kv_heads, layer.head_dim, dtype)

    def write_kv(self, layer, k: torch.Tensor, v: torch.Tensor, meta) -> None:
        torch_native.write_kv_cache(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping, meta.step_cache)

    def forward(self, layer, q, k, v, rotary=None) -> torch.Tensor:
        if rotary is not None:
            raise ValueError("the rotary embedding folds into the Triton attention kernel only")
        if k is None:
            raise ValueError("the torch attention backend needs this step's k and v")
        meta = get_forward_context()
        self.write_kv(layer, k, v, meta)
        return torch_native.paged_attention(q, layer.k_cache, layer.v_cache, meta, layer.scale)

    def __repr__(self) -> str:
        return "TorchAttentionBackend()"
