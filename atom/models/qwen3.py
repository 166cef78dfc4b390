"""Qwen3 (dense): Llama with an explicit head_dim and RMSNorm on q and k per head."""
from __future__ import annotations

from atom.models.llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel)


class Qwen3Attention(LlamaAttention):
    qk_norm = True


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
