"""Weights into a model: from a folder of safetensors, or dummy values (`load_dummy`).

Checkpoint names are mapped through the model's `packed_modules_mapping`
(`...q_proj.weight` -> `...qkv_proj.weight`, shard "q") and copied by the parameter's
`weight_loader`; plain parameters are copied as they are; per-layer FP8 KV-cache scales
(`self_attn.k_scale`, `k_proj.output_scale`, ...) go to the attention layers (`kv_scales`).
Every parameter must be written exactly once (tied ones excepted), or loading fails naming
what is missing.
"""
from __future__ import annotations

import glob
import logging
import os

import torch
from safetensors import safe_open
from torch import nn

from atom.model_loader.kv_scales import attention_index, load_kv_scale, log_kv_scales

logger = logging.getLogger(__name__)

DUMMY_MODES = (None, "empty", "zero", "xavier")


def _target(name: str, packed: dict) -> tuple[str, object]:
    for src, (dst, shard) in packed.items():
        if f".{src}." in name:
            return name.replace(f".{src}.", f".{dst}."), shard
    return name, None


def load_weights(model: nn.Module, path: str) -> None:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model={path!r} has no *.safetensors files: give a folder with weights, "
                         "or use load_dummy")
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: set[str] = set()
    kv_index = attention_index(model)  # where FP8 KV-cache scales go
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as st:
            for name in st.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                if tied and name == "lm_head.weight":
                    continue  # tied to the embedding, which the checkpoint also holds
                target, shard = _target(name, packed)
                param = params.get(target)
                if param is None and load_kv_scale(kv_index, name, lambda: st.get_tensor(name)):
                    continue
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} in {f} has no place in "
                                     f"{type(model).__name__}")
                tensor = st.get_tensor(name)
                loader = getattr(param, "weight_loader", None)
                if loader is not None:
                    loader(param, tensor, shard)
                else:
                    if param.shape != tensor.shape:
                        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                                         f"model shape {tuple(param.shape)}")
                    param.data.copy_(tensor)
                loaded.add(f"{target}#{shard}")
    log_kv_scales(kv_index)
    expected = {n for n in params if not (tied and n == "lm_head.weight")}
    missing = sorted(n for n in expected if not any(k.split("#")[0] == n for k in loaded))
    if missing:
        raise ValueError(f"checkpoint at {path} lacks {len(missing)} tensors, e.g. {missing[:5]}")


def init_dummy_weights(model: nn.Module, mode: str) -> None:
    """`load_dummy` modes: "empty" leaves memory as allocated, "zero" zeros, "xavier" random."""
    if mode not in DUMMY_MODES[1:]:
        raise ValueError(f"load_dummy={mode!r} is invalid: choose one of empty, zero, xavier")
    if mode == "empty":
        return
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if getattr(p, "keep_on_dummy", False):
            continue  # metadata a method checks after loading (int4 weight_shape)
        gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(0))
        if mode == "zero":
            p.data.zero_()
        elif "norm" in name:
            p.data.fill_(1.0)
        elif p.dim() >= 2:
            fan_in, fan_out = p.shape[1], p.shape[0]
            std = (2.0 / (fan_in + fan_out)) ** 0.5
            for start in range(0, p.shape[0], 8192):  # chunks of rows keep memory flat
                rows = p.data[start:start + 8192]
                rows.copy_(torch.randn(rows.shape, generator=gen, device=p.device) * std)
        else:
            p.data.zero_()
