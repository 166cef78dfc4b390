"""Per-request sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

__all__ = ["SamplingParams"]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    ``temperature == 0`` means greedy decoding (see :attr:`greedy`).
    ``top_k`` of ``-1`` or ``0`` and ``top_p`` of ``1.0`` turn those filters off.
    ``stop_strings`` may be given as a single string; it is wrapped in a list.
    """

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_strings: Optional[Union[list[str], str]] = None
    top_k: int = -1
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None

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
