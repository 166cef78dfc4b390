"""`Mxfp4MoEMethod`: experts stored as MXFP4 (e2m1 values two per byte, one E8M0 scale per 32
along K), weight only, as GPT-OSS checkpoints (`quant_method: "mxfp4"`) hold them.

Stored stacked (`layer.add_expert_param`), packed as the numerics of
`atom.model_ops.quant.mxfp4` define them (low nibble the even column):
- `w13_weight` uint8 [E, 2I, H/2] (parts "w1" gate rows, "w3" up rows) and
  `w13_weight_scale` uint8 [E, 2I, H/32];
- `w2_weight` uint8 [E, H, I/2] and `w2_weight_scale` uint8 [E, H, I/32];
- with `bias`, `w13_bias` [E, 2I] and `w2_bias` [E, H] in the model's dtype.

GPT-OSS's checkpoint: `mlp.experts.gate_up_proj_blocks` [E, 2I, H/32, 16] with gate and up
rows interleaved and `gate_up_proj_scales` [E, 2I, H/32] (same interleave), `down_proj_blocks`
[E, H, I/32, 16] and `down_proj_scales` [E, H, I/32] (transformers' `integrations/mxfp4.py`
dequantizes these bytes into `gate_up_proj` [E, H, 2I] / `down_proj` [E, I, H]); the model's
checkpoint mapping hands them to the layer's loader with the "blocks" and "interleaved"
layout tags (`FusedMoE.LAYOUTS`), which flatten the blocks and de-interleave the rows.

`apply` runs the plan's experts kernel (`KernelPlan.experts_kernel`). Triton: the grouped
GEMM over all experts with the packed weights dequantized in registers
(`experts_mxfp4_triton.fused_experts_mxfp4`, through the `atom::moe_experts_mxfp4` op under
torch.compile): no host sync, so CUDA graphs capture the layer. The reference loops over the
experts that got tokens (`experts_ref.routed_sum`): on CPU each expert's two matrices are
dequantized to fp32 and the products run in fp32 with the biases; on CUDA each product is
the 4-bit kernel `atom::w4_linear` (`kernels.w4_gemm`) on that expert's packed bytes and
scales (the same numbers without an fp32 copy of the expert). The activation between the
products runs in the model's dtype. Nothing stays dequantized in the layer. Activations are
not quantized (GPT-OSS runs MXFP4 weights x bf16 activations).
"""
from __future__ import annotations

import torch

from atom.model_ops.kernels.w4_gemm import KERNEL_DESCRIPTION, kernel_for_weight, use_w4_kernel, w4_product
from atom.model_ops.moe.experts_ref import routed_sum
from atom.model_ops.moe.method import MOE_METHODS, MoEMethod
from atom.model_ops.quant.common import product, refuse
from atom.model_ops.quant.mxfp4 import MX_GROUP, dequantize_mxfp4


