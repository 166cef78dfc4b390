"""What an engine is built of, as DataFrames: its linear layers' methods, its kernel plan, its
KV cache. Each takes an `LLM`, an `LLMEngine` or a `ModelRunner` (the first also a model).

    linear_methods_frame(llm)   # layer, class, method, format, bytes, shape
    moe_layers_frame(llm)       # one row per MoE layer: experts, top_k, width, routing, method, bytes
    kernel_plan_frame(llm)      # one row per start-up choice (GEMV, cuBLASLt, MoE tiles)
    kv_cache_frame(llm)         # one row per attention layer: kind, dtype, page shape, bytes
"""
from __future__ import annotations

from typing import Any

import pandas as pd
from torch import nn


def _runner_of(src: Any):
    for attr in ("engine", "runner"):
        if hasattr(src, attr):
            src = getattr(src, attr)
    return src


def linear_methods_frame(src: Any) -> pd.DataFrame:
    from atom.model_ops.quant import describe_layers
    model = src if isinstance(src, nn.Module) else _runner_of(src).model
    return pd.DataFrame(describe_layers(model), columns=["layer", "class", "method", "format", "bytes", "shape",
                                                          "kernel"])


def moe_layers_frame(src: Any) -> pd.DataFrame:
    from atom.model_ops.moe import describe_moe_layers
    model = src if isinstance(src, nn.Module) else _runner_of(src).model
    return pd.DataFrame(describe_moe_layers(model), columns=["layer", "experts", "top_k", "width", "routing",
                                                              "activation", "method", "format", "bytes", "kernel",
                                                              "route_kernel", "shared_experts", "parallel", "local_experts",
                                                              "rank", "ranks"])


def kernel_plan_frame(src: Any) -> pd.DataFrame:
    return _runner_of(src).plan.to_frame()


def kv_cache_frame(src: Any) -> pd.DataFrame:
    return _runner_of(src).kv_cache_manager.to_frame()
