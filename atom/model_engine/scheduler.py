"""`Scheduler`: which sequences run in the next step, and how many tokens each.

One step carries at most `max_num_seqs` sequences and `max_num_batched_tokens` tokens.
Running sequences go first, in arrival order: a decode takes one token, an unfinished
prefill takes the next chunk that fits the remaining token budget (chunked prefill), so
prefills and decodes share a batch. Waiting sequences are then admitted while budget,
sequence slots and KV blocks last. When a running sequence needs a block and none is
free, the most recently admitted running sequence is preempted: its blocks are freed and
it is recomputed later from its tokens (prompt + what it generated), which leaves its
output unchanged.

A step ends in two halves: `advance` (the batch's K/V now exist) and `commit` (sampled
tokens in place, stops checked). Between them, `schedule_lookahead` may already hand out
the next decode step, with placeholder tokens the device fills in (async scheduling).

Multi-token steps: a decode whose sequence carries proposed `draft_token_ids` runs 1 + k
query tokens (the drafts appended for the step) and gets a token sampled at each. `commit`
verifies: drafts are accepted while they equal the target's sample at their position, then
the target's sample at the first mismatch (or the bonus one after all k) is taken, so the
output is always the target's own samples. Rejected drafts' blocks go back (`trim`).
A step thus yields a list of tokens per sequence; stops apply token by token in it.

n completions of a prompt (`SamplingParams.n`): the first sequence is scheduled alone; once
its prompt's K/V exist (`advance`), its siblings (`seq.forks`) take references on its full
prompt blocks (`BlockManager.fork`) and wait at the front of the queue: each computes only
the tokens after the shared blocks (at least the last prompt token, for its own logits).
A prompt whose logprobs are asked is computed whole (no prefix-cache hits), as in vLLM.
Batches with rows that need this step's tokens on the host (penalties, min_tokens,
logprobs) get no look-ahead step.

The scheduler is handed its `BlockManager`; it never touches tensors.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from atom.model_engine.block_manager import BlockManager
from atom.model_engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


def eos_token_ids(config) -> frozenset[int]:
    """The ids that end a request (unless ignore_eos): the model's EOS and `stop_token_ids`."""
    eos = {config.eos_token_id} if config.eos_token_id is not None and config.eos_token_id >= 0 else set()
    return frozenset(eos | set(config.stop_token_ids or []))


