"""DeepSeek-V2 / V3: multi-head latent attention and a mixture of experts with shared experts.

Reads like the architecture: embed -> N x (RMSNorm, MLA, residual, RMSNorm, MLP or MoE,
residual) -> RMSNorm -> LM head. The first `first_k_dense_replace` layers have a dense MLP;
the others a MoE of `n_routed_experts` experts (top `num_experts_per_tok`, DeepSeek routing:
`deepseek_routing`) plus `n_shared_experts` always-on experts.

MLA (DeepSeek-V2 paper, section 2.1): queries come from `q_proj`, or with `q_lora_rank`
from a low-rank pair (`q_a_proj`, RMSNorm, `q_b_proj`); keys and values from one compressed
latent `kv_a_proj_with_mqa` -> [kv_c (kv_lora_rank) | k_pe (qk_rope_head_dim)], kv_c
RMSNorm'd. `q_a_proj` (or `q_proj`) and `kv_a_proj_with_mqa` take the same input: one packed
matrix `fused_qkv_a_proj` loaded from the two checkpoint tensors, one product. Only the rope dims
rotate (interleaved pairs, YaRN scaling); the layer caches [kv_c | k_pe] per token
(`MLAAttention`), which expands or absorbs `kv_b_proj` itself.

The MoE block is the gate (fp32 logits, V3's correction bias) and a `FusedMoE`
(atom.model_ops.moe) with the routing's `TopK` (`DeepseekRouting.to_topk`) and the shared
experts; per-expert checkpoint tensors `mlp.experts.{e}.{gate,up,down}_proj.*` load into its
stacked parameters (`expert_params_mapping`), so quantized MoE methods and routing
statistics apply as for the other MoE families.
"""
from __future__ import annotations

import torch
from torch import nn

from atom.distributed.state import ParallelState
from atom.model_ops.activation import SiluAndMul
from atom.model_ops.attention.mla import MLAAttention
from atom.model_ops.embedding import LMHead, VocabEmbedding
from atom.model_ops.linear import Linear, MergedLinear
from atom.model_ops.moe import FusedMoE
from atom.model_ops.moe.gate import Fp32Gate
from atom.model_ops.norm import RMSNorm
from atom.model_ops.rotary import rope_parameters
from atom.model_ops.rotary_yarn import DeepseekRotaryEmbedding, mla_softmax_scale
from atom.models.deepseek_routing import DeepseekRouting


class DeepseekMLP(nn.Module):
    """SiLU-gated MLP (the dense layers and the shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, quant_config=None, prefix: str = ""):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, quant_config=quant_config,
                                         prefix=f"{prefix}.gate_up_proj")
        self.down_proj = Linear(intermediate_size, hidden_size, quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DeepseekRouter(Fp32Gate):
    """The gate: router logits in fp32 (DeepSeek keeps the gate in fp32; `Fp32Gate`) and, for
    V3's noaux_tc, the `e_score_correction_bias` the choice adds (never the weights)."""

    def __init__(self, hidden_size: int, routing: DeepseekRouting):
        super().__init__(routing.num_experts, hidden_size)
        self.routing = routing
        if routing.uses_correction_bias:  # V3: balances load, chooses, never weighs
            self.e_score_correction_bias = nn.Parameter(torch.zeros(routing.num_experts, dtype=torch.float32),
                                                        requires_grad=False)
        else:
            self.e_score_correction_bias = None

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.routing!r}"


class DeepseekMoE(nn.Module):
    """The gate's logits -> `FusedMoE` (routed experts stacked, chosen by the routing's
    `TopK`) + the shared experts (a `DeepseekMLP` of width moe_intermediate_size x
    n_shared_experts, kept under its checkpoint name `mlp.shared_experts` and handed to the
    layer, which adds it to the routed sum)."""

    def __init__(self, cfg, routing: DeepseekRouting, layer_idx: int, quant_config=None, prefix: str = ""):
        super().__init__()
        self.gate = DeepseekRouter(cfg.hidden_size, routing)
        n_shared = getattr(cfg, "n_shared_experts", None) or 0
        self.shared_experts = (DeepseekMLP(cfg.hidden_size, cfg.moe_intermediate_size * n_shared, quant_config,
                                           f"{prefix}.shared_experts") if n_shared else None)
        self.experts = FusedMoE(routing.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, routing.to_topk(),
                                activation="silu",
                                shared_experts=self.shared_experts.forward if n_shared else None,
                                quant_config=quant_config, prefix=f"{prefix}.experts", layer_idx=layer_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x), self.gate.e_score_correction_bias)


