"""The Triton attention backend: the KV-cache write and the unified kernel, as one custom op.

`atom::unified_attention_with_output(q, k, v, output, amax, layer_idx)` writes this step's K/V
into layer `layer_idx`'s cache and attends for the whole batch in one launch; with k and v
None the cache already holds them (a fused rotary / GEMV kernel wrote them into the target
`cache_target` handed out); with `cos_sin_cache` (decode steps) q, k are unrotated and the
attention kernel rotates them (after the q / k norms when their weights are given) and
writes k and v itself. Being a registered op, it is opaque to torch.compile: level 3 splits
the graph there (`splitting_ops`). The op finds the engine's backend (its layers and
split-KV scratch) through the per-forward context, so engines in one process do not share them.
`atom::unified_attention_rope(qkv, ...)` is the compiled graphs' form (level 3, `forward_rope`):
the packed q/k/v projection in, the q/k norms, the rotary embedding and the cache write by the
rotary kernel (the "rope+kv_write" fusion), then the same attention, all inside one op, so
that Inductor neither regenerates the rotary nor copies q, k, v apart for the op.
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
from atom.model_ops.kernels.rotary import rotary_embedding

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

    def forward(self, layer, q, k, v, rotary=None, amax=None, qkv_sum=None) -> torch.Tensor:
        """Opaque to torch.compile: the op reads the forward context, this method does not.
        `amax` (fp32 [T, Hq]): also each row's and head's amax of the output as stored;
        `qkv_sum` = (splits, split_stride, dtype): q, k, v are a split-K product's partials
        (`Attention.forward`)."""
        splits, stride, dtype = qkv_sum if qkv_sum is not None else (0, 0, q.dtype)
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
        rot = tuple(rotary or ()) + (None, None, None, 1e-6)[len(rotary or ()):]
        torch.ops.atom.unified_attention_with_output(q, k, v, out, amax, layer.layer_idx, *rot, splits, stride)
        return out

    def forward_rope(self, layer, qkv: torch.Tensor, q_size: int, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor, q_norm=None, k_norm=None) -> torch.Tensor:
        """Attention of the packed, unrotated projection qkv [T, q + 2 kv] (rotated in place:
        the op declares it mutated): [T, q_size]."""
        out = qkv.new_empty(qkv.shape[0], q_size)
        torch.ops.atom.unified_attention_rope(
            qkv, out, layer.layer_idx, q_size, positions, cos_sin_cache,
            q_norm.weight if q_norm is not None else None, k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 1e-6)
        return out

    def __repr__(self) -> str:
        return f"TritonAttentionBackend(layers={len(self.layers)}, workspace={self.workspace!r})"


def _merge_in_kernel(meta) -> bool:
    """Whether the engine's plan merges split decode segments in the attention kernel
    ("merge_in_attention")."""
    plan = getattr(meta, "plan", None)
    return plan is not None and plan.has("merge_in_attention")


# The mutated arguments (output, amax) have no defaults: torch 2.11's ADInplaceOrView kernel
# indexes the boxed arguments by schema position, and the dispatcher leaves out trailing
# arguments equal to their defaults, so a defaulted `amax` passed as None was out of range
@torch.library.custom_op(OP_NAME, mutates_args=("output", "amax"))
def unified_attention_with_output(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                                  output: torch.Tensor, amax: Optional[torch.Tensor], layer_idx: int,
                                  cos_sin_cache: Optional[torch.Tensor] = None,
                                  q_norm_weight: Optional[torch.Tensor] = None,
                                  k_norm_weight: Optional[torch.Tensor] = None, norm_eps: float = 1e-6,
                                  qkv_splits: int = 0, qkv_split_stride: int = 0) -> None:
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
                      options=layer.options, amax=amax,
                      qkv_sum=(qkv_splits, qkv_split_stride) if qkv_splits else None,
                      merge_in_kernel=_merge_in_kernel(meta))


@unified_attention_with_output.register_fake
def _(q, k, v, output, amax, layer_idx, cos_sin_cache=None, q_norm_weight=None, k_norm_weight=None,
      norm_eps=1e-6, qkv_splits=0, qkv_split_stride=0) -> None:
    return None


@torch.library.custom_op("atom::unified_attention_rope", mutates_args=("qkv", "output"))
def unified_attention_rope(qkv: torch.Tensor, output: torch.Tensor, layer_idx: int, q_size: int,
                           positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                           q_norm_weight: Optional[torch.Tensor], k_norm_weight: Optional[torch.Tensor],
                           norm_eps: float) -> None:
    meta = get_forward_context()
    backend = meta.attn_backend
    layer = backend.layers[layer_idx]
    T, D = qkv.shape[0], layer.head_dim
    kv_size = (qkv.shape[1] - q_size) // 2
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    target = backend.cache_target(layer, meta)
    # the q/k norms, the rotation, and (but for an FP8 cache) the cache write in one kernel
    rotary_embedding(positions, q, k, cos_sin_cache, D, q_norm_weight, k_norm_weight, norm_eps,
                     kv_cache=(v, *target) if target is not None else None)
    if target is None:
        backend.write_kv(layer, k.view(T, -1, D), v.view(T, -1, D), meta)
    unified_attention(q.view(T, -1, D), layer.k_cache, layer.v_cache, output.view(T, -1, D), meta.cu_seqlens_q,
                      meta.seq_lens, meta.block_tables, layer.scale, meta.max_query_len, workspace=backend.workspace,
                      options=layer.options, merge_in_kernel=_merge_in_kernel(meta))


@unified_attention_rope.register_fake
def _(qkv, output, layer_idx, q_size, positions, cos_sin_cache, q_norm_weight, k_norm_weight, norm_eps) -> None:
    return None
