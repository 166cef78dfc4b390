"""Linear layers, with the packed (fused) variants the models load into.

Every layer asks the quantization dispatcher for its `LayerQuantConfig` by its module
prefix. This build runs unquantized weights; a layer whose spec asks for a quantized
format is refused at build time, before any weight loads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.quant_spec import LayerQuantConfig, QuantType


_ONEDNN = torch.backends.mkldnn.is_available()


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b). fp32 on the CPU goes to oneDNN's matmul: on the 2-core machine it streams
    the weights 1.3-1.7x faster than `F.linear`'s BLAS call at 1-256 rows
    (`python -m atom.benchmarks.cpu_gemm` measures both)."""
    if _ONEDNN and x.is_cpu and x.dtype == torch.float32 and not torch.compiler.is_compiling():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _check_unquantized(spec: LayerQuantConfig | None, prefix: str) -> None:
    if spec is not None and spec.quant_type != QuantType.No:
        raise NotImplementedError(
            f"layer '{prefix}' asks for quant_type={spec.quant_type.name} ({spec.quant_dtype}); "
            "quantized kernels are not in this build: use an unquantized checkpoint")


class Linear(nn.Module):
    """y = x W^T (+ b). `weight_loader(param, tensor, shard_id)` copies a checkpoint tensor."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant_config=None, prefix: str = ""):
        super().__init__()
        self.prefix = prefix
        self.quant_spec = quant_config.get_layer_quant_config(prefix) if quant_config is not None else None
        _check_unquantized(self.quant_spec, prefix)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    # packed layers override these two
    def shard_range(self, shard_id) -> tuple[int, int]:
        return 0, self.out_features

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        start, size = self.shard_range(shard_id) if shard_id is not None else (0, param.shape[0])
        if loaded.shape[0] != size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"{self.prefix}: checkpoint tensor shape {tuple(loaded.shape)} does not fit "
                             f"rows [{start}, {start + size}) of {tuple(param.shape)}")
        param.data[start:start + size].copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class QKVLinear(Linear):
    """q, k and v projections in one matrix: rows [q | k | v]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, quant_config=None, prefix: str = ""):
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, quant_config, prefix)

    def shard_range(self, shard_id) -> tuple[int, int]:
        return {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                "v": (self.q_size + self.kv_size, self.kv_size)}[shard_id]


class MergedLinear(Linear):
    """Several projections of the same input stacked by rows (gate_up: [gate | up])."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 quant_config=None, prefix: str = ""):
        self.out_sizes = list(out_sizes)
        super().__init__(in_features, sum(out_sizes), bias, quant_config, prefix)

    def shard_range(self, shard_id) -> tuple[int, int]:
        return sum(self.out_sizes[:shard_id]), self.out_sizes[shard_id]
