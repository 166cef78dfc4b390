"""The vLLM peer plumbing (child process, arguments, JSON back) against a stand-in `vllm`
package: the real one runs on the GPU machine only."""
import argparse
import os
import textwrap

import pytest

from atom.benchmarks.peer_vllm import run_in_child
from atom.benchmarks.workloads import nano_vllm_workload, write_model_config

FAKE = textwrap.dedent('''
    import os, time, types
    __version__ = "0.0-fake"
    class SamplingParams:
        def __init__(self, temperature, max_tokens, ignore_eos, detokenize):
            assert ignore_eos and not detokenize
            self.max_tokens = max_tokens
    class LLM:
        def __init__(self, model, load_format, **kw):
            assert load_format == "dummy" and kw["skip_tokenizer_init"] and kw["enable_prefix_caching"] is False
            self.kw = kw
        def generate(self, prompts, sps, use_tqdm):
            assert len(prompts) == len(sps) and all(p["prompt_token_ids"] for p in prompts)
            time.sleep(0.001 * sum(sp.max_tokens for sp in sps) / len(sps))
            if os.environ.get("FAKE_SLOW_ONE_TOKEN") and all(sp.max_tokens == 1 for sp in sps):
                time.sleep(0.2)  # a hiccup longer than the whole N-token run
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[1] * sp.max_tokens)])
                    for sp in sps]
''')


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    pkg = tmp_path / "vllm"
    (pkg / "inputs").mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE)
    (pkg / "inputs" / "__init__.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), root]))


def test_throughput_peer_counts_the_workload_tokens(fake_vllm):
    args = argparse.Namespace(temperature=0.6, repeat=2, max_model_len=4096, gpu_memory_utilization=0.9,
                              max_num_seqs=512, max_num_batched_tokens=16384, enforce_eager=False)
    res = run_in_child("throughput", write_model_config("qwen3-0.6b"), 151936, args, ["--num-seqs", "8"])
    assert res["tokens"] == sum(r.max_tokens for r in nano_vllm_workload(8))
    assert res["vllm_version"] == "0.0-fake" and len(res["all_runs_s"]) == 2
    assert res["tok_s"] == pytest.approx(res["tokens"] / res["seconds"])


def test_latency_peer_reports_every_batch(fake_vllm):
    args = argparse.Namespace(repeat=1, max_model_len=2048)
    res = run_in_child("latency", write_model_config("qwen3-0.6b"), 151936, args,
                       ["--batches", "1", "4", "--new-tokens", "20", "--prompt-len", "8"])
    assert set(res["ms_per_step"]) == {"1", "4"}
    assert all(v > 0 for v in res["ms_per_step"].values())  # the fake sleeps 1 ms per token


def test_latency_peer_gives_no_figure_where_the_one_token_run_was_slower(fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_SLOW_ONE_TOKEN", "1")
    args = argparse.Namespace(repeat=1, max_model_len=2048)
    res = run_in_child("latency", write_model_config("qwen3-0.6b"), 151936, args,
                       ["--batches", "2", "--new-tokens", "20", "--prompt-len", "8"])
    assert res["ms_per_step"] == {"2": None}  # not a negative ms/step


def test_missing_vllm_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = argparse.Namespace(repeat=1, max_model_len=2048)
    with pytest.raises(SystemExit, match="the vLLM run failed"):
        run_in_child("latency", write_model_config("qwen3-0.6b"), 151936, args, ["--batches", "1"])
