"""FP8 E4M3 weights: per-tensor, per-channel and block scales.

Formats (checkpoint tensors per layer; `weight` is float8_e4m3fn [out, in], w = weight * scale):
- per-tensor: `weight_scale` one value ([] Quark, [1] compressed-tensors / HF "fp8"); a
  packed layer keeps one per shard, applied to that shard's rows. Activations: static
  (`input_scale`, one per shard; the packed layer uses their maximum, as vLLM does) or
  dynamic per tensor (amax / 448 over the whole input).
- per-channel (compressed-tensors "channel", Quark ptpc `per_channel`): `weight_scale`
  [out, 1] (Quark [out]) x dynamic per-token activations (amax / 448 per row), or a static
  per-tensor `input_scale`.
- block (DeepSeek / HF fine-grained fp8: `weight_scale_inv`; compressed-tensors "block":
  `weight_scale`): [ceil(out/bn), ceil(in/bk)], one scale per bn x bk block (partial blocks
  at the edges; each packed shard has its own block rows) x dynamic 1 x bk activation
  groups, which must divide in_features (DeepSeek's act_quant and compressed-tensors'
  forward both require it).
Activations are quantized to e4m3 and back (fake quant) in the reference product.

On a GPU (`common.use_kernels`) the product runs `common.quantized_product`: the activations
quantized to e4m3 by a Triton kernel with the reference's arithmetic, then a weight-streaming
GEMV (small M), torch._scaled_mm (per-tensor / per-channel, larger M, where cuBLASLt takes
the case) or the Triton GEMM (fp16 row-wise, odd sizes, blocks: each K block's tl.dot
scaled by x_scale[m, kb] * w_scale[n, kb]). Weight-only fp8 and blocks whose activation
group differs from the block width (or is narrower than 16) keep the reference; `kernel`
says which. Dynamic per-token (and, for one row, per-tensor) activations may also come
quantized by the kernel in front (`input_quant` / `apply_quantized`: the kernel plan's
"norm+quant" and "silu+quant" fusions), the product then running the same routes.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from atom.model_ops.quant import common
from atom.model_ops.quant.common import (FP8_MAX, REFERENCE_KERNEL, InputQuant, QuantLinearMethod, bias_param,
                                         expand_rows, fake_quant_act, kernel_summary, per_row_from_shards,
                                         per_shard_param, prequantized_product, prequantized_ref, product,
                                         quantized_product, refuse, row_param, weight_param)
from atom.quant_spec import QuantType

logger = logging.getLogger(__name__)

_ACT_NAMES = {"none": "none", "tensor": "per-tensor", "token": "per-token"}


class Fp8LinearMethod(QuantLinearMethod):
    name = "fp8"

    def __init__(self, spec, prefix: str):
        super().__init__(spec, prefix)
        block = spec.block_size
        if block is None and spec.quant_type in (QuantType.per_1x128, QuantType.per_128x128):
            block = (128, 128)
        if block is not None:
            self.weight_scheme, self.block = "block", block
            default_act = "group"
        elif spec.quant_type is QuantType.per_Token:
            self.weight_scheme, self.block = "channel", None
            default_act = "token" if spec.is_dynamic else "tensor"
        elif spec.quant_type is QuantType.per_Tensor:
            self.weight_scheme, self.block = "tensor", None
            default_act = "tensor"
        else:
            raise refuse(prefix, spec, "fp8 weights come per tensor, per channel or in blocks "
                         "(block_size); this granularity without a block size has no fp8 format")
        self.act = spec.act_scheme or default_act
        self.act_group = spec.act_group_size or (self.block[1] if self.act == "group" else None)
        self.static = not spec.is_dynamic and self.act != "none"
        if self.static and self.act != "tensor":
            raise refuse(prefix, spec, f"static activation scales exist per tensor only, not for "
                         f"{self.act!r} activations")
        if self.act == "group" and self.act_group is None:
            raise refuse(prefix, spec, "per-group activations without a group size")
        bk = self.block[1] if self.block else 0
        # the kernels take block weights with their own 1 x bk activation groups only (block
        # weights with per-token / per-tensor activations keep the reference)
        self.kernels = self.act != "none" and (
            (self.act == "group" and self.act_group == bk and bk >= 16 and not bk & (bk - 1))
            or (self.act != "group" and self.weight_scheme != "block"))
        self.kernel = kernel_summary("fp8", self.act, bk) if self.kernels else REFERENCE_KERNEL
        self.scale_name = "weight_scale_inv" if (self.weight_scheme == "block"
                                                  and spec.quant_method != "compressed-tensors") else "weight_scale"

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        if self.act == "group" and in_features % self.act_group:
            raise refuse(self.prefix, self.spec, f"in_features={in_features} is not a multiple of the "
                         f"{self.act_group}-wide activation group (producers refuse it too)")
        weight_param(layer, "weight", (out_features, in_features), torch.float8_e4m3fn)
        if self.weight_scheme == "tensor":
            per_shard_param(layer, self.scale_name)
        elif self.weight_scheme == "channel":
            row_param(layer, self.scale_name, 1)
        else:
            bn, bk = self.block
            row_param(layer, self.scale_name, -(-in_features // bk), rows_per_entry=bn, input_pack=bk)
        if self.static:
            per_shard_param(layer, "input_scale")
        bias_param(layer, out_features, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Scales per output row ([out, 1], or [out, ceil(in/bk)] for blocks) for apply."""
        scale = getattr(layer, self.scale_name).data
        if self.weight_scheme == "tensor":
            rows = per_row_from_shards(layer, scale)
            if scale.shape[0] == 1:  # one scale for the whole weight: cuBLASLt's tensor-wise scales
                layer.register_buffer("w_scalar", scale.float().reshape(()), persistent=False)
                if self.kernels:
                    self.kernel = kernel_summary("fp8", self.act, 0, tensorwise=self.act == "tensor")
        else:
            rows = expand_rows(layer, scale.float(), self.block[0] if self.block else 1)
        layer.register_buffer("row_scale", rows.contiguous(), persistent=False)
        if self.static:
            layer.register_buffer("act_scale", layer.input_scale.data.float().max(), persistent=False)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        w, s = layer.weight.float(), layer.row_scale
        if self.weight_scheme == "block":
            s = s.repeat_interleave(self.block[1], 1)[:, :w.shape[1]]
        return w * s

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.kernels and common.use_kernels(x):
            plan = getattr(layer, "plan", None)
            return quantized_product(x, layer.weight, layer.row_scale, layer.bias, "fp8", self.act, FP8_MAX,
                                     self.act_group or 0, layer.act_scale if self.static else None,
                                     getattr(layer, "w_scalar", None), plan.handle if plan is not None else 0)
        x32 = fake_quant_act(x, "fp8", self.act, self.act_group,
                             layer.act_scale if self.static else None)
        return product(x, x32, self.dequantized_weight(layer), layer.bias)

    def rowwise_scaled(self) -> bool:
        """Whether the GPU product from `common.SCALED_MM_MIN_M` rows is the row-wise scaled one
        (per-token dynamic activations, one scale a weight row; cuBLASLt's outer-vector
        scaling): the products the start-up cuBLASLt choice times (`tuning.gemm_choice`)."""
        return self.kernels and self.act == "token" and not self.static and self.weight_scheme != "block"

    def input_quant(self, layer: nn.Module) -> InputQuant | None:
        """Dynamic per-token or per-tensor activations on the kernels: their quantizer may run
        in the kernel in front (per-tensor only for one row, where the tensor is the row)."""
        if not self.kernels or self.static or self.act not in ("token", "tensor"):
            return None
        return InputQuant("fp8", FP8_MAX, per_token=self.act == "token")

    def apply_quantized(self, layer: nn.Module, xq: torch.Tensor, xs: torch.Tensor, out_dtype: torch.dtype,
                        lock: torch.Tensor | None = None, defer_sum: bool = False):
        if common.use_kernels(xq):
            return prequantized_product(xq, xs, layer.weight, layer.row_scale, layer.bias, out_dtype,
                                        getattr(layer, "w_scalar", None), lock, defer_sum, getattr(layer, "plan", None))
        return prequantized_ref(xq, xs, self.dequantized_weight(layer), layer.bias, out_dtype)

    def format_spec(self) -> str:
        w = {"tensor": "per-tensor", "channel": "per-channel"}.get(self.weight_scheme)
        if w is None:
            w = f"block {self.block[0]}x{self.block[1]}"
        if self.act == "none":
            return f"fp8 {w}, weight only"
        act = f"1x{self.act_group}" if self.act == "group" else _ACT_NAMES[self.act]
        return f"fp8 {w}, act {'static' if self.static else 'dynamic'} {act}"
