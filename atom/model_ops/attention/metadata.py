"""Attention metadata: what one forward needs to find every token's K/V in the paged cache.

Built once per step by the `ModelRunner` as tensors (backends never look at `Sequence`
objects) and published as the per-forward context, the one global the model reads. It also
carries the engine's kernel plan and attention backend (the runner sets them), so that two
engines in one process each find their own:

    with forward_context(meta):
        logits = model(input_ids, positions)
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor    # int32 [B+1]: token offsets of each sequence's queries
    seq_lens: torch.Tensor        # int32 [B]: context length incl. this step's tokens
    block_tables: torch.Tensor    # int32 [B, max_blocks]
    slot_mapping: torch.Tensor    # int64 [T]: cache slot of each new token (-1: padding)
    max_query_len: int
    max_seq_len: int
    # host copies, for backends that loop on the host (the torch reference)
    query_lens_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    # what a backend derives once per step and every layer reuses (host lists, gather plans)
    step_cache: dict = field(default_factory=dict)
    # the engine running this forward: its `KernelPlan` and attention backend (None: defaults)
    plan: object = None
    attn_backend: object = None
    # a CUDA graph's padded step: rows past cu_seqlens_q[-1] are padding whose activations
    # hold whatever memory was there (what a statistic over all rows must leave out)
    padded: bool = False

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


_CONTEXT: AttentionMetadata | None = None


def get_forward_context() -> AttentionMetadata:
    if _CONTEXT is None:
        raise RuntimeError("no attention metadata: run the model inside forward_context(meta)")
    return _CONTEXT


def current_forward_context() -> AttentionMetadata | None:
    """The metadata of the forward running now, or None outside one."""
    return _CONTEXT


def set_forward_context(meta: AttentionMetadata | None) -> None:
    global _CONTEXT
    _CONTEXT = meta


@contextmanager
def forward_context(meta: AttentionMetadata):
    prev = _CONTEXT
    set_forward_context(meta)
    try:
        yield meta
    finally:
        set_forward_context(prev)
