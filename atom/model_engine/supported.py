"""Engine settings this build cannot honour, refused before any weight loads.

`Config` accepts and validates every field of the guide (so it can be built and inspected
anywhere); an engine that would silently ignore one of them is worse than none. So
`LLMEngine` calls `check_supported(config)` first: one `ValueError` lists every setting
that is not implemented here (DP attention with tensor_parallel_size > 1, speculative
decoding), each with its field and value. DP attention runs with TP=1 replicas
(`atom.distributed.data_parallel`; it needs data_parallel_size >= 2). Tensor parallel
(`atom.distributed.executor`), data parallel (`atom.distributed.data_parallel`) and expert
parallel (`enable_expert_parallel`: the MoE layers' experts split over the tensor-parallel
ranks, `atom.model_ops.moe.layer`; a model without MoE layers runs as without it, with a
warning) run. Online quantization runs (`atom.model_loader.online_quant`), also under tensor
parallel: a rank gathers a weight before quantizing it where its own slice would give other
scales than the full weight (`atom.model_ops.quant.online.needs_gather`). `asyncio_mode`
runs in `atom.model_engine.async_engine.AsyncLLMEngine` (the server's engine loop); the
offline `LLM`, which steps the engine itself, refuses it. It also checks the kernel backend
(`ATOM_KERNEL_BACKEND`, `atom.platform`) and warns, once, that a compilation level above 0
does nothing on a CPU. (`kv_cache_dtype="fp8"` runs: e4m3 keys and values with per-layer
scales, `kv_cache.py`; e4m3 latents with one scale per layer for MLA, `attention/mla.py`.)
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from atom import platform

logger = logging.getLogger(__name__)

WHY = "not implemented in this build yet"


def _get(obj: Any, dotted: str, default: Any = None) -> Any:
    for name in dotted.split("."):
        obj = obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)
        if obj is None:
            return default
    return obj


def unsupported_settings(config: Any) -> list[str]:
    """One line per setting of `config` (a Config, or a dict / namespace of its keywords)
    that this build cannot honour."""
    found = []

    def refuse(field: str, value: Any, allowed: str) -> None:
        found.append(f"{field}={value!r} is {WHY}: {allowed}")

    if _get(config, "enable_dp_attention", False):
        dp = _get(config, "parallel_config.data_parallel_size", 1)
        tp = _get(config, "tensor_parallel_size", 1)
        if isinstance(dp, int) and dp < 2:
            found.append(f"enable_dp_attention=True is invalid with data_parallel_size={dp}: DP attention splits "
                         "the requests over data-parallel replicas; set data_parallel_size >= 2 or leave it False")
        if isinstance(tp, int) and tp > 1:
            refuse("enable_dp_attention", True, f"only with tensor_parallel_size=1 (got {tp}): each replica one "
                   "rank, the MoE layers over the replicas; leave it False to run tensor parallel")
    spec = _get(config, "speculative_config")
    if spec is not None:
        method = _get(spec, "method")
        refuse("speculative_config", f"<method={method!r}>" if method else spec,
               "leave it None (no speculative decoding; --method)")
    return found


def check_supported(config: Any, device: torch.device | str | None = None) -> None:
    """Raise one ValueError naming every setting this build cannot honour; check the
    kernel backend; warn once that compilation levels do nothing on a CPU."""
    found = unsupported_settings(config)
    if found:
        raise ValueError("; ".join(found))
    platform.kernel_backend()  # ValueError for a bad / impossible ATOM_KERNEL_BACKEND
    device = torch.device(device) if device is not None else platform.default_device()
    level = _get(config, "compilation_config.level", 0)
    if device.type == "cpu" and level and not _get(config, "enforce_eager", False):
        _warn_compilation_on_cpu(int(level))


@functools.cache
def _warn_compilation_on_cpu(level: int) -> None:
    logger.warning("compilation_config.level=%d has no effect on a CPU: the model runs eagerly "
                   "(levels 1-3 and CUDA graphs apply on a GPU)", level)
