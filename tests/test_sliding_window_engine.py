"""Sliding-window models in the engine against transformers (fp32, greedy tokens exact):
a Mistral whose every layer sees the last 8 tokens, and a Qwen3 alternating full and
windowed layers (`layer_types`), with prompts longer than the window, chunked prefill and
prefix caching (the window is on absolute positions, so cached context is read the same)."""
import pytest
import torch
import transformers

from atom import LLM, SamplingParams
from atom.model_ops.attention import Attention
from atom.model_ops.attention.windows import sliding_window_of
from atom.viz import kv_cache_frame
from conftest import hf_greedy
from tiny_attention import make_tiny_mistral, make_tiny_qwen3_windowed

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _prompts(lens=(3, 9, 25, 60), seed=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def windowed_models(tmp_path_factory):
    return {"mistral": make_tiny_mistral(tmp_path_factory.mktemp("mistral_swa"), sliding_window=8),
            "qwen3": make_tiny_qwen3_windowed(tmp_path_factory.mktemp("qwen3_swa"), sliding_window=6)}


@pytest.fixture(scope="module")
def references(windowed_models):
    ps = _prompts()
    out = {}
    for name, path in windowed_models.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[name] = [hf_greedy(hf, p, GREEDY.max_tokens) for p in ps]
    return ps, out


def test_the_window_matters_for_these_models(windowed_models, references):
    """The same weights with full attention give other tokens (the test can fail)."""
    ps, ref = references
    cfg = transformers.AutoConfig.from_pretrained(windowed_models["mistral"])
    cfg.sliding_window = None
    hf = transformers.AutoModelForCausalLM.from_pretrained(windowed_models["mistral"], config=cfg,
                                                           dtype=torch.float32).eval()
    assert [hf_greedy(hf, p, GREEDY.max_tokens) for p in ps] != ref["mistral"]


SETTINGS = {
    "plain": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=16),
    "prefix_caching": dict(enable_prefix_caching=True, max_num_batched_tokens=32),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("model", ["mistral", "qwen3"])
def test_sliding_window_greedy_matches_transformers(windowed_models, references, model, setting):
    ps, ref = references
    llm = LLM(windowed_models[model], enable_log_stats=False, num_kvcache_blocks=64, **SETTINGS[setting])
    # twice: the second time the prompts hit the prefix cache where it is on
    outs = llm.generate(ps + ps, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref[model] * 2


def test_per_layer_windows_reach_the_attention_layers(windowed_models):
    runner = LLM(windowed_models["qwen3"], enable_log_stats=False, num_kvcache_blocks=8).engine.runner
    assert [a.sliding_window for a in runner.attn_layers] == [None, 6, None, 6]
    assert list(kv_cache_frame(runner)["kind"]) == ["full", "sliding(6)", "full", "sliding(6)"]
    assert "sliding_window=6" in repr(runner.attn_layers[1])


def test_sliding_window_on_the_triton_backend(windowed_models, references):
    """The Triton attention op (interpreter) with every fusion: the same tokens."""
    pytest.importorskip("triton")
    from test_triton_engine import _on_triton
    ps, ref = references
    llm = LLM(windowed_models["qwen3"], enable_log_stats=False, num_kvcache_blocks=64, max_num_batched_tokens=32)
    _on_triton(llm.engine.runner, fused=True)
    outs = llm.generate(ps[2:], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == [r[:4] for r in ref["qwen3"][2:]]


def test_window_config_reading_and_bad_values():
    class Cfg:
        sliding_window = 16
    assert sliding_window_of(Cfg(), 3) == 16  # Mistral: every layer
    Cfg.layer_types = ["full_attention", "sliding_attention"]
    assert [sliding_window_of(Cfg(), i) for i in range(2)] == [None, 16]
    Cfg.layer_types = ["chunked_attention"]
    with pytest.raises(ValueError, match=r"layer_types\[0\]='chunked_attention' is not supported"):
        sliding_window_of(Cfg(), 0)
    Cfg.layer_types, Cfg.sliding_window = ["sliding_attention"], None
    with pytest.raises(ValueError, match="needs sliding_window"):
        sliding_window_of(Cfg(), 0)
    with pytest.raises(ValueError, match="sliding_window=0 is invalid for layer 2"):
        Attention(4, 2, 16, 0.25, 2, sliding_window=0)
    with pytest.raises(ValueError, match=r"sinks of layer 1 must be \[num_heads=4\]"):
        Attention(4, 2, 16, 0.25, 1, sinks=torch.zeros(2))
