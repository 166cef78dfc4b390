"""Token embedding and the LM head (which computes logits only for the rows asked for)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.model_ops.quant import UnquantizedLinearMethod


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """logits = hidden W^T, unquantized (its weight may be the embedding's: tied)."""

    one_row = "plain"  # batch 1 may take the start-up GEMV choice

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.method = UnquantizedLinearMethod()
        self.plan = None
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.bias = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, hidden)
