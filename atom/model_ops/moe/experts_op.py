"""`atom::moe_experts`: the Triton experts path as a torch custom op, for torch.compile.

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
