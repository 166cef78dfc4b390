"""`Sequence`: one request's tokens, its KV blocks and its progress through the engine.

A sequence moves WAITING -> RUNNING -> FINISHED (and back to WAITING when preempted).
Its progress is a single number, `num_computed_tokens`: how many of its tokens already
have their K/V in the paged cache. Each step the scheduler gives it `num_new_tokens`
more; when that reaches the end of `token_ids` the model's output at the last position
is sampled and appended. A prefill, a chunk of a prefill and a decode step are all the
same thing seen this way (a decode is a chunk of one token).

Multi-token steps: a proposer may set `draft_token_ids` (guesses of the next tokens). The
scheduler appends them to `token_ids` for one decode step (`num_draft_tokens` of them), so
the step runs 1 + k query tokens; the scheduler's `commit` then keeps the drafts the
target model confirmed and drops the rest. Drafts never count as output.

`n > 1` completions of one prompt are `n` sequences (`index` 0..n-1, one request id). The
first runs alone until its prompt's K/V exist; `forks` holds the others until then, when the
scheduler forks them onto its full prompt blocks (`BlockManager.fork`).
"""
from __future__ import annotations

import itertools
import time
from enum import Enum, auto

from atom.outputs import RequestOutputKind
from atom.sampling_params import SamplingParams


PLACEHOLDER = -1  # a token id not yet copied back from the device


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = itertools.count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, prompt: str | None = None,
                 output_kind: RequestOutputKind | None = None):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.prompt = prompt
        self.sampling_params = sampling_params or SamplingParams()
        self.status = SequenceStatus.WAITING
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.prompt_token_ids: list[int] = list(token_ids)  # outputs share this copy (not re-sliced per step)
        self.num_computed_tokens = 0   # tokens whose K/V are in the cache
        self.num_cached_tokens = 0     # of those, how many came from the prefix cache
        self.num_new_tokens = 0        # scheduled for the current step
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this sequence's full blocks
        self.num_published_blocks = 0      # leading blocks already offered to the prefix cache
        self.num_pending = 0               # trailing placeholder tokens (look-ahead steps)
        self.draft_token_ids: list[int] = []  # proposed for the next step, not yet in token_ids
        self.num_draft_tokens = 0          # trailing draft tokens in token_ids (this step only)
        self.num_accepted_drafts = 0       # drafts the target confirmed, over the request
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id / stop string that ended it
        self.stopped_by_string = False
        self.index = 0                     # which of the request's n completions
        self.forks: list[Sequence] = []    # siblings waiting for this one's prompt K/V (n > 1)
        sp = self.sampling_params
        self.needs_step_tokens = sp.needs_step_tokens  # penalties, min_tokens or logprobs
        # logprobs (when asked): per generated token {token_id: Logprob}, and for the prompt
        # tokens after the first (vLLM's layout; filled by the engine)
        self.logprobs: list[dict] = []
        self.token_logprobs: list[float] = []  # the sampled tokens' own
        self.prompt_logprobs: list[dict] = []
        self.num_preemptions = 0
        # timing (host clock, seconds)
        self.arrival_time = time.perf_counter()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        # detokenization state
        self.output_text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        # streaming: what earlier outputs already carried (None kind: the engine's default)
        self.output_kind = output_kind
        self.num_streamed_tokens = 0
        self.num_streamed_chars = 0

    # --- sizes -----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens known on the host (placeholders and drafts not counted)."""
        return len(self.token_ids) - self.num_pending - self.num_draft_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.num_pending - self.num_draft_tokens]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than one token (drafts aside) still lacks K/V: a (possibly chunked) prefill."""
        return self.num_uncomputed_tokens - self.num_draft_tokens > 1

    @property
    def samples_this_step(self) -> bool:
        """This step's chunk reaches the end of the known tokens, so a token is sampled."""
        return self.num_computed_tokens + self.num_new_tokens == len(self.token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked and not all known yet."""
        k = self.sampling_params.prompt_logprobs
        return k is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size:(i + 1) * block_size]

    # --- transitions -------------------------------------------------------------
    def append_token(self, token_id: int) -> None:
        self.set_token(len(self.token_ids), token_id)

    def set_token(self, index: int, token_id: int) -> None:
        """A sampled token: fills the placeholder at `index`, or is appended."""
        if index < len(self.token_ids):
            assert self.token_ids[index] == PLACEHOLDER, f"token {index} of {self} is not a placeholder"
            self.token_ids[index] = token_id
            self.num_pending -= 1
        else:
            self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()

    def add_placeholder(self) -> None:
        """A token whose id the device will supply (look-ahead scheduling)."""
        self.token_ids.append(PLACEHOLDER)
        self.num_pending += 1

    def drop_placeholders(self) -> None:
        if self.num_pending:
            del self.token_ids[-self.num_pending:]
            self.num_pending = 0

    def add_drafts(self, k: int) -> None:
        """Append the first `k` proposed tokens for this step (the proposal is used up)."""
        self.token_ids.extend(self.draft_token_ids[:k])
        self.num_draft_tokens = k
        self.draft_token_ids = []

    def drop_drafts(self) -> list[int]:
        """Take this step's draft tokens back out of `token_ids`; returns them."""
        k = self.num_draft_tokens
        if not k:
            return []
        drafts = self.token_ids[-k:]
        del self.token_ids[-k:]
        self.num_draft_tokens = 0
        return drafts

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop all cached K/V; generated tokens are kept."""
        self.drop_drafts()
        self.draft_token_ids = []
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_new_tokens = 0
        self.block_table = []
        self.num_published_blocks = 0
        self.num_preemptions += 1

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.name}, tokens={len(self.token_ids)} "
                f"(prompt {self.num_prompt_tokens}), computed={self.num_computed_tokens}, "
                f"cached={self.num_cached_tokens}, blocks={self.block_table})")
