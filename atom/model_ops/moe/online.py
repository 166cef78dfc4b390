"""Online quantization of a loaded MoE layer's experts (`online_quant_config` naming a
`FusedMoE`, e.g. the guide's `{"*expert*": "mxfp4"}`).

The experts load unquantized (stacked `w13_weight` [E, 2I, H] gate rows then up rows,
`w2_weight` [E, H, I]); `requantize_experts` then rebuilds the layer with the target format's
MoE method (`Target.moe_method`: `Fp8MoEMethod` for ptpc_fp8, per output channel x per-token
activations; `Mxfp4MoEMethod` for mxfp4, weight-only) and fills it through the layer's own
expert loader with the tensors the format's producer makes for each expert's gate, up and
down matrices (`Target.produce`, the same numbers as an online linear layer's), so an
online expert equals a checkpoint expert of that format bit for bit. Biases stay as loaded.
`expert_refusal` says, before anything loads, why a target cannot hold a layer (a format
with no MoE method, activation quantization the method does not run, a width the format
cannot pack, biases an FP8 expert has no room for).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn



class _Probe(nn.Module):
    """Takes a method's expert parameters on the meta device (shape checks, nothing allocated)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.num_local_experts = layer.num_local_experts

    def add_expert_param(self, name, tensor, parts, **shards):
        return tensor


def _bias(layer: nn.Module) -> bool:
    return "w13_bias" in layer.expert_parts


def _method_or_refusal(target, layer: nn.Module):
    """(the target's MoE method for `layer`, None), or (None, why it cannot hold the layer)."""
    if layer.method.name != "unquantized":
        return None, (f"its experts are already {layer.method.format(layer)} (online quantization starts "
                      "from unquantized experts)")
    try:
        method = target.moe_method(layer.prefix)
        with torch.device("meta"):
            method.create_weights(_Probe(layer), layer.num_local_experts, layer.hidden_size,
                                  layer.intermediate_size, _bias(layer))
    except (NotImplementedError, ValueError) as e:
        return None, str(e)
    return method, None


def expert_refusal(target, layer: nn.Module) -> Optional[str]:
    """Why `target` cannot re-quantize MoE `layer` (None: it can)."""
    return _method_or_refusal(target, layer)[1]


def requantize_experts(layer: nn.Module, target) -> None:
    """Rebuild MoE `layer`'s experts in `target`'s format (module docstring)."""
    method, why = _method_or_refusal(target, layer)
    if why is not None:
        raise ValueError(f"the experts of '{layer.prefix}' cannot be quantized online as {target.name}: {why}")
    I = layer.intermediate_size
    w13, w2 = layer.w13_weight.data.float(), layer.w2_weight.data.float()
    biases = {n: getattr(layer, n) for n in ("w13_bias", "w2_bias") if n in layer.expert_parts}
    for name in list(layer.expert_parts):
        delattr(layer, name)
    layer.expert_parts.clear()
    layer._filled.clear()
    with torch.device(w13.device):
        method.create_weights(layer, layer.num_local_experts, layer.hidden_size, I, bool(biases))
    for name, p in biases.items():  # as loaded, in the new method's parameter
        getattr(layer, name).data.copy_(p.data)
        layer._filled[name] = {(e, w) for e in range(layer.num_local_experts) for w in layer.expert_parts[name]}
    start = getattr(layer, "expert_start", 0)
    for e in range(layer.num_local_experts):
        for prefix, part, w in (("w13", "w1", w13[e, :I]), ("w13", "w3", w13[e, I:]), ("w2", "w2", w2[e])):
            for key, t in target.produce(w).items():
                p = getattr(layer, f"{prefix}_{key}")
                layer.weight_loader(p, t.to(p.device), (start + e, part))
    method.process_weights_after_loading(layer)
    layer.method = method
    missing = layer.missing_shards()
    if missing:
        raise RuntimeError(f"'{layer.prefix}': online quantization left {missing[:4]} unfilled")
