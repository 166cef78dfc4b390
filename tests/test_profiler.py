"""Torch profiler support: torch_profiler_dir / ATOM_TORCH_PROFILER_DIR / ATOM_PROFILER_MORE."""
import os

import pytest

from atom import LLM, SamplingParams


def test_profile_writes_a_trace(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("ATOM_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    monkeypatch.setenv("ATOM_PROFILER_MORE", "1")
    llm = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=16)
    assert llm.config.torch_profiler_dir == str(tmp_path / "traces")
    llm.start_profile()
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    llm.stop_profile()
    files = os.listdir(tmp_path / "traces")
    assert any(f.endswith(".json.gz") for f in files)


def test_profile_needs_a_folder(tiny_llama, monkeypatch):
    monkeypatch.delenv("ATOM_TORCH_PROFILER_DIR", raising=False)
    llm = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=16)
    with pytest.raises(ValueError, match="torch_profiler_dir"):
        llm.start_profile()
