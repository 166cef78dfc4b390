"""Linear layers, with the packed (fused) variants the models load into.

Each layer gets its method from the quantization config by its module prefix
(`quant.linear_method_for`): the method creates the parameters, post-processes them after
loading and computes the product. `weight_loader(param, tensor, shard_id)` copies a
checkpoint tensor (or one shard of a packed layer) into a parameter. `plan` is the engine's
`KernelPlan`, set by the runner (None: the library product).
"""
from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.quant import dense, linear_method_for  # noqa: F401  (dense: the functional form)


class Linear(nn.Module):
    """y = x W^T (+ b) through the layer's method. `one_row` names how a decoder layer calls
    it at batch 1 ("plain", or the fused variants `fusions.install` declares), for the
    start-up GEMV choice."""

    one_row = "plain"

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant_config=None, prefix: str = ""):
        super().__init__()
        self.prefix = prefix
        self.in_features, self.out_features = in_features, out_features
        self.method = linear_method_for(quant_config, prefix)  # refuses formats without a kernel
        self.plan = None
        self.method.create_weights(self, in_features, out_features, bias)

    # packed layers override shard_ids and shard_range
    def shard_ids(self) -> list:
        """The checkpoint shards packed into this layer, in row order (None: one matrix)."""
        return [None]

    def shard_range(self, shard_id) -> tuple[int, int]:
        return 0, self.out_features

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        start, size = self.shard_range(shard_id) if shard_id is not None else (0, param.shape[0])
        if loaded.shape[0] != size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"{self.prefix}: checkpoint tensor shape {tuple(loaded.shape)} does not fit "
                             f"rows [{start}, {start + size}) of {tuple(param.shape)}")
        param.data[start:start + size].copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
                f"method={self.method.name}")


class QKVLinear(Linear):
    """q, k and v projections in one matrix: rows [q | k | v]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, quant_config=None, prefix: str = ""):
        self.head_dim = head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, quant_config, prefix)

    def shard_ids(self) -> list:
        return ["q", "k", "v"]

    def shard_range(self, shard_id) -> tuple[int, int]:
        return {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                "v": (self.q_size + self.kv_size, self.kv_size)}[shard_id]


class MergedLinear(Linear):
    """Several projections of the same input stacked by rows (gate_up: [gate | up])."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 quant_config=None, prefix: str = ""):
        self.out_sizes = list(out_sizes)
        super().__init__(in_features, sum(out_sizes), bias, quant_config, prefix)

    def shard_ids(self) -> list:
        return list(range(len(self.out_sizes)))

    def shard_range(self, shard_id) -> tuple[int, int]:
        return sum(self.out_sizes[:shard_id]), self.out_sizes[shard_id]
