"""ATOM_* environment variables, read lazily.

Every variable is evaluated when it is accessed (``envs.ATOM_DP_SIZE``), never at
import time, so a test or notebook can change ``os.environ`` and see the new
value on the next access.

Boolean rule: ``"1"`` is True and anything else is False. A variable whose
default is True is True while unset; once set, it is True only for ``"1"``.
Numeric variables that are set to something unparsable raise ``ValueError``
naming the variable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["ENV_VARS", "EnvVar", "is_set", "describe"]


def _as_bool(raw: str) -> bool:
    return raw == "1"


def _as_int(raw: str) -> int:
    return int(raw.strip())


def _as_float(raw: str) -> float:
    return float(raw.strip())


def _as_str(raw: str) -> str:
    return raw


@dataclass(frozen=True)
class EnvVar:
    """One documented environment variable."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str

    def read(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError:
            kind = {_as_int: "an integer", _as_float: "a number"}.get(self.parse, "valid")
            raise ValueError(
                f"{self.name}={raw!r} is invalid: must be {kind} "
                f"(unset it to use the default {self.default!r})"
            ) from None


_VARS = [
    # --- data parallelism ---
    EnvVar("ATOM_DP_RANK", _as_int, 0, "Data-parallel rank of this process."),
    EnvVar("ATOM_DP_RANK_LOCAL", _as_int, 0, "Local data-parallel rank (SPMD mode)."),
    EnvVar("ATOM_DP_SIZE", _as_int, 1, "Total number of data-parallel groups."),
    EnvVar(
        "ATOM_DP_SIZE_LOCAL",
        _as_int,
        None,
        "DP ranks on this node; overrides ParallelConfig.data_parallel_size_local.",
    ),
    EnvVar("ATOM_DP_MASTER_IP", _as_str, "127.0.0.1", "IP of the data-parallel master."),
    EnvVar("ATOM_DP_MASTER_PORT", _as_int, 29500, "Port of the data-parallel master."),
    EnvVar(
        "ATOM_DP_LB_REQ_EQUIV",
        _as_int,
        512,
        "Token-equivalent cost of one in-flight request for the 'least_tokens' "
        "DP load balancer: score = sum_prompt_tokens + this * num_reqs.",
    ),
    # --- scheduling ---
    EnvVar(
        "ATOM_DYNAMIC_CHUNKING_SMOOTH_FACTOR",
        _as_float,
        0.75,
        "Default for Config.dynamic_chunking_smooth_factor (0 = initial chunk, "
        "1 = equal-latency chunk).",
    ),
    EnvVar(
        "ATOM_STATE_CHECKPOINT_DEMAND",
        _as_bool,
        True,
        "Overrides Config.state_checkpoint_demand when set.",
    ),
    EnvVar(
        "ATOM_DSV4_STATE_REPLAY",
        _as_bool,
        False,
        "DeepSeek-V4 state replay (no effect in this build).",
    ),
    # --- kernels and fusions ---
    EnvVar(
        "ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION",
        _as_bool,
        False,
        "QK-norm + RoPE + cache + quant fusion for Qwen3 dense and MoE.",
    ),
    EnvVar("ATOM_USE_TRITON_GEMM", _as_bool, False, "Use Triton GEMM kernels."),
    EnvVar(
        "ATOM_USE_TRITON_MXFP4_BMM", _as_bool, False, "Use Triton MXFP4 batched matmul."
    ),
    EnvVar(
        "ATOM_ENABLE_DS_INPUT_RMSNORM_QUANT_FUSION",
        _as_bool,
        True,
        "Fused input RMSNorm + quant for DeepSeek models.",
    ),
    EnvVar(
        "ATOM_ENABLE_DS_QKNORM_QUANT_FUSION",
        _as_bool,
        True,
        "Fused QK-norm + quant for DeepSeek models.",
    ),
    EnvVar(
        "ATOM_ENABLE_ALLREDUCE_RMSNORM_FUSION",
        _as_bool,
        True,
        "Fused all-reduce + RMSNorm.",
    ),
    EnvVar(
        "ATOM_LLAMA_ENABLE_AITER_TRITON_FUSED_RMSNORM_QUANT",
        _as_bool,
        True,
        "AITER Triton fused RMSNorm + quant for LLaMA models.",
    ),
    EnvVar(
        "ATOM_LLAMA_ENABLE_AITER_TRITON_FUSED_SILU_MUL_QUANT",
        _as_bool,
        True,
        "AITER Triton fused SiLU * mul + quant for LLaMA models.",
    ),
    # --- profiling ---
    EnvVar(
        "ATOM_TORCH_PROFILER_DIR",
        _as_str,
        None,
        "Directory for torch profiler traces; default of Config.torch_profiler_dir.",
    ),
    EnvVar(
        "ATOM_PROFILER_MORE",
        _as_bool,
        False,
        "'1' turns on record_shapes / with_stack / profile_memory. Read as a "
        "boolean (the guide lists the raw string '0' as its default).",
    ),
]

#: name -> EnvVar, in documentation order.
ENV_VARS: dict[str, EnvVar] = {v.name: v for v in _VARS}


def is_set(name: str) -> bool:
    """Whether ``name`` is present in the environment (even if empty)."""
    return name in os.environ


def describe() -> list[dict[str, Any]]:
    """One row per variable: name, current value, default, whether set, doc."""
    return [
        {
            "name": v.name,
            "value": v.read(),
            "default": v.default,
            "set": is_set(v.name),
            "doc": v.doc,
        }
        for v in _VARS
    ]


def __getattr__(name: str) -> Any:
    var: Optional[EnvVar] = ENV_VARS.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted(list(ENV_VARS) + __all__)
