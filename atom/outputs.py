"""What a request returns: one `RequestOutput` per step it advanced in, and a final one.

`RequestOutputKind` (as in vLLM) picks what a request's outputs carry:
  CUMULATIVE  every step it advanced in: `text` / `token_ids` hold everything so far;
  DELTA       every step it advanced in: `text` / `token_ids` hold only what is new (the
              final output holds the whole text and tokens);
  FINAL_ONLY  one output when it finishes; nothing is detokenized per step.
Whatever the kind, `new_text` / `new_token_ids` hold what is new since the request's
previous output: concatenated over its outputs they give the final `text` / `token_ids`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class RequestOutputKind(Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None   # "stop", "length", "abort" or "error"; None: still running
    num_cached_tokens: int = 0
    ttft: float | None = None          # seconds from arrival to the first token
    tpot: float | None = None          # seconds per output token after the first
    error: str | None = None           # why the request failed (finish_reason "error")
    new_token_ids: list[int] = field(default_factory=list)  # since this request's previous output
    new_text: str = ""                 # likewise (UTF-8 safe: no half character)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __getitem__(self, key: str):  # nano-vllm style: out["text"], out["token_ids"]
        return getattr(self, key)
