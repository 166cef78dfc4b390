"""ATOM's configuration surface.

:class:`Config` is the root dataclass the engine consumes. It validates every
scalar field before touching the disk, then loads the model's HuggingFace
config (local folders and the HF cache only -- nothing is downloaded) and
derives the rest: context length, stop tokens, dtype, quantization, capture
sizes.

Sub-configs: :class:`CompilationConfig` (+ :class:`CompilationLevel`,
:class:`CUDAGraphMode`), :class:`ParallelConfig`, :class:`SpeculativeConfig`,
:class:`QuantizationConfig`, and the KV-cache descriptors
:class:`KVCacheTensor` / :class:`KVCacheConfig`.

Every invalid value raises ``ValueError("<field>=<value> is invalid: <what is
allowed>")``.

The sub-configs live in their own files (`compilation_config.py`, `quant_config.py`,
`parallel_config.py`; HF config reading in `hf_config.py`, validation helpers in
`config_checks.py`) and are re-exported here, where the guide places them.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch
from transformers import GenerationConfig, PretrainedConfig

from atom.quant_spec import ONLINE_QUANT_FORMATS, online_quant_spec
from atom.utils import envs
from atom.compilation_config import CompilationConfig, CompilationLevel, CUDAGraphMode
from atom.config_checks import (_check_bool, _check_choice, _check_int, _check_int_list,  # noqa: F401
                                _invalid, _is_int, _is_number)
from atom.hf_config import (_config_dtype, _hf_summary, _deepseek_v4_family, _gpu_arch, _max_positions,  # noqa: F401
                            _model_error, get_generation_config, get_hf_config, get_text_config)
from atom.parallel_config import (KVCacheConfig, KVCacheTensor, ParallelConfig,  # noqa: F401
                                  SpeculativeConfig)
from atom.quant_config import QuantizationConfig  # noqa: F401

logger = logging.getLogger(__name__)

__all__ = [
    "Config",
    "CompilationConfig",
    "CompilationLevel",
    "CUDAGraphMode",
    "ParallelConfig",
    "SpeculativeConfig",
    "KVCacheTensor",
    "KVCacheConfig",
    "QuantizationConfig",
    "get_hf_config",
    "get_generation_config",
    "get_text_config",
    "check_dynamic_chunking",
    "KV_CACHE_DTYPES",
    "INDEX_CACHE_DTYPES",
    "DP_LOAD_BALANCE_CHOICES",
    "LOAD_DUMMY_CHOICES",
]

KV_CACHE_DTYPES = ("bf16", "fp8")
INDEX_CACHE_DTYPES = ("bf16", "fp8", "fp4")
DP_LOAD_BALANCE_CHOICES = ("round_robin", "least_requests", "least_tokens")
LOAD_DUMMY_CHOICES = ("empty", "zero", "xavier")
SPECULATIVE_METHODS = ("mtp",)
ONLINE_QUANT_KEYS = ("global_quant_config", "layer_quant_config", "exclude_layer")


# ---------------------------------------------------------------------------
# dynamic chunking
# ---------------------------------------------------------------------------


def _dynamic_chunking_blocker() -> Optional[str]:
    """Why dynamic chunking cannot run here, or ``None``."""
    return (
        "it needs pipeline_parallel_size > 1 with chunked prefill, and this build "
        "has no pipeline parallelism"
    )


def check_dynamic_chunking(
    smooth_factor: Optional[float], min_chunk_size: int
) -> float:
    """Validate the dynamic-chunking knobs of an enabled feature.

    ``None`` takes ``ATOM_DYNAMIC_CHUNKING_SMOOTH_FACTOR``. Returns the factor.
    """
    if smooth_factor is None:
        smooth_factor = envs.ATOM_DYNAMIC_CHUNKING_SMOOTH_FACTOR
    if not _is_number(smooth_factor) or not 0.0 <= smooth_factor <= 1.0:
        raise _invalid(
            "dynamic_chunking_smooth_factor", smooth_factor, "must be a number in [0, 1]"
        )
    _check_int("dynamic_chunking_min_chunk_size", min_chunk_size, 1)
    return float(smooth_factor)


# ---------------------------------------------------------------------------
# the root config
# ---------------------------------------------------------------------------


@dataclass
class Config:
    """Everything the engine needs; see the configuration guide for each field.

    ``hf_config`` / ``generation_config`` are normally loaded from ``model``;
    passing ``hf_config`` skips all disk access (useful in notebooks and tests).
    Fields marked "no effect in this build" belong to models or deployments this
    engine does not implement; they are accepted and validated.
    """

    model: str
    trust_remote_code: bool = False
    max_num_batched_tokens: int = 16384
    scheduler_delay_factor: float = 0.0
    max_num_seqs: int = 512
    max_model_len: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kv_cache_block_size: int = 16
    num_kvcache_blocks: int = -1
    kv_cache_dtype: str = "bf16"
    # Indexer cache of DeepSeek-V4 sparse attention: no effect in this build.
    index_cache_dtype: Optional[str] = None
    enable_prefix_caching: bool = False
    enable_log_stats: bool = True
    throughput_log_interval: float = 10.0
    cache_hit_rate_window: int = 1000
    # Pipeline-parallel dynamic chunking: no effect in this build (no PP); a
    # request for it is turned off with a warning.
    enable_dynamic_chunking: bool = False
    dynamic_chunking_smooth_factor: Optional[float] = None
    dynamic_chunking_min_chunk_size: int = 4096
    # Per-request state checkpoints (DeepSeek-V4, GDN, Kimi-K3): no effect in
    # this build beyond validation.
    state_checkpoint_interval_tokens: int = 8192
    state_checkpoint_demand: bool = True
    # DeepSeek-V4.1 bounded replay: no effect in this build.
    enable_decoder_swa_bounded_replay: bool = True
    enable_encoder_swa_bounded_replay: bool = True
    # Set by the model, not by users (0 for every model in this build).
    min_final_prefill_rows: int = 0
    replay_history_tokens: int = 0
    state_replay_tokens: int = 0
    port: int = 8006
    torch_profiler_dir: Optional[str] = field(
        default_factory=lambda: os.getenv("ATOM_TORCH_PROFILER_DIR", None)
    )
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    quant_config: Optional[QuantizationConfig] = None
    asyncio_mode: bool = False
    load_dummy: Optional[str] = None
    enable_expert_parallel: bool = False
    master_addr: str = "127.0.0.1"
    capture_sizes: Optional[list[int]] = None
    enable_dp_attention: bool = False
    dp_load_balance: str = "least_requests"
    speculative_config: Optional[SpeculativeConfig] = None
    bos_token_id: int = -1
    eos_token_id: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    # ``--online_quant_config``: load-time re-quantization targets.
    online_quant_config: Optional[dict] = None
    # Auto-derived (may be supplied to skip disk access).
    hf_config: Optional[PretrainedConfig] = None
    generation_config: Optional[GenerationConfig] = None
    pool_entries: dict[str, int] = field(default_factory=dict)
    pool_entries_per_req: dict[str, int] = field(default_factory=dict)
    torch_dtype: torch.dtype = field(default=torch.bfloat16, init=False)

    _BOOL_FIELDS: ClassVar[tuple[str, ...]] = (
        "trust_remote_code",
        "enforce_eager",
        "enable_prefix_caching",
        "enable_log_stats",
        "enable_dynamic_chunking",
        "state_checkpoint_demand",
        "enable_decoder_swa_bounded_replay",
        "enable_encoder_swa_bounded_replay",
        "asyncio_mode",
        "enable_expert_parallel",
        "enable_dp_attention",
    )

    # -- construction ---------------------------------------------------------

    def __post_init__(self):
        self._coerce_subconfigs()
        self._validate_scalars()
        self.parallel_config.world_size = self.tensor_parallel_size
        if envs.is_set("ATOM_STATE_CHECKPOINT_DEMAND"):
            self.state_checkpoint_demand = envs.ATOM_STATE_CHECKPOINT_DEMAND

        from atom.model_loader.embedded import resolve_model

        self.model = resolve_model(self.model)
        supplied = self.hf_config is not None
        raw_hf_config = self.hf_config if supplied else get_hf_config(
            self.model, self.trust_remote_code
        )
        self.hf_config = get_text_config(raw_hf_config)
        if not supplied and self.generation_config is None:
            self.generation_config = get_generation_config(self.model)

        self._derive_lengths()
        self._derive_token_ids()
        self.torch_dtype = (
            _config_dtype(self.hf_config) or _config_dtype(raw_hf_config) or torch.bfloat16
        )
        if self.quant_config is None:
            self.quant_config = QuantizationConfig(raw_hf_config)
        self._resolve_index_cache_dtype()
        self._resolve_dynamic_chunking()
        self._finish_speculative(raw_hf_config)
        self._derive_capture_sizes()
        if self.torch_profiler_dir:
            os.makedirs(self.torch_profiler_dir, exist_ok=True)

    def _coerce_subconfigs(self):
        """Accept plain dicts (e.g. from YAML) for the sub-configs."""
        for name, cls in (
            ("compilation_config", CompilationConfig),
            ("parallel_config", ParallelConfig),
            ("speculative_config", SpeculativeConfig),
        ):
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, cls(**value))
            elif value is None and name == "speculative_config":
                continue
            elif not isinstance(getattr(self, name), cls):
                raise _invalid(name, value, f"must be a {cls.__name__} or a dict of its fields")
        if self.quant_config is not None and not isinstance(self.quant_config, QuantizationConfig):
            raise _invalid(
                "quant_config", self.quant_config, "must be a QuantizationConfig or None"
            )

    def _validate_scalars(self):
        """Every user-facing scalar, before any I/O."""
        if not isinstance(self.model, str) or not self.model:
            raise _model_error(self.model, "must be a non-empty string")
        for name in self._BOOL_FIELDS:
            _check_bool(name, getattr(self, name))
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if not _is_number(self.scheduler_delay_factor) or self.scheduler_delay_factor < 0:
            raise _invalid(
                "scheduler_delay_factor", self.scheduler_delay_factor, "must be a number >= 0"
            )
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        g = self.gpu_memory_utilization
        if not _is_number(g) or not 0.0 < g <= 1.0:
            raise _invalid("gpu_memory_utilization", g, "must be a number in (0, 1]")
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 8)

        b = self.kv_cache_block_size
        if not _is_int(b) or b < 1 or (b != 1 and b % 16 != 0):
            raise _invalid("kv_cache_block_size", b, "must be a multiple of 16 or exactly 1")
        n = self.num_kvcache_blocks
        if not _is_int(n) or not (n == -1 or n >= 1):
            raise _invalid("num_kvcache_blocks", n, "must be -1 (auto) or an integer >= 1")
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("index_cache_dtype", self.index_cache_dtype, INDEX_CACHE_DTYPES, True)

        t = self.throughput_log_interval
        if not _is_number(t) or t <= 0:
            raise _invalid("throughput_log_interval", t, "must be a number > 0 (seconds)")
        _check_int("cache_hit_rate_window", self.cache_hit_rate_window, 1)
        s = self.dynamic_chunking_smooth_factor
        if s is not None and not _is_number(s):
            raise _invalid(
                "dynamic_chunking_smooth_factor", s, "must be None or a number in [0, 1]"
            )
        if not _is_int(self.dynamic_chunking_min_chunk_size):
            raise _invalid(
                "dynamic_chunking_min_chunk_size",
                self.dynamic_chunking_min_chunk_size,
                "must be an integer",
            )

        c = self.state_checkpoint_interval_tokens
        if not _is_int(c) or c < -1:
            raise _invalid(
                "state_checkpoint_interval_tokens",
                c,
                "must be a positive multiple of kv_cache_block_size, 0 (off) or -1 (ladder off)",
            )
        if c > 0 and c % b != 0:
            raise _invalid(
                "state_checkpoint_interval_tokens",
                c,
                f"must be a multiple of kv_cache_block_size={b} "
                f"(e.g. {max(b, c - c % b)}), 0 (off) or -1 (ladder off)",
            )
        for name in ("min_final_prefill_rows", "replay_history_tokens", "state_replay_tokens"):
            _check_int(name, getattr(self, name), 0)

        _check_int("port", self.port, 1, 65535)
        if self.torch_profiler_dir is not None and (
            not isinstance(self.torch_profiler_dir, str) or not self.torch_profiler_dir
        ):
            raise _invalid(
                "torch_profiler_dir", self.torch_profiler_dir, "must be None or a directory path"
            )
        _check_choice("load_dummy", self.load_dummy, LOAD_DUMMY_CHOICES, True)
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise _invalid("master_addr", self.master_addr, "must be a non-empty string")
        if self.capture_sizes is not None:  # [] = capture nothing
            self.capture_sizes = sorted(
                set(_check_int_list("capture_sizes", self.capture_sizes, allow_empty=True))
            )
        _check_choice("dp_load_balance", self.dp_load_balance, DP_LOAD_BALANCE_CHOICES)
        _check_int("bos_token_id", self.bos_token_id, -1)
        _check_int("eos_token_id", self.eos_token_id, -1)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(i) and i >= 0 for i in self.stop_token_ids
        ):
            raise _invalid("stop_token_ids", self.stop_token_ids, "must be a list of integers >= 0")
        self.stop_token_ids = list(self.stop_token_ids)

        spec = self.speculative_config
        if spec is not None:
            _check_choice("speculative_config.method", spec.method, SPECULATIVE_METHODS)
            if spec.num_speculative_tokens != 1:
                raise _invalid(
                    "speculative_config.num_speculative_tokens",
                    spec.num_speculative_tokens,
                    "must be 1 (only one MTP token is supported)",
                )
        self.online_quant_config = self._check_online_quant(self.online_quant_config)

    @staticmethod
    def _check_online_quant(cfg: Any) -> Optional[dict]:
        if cfg is None:
            return None
        name = "online_quant_config"
        if isinstance(cfg, str):
            try:
                cfg = json.loads(cfg)
            except json.JSONDecodeError as exc:
                raise _invalid(name, cfg, f"must be a JSON object ({exc})") from None
        if not isinstance(cfg, dict):
            raise _invalid(name, cfg, "must be a JSON object / dict")
        if not cfg:
            return None  # '{}' is the same as not passing the flag
        unknown = sorted(set(cfg) - set(ONLINE_QUANT_KEYS))
        if unknown:
            raise _invalid(name, cfg, f"unknown keys {unknown}; allowed: {list(ONLINE_QUANT_KEYS)}")
        out = dict(cfg)
        formats = f"must be one of {sorted(ONLINE_QUANT_FORMATS)}"

        def check_format(field: str, fmt: Any) -> None:
            try:
                online_quant_spec(fmt)
            except ValueError:
                raise _invalid(f"{name}.{field}", fmt, formats) from None

        if "global_quant_config" in out:
            check_format("global_quant_config", out["global_quant_config"])
        layers = out.get("layer_quant_config", {})
        if not isinstance(layers, dict):
            raise _invalid(f"{name}.layer_quant_config", layers, "must map layer patterns to formats")
        for pattern, fmt in layers.items():
            check_format(f"layer_quant_config[{pattern!r}]", fmt)
        out["layer_quant_config"] = dict(layers)
        exclude = out.get("exclude_layer", [])
        if isinstance(exclude, str):
            exclude = [exclude]
        if not isinstance(exclude, list) or not all(isinstance(e, str) and e for e in exclude):
            raise _invalid(f"{name}.exclude_layer", out.get("exclude_layer"),
                           "must be a non-empty string or a list of them")
        for entry in exclude:
            if entry.startswith("re:"):
                try:
                    re.compile(entry[3:])
                except re.error as exc:
                    raise _invalid(f"{name}.exclude_layer", entry, f"bad regex ({exc})") from None
        out["exclude_layer"] = exclude
        return out

    # -- derivations ------------------------------------------------------------

    def _derive_lengths(self):
        limit = _max_positions(self.hf_config)
        if limit is None:
            if self.max_model_len is None:
                raise _invalid(
                    "max_model_len",
                    None,
                    "the model config has no max_position_embeddings; set max_model_len",
                )
        elif self.max_model_len is None or self.max_model_len > limit:
            if self.max_model_len is not None:
                logger.warning(
                    "max_model_len=%d exceeds the model's max_position_embeddings=%d: "
                    "capped to %d (the model's limit)",
                    self.max_model_len,
                    limit,
                    limit,
                )
            self.max_model_len = limit

    def _derive_token_ids(self):
        def as_list(value) -> list[int]:
            if value is None:
                return []
            return [value] if _is_int(value) else [v for v in value if _is_int(v)]

        hf_eos = as_list(getattr(self.hf_config, "eos_token_id", None))
        if self.eos_token_id == -1 and hf_eos:
            self.eos_token_id = hf_eos[0]
        hf_bos = as_list(getattr(self.hf_config, "bos_token_id", None))
        if self.bos_token_id == -1 and hf_bos:
            self.bos_token_id = hf_bos[0]
        extra = hf_eos[1:]
        if self.generation_config is not None:
            extra += as_list(getattr(self.generation_config, "eos_token_id", None))
        for token in extra:
            if token not in self.stop_token_ids:
                self.stop_token_ids.append(token)

    def _resolve_index_cache_dtype(self):
        family = _deepseek_v4_family(self.hf_config)
        if self.index_cache_dtype is None:
            if family == "v4.1":
                self.index_cache_dtype = "fp8"
            elif family == "v4":
                arch = _gpu_arch()
                self.index_cache_dtype = "fp8" if arch == "gfx942" else "fp4"
            else:
                self.index_cache_dtype = self.kv_cache_dtype
        if family == "v4" and self.index_cache_dtype == "fp4" and self.kv_cache_block_size != 64:
            logger.warning(
                "index_cache_dtype='fp4' needs kv_cache_block_size=64 (got %d); the indexer "
                "will score in FP8",
                self.kv_cache_block_size,
            )

    def _resolve_dynamic_chunking(self):
        if self.enable_dynamic_chunking:
            blocker = _dynamic_chunking_blocker()
            if blocker is not None:
                logger.warning("enable_dynamic_chunking turned off: %s", blocker)
                self.enable_dynamic_chunking = False
        if self.enable_dynamic_chunking:  # pragma: no cover - unreachable without PP
            self.dynamic_chunking_smooth_factor = check_dynamic_chunking(
                self.dynamic_chunking_smooth_factor, self.dynamic_chunking_min_chunk_size
            )

    def _finish_speculative(self, raw_hf_config: PretrainedConfig):
        spec = self.speculative_config
        if spec is None:
            return
        if spec.model is None:
            spec.model = self.model
        if spec.draft_model_hf_config is None:
            spec.draft_model_hf_config = SpeculativeConfig.hf_config_override(
                get_text_config(copy.deepcopy(raw_hf_config))
            )

    def _derive_capture_sizes(self):
        cc = self.compilation_config
        if self.enforce_eager:
            # One source of truth downstream: eager means no compile, no graphs.
            self.compilation_config = dataclasses.replace(
                cc, level=CompilationLevel.NO_COMPILATION, use_cudagraph=False,
                cudagraph_mode=CUDAGraphMode.NONE,
            )
            self.capture_sizes = []
            return
        explicit = self.capture_sizes
        if explicit and cc.cudagraph_capture_sizes is None:
            # Copy, so a CompilationConfig shared with other configs is not changed.
            cc = self.compilation_config = dataclasses.replace(
                cc, cudagraph_capture_sizes=list(explicit)
            )
        sizes = cc.init_with_cudagraph_sizes()
        self.capture_sizes = sizes if cc.use_cudagraph and explicit != [] else []

    # -- helpers ------------------------------------------------------------------

    def compute_hash(self) -> str:
        """SHA-256 of what a compiled graph depends on (compile-cache key)."""
        cc = self.compilation_config
        payload = {
            "model_type": getattr(self.hf_config, "model_type", None),
            "architectures": getattr(self.hf_config, "architectures", None),
            "dtype": str(self.torch_dtype),
            "tp": self.tensor_parallel_size,
            "max_model_len": self.max_model_len,
            "kv_cache_dtype": self.kv_cache_dtype,
            "block_size": self.kv_cache_block_size,
            "level": cc.level,
            "cudagraph_mode": None if cc.cudagraph_mode is None else cc.cudagraph_mode.name,
            "capture_sizes": self.capture_sizes,
            "quant": self.quant_config.compute_hash() if self.quant_config else None,
            "online_quant": self.online_quant_config,  # re-quantized layers change the graph
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def __repr__(self) -> str:
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "hf_config":
                text = _hf_summary(value)
            elif f.name == "generation_config":
                text = "None" if value is None else (
                    f"<GenerationConfig eos_token_id={getattr(value, 'eos_token_id', None)!r}>"
                )
            else:
                text = repr(value)
            parts.append(f"{f.name}={text}")
        return "Config(" + ", ".join(parts) + ")"

