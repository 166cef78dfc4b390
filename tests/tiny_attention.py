"""Tiny random models for the attention options: a Mistral with a small sliding window, a
Qwen3 whose upper layers use one (alternating full / windowed as `layer_types` says), and a
checkpoint with per-layer FP8 KV-cache scales (compressed-tensors / vLLM naming)."""
from __future__ import annotations

import glob
import os

import torch

from conftest import TINY, make_tiny_model


def make_tiny_mistral(path, sliding_window: int = 8, **overrides) -> str:
    """A random MistralForCausalLM (fp32) whose every layer attends the last `sliding_window` tokens."""
    import transformers
    kw = {**TINY, "num_hidden_layers": 3, **overrides}
    cfg = transformers.MistralConfig(rope_theta=10000.0, tie_word_embeddings=False, sliding_window=sliding_window,
                                     **kw)
    cfg.eos_token_id, cfg.bos_token_id = 2, 1
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def make_tiny_qwen3_windowed(path, sliding_window: int = 6) -> str:
    """A random Qwen3 of 4 layers, layers 1 and 3 windowed (`layer_types`), 0 and 2 full."""
    return make_tiny_model(path, "qwen3", num_hidden_layers=4, use_sliding_window=True, sliding_window=sliding_window,
                           layer_types=["full_attention", "sliding_attention"] * 2)


def add_kv_scales(path, scales: dict[int, tuple[float, float]], naming: str = "self_attn") -> None:
    """Write per-layer k / v scales into the checkpoint folder as their own safetensors file:
    `model.layers.{i}.self_attn.k_scale` (naming "self_attn", compressed-tensors / vLLM) or
    `...self_attn.k_proj.output_scale` (naming "output_scale", AutoFP8 / Quark)."""
    from safetensors.torch import save_file
    tensors = {}
    for i, (ks, vs) in scales.items():
        if naming == "self_attn":
            tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([ks])
            tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([vs])
        else:
            tensors[f"model.layers.{i}.self_attn.k_proj.output_scale"] = torch.tensor(ks)
            tensors[f"model.layers.{i}.self_attn.v_proj.output_scale"] = torch.tensor(vs)
    save_file(tensors, os.path.join(path, "kv_scales.safetensors"))
    assert len(glob.glob(os.path.join(path, "*.safetensors"))) == 2


def hf_with_fp8_kv(path, scales: dict | None = None):
    """transformers' model whose attention sees its keys and values stored as e4m3 (x / scale,
    saturating at +-448, times scale): the numerics the engine's FP8 cache has, as a reference
    for it. `scales`: {layer index: (k_scale, v_scale)}; 1 where absent."""
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fp8_kv_sdpa(module, query, key, value, attention_mask, **kw):
        ks, vs = (scales or {}).get(module.layer_idx, (1.0, 1.0))

        def rnd(x, s):
            return ((x.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s).to(x.dtype)
        return sdpa_attention_forward(module, query, rnd(key, ks), rnd(value, vs), attention_mask, **kw)

    name = f"atom_test_fp8_kv_{id(scales)}" if scales else "atom_test_fp8_kv"
    transformers.AttentionInterface.register(name, fp8_kv_sdpa)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation=name).eval()
