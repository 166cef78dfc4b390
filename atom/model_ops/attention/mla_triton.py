"""The Triton MLA backend: the latent-cache write, the split-KV absorbed decode and the expanded
prefill in Triton, behind one custom op.

`atom::mla_attention(q_nope, q_pe, kv_c, k_pe, output, layer_idx)` (our name for the guide's
`aiter.mla_attention` splitting op) writes this step's latents into layer `layer_idx`'s cache
and attends for the whole batch: decode rows absorbed (W_UK in, `mla_decode` over the latent
cache, W_UV out: no host sync, CUDA-graph safe), other rows expanded from the cache through
`kv_b_proj` and attended by `mla_prefill` (every prefill sequence in one launch). Being a
registered op it is opaque to torch.compile. The op finds the engine's backend (its layers and
split-KV scratch) through the forward context.
"""
from __future__ import annotations

import torch

from atom.model_ops.attention.metadata import get_forward_context
from atom.model_ops.attention.mla_torch import MLABackend
from atom.model_ops.kernels.kv_cache import FP8_CACHE_DTYPES
from atom.model_ops.kernels.mla_decode import MLAWorkspace, mla_decode, num_sms, workspace_slots, write_latent
from atom.model_ops.kernels.mla_prefill import PREFILL_TILE, mla_prefill, prefill_tiles

OP_NAME = "atom::mla_attention"


class TritonMLABackend(MLABackend):
    """One per engine: its MLA layers (by layer index) and the split-KV scratch."""
    name = "triton-mla"

    def __init__(self, layers: list, max_num_tokens: int = 1024, device=None, max_splits: int = 32):
        self.layers = list(layers)
        a = layers[0]
        # scratch for the split count `pick_mla_config` gives every decode batch of up to
        # `max_num_tokens` sequences (B x splits is bounded by the split rule: ~33 MiB for 16
        # heads of a 512-wide latent at 1024 sequences, 4 bytes per value)
        sms = num_sms(device)
        slots = workspace_slots(max_num_tokens, a.num_heads, a.kv_lora_rank, sms, max_splits)
        self.workspace = MLAWorkspace(max_num_tokens, a.num_heads, a.kv_lora_rank, max_splits=max_splits,
                                      device=device, slots=slots)

    def write_kv(self, layer, kv_c, k_pe, meta) -> None:
        if layer.kv_cache.dtype in FP8_CACHE_DTYPES:
            layer.calibrate_kv_scales(kv_c, k_pe)
        write_latent(kv_c, k_pe, layer.kv_cache, meta.slot_mapping, layer.k_scale)

    def decode_latent(self, layer, q_lat, q_pe, block_tables, seq_lens, seq_lens_host, meta) -> torch.Tensor:
        return mla_decode(q_lat, q_pe, layer.kv_cache, block_tables, seq_lens,  # (any strides but the last)
                          layer.kv_lora_rank, layer.scale, workspace=self.workspace, kv_scale=layer.k_scale)

    def prefill(self, layer, q_nope, q_pe, k_nope, k_pe, v, spans, out, meta) -> None:
        """Every prefill span in one `mla_prefill` launch (its work list built once per step,
        for the step's spans: every layer gets the same list from `_prefill_plan`)."""
        cached = meta.step_cache.get("mla_prefill_tiles")
        if cached is None or cached[0] is not spans:
            cached = meta.step_cache["mla_prefill_tiles"] = (
                spans, prefill_tiles(spans, PREFILL_TILE["BLOCK_M"], out.device))
        mla_prefill(q_nope, q_pe, k_nope, k_pe, v, cached[1], layer.scale, out)

    def forward(self, layer, q_nope, q_pe, kv_c, k_pe) -> torch.Tensor:
        """Opaque to torch.compile: the op reads the forward context, this method does not."""
        out = q_nope.new_empty(q_nope.shape[0], layer.num_heads, layer.v_head_dim)
        torch.ops.atom.mla_attention(q_nope, q_pe, kv_c, k_pe, out, layer.layer_idx)
        return out

    def __repr__(self) -> str:
        return f"TritonMLABackend(layers={len(self.layers)}, workspace={self.workspace!r})"


@torch.library.custom_op(OP_NAME, mutates_args=("output",))
def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                  output: torch.Tensor, layer_idx: int) -> None:
    backend = get_forward_context().attn_backend
    layer = backend.layers[layer_idx]
    output.copy_(MLABackend.forward(backend, layer, q_nope, q_pe, kv_c, k_pe))


@mla_attention.register_fake
def _(q_nope, q_pe, kv_c, k_pe, output, layer_idx) -> None:
    return None
