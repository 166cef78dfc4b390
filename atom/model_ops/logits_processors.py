"""Penalties and `min_tokens`: the logits changed before sampling, on the device, for the
rows that ask (the others are not touched; a batch where none asks never comes here).

vLLM's definitions, over a row's token counts (`[rows, vocab]`, built by one scatter_add from
the sequences' token ids):
  repetition_penalty r  tokens seen in the prompt or the output: logit > 0 divided by r,
                        logit <= 0 multiplied by r (HF / CTRL's rule);
  frequency_penalty f   logit -= f * (times the token was generated);
  presence_penalty p    logit -= p * (1 if the token was generated);
  min_tokens m          while fewer than m tokens were generated, EOS (unless ignore_eos) and
                        `stop_token_ids` get -inf.
Repetition first, then frequency and presence, as vLLM applies them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from atom.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, seen: torch.Tensor | None,
                    presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor | None) -> torch.Tensor:
    """logits [R, V] fp32, output_counts [R, V] (generated-token counts), seen [R, V] bool
    (prompt or output; None: no row has a repetition penalty), per-row penalties [R]."""
    if seen is not None and repetition is not None:
        rep = torch.where(seen, repetition[:, None], 1.0)
        logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * (output_counts > 0).to(logits.dtype)


@dataclass
class LogitsProcessing:
    """One step's logits processing, as device tensors (see `build_logits_processing`)."""
    rows: torch.Tensor | None = None           # [R] rows of the logits with penalties
    output_counts: torch.Tensor | None = None  # [R, V] float32
    seen: torch.Tensor | None = None           # [R, V] bool; None: no repetition penalty
    presence: torch.Tensor | None = None       # [R] float32
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    ban_rows: torch.Tensor | None = None       # min_tokens: logits[ban_rows, ban_tokens] = -inf
    ban_tokens: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed logits (float32; `logits` itself may be changed in place)."""
        x = logits.float()
        if self.rows is not None:
            x[self.rows] = apply_penalties(x[self.rows], self.output_counts, self.seen, self.presence,
                                           self.frequency, self.repetition)
        if self.ban_rows is not None:
            x[self.ban_rows, self.ban_tokens] = float("-inf")
        return x


def _flat(lists: list[list[int]], vocab: int) -> np.ndarray:
    """row * vocab + token for every token of every row's list."""
    lens = np.fromiter((len(t) for t in lists), np.int64, len(lists))
    toks = np.fromiter(itertools.chain.from_iterable(lists), np.int64, int(lens.sum()))
    return np.repeat(np.arange(len(lists), dtype=np.int64) * vocab, lens) + toks


def token_counts(lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[len(lists), vocab] float32: how often each token occurs in each row's list."""
    flat = torch.from_numpy(_flat(lists, vocab)).to(device, non_blocking=True)
    counts = torch.zeros(len(lists) * vocab, dtype=torch.float32, device=device)
    counts.scatter_add_(0, flat, torch.ones(flat.shape[0], dtype=torch.float32, device=device))
    return counts.view(len(lists), vocab)


def build_logits_processing(token_ids: list[list[int]], prompt_lens: list[int], context_lens: list[int],
                            params: list[SamplingParams], vocab: int, device,
                            eos_token_ids: frozenset[int] = frozenset()) -> LogitsProcessing | None:
    """Per sampled row: its sequence's tokens, prompt length, how many tokens precede the one
    sampled (`context_lens`), its parameters. None when no row has penalties or min_tokens."""
    out = LogitsProcessing()
    pen = [i for i, sp in enumerate(params) if sp.uses_penalties]
    if pen:
        outputs = [token_ids[i][prompt_lens[i]:context_lens[i]] for i in pen]
        out.rows = torch.tensor(pen, dtype=torch.int64).to(device, non_blocking=True)
        out.output_counts = token_counts(outputs, vocab, device)
        sps = [params[i] for i in pen]
        f32 = dict(dtype=torch.float32)
        out.presence = torch.tensor([sp.presence_penalty for sp in sps], **f32).to(device, non_blocking=True)
        out.frequency = torch.tensor([sp.frequency_penalty for sp in sps], **f32).to(device, non_blocking=True)
        if any(sp.repetition_penalty != 1.0 for sp in sps):
            out.repetition = torch.tensor([sp.repetition_penalty for sp in sps], **f32).to(device, non_blocking=True)
            prompts = [token_ids[i][:prompt_lens[i]] for i in pen]
            out.seen = (token_counts(prompts, vocab, device) > 0) | (out.output_counts > 0)
    ban_rows, ban_tokens = [], []
    for i, sp in enumerate(params):
        if sp.min_tokens and context_lens[i] - prompt_lens[i] < sp.min_tokens:
            stops = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else set(eos_token_ids))
            stops = sorted(t for t in stops if t < vocab)
            ban_rows += [i] * len(stops)
            ban_tokens += stops
    if ban_rows:
        out.ban_rows = torch.tensor(ban_rows, dtype=torch.int64).to(device, non_blocking=True)
        out.ban_tokens = torch.tensor(ban_tokens, dtype=torch.int64).to(device, non_blocking=True)
    if out.rows is None and out.ban_rows is None:
        return None
    return out
