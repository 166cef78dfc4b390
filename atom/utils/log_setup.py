"""Make ATOM's INFO lines (the engine-status line, model load, KV cache) visible by default.

Python shows nothing below WARNING until someone configures logging, so the periodic
engine-status line of `enable_log_stats` would never appear. `ensure_visible()` (called
when an `LLM` is built) gives the `atom` logger one stderr handler at INFO, but only when
neither it nor the root logger has a handler: a user's own configuration
(`logging.basicConfig`, a notebook's, a server's) is left alone, and the handler falls
silent once the root logger gets one later (no line twice). Calling it again does nothing.
"""
from __future__ import annotations

import logging
import sys

_MARK = "_atom_default_handler"


def ensure_visible() -> logging.Handler | None:
    """The handler added (or already added) by ATOM, or None where the user configured logging."""
    log = logging.getLogger("atom")
    for h in log.handlers:
        if getattr(h, _MARK, False):
            return h
    if log.handlers or logging.getLogger().handlers:
        return None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s",
                                           "%H:%M:%S"))
    handler.addFilter(lambda record: not logging.getLogger().handlers)
    setattr(handler, _MARK, True)
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    return handler
