"""Per-request sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

__all__ = ["SamplingParams"]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    ``temperature == 0`` means greedy decoding (see :attr:`greedy`).
    ``top_k`` of ``-1`` or ``0`` and ``top_p`` of ``1.0`` turn those filters off.
    ``stop_strings`` may be given as a single string; it is wrapped in a list.

    As in vLLM: ``n`` independent completions of the prompt (child ``i`` of a seeded request
    draws with ``seed + i``); ``logprobs`` / ``prompt_logprobs`` (None or k >= 0): the log-
    probabilities of each sampled (prompt) token, with its rank, and of the top k, from the
    model's raw distribution (log_softmax of the unprocessed logits); ``presence_penalty`` /
    ``frequency_penalty`` (in [-2, 2]) subtract ``p * [token generated]`` / ``f * count`` from
    the logits; ``repetition_penalty`` (> 0) divides positive / multiplies negative logits of
    tokens seen in the prompt or the output; ``min_tokens`` suppresses EOS and
    ``stop_token_ids`` (and stop strings) until that many tokens were generated.
    """

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_strings: Optional[Union[list[str], str]] = None
    top_k: int = -1
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    n: int = 1
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    def __post_init__(self):
        t = self.temperature
        if (
            isinstance(t, bool)
            or not isinstance(t, (int, float))
            or not math.isfinite(t)
            or t < 0
        ):
            raise ValueError(
                f"temperature={t!r} is invalid: must be a finite number >= 0 "
                "(0 means greedy)"
            )
        self.temperature = float(t)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(
                f"max_tokens={self.max_tokens!r} is invalid: must be an integer >= 1"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(
                f"ignore_eos={self.ignore_eos!r} is invalid: must be True or False"
            )
        if not _is_int(self.top_k) or not (self.top_k in (-1, 0) or self.top_k >= 1):
            raise ValueError(
                f"top_k={self.top_k!r} is invalid: must be -1 or 0 (off) or an "
                "integer >= 1"
            )
        p = self.top_p
        if (
            isinstance(p, bool)
            or not isinstance(p, (int, float))
            or not (0.0 < p <= 1.0)
        ):
            raise ValueError(f"top_p={p!r} is invalid: must be in (0, 1]")
        self.top_p = float(p)

        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r} is invalid: must be None or an integer")

        if isinstance(self.stop_strings, str):
            self.stop_strings = [self.stop_strings]
        if self.stop_strings is not None:
            if not isinstance(self.stop_strings, (list, tuple)) or not all(
                isinstance(s, str) and s for s in self.stop_strings
            ):
                raise ValueError(
                    f"stop_strings={self.stop_strings!r} is invalid: must be None, a "
                    "non-empty string, or a list of non-empty strings"
                )
            self.stop_strings = list(self.stop_strings)

        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(i) and i >= 0 for i in self.stop_token_ids
            ):
                raise ValueError(
                    f"stop_token_ids={self.stop_token_ids!r} is invalid: must be None "
                    "or a list of integers >= 0"
                )
            self.stop_token_ids = list(self.stop_token_ids)

        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n={self.n!r} is invalid: must be an integer >= 1")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or k < 0):
                raise ValueError(f"{name}={k!r} is invalid: must be None or an integer >= 0 "
                                 "(how many top log-probabilities besides the token's own)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name}={v!r} is invalid: must be a number in [-2, 2] (0 is off)")
            setattr(self, name, float(v))
        r = self.repetition_penalty
        if not _is_number(r) or not (math.isfinite(r) and r > 0):
            raise ValueError(f"repetition_penalty={r!r} is invalid: must be a finite number > 0 "
                             "(1 is off)")
        self.repetition_penalty = float(r)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens!r} is invalid: must be an integer >= 0")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens!r} is invalid: must be <= "
                             f"max_tokens={self.max_tokens}")

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """The logits are changed before sampling (penalties, min_tokens)."""
        return self.uses_penalties or self.min_tokens > 0

    @property
    def needs_step_tokens(self) -> bool:
        """The next step needs this step's tokens on the host (no look-ahead step)."""
        return self.processes_logits or self.logprobs is not None

    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (``temperature == 0``)."""
        return self.temperature == 0.0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k >= 1

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0
