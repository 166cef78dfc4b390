"""Tiny random MoE models (Qwen3-MoE, Mixtral) saved as HF folders (fp32, safetensors).

initializer_range 0.4 makes routing decisive (router logits far apart) and greedy tokens
stable; nothing is downloaded. `fused=True` saves the fused 3-D expert tensors
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) that
transformers >= 5 keeps in memory (`save_original_format=False`); the default is what its
`save_pretrained` writes, one tensor per expert and projection.
"""
from __future__ import annotations

import torch

BASE = dict(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, initializer_range=0.4)


def make_tiny_moe(path, arch: str = "qwen3_moe", fused: bool = False, **overrides) -> str:
    import transformers
    if arch == "qwen3_moe":
        kw = dict(BASE, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                  num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                  rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
        kw.update(overrides)
        cfg, cls = transformers.Qwen3MoeConfig(**kw), transformers.Qwen3MoeForCausalLM
    elif arch == "mixtral":
        kw = dict(BASE, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None)
        kw.update(overrides)
        cfg, cls = transformers.MixtralConfig(**kw), transformers.MixtralForCausalLM
    else:
        raise ValueError(arch)
    cfg.eos_token_id, cfg.bos_token_id = 2, 1
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True, save_original_format=not fused)
    return str(path)
