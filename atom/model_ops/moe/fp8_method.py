"""`Fp8MoEMethod`: experts stored as FP8 E4M3, as compressed-tensors / Quark checkpoints write them.

Formats (the same as the fp8 linear method's, `atom.model_ops.quant.fp8`, per expert):
- per-channel weights (compressed-tensors FP8_DYNAMIC "channel"): each expert's
  `{gate,up,down}_proj.weight` float8_e4m3fn [out, in] with `weight_scale` [out, 1], x
  dynamic per-token activations (or a static per-tensor `input_scale`);
- per-tensor weights: `weight_scale` one value per expert and projection, x static
  (`input_scale`, one per expert and projection; gate and up run the larger of their two, as
  a packed linear does) or dynamic per-tensor activations.
- bn x bk block weights (DeepSeek-V3's native fp8, `weight_block_size` [128, 128]; compressed-
  tensors FP8_BLOCK): one scale per block, named `weight_scale_inv` (DeepSeek / HF fine-grained
  fp8) or `weight_scale` (compressed-tensors), x dynamic 1 x bk activation groups.

Stored stacked (`layer.add_expert_param`, filled from per-expert checkpoint tensors by the
layer's loader): `w13_weight` [E, 2I, H] and `w2_weight` [E, H, I] in e4m3; `w13_weight_scale`
[E, 2I, 1] / `w2_weight_scale` [E, H, 1] (per channel) or [E, 2] / [E, 1] (per tensor, one
column per part); with static activations `w13_input_scale` [E, 2] / `w2_input_scale` [E, 1];
blocks: `w13_<scale>` [E, 2 ceil(I/bn), ceil(H/bk)] (the gate's block rows, then the up's)
and `w2_<scale>` [E, ceil(H/bn), ceil(I/bk)], kept as blocks (a per-row expansion of
DeepSeek-V3's would take ~13 GB) and expanded per expert when it runs.

Tensor parallel splits each expert's width I: w13's rows (and its per-row or block-row
scales) and w2's columns (and its block columns); a split inside a block is refused by the
loader. Per-tensor scales, w2's per-row scales and input scales are the same on every rank.

`apply` runs the plan's experts kernel (`KernelPlan.experts_kernel`). Triton
(`experts_fp8_triton.fused_experts_fp8`, through the `atom::moe_experts_fp8` op under
torch.compile) takes dynamic per-token and 1 x bk group activations, e4m3 x e4m3 products
with the scales applied per tile: no host sync, so CUDA graphs capture the layer. The torch
reference runs everywhere else (and for per-tensor activations, whose scale depends on the
rows an expert got): for each expert that got tokens, its weights dequantized to fp32 (w =
e4m3 x scale), its inputs fake-quantized as the format defines (`fake_quant_act`: the
activations an expert's linear sees are the rows routed to it, as in the producers'
per-expert Linears), the two products in fp32 (`product`), the activation between them in
the model's dtype. Nothing stays dequantized in the layer.
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
        self.per_channel = self.scheme.weight_scheme == "channel"
        self.block = self.scheme.block if self.scheme.weight_scheme == "block" else None
        self.scale_name = self.scheme.scale_name  # weight_scale_inv for DeepSeek's blocks, else weight_scale

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, bias):
        if bias:
            raise refuse(self.prefix, self.spec, "fp8 experts with biases are not in this build")
        E, H, I = num_experts, hidden_size, intermediate_size
        group = self.scheme.act_group if self.scheme.act == "group" else None
        for name, k in (("hidden_size", H), ("intermediate_size", I)):
            if group and k % group:
                raise refuse(self.prefix, self.spec, f"{name}={k} is not a multiple of the {group}-wide "
                             "activation group (producers refuse it too)")
        layer.add_expert_param("w13_weight", torch.empty(E, 2 * I, H, dtype=FP8), ("w1", "w3"), output_dim=1)
        layer.add_expert_param("w2_weight", torch.empty(E, H, I, dtype=FP8), ("w2",), input_dim=2)
        s13, s2 = f"w13_{self.scale_name}", f"w2_{self.scale_name}"
        if self.block is not None:
            bn, bk = self.block
            layer.add_expert_param(s13, torch.ones(E, 2 * -(-I // bn), -(-H // bk)), ("w1", "w3"),
                                   output_dim=1, rows_per_entry=bn)
            layer.add_expert_param(s2, torch.ones(E, -(-H // bn), -(-I // bk)), ("w2",), input_dim=2, input_pack=bk)
        elif self.per_channel:
            layer.add_expert_param(s13, torch.ones(E, 2 * I, 1), ("w1", "w3"), output_dim=1)
            layer.add_expert_param(s2, torch.ones(E, H, 1), ("w2",), output_dim=None)
        else:
            layer.add_expert_param(s13, torch.ones(E, 2), ("w1", "w3"), output_dim=None)
            layer.add_expert_param(s2, torch.ones(E, 1), ("w2",), output_dim=None)
        if self.scheme.static:
            layer.add_expert_param("w13_input_scale", torch.ones(E, 2), ("w1", "w3"), output_dim=None)
            layer.add_expert_param("w2_input_scale", torch.ones(E, 1), ("w2",), output_dim=None)

    def process_weights_after_loading(self, layer):
        """Per-row scales [E, rows, 1] for both products; per expert the static input scale
        (gate and up: the larger of the two)."""
        I = layer.intermediate_size
        s13 = getattr(layer, f"w13_{self.scale_name}").data.float()
        s2 = getattr(layer, f"w2_{self.scale_name}").data.float()
        if self.block is not None:  # kept as blocks; `dequantized` expands one expert's at a time
            layer.register_buffer("w13_block_scale", s13.contiguous(), persistent=False)
            layer.register_buffer("w2_block_scale", s2.contiguous(), persistent=False)
            return
        if not self.per_channel:
            s13 = s13.repeat_interleave(I, dim=1).unsqueeze(-1)
            s2 = s2.expand(-1, layer.hidden_size).unsqueeze(-1)
        layer.register_buffer("w13_row_scale", s13.contiguous(), persistent=False)
        layer.register_buffer("w2_row_scale", s2.contiguous(), persistent=False)
        if self.scheme.static:
            layer.register_buffer("w13_act_scale", layer.w13_input_scale.data.float().amax(1), persistent=False)
            layer.register_buffer("w2_act_scale", layer.w2_input_scale.data.float().amax(1), persistent=False)

    def dequantized(self, layer, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (w13 [2I, H], w2 [H, I]) in fp32 (w = e4m3 x its row's, or block's, scale)."""
        if self.block is not None:
            w13, w2 = layer.w13_weight[e].float(), layer.w2_weight[e].float()
            half = layer.w13_block_scale.shape[1] // 2  # the gate's block rows, then the up's
            s13 = layer.w13_block_scale[e]
            gate = _expand_blocks(s13[:half], self.block, (w13.shape[0] // 2, w13.shape[1]))
            up = _expand_blocks(s13[half:], self.block, (w13.shape[0] // 2, w13.shape[1]))
            return w13 * torch.cat((gate, up)), w2 * _expand_blocks(layer.w2_block_scale[e], self.block, w2.shape)
        return layer.w13_weight[e].float() * layer.w13_row_scale[e], layer.w2_weight[e].float() * layer.w2_row_scale[e]

    @property
    def triton_fits(self) -> bool:
        """Whether the Triton path computes this format: dynamic activations a row quantizes
        alike for every expert, with the weights' layout the kernel takes: per-row weight
        scales x per-token activations, or bn x bk blocks x 1 x bk groups (bk a power of two
        >= 32, the e4m3 dots' K step). Anything else runs the reference."""
        from atom.model_ops.moe.experts_fp8_triton import layout_problem
        sc = self.scheme
        if sc.static or sc.act not in ("token", "group"):
            return False
        return layout_problem(sc.act_group if sc.act == "group" else 0, self.block) is None

    def _kernel(self, layer, x: torch.Tensor) -> str:
        plan = getattr(layer, "plan", None)  # a stand-in layer may have none
        if plan is None or not self.triton_fits:
            return "reference"
        return plan.experts_kernel(x)

    def syncs_host(self, layer, device):
        return self._kernel(layer, torch.empty(0, device=device)) != "triton"

    def apply(self, layer, x, topk_weights, topk_ids):
        if self._kernel(layer, x) == "triton":
            return self._apply_triton(layer, x, topk_weights, topk_ids)
        return self._apply_reference(layer, x, topk_weights, topk_ids)

    def _apply_triton(self, layer, x, topk_weights, topk_ids):
        group = self.scheme.act_group if self.scheme.act == "group" else 0
        if self.block is not None:
            s13, s2 = layer.w13_block_scale, layer.w2_block_scale
        else:
            s13, s2 = layer.w13_row_scale, layer.w2_row_scale
        tiles = layer.tile_table()
        if torch.compiler.is_compiling():
            activation = layer.op_activation()  # registers the ops
            bn, bk = self.block or (0, 0)
            return torch.ops.atom.moe_experts_fp8(x, layer.w13_weight, s13, layer.w2_weight, s2, topk_weights,
                                                  topk_ids, activation, group, bn, bk, layer.tiles_json)
        from atom.model_ops.moe.experts_fp8_triton import fused_experts_fp8
        return fused_experts_fp8(x, layer.w13_weight, s13, layer.w2_weight, s2, topk_weights, topk_ids,
                                 layer.activation, group, self.block, tiles=tiles)

    def _apply_reference(self, layer, x, topk_weights, topk_ids):
        act = self.scheme.act
        static = self.scheme.static
        group = self.scheme.act_group if act == "group" else None

        def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
            w13, w2 = self.dequantized(layer, e)
            h = product(xe, fake_quant_act(xe, "fp8", act, group, layer.w13_act_scale[e] if static else None),
                        w13, None)
            a = layer.activation(h)
            return product(a, fake_quant_act(a, "fp8", act, group, layer.w2_act_scale[e] if static else None),
                           w2, None)

        return routed_sum(x, topk_weights, topk_ids, layer.num_experts, expert)

    def format(self, layer):
        return self.scheme.format_spec()

    def kernel_for(self, layer) -> str:
        """What runs the experts' products (the MoE table's `kernel` column)."""
        if self._kernel(layer, layer.w13_weight) == "triton":
            return "triton grouped GEMM (e4m3 x e4m3)"
        return "torch reference (per expert, dequantized)"

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


def _expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    """Block scales [ceil(rows/bn), ceil(cols/bk)] -> one per weight [rows, cols]."""
    bn, bk = block
    return scale.repeat_interleave(bn, 0)[:shape[0]].repeat_interleave(bk, 1)[:, :shape[1]]


MOE_METHODS["fp8"] = Fp8MoEMethod
