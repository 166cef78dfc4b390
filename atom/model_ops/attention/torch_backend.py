"""The torch attention backend (CPU, and any device without the Triton kernels).

Full keys and values per KV head in the paged cache (`FullAttentionSpec`, in the cache dtype
the runner asks for: the model's, or FP8); `write_kv` is the one place that writes them
(quantizing for an FP8 cache); attention is the reference in `torch_native` (with the layer's
sliding window, sinks and FP8 scales).
"""
from __future__ import annotations

import torch

from atom.model_engine.kv_cache import FullAttentionSpec
from atom.model_ops.attention import torch_native
from atom.model_ops.attention.metadata import get_forward_context


class TorchAttentionBackend:
    name = "torch"

    def kv_cache_spec(self, layer, dtype: torch.dtype) -> FullAttentionSpec:
        return FullAttentionSpec(layer.num_kv_heads, layer.head_dim, dtype, layer.sliding_window)

    def write_kv(self, layer, k: torch.Tensor, v: torch.Tensor, meta) -> None:
        layer.calibrate_kv_scales(k, v)
        torch_native.write_kv_cache(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping, meta.step_cache,
                                    layer.k_scale, layer.v_scale)

    def forward(self, layer, q, k, v, rotary=None, amax=None, qkv_sum=None) -> torch.Tensor:
        """`amax` (fp32 [T, Hq]): also filled with each row's and head's amax of the output."""
        if qkv_sum is not None:
            raise ValueError("a split-K q/k/v product summed on load folds into the Triton attention kernel only")
        if rotary is not None:
            raise ValueError("the rotary embedding folds into the Triton attention kernel only")
        if k is None:
            raise ValueError("the torch attention backend needs this step's k and v")
        meta = get_forward_context()
        self.write_kv(layer, k, v, meta)
        out = torch_native.paged_attention(q, layer.k_cache, layer.v_cache, meta, layer.scale, layer.options)
        if amax is not None:
            amax.copy_(out.float().abs().amax(-1))
        return out

    def __repr__(self) -> str:
        return "TorchAttentionBackend()"
