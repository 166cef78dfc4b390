"""`Fp8MoEMethod`: experts stored as FP8 E4M3, as compressed-tensors / Quark checkpoints write them.

Formats (the same as the fp8 linear method's, `atom.model_ops.quant.fp8`, per expert):
- per-channel weights (compressed-tensors FP8_DYNAMIC "channel"): each expert's
  `{gate,up,down}_proj.weight` float8_e4m3fn [out, in] with `weight_scale` [out, 1], x
  dynamic per-token activations (or a static per-tensor `input_scale`);
- per-tensor weights: `weight_scale` one value per expert and projection, x static
  (`input_scale`, one per expert and projection; gate and up run the larger of their two, as
  a packed linear does) or dynamic per-tensor activations.
Block-scaled fp8 experts are refused at build (no MoE method for them in this build yet).

Stored stacked (`layer.add_expert_param`, filled from per-expert checkpoint tensors by the
layer's loader): `w13_weight` [E, 2I, H] and `w2_weight` [E, H, I] in e4m3; `w13_weight_scale`
[E, 2I, 1] / `w2_weight_scale` [E, H, 1] (per channel) or [E, 2] / [E, 1] (per tensor, one
column per part); with static activations `w13_input_scale` [E, 2] / `w2_input_scale` [E, 1].

`apply` is the torch reference on every device: for each expert that got tokens, its weights
dequantized to fp32 (w = e4m3 x scale), its inputs fake-quantized as the format defines
(`fake_quant_act`: the activations an expert's linear sees are the rows routed to it, as in
the producers' per-expert Linears), the two products in fp32 (`product`), the activation
between them in the model's dtype. Nothing stays dequantized in the layer.
"""
from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.moe.experts_ref import routed_sum
from atom.model_ops.moe.method import MOE_METHODS, MoEMethod
from atom.model_ops.quant.common import fake_quant_act, product, refuse
from atom.model_ops.quant.fp8 import Fp8LinearMethod

FP8 = torch.float8_e4m3fn


class Fp8MoEMethod(MoEMethod):
    name = "fp8"

    def __init__(self, spec, prefix: str):
        self.spec, self.prefix = spec, prefix
        self.scheme = Fp8LinearMethod(spec, prefix)  # parses granularity + activations once, as for linears
        if self.scheme.weight_scheme == "block":
            raise refuse(prefix, spec, "block-scaled fp8 experts have no MoE method in this build yet: use a "
                         "per-channel (FP8_DYNAMIC) or per-tensor fp8 checkpoint, or exclude the experts")
        self.per_channel = self.scheme.weight_scheme == "channel"

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, bias):
        if bias:
            raise refuse(self.prefix, self.spec, "fp8 experts with biases are not in this build")
        E, H, I = num_experts, hidden_size, intermediate_size
        layer.add_expert_param("w13_weight", torch.empty(E, 2 * I, H, dtype=FP8), ("w1", "w3"))
        layer.add_expert_param("w2_weight", torch.empty(E, H, I, dtype=FP8), ("w2",))
        if self.per_channel:
            layer.add_expert_param("w13_weight_scale", torch.ones(E, 2 * I, 1), ("w1", "w3"))
            layer.add_expert_param("w2_weight_scale", torch.ones(E, H, 1), ("w2",))
        else:
            layer.add_expert_param("w13_weight_scale", torch.ones(E, 2), ("w1", "w3"))
            layer.add_expert_param("w2_weight_scale", torch.ones(E, 1), ("w2",))
        if self.scheme.static:
            layer.add_expert_param("w13_input_scale", torch.ones(E, 2), ("w1", "w3"))
            layer.add_expert_param("w2_input_scale", torch.ones(E, 1), ("w2",))

    def process_weights_after_loading(self, layer):
        """Per-row scales [E, rows, 1] for both products; per expert the static input scale
        (gate and up: the larger of the two)."""
        I = layer.intermediate_size
        s13, s2 = layer.w13_weight_scale.data.float(), layer.w2_weight_scale.data.float()
        if not self.per_channel:
            s13 = s13.repeat_interleave(I, dim=1).unsqueeze(-1)
            s2 = s2.expand(-1, layer.hidden_size).unsqueeze(-1)
        layer.register_buffer("w13_row_scale", s13.contiguous(), persistent=False)
        layer.register_buffer("w2_row_scale", s2.contiguous(), persistent=False)
        if self.scheme.static:
            layer.register_buffer("w13_act_scale", layer.w13_input_scale.data.float().amax(1), persistent=False)
            layer.register_buffer("w2_act_scale", layer.w2_input_scale.data.float().amax(1), persistent=False)

    def dequantized(self, layer, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (w13 [2I, H], w2 [H, I]) in fp32."""
        return layer.w13_weight[e].float() * layer.w13_row_scale[e], layer.w2_weight[e].float() * layer.w2_row_scale[e]

    def apply(self, layer, x, topk_weights, topk_ids):
        act = self.scheme.act
        static = self.scheme.static

        def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
            w13, w2 = self.dequantized(layer, e)
            h = product(xe, fake_quant_act(xe, "fp8", act, None, layer.w13_act_scale[e] if static else None), w13, None)
            a = layer.activation(h)
            return product(a, fake_quant_act(a, "fp8", act, None, layer.w2_act_scale[e] if static else None), w2, None)

        return routed_sum(x, topk_weights, topk_ids, layer.num_experts, expert)

    def format(self, layer):
        return self.scheme.format_spec()

    def weight_bytes(self, layer):
        """The stored e4m3 values and scales (the derived row scales included)."""
        seen, total = set(), 0
        for t in list(layer.parameters(recurse=False)) + list(layer.buffers(recurse=False)):
            if (t.data_ptr(), t.numel()) not in seen:
                seen.add((t.data_ptr(), t.numel()))
                total += t.numel() * t.element_size()
        return total

    def __repr__(self):
        return f"Fp8MoEMethod({self.scheme.format_spec()})"


MOE_METHODS["fp8"] = Fp8MoEMethod
