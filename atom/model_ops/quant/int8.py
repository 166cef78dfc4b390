"""INT8 W8A8: per-channel int8 weights x per-token dynamic int8 activations.

Format (compressed-tensors "int-quantized", W {8, int, channel, symmetric}, A {8, int,
token, dynamic}): `weight` int8 [out, in], `weight_scale` [out, 1] (packed layers:
concatenated along rows like the weight); w = weight * scale. Activations per row:
scale = amax / 127, q = clamp(round_half_even(x / scale), -128, 127), x ~ q * scale
(fake quant in the reference product). compressed-tensors divides by half its integer
range instead, (127 - (-128)) / 2 = 127.5, in the fake-quantized model it calibrates and in
transformers' reload (`calculate_qparams`), so its checkpoints run with amax / 127.5 (the
largest value then rounds to 128 and clamps to 127, as there). Asymmetric int8 and Quark's per-tensor static int8
(with zero points) are refused by name.

On a GPU (`common.use_kernels`) W8A8 runs `common.quantized_product`: a Triton kernel
quantizes the activations to int8 with the reference's arithmetic (qmax as above), then a
weight-streaming GEMV (small M) or a Triton tl.dot int8 x int8 -> int32 GEMM, the scales
applied to the exact integer sums. W8A16 (no activation quantization) keeps the reference.
W8A8's activations may also come quantized by the kernel in front (`input_quant` /
`apply_quantized`, the kernel plan's "norm+quant" and "silu+quant").
"""
from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.quant import common
from atom.model_ops.quant.common import (REFERENCE_KERNEL, InputQuant, QuantLinearMethod, bias_param,
                                         fake_quant_act, kernel_summary, prequantized_product, prequantized_ref,
                                         product, quantized_product, refuse, row_param, weight_param)
from atom.quant_spec import QuantType


class Int8LinearMethod(QuantLinearMethod):
    name = "int8"

    def __init__(self, spec, prefix: str):
        super().__init__(spec, prefix)
        if spec.quant_type is not QuantType.per_Token:
            raise refuse(prefix, spec, "int8 weights run per channel (W8A8) in this build; per-tensor "
                         "int8 (Quark, static, zero points) has no method yet")
        if spec.symmetric is False:
            raise refuse(prefix, spec, "asymmetric int8 (zero points) has no method yet")
        self.act = spec.act_scheme or "token"
        if self.act not in ("token", "none") or not spec.is_dynamic and self.act != "none":
            raise refuse(prefix, spec, f"int8 weights with {'static' if not spec.is_dynamic else 'dynamic'} "
                         f"{self.act!r} activations: this build runs dynamic per-token activations "
                         "(W8A8) or none (W8A16)")
        self.act_qmax = 127.5 if spec.quant_method == "compressed-tensors" else 127.0
        self.kernel = kernel_summary("int8", self.act) if self.act == "token" else REFERENCE_KERNEL

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        weight_param(layer, "weight", (out_features, in_features), torch.int8)
        row_param(layer, "weight_scale", 1)
        bias_param(layer, out_features, bias)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float() * layer.weight_scale.float()

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.act == "token" and common.use_kernels(x):
            return quantized_product(x, layer.weight, layer.weight_scale, layer.bias, "int8", "token",
                                     self.act_qmax)
        x32 = fake_quant_act(x, "int8", self.act, qmax=self.act_qmax)
        return product(x, x32, self.dequantized_weight(layer), layer.bias)

    def input_quant(self, layer: nn.Module) -> InputQuant | None:
        """W8A8: the per-token quantizer may run in the kernel in front (a plan's fusion)."""
        return InputQuant("int8", self.act_qmax) if self.act == "token" else None

    def apply_quantized(self, layer: nn.Module, xq: torch.Tensor, xs: torch.Tensor, out_dtype: torch.dtype,
                        lock: torch.Tensor | None = None, defer_sum: bool = False):
        if common.use_kernels(xq):
            return prequantized_product(xq, xs, layer.weight, layer.weight_scale, layer.bias, out_dtype, lock=lock,
                                        defer_sum=defer_sum)
        return prequantized_ref(xq, xs, self.dequantized_weight(layer), layer.bias, out_dtype)

    def format_spec(self) -> str:
        return "int8 per-channel, " + ("act dynamic per-token" if self.act == "token" else "weight only")
