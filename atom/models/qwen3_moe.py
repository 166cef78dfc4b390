"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm per head) with sparse MoE blocks.

A decoder layer is sparse when its index is not in `mlp_only_layers` and
(index + 1) % `decoder_sparse_step` == 0 (with `num_experts` > 0); the other layers keep
Qwen3's dense SiLU-gated MLP of width `intermediate_size`. A sparse block is a router
(`gate`, [num_experts, hidden], unquantized) and `num_experts` SiLU-gated experts of width
`moe_intermediate_size`; each token takes the `num_experts_per_tok` largest softmax
probabilities, renormalised to sum to 1 when `norm_topk_prob`.
Checkpoints: per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` or the fused 3-D
`mlp.experts.gate_up_proj` / `mlp.experts.down_proj` of transformers >= 5.
"""
from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.linear import Linear
from atom.model_ops.moe import FusedMoE, TopK
from atom.models.llama import LlamaMLP
from atom.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model


def check_config(cfg) -> None:
    """ValueError naming the field for a Qwen3-MoE config this file cannot run."""
    step = getattr(cfg, "decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step={step!r} is invalid: an integer >= 1 (every step-th layer is sparse)")
    if getattr(cfg, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not implemented for Qwen3-MoE in this build: set it False")


def is_sparse_layer(cfg, layer_idx: int) -> bool:
    return (layer_idx not in (getattr(cfg, "mlp_only_layers", None) or []) and cfg.num_experts > 0
            and (layer_idx + 1) % cfg.decoder_sparse_step == 0)


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, cfg, layer_idx: int, quant_config=None, prefix: str = ""):
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                TopK(cfg.num_experts, cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob),
                                activation=cfg.hidden_act, quant_config=quant_config,
                                prefix=f"{prefix}.experts", layer_idx=layer_idx)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, cfg, layer_idx, quant_config, prefix):
        if is_sparse_layer(cfg, layer_idx):
            return Qwen3MoeSparseMoeBlock(cfg, layer_idx, quant_config, prefix)
        return LlamaMLP(cfg, quant_config, prefix)


class Qwen3MoeModel(Qwen3Model):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_cls = Qwen3MoeModel
    supports_tensor_parallel = True  # attention as Llama; experts split by width, or whole (expert parallel)
    expert_params_mapping = FusedMoE.checkpoint_mapping()

    def __init__(self, cfg, quant_config=None):
        check_config(cfg)
        super().__init__(cfg, quant_config)
