"""The attention layer: hands q, k, v to its backend, which writes this step's K/V into the
paged cache (the one place per backend that does) and attends.

A backend per attention kind: `TorchAttentionBackend` (the reference: CPU) and, on GPUs,
`TritonAttentionBackend` (the unified kernel behind a custom op); each declares the KV-cache
spec of the layers it serves (`kv_cache_spec`). The runner gives every layer its backend and
binds its cache views through the `KVCacheManager`. The layer reads the per-forward
`AttentionMetadata`.

Per layer, from the constructor (model files pass them): `sliding_window` W (a query at
position p sees keys p - W < j <= p; None: full causal attention) and `sinks` (a [num_heads]
tensor of learned logits, one per query head, that join the softmax denominator, as GPT-OSS
has them; the model owns and loads the parameter, the layer only reads it). The layer also
holds `k_scale` / `v_scale` (fp32 scalars), which the backend uses when the cache it was bound
to is FP8 (`kv_cache_dtype="fp8"`): the checkpoint's where it has them, else computed from the
first real prefill's keys and values (`calibrate_kv_scales`, armed by the runner once its
warm-up and graph capture are done): amax(|k|) / 200 and amax(|v|) / 100, the headroom vLLM's
`calculate_kv_scales` leaves below fp8's 448 for later tokens.
"""
from __future__ import annotations

import torch
from torch import nn

from atom.distributed.state import current_parallel_state
from atom.model_ops.attention.metadata import (AttentionMetadata, current_forward_context, forward_context,
                                               get_forward_context, set_forward_context)
from atom.model_ops.attention.torch_backend import TorchAttentionBackend
from atom.model_ops.attention.options import AttentionOptions

# the first prefill's amax maps to these fp8 values: room for later, larger keys / values
K_SCALE_RANGE, V_SCALE_RANGE = 200.0, 100.0

__all__ = ["Attention", "AttentionMetadata", "AttentionOptions", "TorchAttentionBackend", "forward_context", "get_forward_context",
           "current_forward_context", "set_forward_context"]


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int,
                 tp=None, *, sliding_window: int | None = None, sinks: torch.Tensor | None = None):
        """`num_heads` / `num_kv_heads`: the model's; the layer keeps this tensor-parallel
        rank's (`tp`, default: the model being built, `atom.distributed.building`); `sinks`
        are this rank's heads' ([num_heads / tp])."""
        super().__init__()
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) < 1):
            raise ValueError(f"sliding_window={sliding_window!r} is invalid for layer {layer_idx}: "
                             "give a positive number of tokens, or None for full attention")
        tp = tp if tp is not None else current_parallel_state()
        num_heads = tp.split(num_heads, "num_attention_heads")
        num_kv_heads = tp.kv_heads(num_kv_heads)[0]
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks of layer {layer_idx} must be [num_heads={num_heads}], got {tuple(sinks.shape)}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.sliding_window = None if sliding_window is None else int(sliding_window)
        # the caller's parameter, read (not registered here: it is loaded under the caller's name)
        self.__dict__["sinks"] = sinks
        # FP8 KV-cache scales: the checkpoint's k_scale / v_scale (the loader routes them), else
        # computed at the first prefill (`calibrate_kv_scales`); 1.0 until then
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))
        self.kv_scale_source = "default 1.0"  # "checkpoint" once the loader copied them, or "computed"
        self.kv_scale_pending = False          # set by the runner: compute them at the next cache write
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend = TorchAttentionBackend()

    @property
    def options(self) -> AttentionOptions:
        """The sliding window, sinks and FP8 scales the backend applies to this layer."""
        return AttentionOptions(self.sinks, self.sliding_window, self.k_scale, self.v_scale)

    def calibrate_kv_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Once armed (`kv_scale_pending`), at the next cache write: k_scale / v_scale from this
        step's keys and values (amax / K_SCALE_RANGE, / V_SCALE_RANGE; 1.0 where all are zero),
        on the device, no host sync. The backends call it where they write the cache."""
        if not self.kv_scale_pending:
            return
        self.kv_scale_pending = False
        with torch.no_grad():
            for buf, x, rng in ((self.k_scale, k, K_SCALE_RANGE), (self.v_scale, v, V_SCALE_RANGE)):
                amax = x.detach().abs().amax().float()
                buf.copy_(torch.where(amax > 0, amax / rng, torch.ones_like(amax)))
        self.kv_scale_source = "computed"

    def kv_cache_spec(self, dtype: torch.dtype):
        """What this layer stores per token (its backend decides the layout)."""
        return self.backend.kv_cache_spec(self, dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                rotary: tuple | None = None, amax: torch.Tensor | None = None,
                qkv_sum: tuple | None = None) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D]. k = v = None: this step's keys and values
        are in the cache already (a fused kernel wrote them; Triton backend only).
        `rotary` = (cos_sin_cache, q norm weight, k norm weight, eps) (decode steps, Triton
        backend only): q and k are unrotated; the attention kernel rotates them, after the
        norms where their weights are not None, and writes k and v into the cache.
        `amax` (fp32 [T, Hq]): filled with each token's and head's largest |value| of the
        output as stored (the partial amaxes of an 8-bit o_proj quantizing it on load).
        `qkv_sum` = (splits, split_stride, dtype) (with `rotary`, Triton backend only): q, k
        and v are fp32 views into the first split of a split-K q/k/v product's partials, which
        the kernel sums as it loads them (`split_k.PendingSum`); the output is in `dtype`."""
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        if k is not None:
            k = k.view(T, self.num_kv_heads, self.head_dim)
            v = v.view(T, self.num_kv_heads, self.head_dim)
        extra = {name: t for name, t in (("amax", amax), ("qkv_sum", qkv_sum)) if t is not None}
        out = self.backend.forward(self, q, k, v, rotary, **extra)
        return out.view(T, -1)

    def forward_rope(self, qkv: torch.Tensor, q_size: int, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                     q_norm=None, k_norm=None) -> torch.Tensor:
        """The packed, unrotated q/k/v projection [T, q_size + 2 kv] -> [T, q_size]: the q/k
        norms (when given), the rotary embedding, the cache write and attention in one op
        (Triton backend only; compiled graphs call this: `tuning.fusions`). qkv is rotated in place."""
        return self.backend.forward_rope(self, qkv, q_size, positions, cos_sin_cache, q_norm, k_norm)

    def extra_repr(self) -> str:
        extra = (f", sliding_window={self.sliding_window}" if self.sliding_window else "") + \
            (", sinks" if self.sinks is not None else "")
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}{extra}, "
                f"backend={self.backend.name}, cache={tuple(self.k_cache.shape)} {str(self.k_cache.dtype)[6:]}")
