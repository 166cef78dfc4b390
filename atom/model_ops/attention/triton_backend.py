"""The Triton attention backend: the KV-cache write and the unified kernel, as one custom op.

`atom::unified_attention_with_output(q, k, v, output, layer_idx)` writes this step's K/V
into layer `layer_idx`'s cache and attends for the whole batch in one launch; with k and v
None the cache already holds them (a fused rotary / GEMV kernel wrote them into the target
`cache_target` handed out); with `cos_sin_cache` (decode steps) q, k are unrotated and the
attention kernel rotates them (after the q / k norms when their weights are given) and
writes k and v itself. Being a registered op, it is opaque to torch.compile: level 3 splits
the graph there (`splitting_ops`). The op finds the engine's backend (its layers and
split-KV scratch) through the per-forward context, so engines in one process do not share them.
Each layer's sinks, sliding window and FP8 scales (`Attention.options`) go to the kernel and
the cache write; the fused rotary / GEMV cache writes are declined for an FP8 cache
(`cache_target` is None), the attention kernel's own decode write quantizes.
"""
from __future__ import annotations

from typing import Optional

import torch

from atom.model_engine.kv_cache import FullAttentionSpec
from atom.model_ops.attention.metadata import get_forward_context
from atom.model_ops.attention.triton_unified import AttentionWorkspace, DecodeRope, unified_attention
from atom.model_ops.kernels.kv_cache import FP8_CACHE_DTYPES, reshape_and_cache

OP_NAME = "atom::unified_attention_with_output"


class TritonAttentionBackend:
    """One per engine: its attention layers (by layer index) and the split-KV scratch."""
    name = "triton"

    def __init__(self, layers: list, max_num_tokens: int, device):
        self.layers = list(layers)
        a = layers[0]
        self.workspace = AttentionWorkspace(max_num_tokens, a.num_heads, a.head_dim, device=device)

    def kv_cache_spec(self, layer, dtype: torch.dtype) -> FullAttentionSpec:
        return FullAttentionSpec(layer.num_kv_heads, layer.head_dim, dtype, layer.sliding_window)

    # --- the cache writes: the plain kernel here, and the target fused kernels write into
    def write_kv(self, layer, k: torch.Tensor, v: torch.Tensor, meta) -> None:
        layer.calibrate_kv_scales(k, v)
        reshape_and_cache(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping, layer.k_scale, layer.v_scale)

    def cache_target(self, layer, meta) -> tuple | None:
        """(k_cache, v_cache, slot_mapping): where a fused kernel writes this step's K/V; None
        for an FP8 cache (the rotary and GEMV kernels store plain casts; the fusions then run
        unfused and this backend's `write_kv` quantizes)."""
        if layer.k_cache.dtype in FP8_CACHE_DTYPES:
            return None
        return layer.k_cache, layer.v_cache, meta.slot_mapping

    def forward(self, layer, q, k, v, rotary=None) -> torch.Tensor:
        """Opaque to torch.compile: the op reads the forward context, this method does not."""
        out = torch.empty_like(q)
        torch.ops.atom.unified_attention_with_output(q, k, v, out, layer.layer_idx, *(rotary or ()))
        return out

    def __repr__(self) -> str:
        return f"TritonAttentionBackend(layers={len(self.layers)}, workspace={self.workspace!r})"


@torch.library.custom_op(OP_NAME, mutates_args=("output",))
def unified_attention_with_output(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                                  output: torch.Tensor, layer_idx: int,
                                  cos_sin_cache: Optional[torch.Tensor] = None,
                                  q_norm_weight: Optional[torch.Tensor] = None,
                                  k_norm_weight: Optional[torch.Tensor] = None, norm_eps: float = 1e-6) -> None:
    meta = get_forward_context()
    backend = meta.attn_backend
    layer = backend.layers[layer_idx]
    rope = None
    if cos_sin_cache is not None:  # decode: q unrotated, the kernel rotates and writes k / v itself
        rope = DecodeRope(cos_sin_cache, k, v, meta.slot_mapping, q_norm_weight, k_norm_weight, norm_eps)
    elif k is not None:
        backend.write_kv(layer, k, v, meta)
    unified_attention(q, layer.k_cache, layer.v_cache, output, meta.cu_seqlens_q, meta.seq_lens,
                      meta.block_tables, layer.scale, meta.max_query_len, workspace=backend.workspace, rope=rope,
                      options=layer.options)


@unified_attention_with_output.register_fake
def _(q, k, v, output, layer_idx, cos_sin_cache=None, q_norm_weight=None, k_norm_weight=None,
      norm_eps=1e-6) -> None:
    return None
