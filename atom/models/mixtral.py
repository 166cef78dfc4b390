"""Mixtral: Llama/Mistral attention with a sparse MoE block in every layer.

The block is a router (`gate`, [num_local_experts, hidden], unquantized) and
`num_local_experts` SiLU-gated experts (w1 gate, w3 up, w2 down) of width
`intermediate_size`; each token takes its `num_experts_per_tok` most probable experts,
their softmax probabilities renormalised to sum to 1.
Checkpoints: `block_sparse_moe.experts.{e}.w1/w3/w2.weight` (the original names; renamed to
this file's `mlp`, as transformers >= 5 does) or the fused 3-D `mlp.experts.gate_up_proj` /
`mlp.experts.down_proj` that transformers >= 5 writes.
"""
from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.linear import Linear
from atom.model_ops.moe import FusedMoE, TopK
from atom.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


def check_config(cfg) -> None:
    """ValueError naming the field for a Mixtral config this file cannot run."""
    E, k = cfg.num_local_experts, cfg.num_experts_per_tok
    if isinstance(E, bool) or not isinstance(E, int) or E < 1:
        raise ValueError(f"num_local_experts={E!r} is invalid: Mixtral needs an integer >= 1 experts")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= E:
        raise ValueError(f"num_experts_per_tok={k!r} is invalid: each token picks an integer number of experts "
                         f"in [1, num_local_experts={E}]")
    window = getattr(cfg, "sliding_window", None)
    if window is not None and window < cfg.max_position_embeddings:
        raise ValueError(f"sliding_window={window} is not implemented for Mixtral in this build: only None "
                         f"(or >= max_position_embeddings={cfg.max_position_embeddings}) runs")


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, cfg, layer_idx: int, quant_config=None, prefix: str = ""):
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.num_local_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size,
                                TopK(cfg.num_local_experts, cfg.num_experts_per_tok, renormalize=True),
                                activation=cfg.hidden_act, quant_config=quant_config,
                                prefix=f"{prefix}.experts", layer_idx=layer_idx)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, cfg, layer_idx, quant_config, prefix):
        return MixtralSparseMoeBlock(cfg, layer_idx, quant_config, prefix)


class MixtralModel(LlamaModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    model_cls = MixtralModel
    supports_tensor_parallel = True  # attention as Llama; experts split by width, or whole (expert parallel)
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}
    expert_params_mapping = FusedMoE.checkpoint_mapping(gate="w1", up="w3", down="w2")

    def __init__(self, cfg, quant_config=None):
        check_config(cfg)
        super().__init__(cfg, quant_config)
