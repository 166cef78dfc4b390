"""Token embedding and the LM head (which computes logits only for the rows asked for),
vocab-parallel under tensor parallel.

With `tp` ranks (`atom.distributed.building`), each rank holds rows
[r * V', (r + 1) * V') of the vocabulary, V' = ceil(V / tp) (the last rank's tail rows past
V are zeros): the embedding looks up the ids in its range, zeros the others and sums over
the ranks (one all-reduce); the LM head computes its V' logits and gathers them (one
all-gather, cut back to V). A tied LM head shares the embedding's shard.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.distributed.state import current_parallel_state
from atom.model_ops.quant import UnquantizedLinearMethod


class _VocabShard(nn.Module):
    """A [vocab, hidden] table of which this rank holds its rows (loader narrows to them)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp=None):
        super().__init__()
        self.tp = tp if tp is not None else current_parallel_state()
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // self.tp.world_size)
        self.start = self.tp.rank * self.rows
        self.weight = nn.Parameter(torch.zeros(self.rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if tuple(loaded.shape) != (self.vocab_size, param.shape[1]):
            raise ValueError(f"{type(self).__name__}: checkpoint tensor shape {tuple(loaded.shape)} != "
                             f"{(self.vocab_size, param.shape[1])}")
        part = loaded[self.start:self.start + self.rows]
        param.data.zero_()
        param.data[:part.shape[0]].copy_(part)

    def extra_repr(self) -> str:
        tp = f", rows [{self.start}, {self.start + self.rows}) of rank {self.tp.rank}" if self.tp.world_size > 1 else ""
        return f"vocab={self.vocab_size}, hidden={self.weight.shape[1]}{tp}"


class VocabEmbedding(_VocabShard):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class LMHead(_VocabShard):
    """logits = hidden W^T, unquantized (its weight may be the embedding's: tied)."""

    one_row = "plain"  # batch 1 may take the start-up GEMV choice

    def __init__(self, vocab_size: int, hidden_size: int, tp=None):
        super().__init__(vocab_size, hidden_size, tp)
        self.method = UnquantizedLinearMethod()
        self.plan = None
        self.bias = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.method.apply(self, hidden)
        if self.tp.world_size == 1:
            return logits
        return self.tp.all_gather(logits, -1)[..., :self.vocab_size]
