"""The OpenAI request bodies the server accepts, as strict pydantic models.

Strict: a wrong type is an error (no "1" -> 1 coercion), and a field OpenAI does not know is
rejected (`extra="forbid"`), so a typo never silently does nothing. Besides OpenAI's fields,
vLLM's sampling extensions are accepted (`top_k`, `min_tokens`, `repetition_penalty`,
`stop_token_ids`, `ignore_eos`), and `return_token_ids` (ATOM's: each choice, and each
streamed chunk, carries its token ids). A few OpenAI fields this server cannot honour are
accepted only at their neutral value (`logit_bias` empty, `best_of` equal to `n`, `suffix`
unset, `tools` / `response_format` unset, `store` unset or false, `service_tier` unset,
"auto" or "default"), else refused by `serving` with a 400 naming them. Chat fields that
change nothing here are accepted as OpenAI types them: `parallel_tool_calls` (any bool:
`tools` are refused anyway), `metadata` (string values; stored nowhere, as nothing is) and a
message's `tool_call_id` (handed to the chat template, as `name` is).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    n: int = 1
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[str, float]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    return_token_ids: bool = False


PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_Sampling):
    prompt: PromptType
    echo: bool = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class _TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[_TextPart], None] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict[str, Any]] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