@dataclass
class ScheduledBatch:
    """The sequences of one step and how many tokens each runs (`num_new_tokens`)."""
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0
    num_prefill_tokens: int = 0   # tokens of sequences with more than one uncomputed token
    num_decode_tokens: int = 0
    sample_index: list[int] = field(default_factory=list)  # where the first sampled token lands, -1: none
    num_draft_tokens: int = 0     # draft tokens among the decode tokens (multi-token steps)
    accepted: list[list[int]] = field(default_factory=list)  # set by `commit`: tokens kept per row

    def add(self, seq: Sequence, n: int) -> None:
        k = seq.num_draft_tokens
        self.sample_index.append(seq.num_tokens - k if seq.num_computed_tokens + n == seq.num_tokens else -1)
        self.num_draft_tokens += k
        if seq.is_prefill:
            self.num_prefill_tokens += n
        else:
            self.num_decode_tokens += n
        seq.num_new_tokens = n
        self.seqs.append(seq)
        self.num_new_tokens.append(n)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def sort_longest_first(self) -> None:
        """Reorder the sequences by descending context length (stable). The GPU attention
        kernel starts sequences in batch order: long ones first leave short ones for the tail."""
        order = sorted(range(len(self.seqs)), key=lambda i: -self.seqs[i].num_tokens)
        self.seqs = [self.seqs[i] for i in order]
        self.num_new_tokens = [self.num_new_tokens[i] for i in order]
        self.sample_index = [self.sample_index[i] for i in order]

    def __len__(self) -> int:
        return len(self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)

    def __repr__(self) -> str:
        return (f"ScheduledBatch(seqs={len(self.seqs)}, tokens={self.num_tokens} "
                f"(prefill {self.num_prefill_tokens}, decode {self.num_decode_tokens}), "
                f"preempted={self.num_preempted})")


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 512,
                 max_num_batched_tokens: int = 16384, max_model_len: int = 4096,
                 scheduler_delay_factor: float = 0.0):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.scheduler_delay_factor = scheduler_delay_factor
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.eos_token_ids: frozenset[int] = frozenset()  # set by the engine from the model
        self.finished_outside_step: list[Sequence] = []  # finished while scheduling
        self.num_draft_tokens = 0     # drafts run, over the scheduler's life
        self.num_accepted_drafts = 0  # of those, confirmed by the target
        # scheduler_delay_factor bookkeeping
        self._last_prompt_time = 0.0
        self._last_prompt_latency = 0.0

    @classmethod
    def from_config(cls, config, block_manager: BlockManager) -> "Scheduler":
        return cls(block_manager, max_num_seqs=config.max_num_seqs,
                   max_num_batched_tokens=config.max_num_batched_tokens,
                   max_model_len=config.max_model_len,
                   scheduler_delay_factor=config.scheduler_delay_factor)

    def __repr__(self) -> str:
        return (f"Scheduler(waiting={len(self.waiting)}, running={len(self.running)}, "
                f"max_num_seqs={self.max_num_seqs}, max_num_batched_tokens={self.max_num_batched_tokens}, "
                f"max_model_len={self.max_model_len}, preemptions={self.num_preemptions})")

    # --- requests --------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.num_tokens > self.max_model_len:
            raise ValueError(f"prompt has {seq.num_tokens} tokens, more than "
                             f"max_model_len={self.max_model_len}: shorten it or raise max_model_len")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish a sequence (stop, length, abort) and free its blocks."""
        seq.drop_placeholders()
        seq.drop_drafts()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        if seq.forks:  # siblings never forked: aborted with it, else they prefill on their own
            forks, seq.forks = seq.forks, []
            for child in forks:
                if reason == "abort":
                    child.status, child.finish_reason, child.finish_time = SequenceStatus.FINISHED, reason, seq.finish_time
                else:
                    self.waiting.append(child)
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    # --- one step ------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        logger.debug("preempted %s", seq)

    def _admit_allowed(self, now: float) -> bool:
        if self.scheduler_delay_factor <= 0 or not self.running:
            return True
        return now - self._last_prompt_time >= self.scheduler_delay_factor * self._last_prompt_latency

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1) running sequences: decodes and prefill continuations
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if n == 1 and seq.draft_token_ids:
                n += self._take_drafts(seq, budget - 1)
            if n == 1 and seq.num_computed_tokens < len(seq.block_table) * bm.block_size:
                batch.add(seq, 1)  # decode fast path: its last block has room
                budget -= 1
                i += 1
                continue
            while not bm.can_append(seq, n):
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    logger.warning("request %s outgrew the whole KV cache (%d blocks): finished as "
                                   "'length'; raise num_kvcache_blocks", seq.request_id, bm.num_blocks)
                    self.finish(seq, "length")
                    self.finished_outside_step.append(seq)
                    break
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break  # preempted itself: nothing else fits either
            bm.append_slots(seq, n)
            batch.add(seq, n)
            budget -= n
            i += 1

        # 2) waiting sequences, if nothing had to be preempted
        now = time.perf_counter()
        admitted = False
        while (self.waiting and budget > 0 and not batch.num_preempted
               and len(self.running) < self.max_num_seqs and self._admit_allowed(now)):
            seq = self.waiting[0]
            looked_up = not seq.block_table and not seq.needs_prompt_logprobs
            if looked_up:
                bm.allocate_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not bm.can_append(seq, n) and not self.running:
                # nothing running will free blocks: prefill the chunk that fits now
                fits = (len(seq.block_table) + bm.num_free_blocks) * bm.block_size - seq.num_computed_tokens
                n = min(n, fits)
            if n <= 0 or not bm.can_append(seq, n):
                if looked_up:  # hand back its prefix hits; it looks them up again next step
                    bm.free(seq)
                    seq.num_computed_tokens = seq.num_cached_tokens = 0
                # else a forked completion keeps its shared prompt blocks (they cannot be looked up)
                break
            self.waiting.popleft()
            bm.append_slots(seq, n)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
            admitted = True
        if admitted:
            self._last_prompt_time = now
        if not batch.num_prefill_tokens:
            batch.sort_longest_first()
        if not batch.seqs and self.waiting and not self.running:
            seq = self.waiting[0]
            raise RuntimeError(f"cannot schedule {seq}: the KV cache ({bm.num_blocks} blocks of "
                               f"{bm.block_size}) is too small for it; raise num_kvcache_blocks")
        return batch

    def _take_drafts(self, seq: Sequence, limit: int) -> int:
        """Append up to `limit` of a decoding sequence's proposed tokens for this step: no more
        than it may still output minus the step's own token, and only if the KV cache has their
        slots now (drafts never cause a preemption). Returns how many (0: a plain decode)."""
        sp = seq.sampling_params
        room = min(sp.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        k = min(len(seq.draft_token_ids), limit, room)
        if k <= 0 or seq.num_pending or not self.block_manager.can_append(seq, 1 + k):
            seq.draft_token_ids = []
            return 0
        seq.add_drafts(k)
        self.num_draft_tokens += k
        return k

    def postprocess(self, batch: ScheduledBatch, sampled: list[list[int]],
                    step_latency: float | None = None) -> list[Sequence]:
        """`advance` then `commit`: the synchronous end of a step."""
        self.advance(batch)
        if step_latency is not None:
            self.note_step_latency(batch, step_latency)
        return self.commit(batch, sampled)

    def note_step_latency(self, batch: ScheduledBatch, seconds: float) -> None:
        """Prompt steps' latency, which `scheduler_delay_factor` multiplies."""
        if batch.num_prefill_tokens:
            self._last_prompt_latency = seconds

    def advance(self, batch: ScheduledBatch) -> None:
        """The batch's tokens now have K/V: move each sequence on (no sampled token needed)."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.status != SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += n - seq.num_draft_tokens  # drafts count once confirmed
            seq.num_new_tokens = 0
            self.block_manager.publish_full_blocks(seq)
            if seq.forks and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self._fork(seq)

    def _fork(self, seq: Sequence) -> None:
        """`seq`'s prompt K/V exist: its waiting siblings share its full prompt blocks (all but
        the block holding the last prompt token, which each sibling computes for its logits)
        and go to the front of the queue, in index order."""
        forks, seq.forks = seq.forks, []
        shared = (seq.num_prompt_tokens - 1) // self.block_manager.block_size * self.block_manager.block_size
        for child in reversed(forks):
            self.block_manager.fork(seq, child, shared)
            self.waiting.appendleft(child)

    def commit(self, batch: ScheduledBatch, sampled: list[list[int]]) -> list[Sequence]:
        """Put the sampled tokens in place and check stops; returns newly finished sequences.

        `sampled` holds one list per sequence of the batch: empty where nothing was sampled
        (a prefill chunk mid-prompt), one token for a plain step, 1 + k for a step with k
        drafts (verified first, see `_verify`). A token fills the placeholder a look-ahead
        step left at its index, or is appended. Stops handled here, token by token (tokens
        after a stop are dropped): EOS (unless ignore_eos), `stop_token_ids`, `max_tokens`,
        `max_model_len`. Stop strings need text and are checked by the engine. The tokens
        kept per row are left in `batch.accepted`.
        """
        finished, self.finished_outside_step = self.finished_outside_step, []
        accepted: list[list[int]] = []
        for seq, tokens, idx in zip(batch.seqs, sampled, batch.sample_index):
            if not tokens or seq.status != SequenceStatus.RUNNING:
                accepted.append([])
                continue
            if seq.num_draft_tokens:
                tokens = self._verify(seq, tokens)
            if len(tokens) == 1:  # the plain step
                seq.set_token(idx, tokens[0])
                reason = self.stop_reason(seq, tokens[0])
            else:
                for j, token in enumerate(tokens):
                    seq.set_token(idx + j, token)
                    reason = self.stop_reason(seq, token)
                    if reason is not None:
                        tokens = tokens[:j + 1]
                        break
                # K/V of confirmed drafts past a stop are not needed; publish what is confirmed
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
                self.block_manager.publish_full_blocks(seq)
            accepted.append(tokens)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        batch.accepted = accepted
        return finished

    def _verify(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Verify a step's drafts against the target's samples at the 1 + k positions.

        tokens[i] is the target's sample after query token i (the last confirmed token,
        then draft i). Draft i is accepted while it equals tokens[i - 1]; the result is the
        target's samples up to the first mismatch included (all k + 1: the bonus token).
        The drafts leave `token_ids`, the confirmed ones' K/V count as computed, and the
        blocks past the confirmed end are trimmed."""
        drafts = seq.drop_drafts()
        k = len(drafts)
        if len(tokens) != k + 1:
            raise RuntimeError(f"{seq}: {k} drafts need {k + 1} sampled tokens, got {len(tokens)}")
        j = 0
        while j < k and drafts[j] == tokens[j]:
            j += 1
        seq.num_computed_tokens += j
        seq.num_accepted_drafts += j
        self.num_accepted_drafts += j
        self.block_manager.trim(seq, seq.num_computed_tokens)
        return tokens[:j + 1]

    def schedule_lookahead(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The next decode step, scheduled before this step's tokens are known.

        Only in the steady state: nothing waiting, every running sequence in `batch` and
        sampling in it, a free slot for each next token. Each sequence gets a placeholder
        token (its id comes from the device); one that will stop by length is left out,
        one that stops on EOS runs one extra step whose token is dropped. Returns None
        when the state is not steady: the engine then schedules after the tokens arrive.
        """
        if batch.num_draft_tokens:  # how many tokens each sequence keeps is decided on the host
            return None
        live = [s for s in batch.seqs if s.status == SequenceStatus.RUNNING]
        if self.waiting or len(live) != len(self.running) or -1 in batch.sample_index:
            return None
        if any(s.needs_step_tokens for s in live):  # penalties, min_tokens, logprobs
            return None
        bm = self.block_manager
        # this step's token is not on the host yet: after it, a sequence has one more
        nxt = [s for s in live
               if s.num_output_tokens + 1 < s.sampling_params.max_tokens and s.num_tokens + 1 < self.max_model_len]
        nxt.sort(key=lambda s: -s.num_tokens)  # longest first, as `schedule` orders decode batches
        if not nxt:
            return None
        new_blocks = sum(1 for s in nxt if s.num_tokens + 1 > len(s.block_table) * bm.block_size)
        if new_blocks > bm.num_free_blocks:
            return None
        ahead = ScheduledBatch()
        for s in nxt:
            s.add_placeholder()
            bm.append_slots(s, 1)
            ahead.add(s, 1)
        return ahead

    def stop_reason(self, seq: Sequence, token: int) -> str | None:
        """"stop" (EOS, a stop token id: then `seq.stop_reason` is that id), "length" or None.
        Before `min_tokens` tokens were generated only the length stops."""
        sp = seq.sampling_params
        if not sp.min_tokens or seq.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if sp.stop_token_ids and token in sp.stop_token_ids:
                seq.stop_reason = token
                return "stop"
        if seq.num_output_tokens >= sp.max_tokens or seq.num_prompt_tokens + seq.num_output_tokens >= self.max_model_len:
            return "length"
        return None
