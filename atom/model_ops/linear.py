"""Linear layers, with the packed (fused) variants the models load into.

Every layer asks the quantization dispatcher for its `LayerQuantConfig` by its module
prefix. This build runs unquantized weights; a layer whose spec asks for a quantized
format is refused at build time, before any weight loads.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from atom.quant_spec import LayerQuantConfig, QuantType
from atom.utils.cuda_timing import graph_time


logger = logging.getLogger(__name__)
_ONEDNN = torch.backends.mkldnn.is_available()
# (N, K, dtype) of the weights whose one-row products run the Triton GEMV, and the timings
# that chose it (cuBLAS us, Triton us): filled by `choose_gemv_shapes` on a GPU.
GEMV_CHOICES: dict[tuple, tuple[float, float]] = {}
_GEMV_SHAPES: set[tuple] = set()
_gemv = None


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b). fp32 on the CPU goes to oneDNN's matmul: on the 2-core machine, over the
    embedded model's layers, it took 0.54x the time of `F.linear`'s BLAS call at one row,
    0.72x at 32 rows, the same at 8 and 0.92x at 256 (`python -m atom.benchmarks.cpu_gemm`). On a GPU, a single row (batch-1
    decode) of a weight shape where it measured faster goes to the Triton GEMV."""
    if torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    if x.is_cpu:
        if _ONEDNN and x.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    elif (_GEMV_SHAPES and bias is None and x.dim() == 2 and x.shape[0] == 1
          and (weight.shape[0], weight.shape[1], weight.dtype) in _GEMV_SHAPES):
        return _gemv(x, weight)
    return F.linear(x, weight, bias)


def choose_gemv_shapes(model: nn.Module, min_gain: float = 1.05) -> dict:
    """Times cuBLAS against the Triton GEMV on one row for every (N, K, dtype) of the model's
    bf16/fp16 linear weights (inside CUDA graphs, cycling through all the layers' weights of
    the shape so that they come from HBM, not L2) and routes a shape to the GEMV where it is
    at least `min_gain` times faster and gives the same result. Returns {shape: (cuBLAS us,
    Triton us)}; an empty dict off the GPU."""
    global _gemv
    groups: dict[tuple, list[torch.Tensor]] = {}
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, Linear) and m.bias is None and w is not None and w.is_cuda \
                and w.dtype in (torch.bfloat16, torch.float16):
            groups.setdefault((w.shape[0], w.shape[1], w.dtype), []).append(w)
    if not groups:
        return {}
    from atom.model_ops.kernels.gemv import gemv
    _gemv = gemv
    out = {}
    for key, ws in groups.items():
        x = torch.randn(1, key[1], device=ws[0].device, dtype=key[2])
        ref, got = F.linear(x, ws[0]), gemv(x, ws[0])
        if not torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=2e-2 * float(ref.abs().max())):
            logger.warning("Triton GEMV disagrees with cuBLAS on %s: not used", key)
            continue
        blas = graph_time([functools.partial(F.linear, x, w) for w in ws]) * 1e6
        tri = graph_time([functools.partial(gemv, x, w) for w in ws]) * 1e6
        out[key] = (blas, tri)
        if blas >= min_gain * tri:
            _GEMV_SHAPES.add(key)
        else:
            _GEMV_SHAPES.discard(key)
        logger.info("one-row GEMM %dx%d %s: cuBLAS %.1f us, Triton GEMV %.1f us -> %s", key[0], key[1],
                    key[2], blas, tri, "Triton" if key in _GEMV_SHAPES else "cuBLAS")
    GEMV_CHOICES.update(out)
    return out


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
