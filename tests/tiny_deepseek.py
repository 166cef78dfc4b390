"""Tiny random DeepSeek-V2 / V3 models (fp32 safetensors, nothing downloaded) for the tests.

`make_tiny_deepseek(path, "v2" | "v3", **overrides)` saves a transformers model whose logits
are not flat (initializer_range 0.4) and whose routing is not trivial: several experts and
groups, a YaRN rope whose attention factor and softmax mscale differ from 1, V3 correction
biases drawn non-zero.
"""
from __future__ import annotations

import torch

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, first_k_dense_replace=1,
            kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            max_position_embeddings=256, initializer_range=0.4, rms_norm_eps=1e-6,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

VARIANTS = {
    # V2 with q_lora_rank, grouped routing (group_limited_greedy), YaRN
    "v2": dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
               rope_parameters=YARN),
    # V2-Lite-like: no q_lora_rank, greedy routing, plain rope
    "v2_lite": dict(q_lora_rank=None, topk_method="greedy", n_group=None, topk_group=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # V3: sigmoid + correction bias, grouped, norm_topk_prob, scaling 2.5, YaRN, interleaved rope
    "v3": dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, rope_parameters=YARN),
    # V3 without q_lora_rank and with rope by halves
    "v3_noq": dict(q_lora_rank=None, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                   rope_interleave=False, rope_parameters=YARN),
}


def make_tiny_deepseek(path, variant: str = "v3", **overrides) -> str:
    import transformers
    kw = {**BASE, **VARIANTS[variant], **overrides}
    v3 = variant.startswith("v3")
    cls_cfg, cls = ((transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM) if v3 else
                    (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM))
    cfg = cls_cfg(**kw)
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def hf_v2_with_fp8_latent(path, scales: dict, monkeypatch):
    """transformers' DeepSeek-V2 whose attention sees its latents (the normalised compressed KV
    and the rotated shared rope key) stored as e4m3 of latent / k_scale, times k_scale: the
    numerics of the engine's FP8 latent cache, as its reference. `scales`: {layer: k_scale}.
    The rope function of the modeling module is patched through `monkeypatch` (undone after the test)."""
    import transformers
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as modeling

    def rnd(x, s):
        return ((x.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s).to(x.dtype)

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    current = {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        attn.register_forward_pre_hook(lambda mod, args, i=i: current.update(scale=scales[i]))
        attn.kv_a_layernorm.register_forward_hook(lambda mod, args, out, i=i: rnd(out, scales[i]))
    rope = modeling.apply_rotary_emb

    def rope_then_round_k(xq, xk, freqs):
        q, k = rope(xq, xk, freqs)
        return q, rnd(k, current["scale"])
    monkeypatch.setattr(modeling, "apply_rotary_emb", rope_then_round_k)
    return model
