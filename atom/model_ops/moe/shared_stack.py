"""Shared experts run as extra experts of the routed kernel (the plan's "moe+shared" fusion).

A SiLU-gated MLP of width W = S x I is the sum of S MLPs of width I (its intermediate units
split in S blocks: the activation is per unit and the down projection is linear in them), so
DeepSeek's shared experts (`n_shared_experts` x `moe_intermediate_size` wide) are S more
experts of the routed width, which every token takes with weight 1. Stacked after the routed
experts ([E + S, 2I, H] and [E + S, H, I]) and appended to each token's choice by the routing
kernel (`route_triton.fused_topk(..., fixed=S)`), they run inside the grouped GEMM: no separate
gate-up, activation, down and add kernels, and one fp32 sum rounded once for routed and
shared alike. The layer's own parameters become views of the first E experts of the stack
(no second copy); the shared MLP keeps its weights for the paths that call it (the torch
reference, torch.compile, several ranks).

`stack_shared_experts(layer)` builds the stack where it applies and says why not elsewhere.
The fusion is opt-in (`KernelPlan(fusions=(..., "moe+shared"))`): the DeepSeek-V2-Lite
workload ran slower with it on (docs/perf), not yet timed layer by layer; a likely cost is
the shared experts' T rows each in BLOCK_M tiles sized for the routed experts' few rows.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from atom.model_ops.activation import SiluAndMul

logger = logging.getLogger(__name__)


def why_not_stacked(layer: nn.Module) -> str | None:
    """None where the shared experts of `layer` (a `FusedMoE`) can join its stack, else why not."""
    from atom.model_ops.moe.method import UnquantizedMoEMethod
    from atom.model_ops.quant import is_unquantized
    owner = getattr(layer.shared_experts, "__self__", layer.shared_experts)
    if owner is None:
        return "no shared experts"
    if layer.parallel_mode != "single" or layer.gather_tokens:
        return "several ranks (the shared experts are added after the reduce)"
    if type(layer.method) is not UnquantizedMoEMethod or "w13_bias" in layer.expert_parts:
        return f"experts method {layer.method.name} (the stack is for unquantized experts without biases)"
    from atom.model_ops.moe.route_triton import fused_topk_fits
    if not fused_topk_fits(layer.topk):
        return "the routing kernel does not compute this rule (expert groups or a select_fn)"
    if layer.activation_name != "silu":
        return f"activation {layer.activation_name}"
    gate_up, down = getattr(owner, "gate_up_proj", None), getattr(owner, "down_proj", None)
    if not (isinstance(getattr(owner, "act", None), SiluAndMul) and is_unquantized(gate_up) and is_unquantized(down)):
        return "the shared experts are not an unquantized SiLU-gated MLP (gate_up_proj, act, down_proj)"
    if getattr(gate_up, "bias", None) is not None or getattr(down, "bias", None) is not None:
        return "the shared experts have biases"
    I, H = layer.intermediate_size, layer.hidden_size
    W = gate_up.weight.shape[0] // 2
    if gate_up.weight.shape != (2 * W, H) or down.weight.shape != (H, W) or W % I:
        return f"shared width {W} is not a multiple of the experts' width {I}"
    if gate_up.weight.dtype != layer.w13_weight.dtype:
        return f"shared experts in {gate_up.weight.dtype}, routed in {layer.w13_weight.dtype}"
    return None


def stack_shared_experts(layer: nn.Module) -> int:
    """Stack the shared experts of `layer` after its routed ones (module docstring); the number
    of experts they became (0 where `why_not_stacked`). Idempotent."""
    if layer.shared_stack is not None:
        return layer.shared_stack[2]
    reason = why_not_stacked(layer)
    if reason is not None:
        logger.debug("%s: shared experts not stacked: %s", layer.prefix, reason)
        return 0
    owner = getattr(layer.shared_experts, "__self__", layer.shared_experts)
    gu, dn = owner.gate_up_proj.weight.detach(), owner.down_proj.weight.detach()
    w13, w2 = layer.w13_weight, layer.w2_weight
    E, two_i, H = w13.shape
    I = two_i // 2
    W = gu.shape[0] // 2
    S = W // I
    with torch.no_grad():
        w13_all = torch.empty((E + S, two_i, H), dtype=w13.dtype, device=w13.device)
        w2_all = torch.empty((E + S, H, I), dtype=w2.dtype, device=w2.device)
        w13_all[:E].copy_(w13)
        w2_all[:E].copy_(w2)
        for s in range(S):  # block s of the units: its gate rows, its up rows, its down columns
            w13_all[E + s, :I].copy_(gu[s * I:(s + 1) * I])
            w13_all[E + s, I:].copy_(gu[W + s * I:W + (s + 1) * I])
            w2_all[E + s].copy_(dn[:, s * I:(s + 1) * I])
    w13.data = w13_all[:E]  # the layer's parameters: views of the stack (the old storage goes)
    w2.data = w2_all[:E]
    layer.shared_stack = (w13_all, w2_all, S)
    return S
