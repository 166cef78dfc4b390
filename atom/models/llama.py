"""The Llama family (Llama 2/3/3.1, SmolLM2, Mistral-style dense models).

Reads like the architecture: embed -> N x (RMSNorm, attention with RoPE, residual,
RMSNorm, SiLU-gated MLP, residual) -> RMSNorm -> LM head. q/k/v and gate/up are packed
into one matrix each; `packed_modules_mapping` tells the loader where checkpoint
tensors go. Tokens of all sequences of a step are flattened into one [T, hidden] batch.
Kernel fusions are not here: the runner installs them from the engine's kernel plan
(`atom.tuning.fusions`).
"""
from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.activation import SiluAndMul
from atom.model_ops.attention import Attention
from atom.model_ops.attention.windows import sliding_window_of
from atom.model_ops.embedding import LMHead, VocabEmbedding
from atom.model_ops.linear import MergedLinear, QKVLinear, RowParallelLinear
from atom.model_ops.norm import RMSNorm
from atom.model_ops.rotary import RotaryEmbedding, rope_parameters


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(nn.Module):
    qk_norm = False  # Qwen3 turns this on

    def __init__(self, cfg, layer_idx: int, rotary_emb: RotaryEmbedding, quant_config=None, prefix: str = ""):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        bias = getattr(cfg, "attention_bias", False)
        self.qkv_proj = QKVLinear(cfg.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads,
                                  bias=bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias,
                             quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary_emb = rotary_emb  # one table for all layers
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              self.head_dim ** -0.5, layer_idx, sliding_window=sliding_window_of(cfg, layer_idx))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        if self.qk_norm:  # RMSNorm of each head
            T = q.shape[0]
            q = self.q_norm(q.reshape(T, -1, self.head_dim)).view(T, -1)
            k = self.k_norm(k.reshape(T, -1, self.head_dim)).view(T, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, cfg, quant_config=None, prefix: str = ""):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=bias,
                                         quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias,
                                quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, cfg, layer_idx: int, rotary_emb: RotaryEmbedding, quant_config=None, prefix: str = ""):
        super().__init__()
        self.self_attn = self.attention_cls(cfg, layer_idx, rotary_emb, quant_config, f"{prefix}.self_attn")
        self.mlp = self.make_mlp(cfg, layer_idx, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_mlp(self, cfg, layer_idx: int, quant_config, prefix: str) -> nn.Module:
        """The layer's MLP (MoE families return their sparse block for the sparse layers)."""
        return LlamaMLP(cfg, quant_config, prefix)

    def forward(self, positions, hidden, residual):
        """(hidden, residual) -> (hidden, residual): the residual add is fused into each norm."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, cfg, quant_config=None, prefix: str = "model"):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        rotary_emb = RotaryEmbedding(head_dim_of(cfg), cfg.max_position_embeddings, rope_parameters(cfg))
        self.layers = nn.ModuleList(self.layer_cls(cfg, i, rotary_emb, quant_config, f"{prefix}.layers.{i}")
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    model_cls = LlamaModel
    supports_tensor_parallel = True  # its layers split across ranks (atom.model_ops.linear)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg, quant_config=None):
        super().__init__()
        self.config = cfg
        self.model = self.model_cls(cfg, quant_config)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size)
        if getattr(cfg, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] of every token; `compute_logits` on the rows to sample."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
