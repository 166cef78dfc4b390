"""GPT-OSS (openai/gpt-oss-20b, -120b), as transformers 5.24 defines `GptOssForCausalLM`.

embed -> N x (RMSNorm, attention, residual, RMSNorm, MoE, residual) -> RMSNorm -> LM head:
- attention: q/k/v/o projections with biases (`attention_bias`), a learned sink logit per
  query head (`self_attn.sinks`, one more column in the softmax denominator), layers
  alternating sliding-window (`sliding_window` tokens) and full attention as `layer_types`
  says; rotary by halves (rotate-half pairs (x_i, x_{i+D/2})) over YaRN frequencies, cos and
  sin scaled by YaRN's attention factor (`YarnRotaryEmbedding`); softmax scale head_dim^-0.5.
- MoE in every layer: a router with a bias (`mlp.router`, [E, H] + [E]); each token keeps
  its `num_experts_per_tok` largest router logits and softmaxes over those only
  (`topk_then_softmax`); the experts have biases and the clamped gated activation
  (`gpt_oss_swiglu`: gate clamped above at `swiglu_limit`, up clamped to +-limit,
  (up + 1) * gate * sigmoid(`swiglu_alpha` * gate)).

Checkpoints (`gpt_oss_checkpoint_mapping`): transformers writes the experts fused,
`mlp.experts.gate_up_proj` [E, H, 2I] with gate and up INTERLEAVED along the last dim,
`gate_up_proj_bias` [E, 2I] (interleaved too), `down_proj` [E, I, H], `down_proj_bias` [E, H];
the layer's loader transposes them into its [E, 2I, H] / [E, H, I] layout and de-interleaves
gate/up into [gate | up] (layout tags of `FusedMoE.weight_loader`). The MXFP4 checkpoints
(`quantization_config.quant_method == "mxfp4"`) hold `*_blocks` / `*_scales` instead, loaded by
`Mxfp4MoEMethod` (see its module docstring).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from atom.model_ops.attention import Attention
from atom.model_ops.attention.windows import sliding_window_of
from atom.model_ops.embedding import VocabEmbedding
from atom.model_ops.linear import Linear, QKVLinear, RowParallelLinear
from atom.model_ops.moe import FusedMoE, TopK, check_routing
from atom.model_ops.moe.layer import activation_name
from atom.model_ops.norm import RMSNorm
from atom.model_ops.rotary import rope_parameters
from atom.model_ops.rotary_yarn import YarnRotaryEmbedding
from atom.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, head_dim_of

ROPE_TYPES = ("yarn", "default")


#: the clamped SwiGLU's constants where the config has no field for them: transformers
#: before 5.2x has neither `swiglu_alpha` nor `swiglu_limit` (its GPT-OSS module hard-codes
#: these), and released config.json files carry only the limit
SWIGLU_DEFAULTS = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def swiglu_param(cfg, name: str) -> float:
    v = getattr(cfg, name, None)
    return SWIGLU_DEFAULTS[name] if v is None else v


def check_config(cfg) -> None:
    """ValueError naming the field for a GPT-OSS config this file cannot run (before any weight)."""
    check_routing(cfg.num_local_experts, cfg.num_experts_per_tok)
    for name in ("swiglu_alpha", "swiglu_limit"):
        v = swiglu_param(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"{name}={v!r} is invalid: GPT-OSS's clamped SwiGLU needs a positive number")
    rope_type = rope_parameters(cfg)["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_parameters.rope_type={rope_type!r} is not supported for GPT-OSS: "
                         f"choose one of {', '.join(ROPE_TYPES)}")
    types = getattr(cfg, "layer_types", None)
    if types is not None and len(types) != cfg.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries but num_hidden_layers={cfg.num_hidden_layers}")
    for i in range(cfg.num_hidden_layers):
        sliding_window_of(cfg, i)  # raises naming layer_types[i] / sliding_window


def topk_then_softmax(logits: torch.Tensor, top_k: int, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's routing: the k largest logits, softmax over those k (fp32 weights)."""
    values, ids = logits.topk(top_k, dim=-1)
    return values.float().softmax(-1), ids


def gpt_oss_checkpoint_mapping(experts: str = "experts") -> list[tuple[re.Pattern, str, str]]:
    """(regex, target suffix, part + layout tags) for the loader: the fused expert tensors of
    the module docstring, bf16/fp32 and MXFP4 (`*_blocks` [E, rows, K/32, 16] + `*_scales`)."""
    x = re.escape(experts)
    table = (("gate_up_proj", "w13_weight", "w13+transposed+interleaved"),
             ("gate_up_proj_bias", "w13_bias", "w13+interleaved"),
             ("down_proj", "w2_weight", "w2+transposed"),
             ("down_proj_bias", "w2_bias", "w2"),
             ("gate_up_proj_blocks", "w13_weight", "w13+blocks+interleaved"),
             ("gate_up_proj_scales", "w13_weight_scale", "w13+interleaved"),
             ("down_proj_blocks", "w2_weight", "w2+blocks"),
             ("down_proj_scales", "w2_weight_scale", "w2"))
    return [(re.compile(rf"\.{x}\.{src}$"), f".{experts}.{dst}", part) for src, dst, part in table]


class GptOssAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, rotary_emb: YarnRotaryEmbedding, quant_config=None, prefix: str = ""):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        bias = getattr(cfg, "attention_bias", True)
        self.qkv_proj = QKVLinear(cfg.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, bias=bias,
                                  quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary_emb = rotary_emb
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, layer_idx,
                              sliding_window=sliding_window_of(cfg, layer_idx), sinks=self.sinks)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size],
                                              dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class GptOssMLP(nn.Module):
    """The router (logits with a bias) and the experts (biases, clamped SwiGLU)."""

    def __init__(self, cfg, layer_idx: int, quant_config=None, prefix: str = ""):
        super().__init__()
        E, k = cfg.num_local_experts, cfg.num_experts_per_tok
        self.router = Linear(cfg.hidden_size, E, bias=True, prefix=f"{prefix}.router")
        act = activation_name("gpt_oss_swiglu", alpha=swiglu_param(cfg, "swiglu_alpha"),
                              limit=swiglu_param(cfg, "swiglu_limit"))
        self.experts = FusedMoE(E, cfg.hidden_size, cfg.intermediate_size, TopK(E, k, select_fn=topk_then_softmax),
                                activation=act, bias=True, quant_config=quant_config, prefix=f"{prefix}.experts",
                                layer_idx=layer_idx)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.router(hidden))


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention

    def make_mlp(self, cfg, layer_idx, quant_config, prefix):
        return GptOssMLP(cfg, layer_idx, quant_config, prefix)


class GptOssModel(LlamaModel):
    layer_cls = GptOssDecoderLayer

    def __init__(self, cfg, quant_config=None, prefix: str = "model"):
        nn.Module.__init__(self)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        rotary_emb = YarnRotaryEmbedding(head_dim_of(cfg), cfg.max_position_embeddings, rope_parameters(cfg))
        self.layers = nn.ModuleList(self.layer_cls(cfg, i, rotary_emb, quant_config, f"{prefix}.layers.{i}")
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GptOssForCausalLM(LlamaForCausalLM):
    model_cls = GptOssModel
    supports_tensor_parallel = False  # the experts and the sinks are not split across ranks yet
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
    expert_params_mapping = gpt_oss_checkpoint_mapping()

    def __init__(self, cfg, quant_config=None):
        check_config(cfg)
        super().__init__(cfg, quant_config)
