"""`atom::moe_experts` (and `atom::moe_experts_fp8`, `atom::moe_experts_mxfp4`): the Triton
experts paths as torch custom ops, for torch.compile.

Compiled models (levels 1-3, level 3 with `fullgraph`) cannot trace the align step's
data-dependent launch or the reference's host sync; the op is opaque to Dynamo and Inductor,
runs `fused_experts` when executed, and tells the compiler only its output shape (that of
`x`). Its arguments are tensors and strings: the activation by name (`layer.ACTIVATIONS`)
and the layer's tile table as JSON (`TileTable.to_json`, parsed once per distinct table).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from atom.model_ops.moe.tile_configs import TileTable


@functools.lru_cache(maxsize=64)
def _table(tiles: str) -> TileTable:
    return TileTable.from_json(tiles)


@torch.library.custom_op("atom::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor],
                activation: str, tiles: str) -> torch.Tensor:
    from atom.model_ops.moe.experts_triton import fused_experts
    from atom.model_ops.moe.layer import activation_of
    return fused_experts(x, w13, w2, topk_weights, topk_ids, activation_of(activation), w13_bias, w2_bias,
                         tiles=_table(tiles))


@moe_experts.register_fake
def _(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation, tiles):
    return torch.empty_like(x)


@torch.library.custom_op("atom::moe_experts_fp8", mutates_args=())
def moe_experts_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                    w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                    act_group: int, block_n: int, block_k: int, tiles: str) -> torch.Tensor:
    """`experts_fp8_triton.fused_experts_fp8` as an op (`block_n` 0: per-row weight scales)."""
    from atom.model_ops.moe.experts_fp8_triton import fused_experts_fp8
    from atom.model_ops.moe.layer import activation_of
    return fused_experts_fp8(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, activation_of(activation),
                             act_group, (block_n, block_k) if block_n else None, tiles=_table(tiles))


@moe_experts_fp8.register_fake
def _(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, activation, act_group, block_n, block_k, tiles):
    return torch.empty_like(x)


@torch.library.custom_op("atom::moe_experts_mxfp4", mutates_args=())
def moe_experts_mxfp4(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor], activation: str,
                      tiles: str) -> torch.Tensor:
    """`experts_mxfp4_triton.fused_experts_mxfp4` as an op."""
    from atom.model_ops.moe.experts_mxfp4_triton import fused_experts_mxfp4
    from atom.model_ops.moe.layer import activation_of
    return fused_experts_mxfp4(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, activation_of(activation),
                               w13_bias, w2_bias, tiles=_table(tiles))


@moe_experts_mxfp4.register_fake
def _(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, w13_bias, w2_bias, activation, tiles):
    return torch.empty_like(x)
