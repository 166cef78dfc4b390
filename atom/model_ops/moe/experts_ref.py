"""The experts' torch reference: a loop over the experts, each on the tokens routed to it.

    y[t] = sum_j w[t, j] * down_e(act(gate_up_e(x[t])))   with e = ids[t, j]

`routed_sum(x, topk_weights, topk_ids, num_experts, expert_fn)` is the loop itself: the
(token, expert) pairs are sorted by expert once (one host sync for the counts), so only the
experts that got tokens run, each as `expert_fn(e, x_rows) -> y_rows`; the weighted sum is
in fp32 and the output in x's dtype. `experts_reference` runs it on stacked weights: `w13`
is [E, 2I, H] (each expert's [gate | up] rows, as the layer stacks them), `w2` is [E, H, I],
optional per-expert biases [E, 2I] and [E, H]; `activation` maps [n, 2I] -> [n, I]; the
products are in the input dtype. Quantized MoE methods pass their own `expert_fn`
(dequantize that expert's weights, quantize its activations as the format defines).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def routed_sum(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
               expert_fn: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    T, H = x.shape
    k = topk_ids.shape[1]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    if T == 0:
        return out.to(x.dtype)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // k
    weights = topk_weights.reshape(-1)[order].float()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        y = expert_fn(e, x[rows])
        out.index_add_(0, rows, y.float() * weights[start:start + n, None])
        start += n
    return out.to(x.dtype)


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor],
                      w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        h = F.linear(xe, w13[e], None if w13_bias is None else w13_bias[e])
        return F.linear(activation(h), w2[e], None if w2_bias is None else w2_bias[e])

    return routed_sum(x, topk_weights, topk_ids, w13.shape[0], expert)
