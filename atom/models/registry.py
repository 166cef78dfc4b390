"""Model registry keyed by the HF config's `architectures` entry."""
from __future__ import annotations

import importlib

_MODELS = {
    "DeepseekV2ForCausalLM": ("atom.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("atom.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "GptOssForCausalLM": ("atom.models.gpt_oss", "GptOssForCausalLM"),
    "LlamaForCausalLM": ("atom.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("atom.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("atom.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("atom.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("atom.models.mixtral", "MixtralForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(hf_config) -> type:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"architectures={archs} is not supported: this build runs "
                     f"{', '.join(supported_architectures())}")


def register_model(architecture: str, module: str, class_name: str) -> None:
    """Add a model class (e.g. from a notebook) under an HF architecture name."""
    _MODELS[architecture] = (module, class_name)
