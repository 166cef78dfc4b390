"""Token embedding and the LM head (which computes logits only for the rows asked for)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.model_ops.linear import dense


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    one_row = "plain"  # batch 1 goes through `dense`, so the start-up GEMV choice covers it

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return dense(hidden, self.weight)
