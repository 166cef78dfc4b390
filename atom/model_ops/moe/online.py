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
cannot pack, biases an FP8 expert has no room for, a width split across tensor-parallel
ranks that the method does not declare how to narrow).

Parallel layers (`layer.parallel_mode`, `atom.model_ops.moe.layer`):
- expert parallel: a rank holds whole experts, so each is quantized as on one rank (the
  loader gets its global id);
- tensor parallel: every rank holds a slice of each expert's width I: w13's gate and up rows
  (column-parallel) and w2's columns (row-parallel). Each matrix asks the linear layers' rule
  (`needs_gather`): where the rank's slice would get other scales than the full matrix (w2's
  per-row ptpc scales span all of I), the slices of that expert's matrix are all-gathered over
  `layer.tp` (one expert at a time, bounding the memory) and quantized whole, and the layer's
  loader narrows the tensors to this rank's part as it narrows a checkpoint's; elsewhere (the
  gate and up rows, MXFP4 groups of 32 inside the slice) the slice is quantized alone and
  handed to the loader as a tensor whose every rank-part is that slice (so it narrows back
  to it). A rank's tensors equal the matching part of the one-rank layer's.
`requantize_experts` returns the matrices it gathered (the info summary's `tp_gather`).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from atom.model_ops.quant.online import needs_gather


class _Probe(nn.Module):
    """Takes a method's expert parameters on the meta device (shape checks, nothing allocated)
    and what each declares about its tensor-parallel split."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.num_local_experts = layer.num_local_experts
        self.declared: dict[str, dict] = {}

    def add_expert_param(self, name, tensor, parts, **shards):
        self.declared[name] = shards
        return tensor


def _bias(layer: nn.Module) -> bool:
    return "w13_bias" in layer.expert_parts


def _method_or_refusal(target, layer: nn.Module):
    """(the target's MoE method for `layer`, None), or (None, why it cannot hold the layer)."""
    if layer.method.name != "unquantized":
        return None, (f"its experts are already {layer.method.format(layer)} (online quantization starts "
                      "from unquantized experts)")
    probe = _Probe(layer)
    try:
        method = target.moe_method(layer.prefix)
        with torch.device("meta"):
            method.create_weights(probe, layer.num_local_experts, layer.hidden_size,
                                  layer.intermediate_size, _bias(layer))
    except (NotImplementedError, ValueError) as e:
        if _parallel_mode(layer) == "tensor":  # the width it refused is a rank's slice
            return None, f"{e} (one width slice of tensor_parallel_size={layer.tp.world_size})"
        return None, str(e)
    if _parallel_mode(layer) == "tensor":  # the loader narrows each tensor along the dim it declares
        loose = [n for n, d in probe.declared.items() if "output_dim" not in d and "input_dim" not in d]
        if loose:
            return None, (f"the {method.name} MoE method does not declare how {loose} split (output_dim / "
                          f"input_dim), so its experts cannot be split by width over tensor_parallel_size="
                          f"{layer.tp.world_size}; enable_expert_parallel splits whole experts instead")
    return method, None


def _parallel_mode(layer: nn.Module) -> str:
    return getattr(layer, "parallel_mode", "single")


def gathered_parts(target, layer: nn.Module) -> list[str]:
    """The matrices ("w13": gate and up, column-parallel; "w2": down, row-parallel) of MoE
    `layer` whose full width its tensor-parallel ranks gather before quantizing to `target`."""
    if _parallel_mode(layer) != "tensor":
        return []
    world = layer.tp.world_size
    full = layer.intermediate_size * world
    return [name for name, split in (("w13", "column"), ("w2", "row")) if needs_gather(target, split, full, world)]


def _each_rank_holds(layer: nn.Module, param: nn.Parameter, t: torch.Tensor) -> torch.Tensor:
    """`t` (this rank's part of one expert's tensor, made from its slice) repeated once per
    rank along each dim `param` splits: the layer's loader, which narrows a full checkpoint
    tensor to the rank's part, gives back `t`."""
    for dim in (getattr(param, "output_dim", None), getattr(param, "input_dim", None)):
        if dim is not None:  # a per-expert tensor lacks the stacked parameter's expert dim
            t = torch.cat([t] * layer.tp.world_size, dim=dim - 1)
    return t


def expert_refusal(target, layer: nn.Module) -> Optional[str]:
    """Why `target` cannot re-quantize MoE `layer` (None: it can)."""
    return _method_or_refusal(target, layer)[1]


def requantize_experts(layer: nn.Module, target) -> list[str]:
    """Rebuild MoE `layer`'s experts in `target`'s format (module docstring); the matrices
    whose full width the ranks gathered (`gathered_parts`). Under tensor parallel every rank
    of `layer.tp` must call it (the gathers are collectives)."""
    method, why = _method_or_refusal(target, layer)
    if why is not None:
        raise ValueError(f"the experts of '{layer.prefix}' cannot be quantized online as {target.name}: {why}")
    gathered = gathered_parts(target, layer)
    split = _parallel_mode(layer) == "tensor"
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
        gate, up, down = w13[e, :I], w13[e, I:], w2[e]
        if "w13" in gathered:  # [I, H] slices of each part -> the full part, ranks in order
            gate, up = layer.tp.all_gather(gate.contiguous(), dim=0), layer.tp.all_gather(up.contiguous(), dim=0)
        if "w2" in gathered:  # [H, I] slices -> [H, full I]
            down = layer.tp.all_gather(down.contiguous(), dim=1)
        for prefix, part, w in (("w13", "w1", gate), ("w13", "w3", up), ("w2", "w2", down)):
            for key, t in target.produce(w).items():
                p = getattr(layer, f"{prefix}_{key}")
                if split and prefix not in gathered:  # made from this rank's slice: already its part
                    t = _each_rank_holds(layer, p, t)
                layer.weight_loader(p, t.to(p.device), (start + e, part))
    method.process_weights_after_loading(layer)
    layer.method = method
    missing = layer.missing_shards()
    if missing:
        raise RuntimeError(f"'{layer.prefix}': online quantization left {missing[:4]} unfilled")
    return gathered