class DeepseekV2Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int, rotary_emb: DeepseekRotaryEmbedding, quant_config=None, prefix: str = ""):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk_head_dim = self.nope + self.rope
        H, hidden = self.num_heads, cfg.hidden_size
        bias = getattr(cfg, "attention_bias", False)
        if self.q_lora_rank:
            self.fused_qkv_a_proj = MergedLinear(hidden, [self.q_lora_rank, self.kv_lora_rank + self.rope], bias=bias,
                                                 quant_config=quant_config, prefix=f"{prefix}.fused_qkv_a_proj")
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(self.q_lora_rank, H * qk_head_dim, quant_config=quant_config,
                                   prefix=f"{prefix}.q_b_proj")
        else:  # q_proj and kv_a_proj_with_mqa (same input): one packed matrix, replicated like both
            self.fused_qkv_a_proj = MergedLinear(hidden, [H * qk_head_dim, self.kv_lora_rank + self.rope], bias=bias,
                                                 quant_config=quant_config, prefix=f"{prefix}.fused_qkv_a_proj",
                                                 tp=ParallelState.single())
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(self.kv_lora_rank, H * (self.nope + self.v_dim), quant_config=quant_config,
                                prefix=f"{prefix}.kv_b_proj")
        self.o_proj = Linear(H * self.v_dim, hidden, bias=bias, quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary_emb = rotary_emb  # one table for all layers
        scale = mla_softmax_scale(qk_head_dim, rope_parameters(cfg))
        self.attn = MLAAttention(H, self.kv_lora_rank, self.nope, self.rope, self.v_dim, scale, layer_idx,
                                 kv_b_proj=self.kv_b_proj)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        T = hidden.shape[0]
        q, kv_a = self.fused_qkv_a_proj(hidden).split(self.fused_qkv_a_proj.out_sizes, dim=-1)
        if self.q_lora_rank:  # q is the low-rank q_a: normed, then expanded by q_b_proj
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_pe = q.view(T, self.num_heads, -1).split([self.nope, self.rope], dim=-1)
        kv_c, k_pe = kv_a.split([self.kv_lora_rank, self.rope], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        return self.o_proj(self.attn(q_nope, q_pe, kv_c, k_pe))


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, rotary_emb, routing: DeepseekRouting, quant_config=None, prefix: str = ""):
        super().__init__()
        self.self_attn = DeepseekV2Attention(cfg, layer_idx, rotary_emb, quant_config, f"{prefix}.self_attn")
        if layer_idx >= (getattr(cfg, "first_k_dense_replace", 0) or 0):
            self.mlp = DeepseekMoE(cfg, routing, layer_idx, quant_config, f"{prefix}.mlp")
        else:
            self.mlp = DeepseekMLP(cfg.hidden_size, cfg.intermediate_size, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        """(hidden, residual) -> (hidden, residual): the residual add is fused into each norm."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def check_config(cfg) -> None:
    """Refuse what this file does not implement, before any weight is made."""
    freq = getattr(cfg, "moe_layer_freq", 1) or 1
    if freq != 1:
        raise ValueError(f"moe_layer_freq={freq} is not supported: only 1 (every layer from first_k_dense_replace)")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported: only 'silu'")
    if getattr(cfg, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported: the dense and shared-expert MLPs here have no "
                         "biases (every released DeepSeek-V2 config has mlp_bias=False)")


class DeepseekV2Model(nn.Module):
    def __init__(self, cfg, quant_config=None, prefix: str = "model"):
        super().__init__()
        check_config(cfg)
        routing = DeepseekRouting.from_hf_config(cfg)
        interleaved = getattr(cfg, "rope_interleave", True) if cfg.model_type == "deepseek_v3" else True
        rotary_emb = DeepseekRotaryEmbedding(cfg.qk_rope_head_dim, cfg.max_position_embeddings, rope_parameters(cfg),
                                             interleaved=interleaved)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(cfg, i, rotary_emb, routing, quant_config, f"{prefix}.layers.{i}")
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DeepseekV2ForCausalLM(nn.Module):
    expert_params_mapping = FusedMoE.checkpoint_mapping()
    # fused_qkv_a_proj packs [q_a_proj | kv_a_proj_with_mqa] (with q_lora_rank) or
    # [q_proj | kv_a_proj_with_mqa] (without); a checkpoint holds only one of q_a_proj / q_proj
    packed_modules_mapping = {
        "q_a_proj": ("fused_qkv_a_proj", 0), "q_proj": ("fused_qkv_a_proj", 0),
        "kv_a_proj_with_mqa": ("fused_qkv_a_proj", 1),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg, quant_config=None):
        super().__init__()
        self.config = cfg
        absent = "q_proj" if cfg.q_lora_rank else "q_a_proj"
        self.packed_modules_mapping = {k: v for k, v in self.packed_modules_mapping.items() if k != absent}
        self.model = DeepseekV2Model(cfg, quant_config)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size)
        if getattr(cfg, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """DeepSeek-V3 checkpoints hold `num_nextn_predict_layers` multi-token-prediction layers
        after the last decoder layer (model.layers.{num_hidden_layers}...): not run here."""
        parts = name.split(".")
        return (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
                and int(parts[2]) >= self.config.num_hidden_layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] of every token; `compute_logits` on the rows to sample."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """The same model; its config routes by sigmoid scores with a correction bias (noaux_tc)
    and may rotate its rope dims by halves (`rope_interleave=false`)."""
