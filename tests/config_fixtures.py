"""Fixtures for the configuration tests: tiny HF config folders, a clean ATOM_* env.

Import the fixtures into a test module (``from config_fixtures import ...``);
nothing here is downloaded.
"""

from __future__ import annotations

import json
import os

import pytest
import transformers

from atom.utils import envs

TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def write_llama_config(path, generation_eos=None, **overrides) -> str:
    """Save a tiny LlamaConfig (and optionally a GenerationConfig) to ``path``."""
    transformers.LlamaConfig(**{**TINY_LLAMA, **overrides}).save_pretrained(path)
    if generation_eos is not None:
        transformers.GenerationConfig(eos_token_id=generation_eos).save_pretrained(path)
    return str(path)


def write_raw_config(path, **fields) -> str:
    """Write ``config.json`` as given (for model types transformers may not know)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(fields, f)
    return str(path)


@pytest.fixture(autouse=True)
def clean_atom_env(monkeypatch):
    """Every documented ATOM_* variable unset, so host settings never leak in."""
    for name in envs.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch


@pytest.fixture
def tiny_model_dir(tmp_path) -> str:
    """Llama config (max_position_embeddings=256, eos=2, bos=1) + generation eos [1, 2]."""
    return write_llama_config(tmp_path / "tiny", generation_eos=[1, 2])


@pytest.fixture
def tiny_model_dir_no_gen(tmp_path) -> str:
    """Llama config only: no generation_config.json."""
    return write_llama_config(tmp_path / "tiny_nogen")
