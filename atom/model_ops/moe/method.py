"""`MoEMethod`: how one MoE layer holds its experts' weights and runs them.

The quantization config hands each `FusedMoE` a method for its prefix (`moe_method_for`),
the same seam as the linear layers' `LinearMethod`. The method

- `create_weights(layer, num_experts, hidden_size, intermediate_size, bias)`: registers the
  stacked parameters through `layer.add_expert_param(name, tensor, parts)`, which gives each
  its `weight_loader`. The unquantized method creates `w13_weight` [E, 2I, H] (parts "w1" =
  gate rows, "w3" = up rows), `w2_weight` [E, H, I] (part "w2") and, with `bias`, `w13_bias`
  [E, 2I] and `w2_bias` [E, H].
- `process_weights_after_loading(layer)`: once the checkpoint (or dummy weights) is in.
- `apply(layer, x, topk_weights, topk_ids)`: [T, H] -> [T, H], the routed sum of the
  experts (the layer adds shared experts itself).

What a quantized method (FP8, MXFP4, ...) must provide: the same three calls and `format`;
its stored tensors (packed values, per-expert scales [E, ...]) made with `add_expert_param`
with the parts they split into along dim 1 (a per-channel scale of w13 is [E, 2I], parts
"w1", "w3"; a per-tensor scale [E, 2] has one column per part), so the loader fills them from
per-expert checkpoint tensors (`(expert_id, part)`) and from fused 3-D ones (`(None, part)`)
without knowing the format (the loader maps per-expert `weight_scale` / `input_scale`
tensors to `w13_*` / `w2_*` parameters of the same suffix, `FusedMoE.checkpoint_mapping`).
`num_experts` and `intermediate_size` are this rank's (the layer's `num_local_experts` /
sharded width under tensor or expert parallel), and each tensor declares how it shards the
width (`output_dim` / `input_dim`, the dim in the stacked [E, ...] tensor, with
`rows_per_entry` / `input_pack` for blocks; `output_dim=None`: the same on every rank;
`added_once=True`: a bias summed over the ranks, kept on rank 0 only) or tensor parallel
refuses it; `apply` may run `experts_ref.routed_sum` with its own per-expert function
(dequantize that expert, as `fp8_method.Fp8MoEMethod` does) or its own kernel. Register it
in `MOE_METHODS` under its dtype key.
"""
from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.moe.experts_ref import experts_reference


class MoEMethod:
    name = "base"

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int,
                       bias: bool) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after the checkpoint (or dummy weights) is in place."""

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def format(self, layer: nn.Module) -> str:
        raise NotImplementedError

    def syncs_host(self, layer: nn.Module, device: torch.device) -> bool:
        """Whether `apply` on `device` reads device values on the host (the torch reference's
        loop over the experts that got tokens does): such a layer cannot be captured in a CUDA
        graph or traced whole by torch.compile, so the runner then runs the model eagerly."""
        return True

    def weight_bytes(self, layer: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class UnquantizedMoEMethod(MoEMethod):
    """Experts in the model's dtype; the kernel is the plan's choice (`KernelPlan.experts_kernel`):
    the torch reference, or the Triton grouped GEMM (`experts_triton.fused_experts`)."""
    name = "unquantized"

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, bias):
        E, H, I = num_experts, hidden_size, intermediate_size
        layer.add_expert_param("w13_weight", torch.empty(E, 2 * I, H), ("w1", "w3"), output_dim=1)
        layer.add_expert_param("w2_weight", torch.empty(E, H, I), ("w2",), input_dim=2)
        if bias:
            layer.add_expert_param("w13_bias", torch.empty(E, 2 * I), ("w1", "w3"), output_dim=1)
            layer.add_expert_param("w2_bias", torch.empty(E, H), ("w2",), output_dim=None, added_once=True)

    def syncs_host(self, layer, device):
        plan = layer.plan
        return plan is None or plan.experts_kernel(torch.empty(0, device=device)) != "triton"

    def apply(self, layer, x, topk_weights, topk_ids):
        """The plan's kernel: Triton (through the `atom::moe_experts` op under torch.compile,
        for activations known by name) or the torch reference."""
        w13_bias, w2_bias = getattr(layer, "w13_bias", None), getattr(layer, "w2_bias", None)
        plan = layer.plan
        if plan is not None and plan.experts_kernel(x) == "triton":
            tiles = layer.tile_table()
            if torch.compiler.is_compiling():
                activation = layer.op_activation()  # registers the ops
                return torch.ops.atom.moe_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                                  w13_bias, w2_bias, activation, layer.tiles_json)
            from atom.model_ops.moe.experts_triton import fused_experts
            return fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.activation,
                                 w13_bias, w2_bias, tiles=tiles)
        return experts_reference(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.activation,
                                 w13_bias, w2_bias)

    def format(self, layer):
        return str(layer.w13_weight.dtype).removeprefix("torch.")


#: dtype key of the stored experts -> method class (quantized methods register here)
MOE_METHODS: dict[str, type[MoEMethod]] = {}


def moe_method_for(quant_config, prefix: str) -> MoEMethod:
    """The method for the MoE layer at `prefix` (its spec from `quant_config`; None, excluded
    or unquantized: the unquantized method). Raises NotImplementedError naming the layer and
    the format where no MoE method runs it."""
    from atom.model_ops.quant.common import method_for
    return method_for(quant_config, prefix, MOE_METHODS, UnquantizedMoEMethod, lambda spec: (
        f"no MoE method stores experts as {spec.quant_dtype} in this build yet: exclude the experts "
        "from quantization or use an unquantized checkpoint"))
