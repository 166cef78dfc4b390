"""ATOM: a lightweight LLM inference engine you can take apart in a notebook."""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "LLM": "atom.llm",
    "LLMEngine": "atom.model_engine.llm_engine",
    "SamplingParams": "atom.sampling_params",
    "EngineArgs": "atom.model_engine.arg_utils",
    "Config": "atom.config",
    "RequestOutput": "atom.outputs",
    "CompletionOutput": "atom.outputs",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'atom' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
