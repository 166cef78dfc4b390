"""Weights into a model: from a folder of safetensors, or dummy values (`load_dummy`).

Checkpoint names are first renamed by the model's `checkpoint_renames` (name fragments,
e.g. Mixtral's `.block_sparse_moe.` -> `.mlp.`), then mapped through its
`expert_params_mapping` (regexes from `FusedMoE.checkpoint_mapping`: a per-expert
`...experts.3.gate_proj.weight` -> `...experts.w13_weight`, shard (3, "w1"); a fused 3-D
`...experts.gate_up_proj` -> shard (None, "w13")) and its `packed_modules_mapping`
(`...q_proj.weight` -> `...qkv_proj.weight`, shard "q"), and copied by the parameter's
`weight_loader`; plain parameters are copied as they are; per-layer FP8 KV-cache scales
(`self_attn.k_scale`, `k_proj.output_scale`, ...) go to the attention layers (`kv_scales`).
Every parameter must be
written exactly once (tied ones excepted), and every module with `missing_shards()` (a MoE
layer: each expert's parts) must report none, or loading fails naming what is missing. A model
may name checkpoint tensors it does not run (`skip_checkpoint_tensor(name) -> bool`).
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


def _target(name: str, packed: dict, experts=()) -> tuple[str, object]:
    for pattern, dst, part in experts:
        m = pattern.search(name)
        if m:
            expert = m.groupdict().get("expert")
            return name[:m.start()] + dst, (None if expert is None else int(expert), part)
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
    renames = getattr(model, "checkpoint_renames", {})
    experts = getattr(model, "expert_params_mapping", ())
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: set[str] = set()
    skip = getattr(model, "skip_checkpoint_tensor", None)  # e.g. DeepSeek-V3's multi-token-prediction layers
    kv_index = attention_index(model)  # where FP8 KV-cache scales go
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as st:
            for name in st.keys():
                if "rotary_emb.inv_freq" in name or (skip is not None and skip(name)):
                    continue
                if tied and name == "lm_head.weight":
                    continue  # tied to the embedding, which the checkpoint also holds
                target, shard = _target(_renamed(name, renames), packed, experts)
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
    missing += [s for m in model.modules() if hasattr(m, "missing_shards") for s in m.missing_shards()]
    if missing:
        raise ValueError(f"checkpoint at {path} lacks {len(missing)} tensors, e.g. {missing[:5]}")


def _renamed(name: str, renames: dict) -> str:
    for src, dst in renames.items():
        name = name.replace(src, dst)
    return name


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
        elif p.dim() >= 2:  # stacked experts [E, out, in]: each expert's own fans
            fan_in, fan_out = p.shape[-1], p.shape[-2]
            std = (2.0 / (fan_in + fan_out)) ** 0.5
            for start in range(0, p.shape[0], 8192):  # chunks of rows keep memory flat
                rows = p.data[start:start + 8192]
                rows.copy_(torch.randn(rows.shape, generator=gen, device=p.device) * std)
        else:
            p.data.zero_()
