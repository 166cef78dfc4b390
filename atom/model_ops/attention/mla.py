"""Multi-head latent attention (MLA, DeepSeek-V2/V3): the layer.

The cache holds one latent vector per token: the normalised compressed KV `kv_c`
(`kv_lora_rank`) followed by the rotated shared rope key `k_pe` (`qk_rope_head_dim`), through
`LatentAttentionSpec` (576 values per token and layer for DeepSeek-V2-Lite, against 2 x 16 x
192 for the expanded keys and values). `kv_b_proj` ([H * (nope + v), kv_lora_rank]) maps a
latent to every head's non-rope key and value:

- prefill (and chunked continuations, prefix-cache hits, multi-token steps): the context's
  latents are read from the cache and expanded through `kv_b_proj`; ordinary causal
  attention runs with head dims (nope + rope) for q, k and v for values.
- decode (one query token): the absorbed form. A query's non-rope part goes into the latent
  space through W_UK (the key rows of `kv_b_proj`): q_lat = q_nope W_UK [H, kv_lora_rank];
  scores = q_lat . kv_c + q_pe . k_pe over the latent cache (one "KV head" shared by all
  heads); out_lat = softmax . kv_c; out = out_lat W_UV^T (the value rows). Nothing is expanded.

The layer's backend (one per engine, `attention.selector`) writes the latent cache (the one
place) and attends: `TorchMLABackend` (reference, CPU), `TritonMLABackend` (split-KV decode kernel).

An FP8 latent cache (`kv_cache_dtype="fp8"`) stores e4m3 of latent / `k_scale` (one scale per
layer for the whole latent, kv_c and k_pe alike, as vLLM's MLA keeps it): the checkpoint's
`k_scale` where it has one, else computed from the first real prefill's latents
(`calibrate_kv_scales`: amax / K_SCALE_RANGE, the headroom the dense layers leave). Every read
(the absorbed decode, the prefill's gathered context) takes fp8 * k_scale.
"""
from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.attention import K_SCALE_RANGE
from atom.model_ops.attention.mla_torch import TorchMLABackend


class MLAAttention(nn.Module):
    kind = "latent"  # the KV-cache spec kind its backends declare

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float, layer_idx: int, kv_b_proj: nn.Module):
        super().__init__()
        method = getattr(kv_b_proj, "method", None)
        name = getattr(method, "name", "unquantized")
        if name != "unquantized" and not hasattr(method, "dequantized_weight"):
            # the absorbed decode multiplies by the weight itself: a format must dequantize
            raise ValueError(f"{getattr(kv_b_proj, 'prefix', 'kv_b_proj')} is quantized ({name}), a format "
                             "this build cannot dequantize for MLA's absorbed decode; exclude it from "
                             "quantization (quantization_config ignore / exclude_layers)")
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.kv_cache = torch.empty(0)  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
        # FP8 latent cache: one scale for the latent (see the module docstring); 1.0 until set
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.kv_scale_source = "default 1.0"  # "checkpoint" once the loader copied it, or "computed"
        self.kv_scale_pending = False          # set by the runner: compute it at the next cache write
        # the attention module owns kv_b_proj; a tuple keeps it out of this module's parameters
        self._kv_b = (kv_b_proj,)
        self.backend = TorchMLABackend()

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_b_proj(self) -> nn.Module:
        return self._kv_b[0]

    def finish_loading(self, dtype: torch.dtype) -> None:
        """After the weights are in (and any online quantization ran): a quantized `kv_b_proj`
        (DeepSeek-V3's fp8 blocks) is dequantized once into `kv_b_weight` ([H (nope + v), R]
        in `dtype`) for the absorbed decode, which multiplies queries and outputs by it
        directly. The expansion at prefill multiplies by the same copy (not the quantized layer,
        whose activation quantization the absorbed form cannot apply), so that both forms of
        attention compute the same keys and values."""
        method = getattr(self.kv_b_proj, "method", None)
        self._kv_b_source = (method, dtype)  # what the copy was made from (`_kv_b_copy`)
        if getattr(method, "name", "unquantized") == "unquantized":
            self.register_buffer("kv_b_weight", None, persistent=False)
            return
        self.register_buffer("kv_b_weight", method.dequantized_weight(self.kv_b_proj).to(dtype).contiguous(),
                             persistent=False)

    def _kv_b_copy(self) -> torch.Tensor | None:
        """The dequantized copy of `kv_b_proj` (None: it is unquantized, use its weight), made
        again if the layer's method changed since (the sensitivity explorer swaps methods)."""
        method = getattr(self.kv_b_proj, "method", None)
        made = getattr(self, "_kv_b_source", None)
        if made is None or made[0] is not method:
            self.finish_loading(made[1] if made is not None else torch.get_default_dtype())
        return self.kv_b_weight

    def absorb_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, R], W_UV [H, v, R]): views of `kv_b_proj`'s weight (its dequantized
        copy when it is quantized, `finish_loading`) for the absorbed decode."""
        weight = self._kv_b_copy()
        if weight is None:
            weight = self.kv_b_proj.weight
        w = weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, :self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    def expand_latent(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Cached latents [L, R + P] -> (k_nope [L, H, nope], k_pe [L, P], v [L, H, v]): one
        `kv_b_proj` product, whose output k_nope and v are views of; k_pe (shared by the heads)
        a view of the latents."""
        L, R = latent.shape[0], self.kv_lora_rank
        weight = self._kv_b_copy()
        kv = (self.kv_b_proj(latent[:, :R]) if weight is None else
              torch.nn.functional.linear(latent[:, :R].to(weight.dtype), weight)).view(L, self.num_heads, -1)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        return k_nope, latent[:, R:], v

    def calibrate_kv_scales(self, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Once armed (`kv_scale_pending`), at the next cache write: `k_scale` from this step's
        latents (amax over kv_c and k_pe / K_SCALE_RANGE; 1.0 where all are zero), on the
        device, no host sync. The backends call it where they write the cache."""
        if not self.kv_scale_pending:
            return
        self.kv_scale_pending = False
        with torch.no_grad():
            amax = torch.maximum(kv_c.detach().abs().amax().float(), k_pe.detach().abs().amax().float())
            self.k_scale.copy_(torch.where(amax > 0, amax / K_SCALE_RANGE, torch.ones_like(amax)))
        self.kv_scale_source = "computed"

    def kv_cache_spec(self, dtype: torch.dtype):
        """What this layer stores per token (its backend decides the layout)."""
        return self.backend.kv_cache_spec(self, dtype)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                k_pe: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (rotated), kv_c [T, R] (normalised), k_pe [T, rope]
        (rotated) -> [T, H * v]. Writes this step's latents into the cache first."""
        T = q_nope.shape[0]
        return self.backend.forward(self, q_nope, q_pe, kv_c, k_pe).reshape(T, -1)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, nope={self.qk_nope_head_dim}, "
                f"rope={self.qk_rope_head_dim}, v={self.v_head_dim}, backend={self.backend.name}, "
                f"cache={tuple(self.kv_cache.shape)}")
