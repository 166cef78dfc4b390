"""GPU attention: the KV-cache write and the Triton unified kernel, as one custom op.

`atom::unified_attention_with_output(q, k, v, output, layer_idx)` writes this step's K/V
into layer `layer_idx`'s cache and attends for the whole batch in one launch; with k and v
None the cache already holds them (the rotary kernel wrote them, see LlamaAttention); with
`cos_sin_cache` (decode steps) q, k are unrotated and the attention kernel rotates them
(after the q / k norms when their weights are given) and writes k and v itself. Being a
registered op, it is opaque to torch.compile: level 3 splits the graph there
(`splitting_ops`). The layer caches and the per-forward metadata are found through
`register_layers` and the forward context, like vLLM's attention op.
"""
from __future__ import annotations

from typing import Optional

import torch

from atom.model_ops.attention.metadata import get_forward_context
from atom.model_ops.attention.triton_unified import AttentionWorkspace, DecodeRope, unified_attention
from atom.model_ops.kernels.kv_cache import reshape_and_cache

OP_NAME = "atom::unified_attention_with_output"
_LAYERS: list = []          # Attention modules, by layer index
_WORKSPACE: list = [None]   # the split-KV scratch, shared by all layers


def register_layers(layers: list, max_num_tokens: int, device) -> None:
    """Called by the ModelRunner with its attention layers (their caches are read per call)."""
    _LAYERS[:] = layers
    a = layers[0]
    _WORKSPACE[0] = AttentionWorkspace(max_num_tokens, a.num_heads, a.head_dim, device=device)


def current_workspace() -> Optional[AttentionWorkspace]:
    """The split-KV scratch the op uses now (None before `register_layers`)."""
    return _WORKSPACE[0]


@torch.library.custom_op(OP_NAME, mutates_args=("output",))
def unified_attention_with_output(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                                  output: torch.Tensor, layer_idx: int,
                                  cos_sin_cache: Optional[torch.Tensor] = None,
                                  q_norm_weight: Optional[torch.Tensor] = None,
                                  k_norm_weight: Optional[torch.Tensor] = None, norm_eps: float = 1e-6) -> None:
    layer = _LAYERS[layer_idx]
    meta = get_forward_context()
    rope = None
    if cos_sin_cache is not None:  # decode: q unrotated, the kernel rotates and writes k / v itself
        rope = DecodeRope(cos_sin_cache, k, v, meta.slot_mapping, q_norm_weight, k_norm_weight, norm_eps)
    elif k is not None:
        reshape_and_cache(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping)
    unified_attention(q, layer.k_cache, layer.v_cache, output, meta.cu_seqlens_q, meta.seq_lens,
                      meta.block_tables, layer.scale, meta.max_query_len, workspace=_WORKSPACE[0], rope=rope)


@unified_attention_with_output.register_fake
def _(q, k, v, output, layer_idx, cos_sin_cache=None, q_norm_weight=None, k_norm_weight=None,
      norm_eps=1e-6) -> None:
    return None
