"""The per-step work only some rows ask for: processed logits (penalties, min_tokens),
logprobs of the sampled tokens and of prompt tokens. `ModelRunner.launch` calls these only
when a sequence of the batch asks, so a batch where none does runs exactly the plain path.

Device work is in `model_ops.logits_processors` and `model_ops.logprobs`; here the rows of a
step are matched to sequences: which positions sample (a row with k drafts samples k + 1
times, position i after its confirmed tokens and drafts [:i]), which prompt positions a
prefill chunk covers (position j scores prompt token j + 1; chunk by chunk, positions
scored before, e.g. before a preemption, skipped).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from atom.model_engine.sequence import Sequence
from atom.model_ops.logits_processors import build_logits_processing
from atom.model_ops.logprobs import LogprobsTensors, TokenLogprobs, compute_logprobs, prompt_logprobs, to_host


@dataclass
class StepLogprobs:
    """A step's logprobs: device results at launch, per batch row on the host after `collect`."""
    sample_owners: list[int] = field(default_factory=list)  # batch row of each scored sampled position
    sample_ks: list[int] = field(default_factory=list)
    sample_tensors: LogprobsTensors | None = None
    prompt_spans: list[tuple[int, int, int, int]] = field(default_factory=list)  # (row, first, end, k)
    prompt_tensors: LogprobsTensors | None = None
    sample: list[list[TokenLogprobs]] | None = None   # per batch row: one per sampled position
    prompt: dict[int, tuple[int, list[TokenLogprobs]]] | None = None  # row -> (first prompt token, rows)

    def to_host(self, num_seqs: int) -> None:
        """One sync per kind; results grouped by batch row."""
        if self.sample_tensors is not None:
            self.sample = [[] for _ in range(num_seqs)]
            for r, row in zip(self.sample_owners, to_host(self.sample_tensors, self.sample_ks)):
                self.sample[r].append(row)
        if self.prompt_tensors is not None:
            ks = [k for _, first, end, k in self.prompt_spans for _ in range(end - first)]
            rows, at, self.prompt = to_host(self.prompt_tensors, ks), 0, {}
            for r, first, end, _ in self.prompt_spans:
                self.prompt[r] = (first, rows[at:at + end - first])
                at += end - first


def sample_processed(runner, logits: torch.Tensor, seqs: list[Sequence], sample_rows: list[int],
                     counts, sample_seqs: list[Sequence], handle) -> torch.Tensor:
    """Sample a step of which some rows need processed logits or logprobs: logprobs from the
    raw logits, penalties and min_tokens applied before the runner's usual sampler."""
    if counts is None:
        owners = sample_rows
        contexts = [s.num_tokens - s.num_pending for s in sample_seqs]
    else:  # drafts: position i of a row follows its confirmed tokens and drafts [:i]
        owners = [r for r, c in zip(sample_rows, counts.tolist()) for _ in range(c)]
        contexts = [seqs[r].num_tokens - seqs[r].num_draft_tokens + i
                    for r, c in zip(sample_rows, counts.tolist()) for i in range(c)]
    sps = [s.sampling_params for s in sample_seqs]
    scored = [i for i, sp in enumerate(sps) if sp.logprobs is not None]
    if scored:
        idx = torch.tensor(scored, dtype=torch.int64).to(runner.device, non_blocking=True)
        raw = logits[idx]  # a copy: the processing below does not change it
    st = runner.sampling_tensors(sample_seqs)
    proc = build_logits_processing([s.token_ids for s in sample_seqs], [s.num_prompt_tokens for s in sample_seqs],
                                   contexts, sps, logits.shape[-1], runner.device, runner.eos_token_ids)
    if proc is not None:
        logits = proc.apply(logits)
    tokens = runner.sampler(logits, st)
    if scored:
        lp = handle.logprobs = handle.logprobs or StepLogprobs()
        lp.sample_ks = [sps[i].logprobs for i in scored]
        lp.sample_tensors = compute_logprobs(raw, tokens[idx], max(lp.sample_ks))
        lp.sample_owners = [owners[i] for i in scored]
    return tokens


def score_prompts(runner, seqs: list[Sequence], cu_seqlens_q, hidden: torch.Tensor, handle) -> None:
    """Logprobs of the prompt tokens this step's chunks predict, for the sequences that ask
    and do not have them yet (logits of those rows only, in slices)."""
    spans, rows, targets = [], [], []
    for r, s in enumerate(seqs):
        if not s.needs_prompt_logprobs:
            continue
        start = s.num_computed_tokens
        first = max(start, len(s.prompt_logprobs))  # positions already scored are skipped
        last = min(start + s.num_new_tokens, s.num_prompt_tokens - 1)
        if first >= last:
            continue
        base = int(cu_seqlens_q[r]) - start
        rows.extend(range(base + first, base + last))
        targets.extend(s.token_ids[first + 1:last + 1])
        spans.append((r, first + 1, last + 1, s.sampling_params.prompt_logprobs))
    if not spans:
        return
    dev = runner.device
    h = hidden[torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)]
    tgt = torch.tensor(targets, dtype=torch.int64).to(dev, non_blocking=True)
    lp = handle.logprobs = handle.logprobs or StepLogprobs()
    lp.prompt_spans = spans
    lp.prompt_tensors = prompt_logprobs(runner.model.compute_logits, h, tgt, max(s[3] for s in spans),
                                        runner.config.hf_config.vocab_size)
