"""The experts' torch reference: a loop over the experts, each on the tokens routed to it.

    y[t] = sum_j w[t, j] * down_e(act(gate_up_e(x[t])))   with e = ids[t, j]

`w13` is [E, 2I, H] (each expert's [gate | up] rows, as the layer stacks them), `w2` is
[E, H, I]; optional per-expert biases [E, 2I] and [E, H]. `activation` maps [n, 2I] -> [n, I].
The (token, expert) pairs are sorted by expert once (one host sync for the counts), so the
loop visits only the experts that got tokens. Products in the input dtype, the weighted sum
in fp32, the output in the input dtype.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor],
                      w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    T, H = x.shape
    k = topk_ids.shape[1]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    if T == 0:
        return out.to(x.dtype)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // k
    weights = topk_weights.reshape(-1)[order].float()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        h = F.linear(x[rows], w13[e], None if w13_bias is None else w13_bias[e])
        y = F.linear(activation(h), w2[e], None if w2_bias is None else w2_bias[e])
        out.index_add_(0, rows, y.float() * weights[start:start + n, None])
        start += n
    return out.to(x.dtype)