class Mxfp4MoEMethod(MoEMethod):
    name = "mxfp4"

    def __init__(self, spec, prefix: str):
        self.spec, self.prefix = spec, prefix
        if (spec.group_size or MX_GROUP) != MX_GROUP:
            raise refuse(prefix, spec, f"MXFP4 experts have one E8M0 scale per {MX_GROUP} values; "
                         f"group_size={spec.group_size} is another format")
        if (spec.act_scheme or "none") != "none":
            raise refuse(prefix, spec, f"MXFP4 experts with {spec.act_scheme!r} activation quantization are not "
                         "in this build: the experts run weight-only (activations in the model's dtype)")

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, bias):
        E, H, I = num_experts, hidden_size, intermediate_size
        for name, k in (("hidden_size", H), ("intermediate_size", I)):
            if k % MX_GROUP:
                raise refuse(self.prefix, self.spec, f"{name}={k} is not a multiple of {MX_GROUP}: MXFP4 packs "
                             f"groups of {MX_GROUP} along K")
        layer.add_expert_param("w13_weight", torch.zeros(E, 2 * I, H // 2, dtype=torch.uint8), ("w1", "w3"))
        layer.add_expert_param("w13_weight_scale", torch.full((E, 2 * I, H // MX_GROUP), 127, dtype=torch.uint8),
                               ("w1", "w3"))
        layer.add_expert_param("w2_weight", torch.zeros(E, H, I // 2, dtype=torch.uint8), ("w2",))
        layer.add_expert_param("w2_weight_scale", torch.full((E, H, I // MX_GROUP), 127, dtype=torch.uint8), ("w2",))
        if bias:
            layer.add_expert_param("w13_bias", torch.zeros(E, 2 * I), ("w1", "w3"))
            layer.add_expert_param("w2_bias", torch.zeros(E, H), ("w2",))

    def dequantized(self, layer, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (w13 [2I, H], w2 [H, I]) in fp32."""
        return (dequantize_mxfp4(layer.w13_weight[e], layer.w13_weight_scale[e]),
                dequantize_mxfp4(layer.w2_weight[e], layer.w2_weight_scale[e]))

    def _kernel(self, layer, x: torch.Tensor) -> str:
        plan = getattr(layer, "plan", None)  # a stand-in layer may have none
        return "reference" if plan is None else plan.experts_kernel(x)

    def syncs_host(self, layer, device):
        return self._kernel(layer, torch.empty(0, device=device)) != "triton"

    def apply(self, layer, x, topk_weights, topk_ids):
        b13, b2 = getattr(layer, "w13_bias", None), getattr(layer, "w2_bias", None)
        if self._kernel(layer, x) == "triton":
            tiles = layer.tile_table()
            if torch.compiler.is_compiling():
                activation = layer.op_activation()  # registers the ops
                return torch.ops.atom.moe_experts_mxfp4(x, layer.w13_weight, layer.w13_weight_scale, layer.w2_weight,
                                                        layer.w2_weight_scale, topk_weights, topk_ids, b13, b2,
                                                        activation, layer.tiles_json)
            from atom.model_ops.moe.experts_mxfp4_triton import fused_experts_mxfp4
            return fused_experts_mxfp4(x, layer.w13_weight, layer.w13_weight_scale, layer.w2_weight,
                                       layer.w2_weight_scale, topk_weights, topk_ids, layer.activation, b13, b2,
                                       tiles=tiles)

        if use_w4_kernel(x):
            H, I = layer.w2_weight.shape[1], layer.w2_weight.shape[2] * 2

            def expert_kernel(e: int, xe: torch.Tensor) -> torch.Tensor:
                h = w4_product(xe, layer.w13_weight[e], layer.w13_weight_scale[e], None,
                               None if b13 is None else b13[e], "mxfp4", MX_GROUP, H)
                return w4_product(layer.activation(h), layer.w2_weight[e], layer.w2_weight_scale[e], None,
                                  None if b2 is None else b2[e], "mxfp4", MX_GROUP, I)

            return routed_sum(x, topk_weights, topk_ids, layer.num_experts, expert_kernel)

        def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
            w13, w2 = self.dequantized(layer, e)
            h = product(xe, xe.float(), w13, None if b13 is None else b13[e])
            a = layer.activation(h)
            return product(a, a.float(), w2, None if b2 is None else b2[e])

        return routed_sum(x, topk_weights, topk_ids, layer.num_experts, expert)

    #: the GPU kernel of each expert's products (CPU runs the torch reference)
    kernel = KERNEL_DESCRIPTION

    def format(self, layer):
        return "mxfp4 1x32 e8m0, weight only"

    def kernel_for(self, layer) -> str:
        """What runs the experts' products (the MoE table's `kernel` column)."""
        if self._kernel(layer, layer.w13_weight) == "triton":
            return "triton grouped GEMM (mxfp4 dequantized in registers)"
        return kernel_for_weight(layer.w13_weight)

    def __repr__(self):
        return "Mxfp4MoEMethod(mxfp4 1x32 e8m0, weight only)"


MOE_METHODS["fp4x2"] = Mxfp4MoEMethod
