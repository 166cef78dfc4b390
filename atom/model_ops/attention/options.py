"""What one attention layer adds to plain causal attention, as both backends read it."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class AttentionOptions(NamedTuple):
    """`sinks` [Hq] (a learned logit per query head that joins the softmax denominator and
    carries no value; any float dtype) or None; `sliding_window` W (a query at position p sees
    keys p - W < j <= p) or None for full attention; `k_scale` / `v_scale`: 0-d fp32 tensors
    of an FP8 cache (stored = x / scale; 1.0 when None), unused for other caches.
    `Attention.options` builds one per layer."""
    sinks: Optional[torch.Tensor] = None
    sliding_window: Optional[int] = None
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None
