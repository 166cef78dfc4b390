"""`ParallelConfig`, `SpeculativeConfig` and the KV-cache descriptors `KVCacheTensor` /
`KVCacheConfig` (re-exported by `atom.config`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch
from transformers import PretrainedConfig

from atom.utils import envs
from atom.config_checks import _check_int, _invalid
from atom.hf_config import _hf_summary, get_hf_config, get_text_config

logger = logging.getLogger(__name__)

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


