"""Reading a model's HuggingFace config and generation config from a local folder
(nothing is downloaded), and the facts `Config` derives from them."""

from __future__ import annotations

import copy
import json
import logging
import os
from typing import Any, Optional

import torch
from transformers import AutoConfig, GenerationConfig, PretrainedConfig


from atom.config_checks import _invalid, _is_int

logger = logging.getLogger(__name__)

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


def _hf_summary(hf_config: Any) -> str:
    if hf_config is None:
        return "None"
    return (
        f"<{type(hf_config).__name__} model_type={getattr(hf_config, 'model_type', None)!r} "
        f"architectures={getattr(hf_config, 'architectures', None)!r}>"
    )
