"""The Llama family (Llama 2/3/3.1, SmolLM2, Mistral-style dense models).

Reads like the architecture: embed -> N x (RMSNorm, attention with RoPE, residual,
RMSNorm, SiLU-gated MLP, residual) -> RMSNorm -> LM head. q/k/v and gate/up are packed
into one matrix each; `packed_modules_mapping` tells the loader where checkpoint
tensors go. Tokens of all sequences of a step are flattened into one [T, hidden] batch.
Each RMSNorm and the projection after it go through `norm_linear` (and the MLP's
activation with them), which at batch 1 on a GPU can run all three as one kernel.
"""
from __future__ import annotations

import torch
from torch import nn

from atom.model_ops import kernel_backend
from atom.model_ops.activation import SiluAndMul
from atom.model_ops.attention import Attention, get_forward_context
from atom.model_ops.embedding import LMHead, VocabEmbedding
from atom.model_ops.linear import Linear, MergedLinear, QKVLinear, norm_linear, norm_linear_rope
from atom.model_ops.norm import RMSNorm
from atom.model_ops.rotary import RotaryEmbedding, rope_parameters


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(nn.Module):
    qk_norm = False  # Qwen3 turns this on
    # decode steps on the Triton attention op (not under torch.compile): the attention kernel
    # rotates q and k and writes k, v into the cache, instead of a rotary kernel before it.
    # NVIDIA only: the kernel reads what it wrote after a block barrier, whose ordering of
    # global memory has not been checked on AMD GPUs
    fold_rotary = torch.version.hip is None

    def __init__(self, cfg, layer_idx: int, rotary_emb: RotaryEmbedding, quant_config=None, prefix: str = ""):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        bias = getattr(cfg, "attention_bias", False)
        self.qkv_proj = QKVLinear(cfg.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads,
                                  bias=bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size,
                             bias=bias,
                             quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary_emb = rotary_emb  # one table for all layers
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              self.head_dim ** -0.5, layer_idx)

    def project_rotated(self, norm, positions: torch.Tensor, hidden: torch.Tensor, residual):
        """At batch 1 on a GPU, where measured faster at start-up: the norm, the q/k/v
        projection, the rotary embedding and the cache write in one GEMV; returns (qkv with q
        rotated, residual) for `attend`, or None (then `norm_linear` and `forward`)."""
        if self.qk_norm or self.attn.backend != "triton" or hidden.shape[0] != 1:
            return None
        return norm_linear_rope(norm, self.qkv_proj, hidden, residual, positions, self.rotary_emb.cos_sin_cache,
                                self.attn.k_cache, self.attn.v_cache, get_forward_context().slot_mapping)

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """Attention output (after o_proj) when q is rotated and k, v are in the cache already."""
        return self.o_proj(self.attn(qkv[:, :self.qkv_proj.q_size], None, None))

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Attention output (after o_proj) of the packed q/k/v projection `qkv`."""
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        norms = (self.q_norm, self.k_norm) if self.qk_norm else ()
        kern = kernel_backend.get(qkv)
        if kern is not None and self.attn.backend == "triton":
            if self.fold_rotary and get_forward_context().max_query_len == 1 and not torch.compiler.is_compiling():
                # decode: the attention kernel rotates q and k (after the q / k norms) and writes k, v
                rotary = (self.rotary_emb.cos_sin_cache,) + ((self.q_norm.weight, self.k_norm.weight,
                                                              self.q_norm.eps) if self.qk_norm else ())
                return self.o_proj(self.attn(q, k, v, rotary))
            # one kernel: q/k norm, rotary, and this step's k and v into the paged cache
            self.rotary_emb(positions, q, k, *norms, kv_cache=self.attn.cache_write_args(v))
            return self.attend(qkv)
        if self.qk_norm or kern is not None:
            q, k = self.rotary_emb(positions, q, k, *norms)
        else:  # torch path: rotate q and k heads in one go
            qk = self.rotary_emb.rotate(positions, qkv[:, :q_size + kv_size])
            q, k = qk[:, :q_size], qk[:, q_size:]
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, cfg, quant_config=None, prefix: str = ""):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=bias,
                                         quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias,
                                quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, cfg, layer_idx: int, rotary_emb: RotaryEmbedding, quant_config=None, prefix: str = ""):
        super().__init__()
        self.self_attn = self.attention_cls(cfg, layer_idx, rotary_emb, quant_config, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(cfg, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # q/k norm (Qwen3) needs whole heads before rotating: no rotary GEMV epilogue then
        self.self_attn.qkv_proj.one_row = "norm" if self.self_attn.qk_norm else ("norm", "norm+rope")
        self.mlp.gate_up_proj.one_row = "norm+silu"

    def forward(self, positions, hidden, residual):
        attn = self.self_attn
        fused = attn.project_rotated(self.input_layernorm, positions, hidden, residual)
        if fused is not None:
            qkv, residual = fused
            hidden = attn.attend(qkv)
        else:
            qkv, residual = norm_linear(self.input_layernorm, attn.qkv_proj, hidden, residual)
            hidden = attn(positions, qkv)
        act, residual = norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, hidden, residual,
                                    gated=True)
        return self.mlp.down_proj(act), residual


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
