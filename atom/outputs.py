"""What a finished (or failed) request returns."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None   # "stop", "length", "abort" or "error"
    num_cached_tokens: int = 0
    ttft: float | None = None          # seconds from arrival to the first token
    tpot: float | None = None          # seconds per output token after the first
    error: str | None = None           # why the request failed (finish_reason "error")

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
