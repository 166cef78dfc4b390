"""Which attention backend serves an engine's attention layers: by the layers' kind and the
kernel library (`atom.platform.kernel_backend`).

    kind "full"   (`Attention`):    TorchAttentionBackend | TritonAttentionBackend
    kind "latent" (`MLAAttention`): TorchMLABackend       | TritonMLABackend

One backend per engine (it may own scratch buffers); every layer of the model must be of one
kind (a model mixing kinds would need a backend per group of layers, not built yet).
"""
from __future__ import annotations

import torch

from atom.model_ops.attention import Attention
from atom.model_ops.attention.mla import MLAAttention

ATTENTION_LAYERS = (Attention, MLAAttention)


def attention_layers(model: torch.nn.Module) -> list:
    """The model's attention layers (those a backend serves and the KV-cache manager binds)."""
    return [m for m in model.modules() if isinstance(m, ATTENTION_LAYERS)]


def attention_backend_for(layers: list, kernels: str, max_num_tokens: int, device):
    kinds = sorted({getattr(layer, "kind", "full") for layer in layers})
    if len(kinds) != 1:
        raise ValueError(f"attention layers of kinds {kinds}: one engine serves layers of one kind")
    if kinds[0] == "latent":
        if kernels == "torch":
            from atom.model_ops.attention.mla_torch import TorchMLABackend
            return TorchMLABackend()
        from atom.model_ops.attention.mla_triton import TritonMLABackend
        return TritonMLABackend(layers, max_num_tokens=max_num_tokens, device=device)
    if kernels == "torch":
        from atom.model_ops.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    from atom.model_ops.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend(layers, max_num_tokens=max_num_tokens, device=device)
