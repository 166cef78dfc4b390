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
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import enum
import fnmatch
import hashlib
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

import torch
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from atom.quant_spec import (
    GenericParser,
    LayerQuantConfig,
    QuantType,
    QuarkParser,
    online_quant_spec,
)
from atom.utils import envs

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
# validation helpers
# ---------------------------------------------------------------------------


def _invalid(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is invalid: {allowed}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def _check_int(name: str, value: Any, lo: Optional[int] = None, hi: Optional[int] = None):
    if not _is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        if lo is not None and hi is not None:
            allowed = f"must be an integer in [{lo}, {hi}]"
        elif lo is not None:
            allowed = f"must be an integer >= {lo}"
        else:
            allowed = "must be an integer"
        raise _invalid(name, value, allowed)


def _check_bool(name: str, value: Any):
    if not isinstance(value, bool):
        raise _invalid(name, value, "must be True or False")


def _check_choice(name: str, value: Any, choices: tuple, allow_none: bool = False):
    if value is None and allow_none:
        return
    if value not in choices:
        extra = " or None" if allow_none else ""
        raise _invalid(name, value, f"must be one of {list(choices)}{extra}")


def _check_int_list(name: str, value: Any, allow_empty: bool = False) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(
        _is_int(v) and v >= 1 for v in value
    ):
        raise _invalid(name, value, "must be a list of integers >= 1")
    if not value and not allow_empty:
        raise _invalid(name, value, "must be a non-empty list of integers >= 1")
    return list(value)


# ---------------------------------------------------------------------------
# compilation
# ---------------------------------------------------------------------------


class CompilationLevel:
    """Integer constants for ``CompilationConfig.level``."""

    NO_COMPILATION = 0
    DYNAMO_AS_IS = 1
    DYNAMO_ONCE = 2
    PIECEWISE = 3


class CUDAGraphMode(enum.Enum):
    """How CUDA graphs are captured.

    Single modes apply to every batch. The two tuple modes name
    ``(decode_mode, mixed_mode)``: the first for pure-decode batches, the second
    for mixed prefill/decode batches.

    ``FULL_AND_TR_HYBRID`` is *recorded* as ``TR_HYBRID`` by the native runner
    (decode replays token graphs too, no full decode graph): see
    :meth:`native_mode`. :meth:`decode_mode` / :meth:`mixed_mode` report the
    declared tuple.
    """

    NONE = 0
    TR_HYBRID = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_TR_HYBRID = (FULL, TR_HYBRID)

    def separate_routine(self) -> bool:
        """Whether decode and mixed batches use different routines."""
        return isinstance(self.value, tuple)

    def decode_mode(self) -> "CUDAGraphMode":
        """Mode used for pure-decode batches."""
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> "CUDAGraphMode":
        """Mode used for mixed prefill/decode batches."""
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def uses_tr_hybrid(self) -> bool:
        """Whether this mode records token graphs."""
        return CUDAGraphMode.TR_HYBRID in (self.decode_mode(), self.mixed_mode())

    def has_full_cudagraphs(self) -> bool:
        """Whether this mode includes a full CUDA graph."""
        return CUDAGraphMode.FULL in (self.decode_mode(), self.mixed_mode())

    def native_mode(self) -> "CUDAGraphMode":
        """The mode the native runner records (``FULL_AND_TR_HYBRID`` -> ``TR_HYBRID``)."""
        if self is CUDAGraphMode.FULL_AND_TR_HYBRID:
            return CUDAGraphMode.TR_HYBRID
        return self

    @classmethod
    def parse(cls, value: Any) -> "CUDAGraphMode":
        """Accept a member, its name (any case) or its value."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        try:
            return cls(tuple(value) if isinstance(value, list) else value)
        except (ValueError, TypeError):
            raise _invalid(
                "cudagraph_mode", value, f"must be one of {list(cls.__members__)}"
            ) from None


PIECEWISE_SPLITTING_OPS = ["aiter.unified_attention_with_output", "aiter.mla_attention"]


@dataclass
class CompilationConfig:
    """torch.compile and CUDA graph settings."""

    level: int = 0
    use_cudagraph: bool = True
    cudagraph_capture_sizes: Optional[list[int]] = None
    cuda_graph_sizes: list[int] = field(default_factory=list)
    debug_dump_path: str = ""
    cache_dir: str = ""
    use_inductor: bool = True
    cudagraph_mode: Optional[CUDAGraphMode] = None
    splitting_ops: Optional[list[str]] = None
    cudagraph_copy_inputs: bool = False
    compile_sizes: Optional[list[Union[int, str]]] = None
    inductor_compile_config: dict = field(default_factory=dict)

    def __post_init__(self):
        _check_int("level", self.level, 0, 3)
        for name in ("use_cudagraph", "use_inductor", "cudagraph_copy_inputs"):
            _check_bool(name, getattr(self, name))
        for name in ("debug_dump_path", "cache_dir"):
            if not isinstance(getattr(self, name), str):
                raise _invalid(name, getattr(self, name), "must be a string")
        if not isinstance(self.inductor_compile_config, dict):
            raise _invalid(
                "inductor_compile_config", self.inductor_compile_config, "must be a dict"
            )

        self.cuda_graph_sizes = _check_int_list(
            "cuda_graph_sizes", self.cuda_graph_sizes, allow_empty=True
        ) or [512]
        if self.cudagraph_capture_sizes is not None:
            sizes = _check_int_list("cudagraph_capture_sizes", self.cudagraph_capture_sizes)
            self.cudagraph_capture_sizes = sorted(set(sizes))

        if self.cudagraph_mode is not None:
            self.cudagraph_mode = CUDAGraphMode.parse(self.cudagraph_mode)
        if self.splitting_ops is not None and not (
            isinstance(self.splitting_ops, (list, tuple))
            and all(isinstance(op, str) and op for op in self.splitting_ops)
        ):
            raise _invalid("splitting_ops", self.splitting_ops, "must be a list of op names")
        if self.compile_sizes is not None:
            ok = isinstance(self.compile_sizes, (list, tuple)) and all(
                (_is_int(s) and s >= 1) or s == "cudagraph_capture_sizes"
                for s in self.compile_sizes
            )
            if not ok:
                raise _invalid(
                    "compile_sizes",
                    self.compile_sizes,
                    "must be a list of integers >= 1 and/or 'cudagraph_capture_sizes'",
                )

        if self.level == CompilationLevel.PIECEWISE:
            if self.cudagraph_mode is None:
                self.cudagraph_mode = CUDAGraphMode.TR_HYBRID
            if self.splitting_ops is None:
                self.splitting_ops = list(PIECEWISE_SPLITTING_OPS)
        self._capture_sizes = self.init_with_cudagraph_sizes()

    def init_with_cudagraph_sizes(self) -> list[int]:
        """Final CUDA graph capture sizes, ascending.

        ``cudagraph_capture_sizes`` wins when set. Otherwise ``cuda_graph_sizes``:
        one value ``N`` gives ``[1..8] + range(16, N+1, 16)`` (sizes above ``N``
        dropped), several values are used as they are.
        """
        if self.cudagraph_capture_sizes is not None:
            sizes = list(self.cudagraph_capture_sizes)
        elif len(self.cuda_graph_sizes) == 1:
            n = self.cuda_graph_sizes[0]
            sizes = [i for i in range(1, 9) if i <= n] + list(range(16, n + 1, 16))
        else:
            sizes = list(self.cuda_graph_sizes)
        self._capture_sizes = sorted(set(sizes))
        return list(self._capture_sizes)

    @property
    def capture_sizes(self) -> list[int]:
        return list(self._capture_sizes)

    @property
    def max_capture_size(self) -> int:
        return self._capture_sizes[-1] if self._capture_sizes else 0

    def padded_size(self, batch_size: int) -> Optional[int]:
        """Smallest captured size >= ``batch_size``; ``None`` when it is larger than all."""
        _check_int("batch_size", batch_size, 1)
        i = bisect.bisect_left(self._capture_sizes, batch_size)
        return self._capture_sizes[i] if i < len(self._capture_sizes) else None

    def get_compile_sizes(self) -> list[int]:
        """``compile_sizes`` with ``"cudagraph_capture_sizes"`` expanded, ascending."""
        out: set[int] = set()
        for s in self.compile_sizes or []:
            out.update(self._capture_sizes if s == "cudagraph_capture_sizes" else [s])
        return sorted(out)


# ---------------------------------------------------------------------------
# HuggingFace config helpers
# ---------------------------------------------------------------------------


def _model_error(model: Any, why: str) -> ValueError:
    return _invalid(
        "model",
        model,
        f"{why}; it must be a local folder containing config.json (or the "
        "embedded-model alias, or a model already in the HuggingFace cache) -- "
        "nothing is downloaded",
    )


def get_hf_config(model: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """Load the HuggingFace config of ``model`` without network access.

    A local folder must hold ``config.json``; a hub id is looked up in the local
    HF cache only. A local config whose ``model_type`` transformers does not
    know is loaded as a plain :class:`PretrainedConfig` (with a warning).
    """
    if not isinstance(model, str) or not model:
        raise _model_error(model, "must be a non-empty string")
    path = os.path.expanduser(model)
    is_dir = os.path.isdir(path)
    if is_dir and not os.path.isfile(os.path.join(path, "config.json")):
        raise _model_error(model, "the folder has no config.json")
    try:
        return AutoConfig.from_pretrained(
            path if is_dir else model,
            trust_remote_code=trust_remote_code,
            local_files_only=True,
            token=os.environ.get("HF_TOKEN"),
        )
    except (OSError, ValueError) as exc:
        if not is_dir:
            raise _model_error(model, "no such local folder or cached model") from exc
        # Known file, unknown architecture: keep the raw fields.
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        logger.warning(
            "transformers cannot build a config for %s (%s); using the raw config.json",
            model,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        return PretrainedConfig.from_dict(raw)


def get_generation_config(model: str) -> Optional[GenerationConfig]:
    """The model's ``generation_config.json``, or ``None`` when there is none."""
    try:
        path = os.path.expanduser(model)
        return GenerationConfig.from_pretrained(
            path if os.path.isdir(path) else model, local_files_only=True
        )
    except (OSError, ValueError, TypeError):
        return None


def get_text_config(hf_config: PretrainedConfig) -> PretrainedConfig:
    """The language-model part of a multimodal config (the config itself otherwise).

    ``architectures`` and ``quantization_config`` missing on the text config are
    copied from the outer config, so the model registry and quantization see them.
    """
    text = getattr(hf_config, "text_config", None)
    if text is None or text is hf_config:
        return hf_config
    if isinstance(text, dict):
        text = PretrainedConfig.from_dict(text)
    else:
        text = copy.copy(text)
    for attr in ("architectures", "quantization_config"):
        if getattr(text, attr, None) is None and getattr(hf_config, attr, None) is not None:
            setattr(text, attr, getattr(hf_config, attr))
    return text


def _config_dtype(hf_config: Any) -> Optional[torch.dtype]:
    """``hf_config.dtype`` (transformers 5) or ``torch_dtype`` (older), as a torch dtype."""
    try:
        # Older transformers store ``torch_dtype`` as a plain attribute; in 5.x it
        # is a deprecated property, which this lookup deliberately skips.
        own = vars(hf_config)
    except TypeError:
        own = {}
    for value in (getattr(hf_config, "dtype", None), own.get("torch_dtype")):
        if isinstance(value, str):
            value = getattr(torch, value.replace("torch.", ""), None)
        if isinstance(value, torch.dtype):
            return value
    return None


def _max_positions(hf_config: Any) -> Optional[int]:
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(hf_config, attr, None)
        if _is_int(value) and value > 0:
            return value
    return None


def _deepseek_v4_family(hf_config: Any) -> Optional[str]:
    """``"v4.1"``, ``"v4"`` or ``None`` from architectures / model_type."""
    names = [a.lower() for a in (getattr(hf_config, "architectures", None) or [])]
    model_type = str(getattr(hf_config, "model_type", "") or "").lower()
    if any("deepseekv41" in a for a in names) or model_type in ("deepseek_v41", "deepseek_v4_1"):
        return "v4.1"
    if any("deepseekv4" in a for a in names) or model_type == "deepseek_v4":
        return "v4"
    return None


def _gpu_arch() -> Optional[str]:
    """ROCm gfx name of device 0 (e.g. ``"gfx942"``), ``None`` elsewhere."""
    try:
        if torch.version.hip and torch.cuda.is_available():
            return str(torch.cuda.get_device_properties(0).gcnArchName).split(":")[0]
    except Exception:  # pragma: no cover - device query failures are not fatal
        return None
    return None


# ---------------------------------------------------------------------------
# quantization
# ---------------------------------------------------------------------------


@dataclass
class _ParsedQuantConfig:
    global_spec: LayerQuantConfig
    layer_pattern_specs: list[tuple[str, LayerQuantConfig]] = field(default_factory=list)
    exclude_layers: list[str] = field(default_factory=list)


# shard name -> packed name, when no packed_modules_mapping is given.
_DEFAULT_PACKED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
_DEEPSEEK_PACKED = {"q_a_proj": "fused_qkv_a_proj", "kv_a_proj_with_mqa": "fused_qkv_a_proj"}


class QuantizationConfig:
    """Layer-wise quantization, auto-detected from ``hf_config.quantization_config``.

    ``get_layer_quant_config(name)`` checks, in order: the exclude list (exact
    name, a parent module name, an fnmatch glob, or ``"re:<regex>"`` matched
    from the start of the name), the per-layer fnmatch patterns, then the global
    spec.
    """

    def __init__(self, hf_config: Optional[Any] = None):
        self.torch_dtype: torch.dtype = (
            _config_dtype(hf_config) if hf_config is not None else None
        ) or torch.bfloat16
        raw = getattr(hf_config, "quantization_config", None) if hf_config is not None else None
        if raw is None and hf_config is not None:
            text = getattr(hf_config, "text_config", None)
            raw = getattr(text, "quantization_config", None) if text is not None else None
        if raw is not None and not isinstance(raw, dict):
            raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(raw)
        self.hf_quant_config: Optional[dict] = raw or None
        self.quant_method: str = str((raw or {}).get("quant_method", "") or "")
        self._parsed = self._parse(self.hf_quant_config)
        self._compile_excludes()

    # -- parsing ----------------------------------------------------------

    def _unquantized(self) -> LayerQuantConfig:
        return LayerQuantConfig(QuantType.No, self.torch_dtype, True, "")

    def _parse(self, cfg: Optional[dict]) -> _ParsedQuantConfig:
        if not cfg:
            return _ParsedQuantConfig(self._unquantized())
        if self.quant_method.lower() == "quark":
            parser = QuarkParser(self.torch_dtype)
            layers = cfg.get("layer_quant_config") or {}
            exclude = cfg.get("exclude") or []
            return _ParsedQuantConfig(
                parser.parse(cfg.get("global_quant_config")),
                [(pattern, parser.parse(spec)) for pattern, spec in layers.items()],
                [exclude] if isinstance(exclude, str) else list(exclude),
            )
        exclude = GenericParser.exclude_layers(cfg)
        for name in cfg.get("modules_to_not_convert") or []:
            if name not in exclude:
                exclude.append(name)
        return _ParsedQuantConfig(GenericParser().parse(cfg), [], exclude)

    def _compile_excludes(self):
        self._exclude_regexes = []
        for entry in self._parsed.exclude_layers:
            if not isinstance(entry, str) or not entry:
                raise _invalid("exclude_layers", entry, "entries must be non-empty strings")
            if entry.startswith("re:"):
                try:
                    self._exclude_regexes.append(re.compile(entry[3:]))
                except re.error as exc:
                    raise _invalid("exclude_layers", entry, f"bad regex ({exc})") from None

    # -- public attributes --------------------------------------------------

    @property
    def global_quant_config(self) -> LayerQuantConfig:
        return self._parsed.global_spec

    @property
    def exclude_layers(self) -> list[str]:
        return self._parsed.exclude_layers

    @property
    def layer_pattern_specs(self) -> list[tuple[str, LayerQuantConfig]]:
        return self._parsed.layer_pattern_specs

    def get_name(self) -> str:
        """The quantization method name (``""`` for an unquantized model)."""
        return self.quant_method

    # -- dispatch -------------------------------------------------------------

    def is_excluded(self, layer_name: str) -> bool:
        if any(rx.match(layer_name) for rx in self._exclude_regexes):
            return True
        for entry in self._parsed.exclude_layers:
            if entry.startswith("re:"):
                continue
            if any(c in entry for c in "*?["):
                if fnmatch.fnmatchcase(layer_name, entry):
                    return True
            elif layer_name == entry or layer_name.startswith(entry + "."):
                return True
        return False

    def get_layer_quant_config(self, layer_name: str) -> LayerQuantConfig:
        """Spec for ``layer_name``: exclusions, then per-layer patterns, then global."""
        if self.is_excluded(layer_name):
            return self._unquantized()
        for pattern, spec in self._parsed.layer_pattern_specs:
            if fnmatch.fnmatchcase(layer_name, pattern):
                return spec
        return self._parsed.global_spec

    def remap_layer_name(
        self, hf_config: Any = None, packed_modules_mapping: Optional[dict] = None
    ) -> "QuantizationConfig":
        """Add packed/fused names to the exclude list and per-layer patterns.

        A checkpoint names shards (``q_proj``); ATOM's layers are packed
        (``qkv_proj``). ``packed_modules_mapping`` may map shard -> ``(packed,
        shard_id)`` (nano-vllm style), shard -> ``packed``, or packed -> list of
        shards (vLLM style). Without it, q/k/v -> ``qkv_proj`` and gate/up ->
        ``gate_up_proj``; DeepSeek-style configs with a ``q_lora_rank`` also map
        ``q_a_proj`` / ``kv_a_proj_with_mqa`` -> ``fused_qkv_a_proj``.
        Original names are kept. Returns ``self``.
        """
        shard_to_packed = self._shard_map(hf_config, packed_modules_mapping)
        if not shard_to_packed:
            return self

        def rename(name: str) -> str:
            for shard, packed in shard_to_packed.items():
                name = re.sub(rf"(?<![A-Za-z0-9_]){re.escape(shard)}(?![A-Za-z0-9_])", packed, name)
            return name

        excludes: list[str] = []
        for entry in self._parsed.exclude_layers:
            for name in (entry, rename(entry)):
                if name not in excludes:
                    excludes.append(name)
        patterns: list[tuple[str, LayerQuantConfig]] = []
        seen: set[str] = set()
        for pattern, spec in self._parsed.layer_pattern_specs:
            for name in (pattern, rename(pattern)):
                if name not in seen:
                    seen.add(name)
                    patterns.append((name, spec))
        self._parsed.exclude_layers = excludes
        self._parsed.layer_pattern_specs = patterns
        self._compile_excludes()
        return self

    @staticmethod
    def _shard_map(hf_config: Any, mapping: Optional[dict]) -> dict[str, str]:
        if mapping is None:
            out = dict(_DEFAULT_PACKED)
            model_type = str(getattr(hf_config, "model_type", "") or "")
            if (
                "deepseek" in model_type or model_type in ("kimi_k2", "glm_moe_dsa")
            ) and getattr(hf_config, "q_lora_rank", None) is not None:
                out.update(_DEEPSEEK_PACKED)
            return out
        out = {}
        for key, value in mapping.items():
            if isinstance(value, str):
                out[key] = value
            elif isinstance(value, tuple) and value and isinstance(value[0], str):
                out[key] = value[0]
            elif isinstance(value, list):
                for shard in value:
                    out[str(shard)] = key
            else:
                raise _invalid(
                    "packed_modules_mapping",
                    {key: value},
                    "values must be (packed_name, shard_id), a packed name, "
                    "or a list of shard names",
                )
        return out

    def compute_hash(self) -> str:
        """SHA-256 over the parsed config, for compilation-cache invalidation."""
        payload = {
            "quant_method": self.quant_method,
            "torch_dtype": str(self.torch_dtype),
            "global": self._parsed.global_spec.to_dict(),
            "layers": [[p, s.to_dict()] for p, s in self._parsed.layer_pattern_specs],
            "exclude": list(self._parsed.exclude_layers),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def __repr__(self) -> str:
        g = self._parsed.global_spec
        return (
            f"QuantizationConfig(method={self.quant_method!r}, "
            f"global={g.quant_type.name}/{str(g.quant_dtype).replace('torch.', '')}"
            f"{'/dynamic' if g.is_dynamic else '/static'}, "
            f"layer_overrides={len(self._parsed.layer_pattern_specs)}, "
            f"exclude={self._parsed.exclude_layers!r})"
        )


# ---------------------------------------------------------------------------
# parallelism, speculation, KV cache
# ---------------------------------------------------------------------------


@dataclass
class ParallelConfig:
    """Data-parallel layout. ``ATOM_DP_*`` variables override these fields when set."""

    data_parallel_size: int = 1
    data_parallel_size_local: Optional[int] = None
    data_parallel_rank: int = 0
    data_parallel_rank_local: Optional[int] = None
    data_parallel_master_port: int = 29500
    data_parallel_base_port: int = 0
    data_parallel_master_ip: str = "127.0.0.1"
    world_size: int = 1  # TP x PP; set by Config

    _ENV: ClassVar[dict[str, str]] = {
        "data_parallel_size": "ATOM_DP_SIZE",
        "data_parallel_size_local": "ATOM_DP_SIZE_LOCAL",
        "data_parallel_rank": "ATOM_DP_RANK",
        "data_parallel_rank_local": "ATOM_DP_RANK_LOCAL",
        "data_parallel_master_ip": "ATOM_DP_MASTER_IP",
        "data_parallel_master_port": "ATOM_DP_MASTER_PORT",
    }

    def __post_init__(self):
        for attr, var in self._ENV.items():
            if envs.is_set(var):
                setattr(self, attr, getattr(envs, var))
        _check_int("data_parallel_size", self.data_parallel_size, 1)
        if self.data_parallel_size_local is None:
            self.data_parallel_size_local = self.data_parallel_size
        _check_int(
            "data_parallel_size_local", self.data_parallel_size_local, 1, self.data_parallel_size
        )
        _check_int("data_parallel_rank", self.data_parallel_rank, 0, self.data_parallel_size - 1)
        if self.data_parallel_rank_local is not None:
            _check_int(
                "data_parallel_rank_local",
                self.data_parallel_rank_local,
                0,
                self.data_parallel_size_local - 1,
            )
        _check_int("data_parallel_master_port", self.data_parallel_master_port, 1, 65535)
        _check_int("data_parallel_base_port", self.data_parallel_base_port, 0, 65535)
        if not isinstance(self.data_parallel_master_ip, str) or not self.data_parallel_master_ip:
            raise _invalid(
                "data_parallel_master_ip",
                self.data_parallel_master_ip,
                "must be a non-empty string",
            )
        _check_int("world_size", self.world_size, 1)

    @property
    def world_size_across_dp(self) -> int:
        return self.world_size * self.data_parallel_size


@dataclass
class SpeculativeConfig:
    """Speculative decoding. Only MTP with one speculative token is supported.

    The draft config is loaded from ``model`` when not given (``Config`` fills
    ``model`` with the target model when it is ``None``), reduced to its text
    config, and rewritten by :meth:`hf_config_override`.
    """

    method: Optional[str] = ""
    model: Optional[str] = None
    num_speculative_tokens: Optional[int] = None
    draft_model_hf_config: Optional[PretrainedConfig] = None

    # base model_type -> MTP model_type
    _MTP_TYPE_MAP: ClassVar[dict[str, str]] = {
        "deepseek_v3": "deepseek_mtp",
        "glm_moe_dsa": "deepseek_mtp",
        "qwen3_next": "qwen3_next_mtp",
        "qwen3_5": "qwen3_5_mtp",
        "qwen3_5_moe": "qwen3_5_mtp",
        "qwen3_5_text": "qwen3_5_mtp",
        "qwen3_5_moe_text": "qwen3_5_mtp",
    }
    # MTP model_type -> (attribute holding n_predict, architecture)
    _MTP_CONFIG: ClassVar[dict[str, tuple[str, str]]] = {
        "deepseek_mtp": ("num_nextn_predict_layers", "DeepSeekMTPModel"),
        "qwen3_next_mtp": ("num_nextn_predict_layers", "Qwen3NextMTPModel"),
        "qwen3_5_mtp": ("mtp_num_hidden_layers", "Qwen3_5MTPModel"),
    }

    def __post_init__(self):
        if self.draft_model_hf_config is None and self.model is not None:
            self.draft_model_hf_config = get_hf_config(self.model)
        if self.draft_model_hf_config is not None:
            self.draft_model_hf_config = self.hf_config_override(
                get_text_config(self.draft_model_hf_config)
            )

    @staticmethod
    def hf_config_override(hf_config: PretrainedConfig) -> PretrainedConfig:
        """Rewrite a base config into its MTP draft config (in place; returned)."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type in SpeculativeConfig._MTP_TYPE_MAP:
            model_type = SpeculativeConfig._MTP_TYPE_MAP[model_type]
            hf_config.model_type = model_type
        if model_type not in SpeculativeConfig._MTP_CONFIG:
            return hf_config
        attr, arch = SpeculativeConfig._MTP_CONFIG[model_type]
        n_predict = getattr(hf_config, attr, None)
        n_predict = 1 if n_predict is None else n_predict
        if n_predict != 1:
            logger.warning(
                "%s=%s in the draft config; ATOM supports one MTP layer, using 1", attr, n_predict
            )
        setattr(hf_config, attr, 1)
        hf_config.n_predict = 1
        hf_config.num_nextn_predict_layers = 1
        hf_config.architectures = [arch]
        if model_type == "qwen3_5_mtp":
            hf_config.n_shared_experts = 1
            hf_config.n_routed_experts = getattr(hf_config, "num_experts", 0) or 0
        return hf_config

    def __repr__(self) -> str:
        draft = self.draft_model_hf_config
        summary = None if draft is None else _hf_summary(draft)
        return (
            f"SpeculativeConfig(method={self.method!r}, model={self.model!r}, "
            f"num_speculative_tokens={self.num_speculative_tokens!r}, "
            f"draft_model_hf_config={summary})"
        )


def _tensor_summary(t: Optional[torch.Tensor]) -> str:
    if t is None:
        return "None"
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}@{t.device}"


@dataclass
class KVCacheTensor:
    """The cache tensors of one attention layer (``v_cache`` is None for MLA)."""

    layer_num: int
    k_cache: Optional[torch.Tensor] = None
    v_cache: Optional[torch.Tensor] = None
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None

    def __post_init__(self):
        _check_int("layer_num", self.layer_num, 0)

    @property
    def nbytes(self) -> int:
        tensors = (self.k_cache, self.v_cache, self.k_scale, self.v_scale)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def __repr__(self) -> str:
        return (
            f"KVCacheTensor(layer_num={self.layer_num}, k_cache={_tensor_summary(self.k_cache)}, "
            f"v_cache={_tensor_summary(self.v_cache)}, k_scale={_tensor_summary(self.k_scale)}, "
            f"v_scale={_tensor_summary(self.v_scale)})"
        )


@dataclass
class KVCacheConfig:
    """All layers' KV cache tensors, one :class:`KVCacheTensor` per layer."""

    kv_cache_tensors: list[KVCacheTensor] = field(default_factory=list)

    def __post_init__(self):
        nums = [t.layer_num for t in self.kv_cache_tensors]
        if len(nums) != len(set(nums)):
            raise _invalid("kv_cache_tensors", sorted(nums), "layer_num values must be unique")
        self._by_layer = {t.layer_num: t for t in self.kv_cache_tensors}

    def __len__(self) -> int:
        return len(self.kv_cache_tensors)

    def __iter__(self):
        return iter(self.kv_cache_tensors)

    def get(self, layer_num: int) -> KVCacheTensor:
        try:
            return self._by_layer[layer_num]
        except KeyError:
            raise KeyError(f"no KV cache tensor for layer {layer_num}") from None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.kv_cache_tensors)


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


def _hf_summary(hf_config: Any) -> str:
    if hf_config is None:
        return "None"
    return (
        f"<{type(hf_config).__name__} model_type={getattr(hf_config, 'model_type', None)!r} "
        f"architectures={getattr(hf_config, 'architectures', None)!r}>"
    )


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
        if "global_quant_config" in out:
            online_quant_spec(out["global_quant_config"])
        layers = out.get("layer_quant_config", {})
        if not isinstance(layers, dict):
            raise _invalid(name, cfg, "layer_quant_config must map layer patterns to formats")
        for fmt in layers.values():
            online_quant_spec(fmt)
        exclude = out.get("exclude_layer", [])
        if isinstance(exclude, str):
            exclude = [exclude]
        if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
            raise _invalid(name, cfg, "exclude_layer must be a string or a list of strings")
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
                logger.info(
                    "max_model_len=%d exceeds max_position_embeddings=%d; capped",
                    self.max_model_len,
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
