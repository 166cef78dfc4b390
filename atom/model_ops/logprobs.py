"""Log-probabilities of sampled and prompt tokens, on the device, for the rows that ask.

As vLLM returns them by default: from the model's raw distribution (log_softmax of the
unprocessed logits, in fp32: before penalties, temperature, top-k / top-p). Per row: the
token's logprob, its rank (1 + how many tokens are more likely; ties count, as vLLM's
`(logprobs >= token's).sum()`), and the top k (ranks 1..k). Only these small tensors come
back to the host, where `logprob_dict` turns a row into vLLM's `{token_id: Logprob}`.
Prompt logprobs need the logits of every prompt position: they are computed in slices of
rows (`rows_per_slice`), so a long prefill chunk never holds `[chunk, vocab]` logits at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from atom.outputs import Logprob

SLICE_BYTES = 1 << 28  # fp32 logits held at once for prompt logprobs (256 MiB)


@dataclass
class LogprobsTensors:
    token_ids: torch.Tensor       # [R] int64: the token each row scores
    logprobs: torch.Tensor        # [R] float32
    ranks: torch.Tensor           # [R] int64
    top_ids: torch.Tensor         # [R, k] int64
    top_logprobs: torch.Tensor    # [R, k] float32

    @staticmethod
    def cat(parts: list["LogprobsTensors"]) -> "LogprobsTensors":
        return LogprobsTensors(*(torch.cat([getattr(p, f) for p in parts]) for f in
                                 ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs")))


class TokenLogprobs(NamedTuple):
    """One row on the host."""
    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """logits [R, V] (raw), token_ids [R] -> each token's logprob and rank, and the top k."""
    lp = logits.float().log_softmax(dim=-1)
    token_ids = token_ids.long()
    tok = lp.gather(-1, token_ids[:, None])[:, 0]
    ranks = (lp >= tok[:, None]).sum(dim=-1)
    top_lp, top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return LogprobsTensors(token_ids, tok, ranks, top_ids, top_lp)


def rows_per_slice(vocab: int) -> int:
    return max(1, SLICE_BYTES // (4 * vocab))


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    targets: torch.Tensor, k: int, vocab: int) -> LogprobsTensors:
    """hidden [R, H] of prompt positions, targets [R] the prompt token each one predicts."""
    step = rows_per_slice(vocab)
    return LogprobsTensors.cat([compute_logprobs(compute_logits(hidden[i:i + step]), targets[i:i + step], k)
                                for i in range(0, hidden.shape[0], step)])


def to_host(t: LogprobsTensors, ks: list[int]) -> list[TokenLogprobs]:
    """Rows to the host (one sync), row i keeping its own top ks[i]."""
    ids, lps, ranks = t.token_ids.tolist(), t.logprobs.tolist(), t.ranks.tolist()
    top_ids, top_lps = t.top_ids.tolist(), t.top_logprobs.tolist()
    return [TokenLogprobs(ids[i], lps[i], ranks[i], top_ids[i][:k], top_lps[i][:k]) for i, k in enumerate(ks)]


def logprob_dict(row: TokenLogprobs, decode: Callable[[list[int]], list[str]] | None = None) -> dict[int, Logprob]:
    """vLLM's form: {token: Logprob} for the scored token first, then the top k by rank."""
    ids = [row.token_id] + row.top_ids
    texts = decode(ids) if decode is not None else [None] * len(ids)
    out = {row.token_id: Logprob(row.logprob, row.rank, texts[0])}
    for rank, (tok, lp, text) in enumerate(zip(row.top_ids, row.top_logprobs, texts[1:]), 1):
        out.setdefault(tok, Logprob(lp, rank, text))
    return out
