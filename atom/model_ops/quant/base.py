"""`LinearMethod`: how one linear layer holds and applies its weights.

The quantization config hands each linear layer a method for its prefix
(`atom.model_ops.quant.linear_method_for`). The method creates the layer's parameters
(each with the layer's `weight_loader`, which knows the packed shards), post-processes them
once the checkpoint is loaded (repacking, scales), and computes the product. Adding a
format adds a method file; the layers and the models stay as they are.

Tensor parallel: `create_weights` is handed the rank's in / out features, and each
parameter declares how it shards (`output_dim`, `rows_per_entry`, `input_dim`,
`input_pack`; None: the same on every rank; `quant.common._register` sets them); the
layer narrows each checkpoint tensor to the rank's slice before the parameter's loader
runs (`atom.model_ops.linear`). A method that declares nothing is refused under TP.
"""
from __future__ import annotations

import torch
from torch import nn


class LinearMethod:
    name = "base"

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after the checkpoint (or dummy weights) is in place."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def input_quant(self, layer: nn.Module):
        """How a kernel in front may hand this layer its input already quantized (a fusion of
        the kernel plan), for `apply_quantized`: a `quant.common.InputQuant`, or None (the
        default) where the layer takes x only."""
        return None

    def apply_quantized(self, layer: nn.Module, xq: torch.Tensor, xs: torch.Tensor, out_dtype: torch.dtype,
                        lock: torch.Tensor | None = None, defer_sum: bool = False):
        """`apply` of an input quantized as `input_quant` says: q [M, K] and its scales
        [M, 1] fp32 -> [M, N] in `out_dtype`; `lock`, `defer_sum` (a split-K product may come
        back as a `kernels.split_k.PendingSum`): see `quant.common.prequantized_product`."""
        raise NotImplementedError(f"{type(self).__name__} takes no pre-quantized input (its input_quant is None)")

    def format(self, layer: nn.Module) -> str:
        """What the weights are stored as (e.g. "bfloat16", "fp8 per-channel")."""
        raise NotImplementedError

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes of the layer's parameters (weights, scales, bias)."""
        return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
