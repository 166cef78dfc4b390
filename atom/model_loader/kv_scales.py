"""FP8 KV-cache scales from a checkpoint, routed to the attention layers that use them.

Producers store one scale per layer for keys and one for values (dequantized = fp8 * scale):
llm-compressor / compressed-tensors (`kv_cache_scheme`) and vLLM-style checkpoints as
`<layer>.self_attn.k_scale` / `v_scale`, AutoFP8 / Quark as `<layer>.self_attn.k_proj.output_scale`
/ `v_proj.output_scale`. The model's `Attention` sits one module below the projection's
parent (`self_attn.attn`) and holds `k_scale` / `v_scale` buffers; an MLA layer
(`MLAAttention`, `self_attn.attn`) holds one `k_scale` for its latent. They matter only when the
engine runs `kv_cache_dtype="fp8"`, where layers the checkpoint gives none compute theirs from
the first prefill (`calibrate_kv_scales`).
"""
from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger(__name__)

# checkpoint name suffix -> which buffer of the attention layer
SUFFIXES = {"k_scale": "k_scale", "v_scale": "v_scale",
            "k_proj.output_scale": "k_scale", "v_proj.output_scale": "v_scale"}


def attention_index(model: nn.Module) -> dict[str, nn.Module]:
    """Each attention layer under its own name and its parent's (`...self_attn.attn` and
    `...self_attn`), where checkpoints put its scales."""
    from atom.model_ops.attention import Attention
    from atom.model_ops.attention.mla import MLAAttention
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (Attention, MLAAttention)):
            out[name] = m
            out.setdefault(name.rpartition(".")[0], m)
    return out


def load_kv_scale(index: dict[str, nn.Module], name: str, tensor_fn) -> bool:
    """Copy checkpoint tensor `name` into its attention layer's k_scale / v_scale when it is
    one (`tensor_fn()` reads it); False when `name` is not a KV-cache scale."""
    for suffix, buffer in SUFFIXES.items():
        if name.endswith("." + suffix):
            layer = index.get(name[:-len(suffix) - 1])
            if layer is None:
                return False
            if not hasattr(layer, buffer):
                raise ValueError(f"checkpoint tensor {name!r}: an MLA layer keeps one scale for its latent "
                                 "cache (k_scale); a separate value scale has no place")
            t = tensor_fn()
            if t.numel() != 1:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}: the FP8 KV cache "
                                 "takes one scale per layer (per-head or per-token KV scales are not supported)")
            value = float(t.float().reshape(()))
            if not value > 0:
                raise ValueError(f"checkpoint tensor {name!r} = {value}: a KV-cache scale must be > 0")
            getattr(layer, buffer).fill_(value)
            layer.kv_scale_source = "checkpoint"
            return True
    return False


def log_kv_scales(index: dict[str, nn.Module]) -> None:
    layers = {id(m): m for m in index.values()}.values()
    n = sum(getattr(m, "kv_scale_source", "") == "checkpoint" for m in layers)
    if n:
        logger.info("KV-cache scales from the checkpoint for %d of %d attention layers", n, len(layers))
