"""What a request returns, in vLLM's layout: a `RequestOutput` holding one `CompletionOutput`
per completion (`SamplingParams.n`), per step it advanced in and a final one.

`RequestOutputKind` (as in vLLM) picks what a request's outputs carry:
  CUMULATIVE  every step it advanced in: `text` / `token_ids` hold everything so far;
  DELTA       every step it advanced in: `text` / `token_ids` hold only what is new (the
              final output holds the whole text and tokens);
  FINAL_ONLY  one output when it finishes; nothing is detokenized per step.
Whatever the kind, `new_text` / `new_token_ids` hold what is new since the completion's
previous output: concatenated over its outputs they give the final `text` / `token_ids`.
With n > 1, streamed outputs come per completion (one `CompletionOutput`, its `index` set);
the final output (`finished`) holds all n, in index order.

`out.text`, `out.token_ids`, `out.finish_reason`, `out.new_text`, ... (and `out["text"]`)
are the first completion's; `out.ttft` / `out.tpot` come from `out.metrics`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class RequestOutputKind(Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class Logprob:
    """A token's log-probability under the model's raw distribution, its rank there (1: the
    most likely) and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]          # one dict per generated token
PromptLogprobs = list[dict[int, Logprob] | None]   # None for the first prompt token


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (logprobs asked)
    logprobs: SampleLogprobs | None = None     # per token: {token_id: Logprob}, sampled + top-k
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"; None: still running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    new_token_ids: list[int] = field(default_factory=list)  # since this completion's previous output
    new_text: str = ""                 # likewise (UTF-8 safe: no half character)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Host clock (time.perf_counter) seconds of what the engine tracks for a request."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    ttft: float | None = None    # seconds from arrival to the first token
    tpot: float | None = None    # seconds per output token after the first (once finished)

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


class RequestOutput:
    """One request's output. Built from `outputs` (vLLM's form), or, for a single completion,
    from `text` / `token_ids` / `finish_reason` keywords (the form older code used)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 outputs: list[CompletionOutput] | None = None, finished: bool | None = None, *,
                 prompt_logprobs: PromptLogprobs | None = None, num_cached_tokens: int = 0,
                 metrics: RequestMetrics | None = None, error: str | None = None,
                 text: str = "", token_ids: list[int] | None = None, finish_reason: str | None = None,
                 new_token_ids: list[int] | None = None, new_text: str = ""):
        if outputs is None:
            outputs = [CompletionOutput(0, text, list(token_ids or []), finish_reason=finish_reason,
                                        new_token_ids=list(new_token_ids or []), new_text=new_text)]
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.outputs = outputs
        self.finished = all(o.finished for o in outputs) if finished is None else finished
        self.prompt_logprobs = prompt_logprobs
        self.num_cached_tokens = num_cached_tokens
        self.metrics = metrics
        self.error = error            # why the request failed (finish_reason "error")

    # --- the first completion's, as before n existed ----------------------------------------
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def new_token_ids(self) -> list[int]:
        return self.outputs[0].new_token_ids

    @property
    def new_text(self) -> str:
        return self.outputs[0].new_text

    @property
    def ttft(self) -> float | None:
        return self.metrics.ttft if self.metrics is not None else None

    @property
    def tpot(self) -> float | None:
        return self.metrics.tpot if self.metrics is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, key: str):  # nano-vllm style: out["text"], out["token_ids"]
        return getattr(self, key)

    def __eq__(self, other) -> bool:
        return isinstance(other, RequestOutput) and vars(self) == vars(other)

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids!r}, outputs={self.outputs!r}, "
                f"finished={self.finished}, num_cached_tokens={self.num_cached_tokens}, "
                f"metrics={self.metrics!r}" + (f", error={self.error!r}" if self.error else "") + ")")
