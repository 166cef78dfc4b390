"""Attention metadata: what one forward needs to find every token's K/V in the paged cache.

Built once per step by the `ModelRunner` as tensors (backends never look at `Sequence`
objects) and published as the per-forward context, the one global the model reads:

    with forward_context(meta):
        logits = model(input_ids, positions)
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
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
    # decode batches: int32 [B], the sequences longest context first (the Triton kernel
    # starts them in this order; None: batch order)
    seq_order: torch.Tensor | None = None
    # what a backend derives once per step and every layer reuses (host lists, gather plans)
    step_cache: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def longest_first(seq_lens: np.ndarray, padded: int | None = None) -> np.ndarray:
    """int32 order of the rows by descending context length (stable), then the padding
    rows len(seq_lens) .. padded - 1 in place."""
    order = np.argsort(-np.asarray(seq_lens), kind="stable").astype(np.int32)
    if padded is not None and padded > len(order):
        order = np.concatenate([order, np.arange(len(order), padded, dtype=np.int32)])
    return order


_CONTEXT: AttentionMetadata | None = None


def get_forward_context() -> AttentionMetadata:
    if _CONTEXT is None:
        raise RuntimeError("no attention metadata: run the model inside forward_context(meta)")
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
