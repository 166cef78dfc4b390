"""What the engine records: one row per step and one per finished request.

Cheap enough to stay on (a dict append per step); `Config`-level switch
`LLMEngine(..., record_stats=False)` turns it off. Only the last `window` steps and
requests are kept (default 10,000 each; `LLM(..., stats_window=N)`, `set_window(N)`;
None keeps all), so a long-running engine's memory stays flat. `steps()` / `requests()`
return pandas DataFrames for notebooks and plots (`atom.viz`). The periodic engine-status
line of `enable_log_stats` is produced here too (logger `atom.engine`), and, at the same
interval, the `[Cache Stats]` line (logger `atom.engine.cache`; its own gate: on with prefix
caching): the prefix cache's cumulative hit and queried tokens since start, where the status
line's rate is windowed over the last `cache_hit_rate_window` requests. With routing statistics on
(`LLM(..., record_expert_load=True)`, MoE models) each step also keeps its tokens per
expert per MoE layer: `expert_load()` (same window).
"""
from __future__ import annotations

import logging
import time
from collections import deque

logger = logging.getLogger("atom.engine")
cache_logger = logging.getLogger("atom.engine.cache")  # the [Cache Stats] line

DEFAULT_WINDOW = 10_000  # steps and requests kept by default


def check_window(window: int | None) -> int | None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"stats_window={window!r} is invalid: must be an integer >= 1 "
                         "or None (keep every record)")
    return window


def cache_stats_line(hit_tokens: int, query_tokens: int) -> str:
    """The `[Cache Stats]` line: cumulative prefix-cache hits over queried prompt tokens."""
    rate = hit_tokens / query_tokens if query_tokens else 0.0
    return (f"[Cache Stats] prefix cache since start: {hit_tokens} of {query_tokens} queried "
            f"prompt tokens hit ({rate:.1%})")


class EngineStats:
    def __init__(self, enabled: bool = True, log_stats: bool = True, log_interval: float = 10.0,
                 hit_rate_window: int = 1000, window: int | None = DEFAULT_WINDOW,
                 log_cache_stats: bool = False):
        self.enabled = enabled
        self.log_stats = log_stats
        self.log_cache_stats = log_cache_stats
        self.log_interval = log_interval
        self.step_rows: deque[dict] = deque()
        self.request_rows: deque[dict] = deque()
        self.expert_rows: deque[tuple] = deque()  # (step, layer ids, counts [layers, experts])
        self.set_window(window)
        self._window: deque[tuple[int, int]] = deque(maxlen=hit_rate_window)  # (hit, query) tokens
        self._last_log = time.perf_counter()
        self._tokens_since_log = [0, 0]  # prompt, generation
        self.num_steps = 0

    def set_window(self, window: int | None) -> None:
        """Keep only the last `window` step and request records (None: all of them)."""
        self.window = check_window(window)
        self.step_rows = deque(self.step_rows, maxlen=window)
        self.request_rows = deque(self.request_rows, maxlen=window)
        self.expert_rows = deque(self.expert_rows, maxlen=window)

    def record_step(self, row: dict) -> None:
        self.num_steps += 1
        self._tokens_since_log[0] += row["prefill_tokens"]
        self._tokens_since_log[1] += row["num_sampled"]
        if self.enabled:
            row["step"] = self.num_steps
            self.step_rows.append(row)

    def record_expert_load(self, step: int, layer_ids: list[int], counts) -> None:
        """One step's (token, expert) pairs per MoE layer (`counts` [layers, experts], numpy)."""
        if self.enabled:
            self.expert_rows.append((step, list(layer_ids), counts))

    def expert_load(self):
        """Tokens routed to each expert: one row per (step, layer, expert), column `tokens`
        (a token counts once for each of its top_k experts)."""
        import numpy as np
        import pandas as pd
        if not self.expert_rows:
            return pd.DataFrame({"step": [], "layer": [], "expert": [], "tokens": []}, dtype="int64")
        E = max(c.shape[1] for _, _, c in self.expert_rows)
        counts = np.concatenate([np.pad(c, ((0, 0), (0, E - c.shape[1]))) for _, _, c in self.expert_rows])
        steps = np.concatenate([np.full(c.shape[0], step) for step, _, c in self.expert_rows])
        layers = np.concatenate([np.asarray(ls) for _, ls, _ in self.expert_rows])
        return pd.DataFrame({"step": np.repeat(steps, E), "layer": np.repeat(layers, E),
                             "expert": np.tile(np.arange(E), len(counts)), "tokens": counts.reshape(-1)})

    def record_request(self, row: dict, hit_tokens: int, query_tokens: int) -> None:
        self._window.append((hit_tokens, query_tokens))
        if self.enabled:
            self.request_rows.append(row)

    @property
    def windowed_hit_rate(self) -> float:
        q = sum(x[1] for x in self._window)
        return sum(x[0] for x in self._window) / q if q else 0.0

    def maybe_log(self, running: int, waiting: int, kv_usage: float, force: bool = False,
                  prefix_cache: tuple[int, int] | None = None) -> str | None:
        """Every `log_interval` seconds (or `force`): the engine-status line (returned) when
        `log_stats`, the `[Cache Stats]` line when `log_cache_stats` and `prefix_cache`
        ((hit tokens, queried tokens) since start) is given."""
        if not (self.log_stats or self.log_cache_stats):
            return None
        now = time.perf_counter()
        dt = now - self._last_log
        if dt < self.log_interval and not force:
            return None
        line = None
        if self.log_stats:
            line = (f"Engine: running {running} reqs, waiting {waiting} reqs, KV usage {kv_usage:.1%}, "
                    f"prefix-cache hit rate {self.windowed_hit_rate:.1%}, "
                    f"prompt {self._tokens_since_log[0] / max(dt, 1e-9):.1f} tok/s, "
                    f"generation {self._tokens_since_log[1] / max(dt, 1e-9):.1f} tok/s")
            logger.info(line)
        if self.log_cache_stats and prefix_cache is not None:
            cache_logger.info(cache_stats_line(*prefix_cache))
        self._last_log, self._tokens_since_log = now, [0, 0]
        return line

    def steps(self):
        import pandas as pd
        return pd.DataFrame(self.step_rows)

    def requests(self):
        import pandas as pd
        return pd.DataFrame(self.request_rows)

    def clear(self) -> None:
        self.step_rows.clear()
        self.request_rows.clear()
        self.expert_rows.clear()
