"""Tiny random GPT-OSS models saved as HF folders (fp32, safetensors), and an MXFP4 copy.

`make_tiny_gpt_oss`: 4 layers alternating sliding-window (layers 0, 2; window 8) and full
attention, YaRN rope, 4 experts top-2; initializer_range 0.4 so greedy tokens are decisive,
and the parameters transformers initialises to zero (expert biases, attention biases) made
random too, so every term of the architecture matters. hidden 96 != 2 x width 64, so a
transposed or interleaved tensor loaded the wrong way cannot fit by accident.

`make_tiny_gpt_oss_mxfp4`: the same model with its experts quantized by
`atom.model_ops.quant.mxfp4` into GPT-OSS's checkpoint layout (`*_blocks` [E, rows, K/32, 16]
uint8, `*_scales` [E, rows, K/32] uint8 e8m0, gate/up rows interleaved as transformers keeps
them) and `quantization_config` {"quant_method": "mxfp4", "modules_to_not_convert": [...]}.
"""
from __future__ import annotations

import json
import os

import torch

BASE = dict(vocab_size=512, hidden_size=96, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            max_position_embeddings=1024, initializer_range=0.4, rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 150000.0})
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def tiny_gpt_oss_model(**overrides):
    import transformers
    cfg = transformers.GptOssConfig(**{**BASE, **overrides})
    cfg.eos_token_id, cfg.bos_token_id = 2, 1
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("sinks"):
                p.normal_(0.0, 0.4)
    return model


def make_tiny_gpt_oss(path, **overrides) -> str:
    model = tiny_gpt_oss_model(**overrides)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def mxfp4_blocks(w_rows_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, K] -> (blocks uint8 [E, rows, K/32, 16], scales uint8 [E, rows, K/32])."""
    from atom.model_ops.quant.mxfp4 import quantize_mxfp4
    packed, scales = quantize_mxfp4(w_rows_k)
    return packed.unflatten(-1, (-1, 16)).contiguous(), scales.contiguous()


def make_tiny_gpt_oss_mxfp4(path, **overrides) -> str:
    """The MXFP4 checkpoint (see the module docstring); transformers loads it dequantized."""
    from safetensors.torch import load_file, save_file
    model = tiny_gpt_oss_model(**overrides)
    model.save_pretrained(path, safe_serialization=True)
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    for name in [n for n in tensors if n.endswith("mlp.experts.gate_up_proj") or n.endswith("mlp.experts.down_proj")]:
        w = tensors.pop(name)  # gate_up [E, H, 2I] (interleaved along 2I) / down [E, I, H]
        blocks, scales = mxfp4_blocks(w.transpose(1, 2))  # rows = outputs, K = inputs
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, f, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as fh:
        cfg = json.load(fh)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    return str(path)
