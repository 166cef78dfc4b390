"""`seed=` of `LLM` / `--seed` of the CLI: one seed for Python's, numpy's and torch's RNGs.

Requests without a seed of their own sample from torch's global generator, so two engines
built with the same seed give the same samples for the same requests in the same order.
(A request's own `SamplingParams(seed=...)` is independent of it.)
"""
from __future__ import annotations

import random

import numpy as np
import torch

MAX_SEED = 2**32 - 1  # numpy's limit


def check_seed(seed, field: str = "seed") -> int | None:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{field}={seed!r} is invalid: must be None or an integer in [0, {MAX_SEED}]")
    return int(seed)


def set_seed(seed) -> int | None:
    """Seed `random`, numpy and torch (every device); None leaves them alone."""
    seed = check_seed(seed)
    if seed is not None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
    return seed
