"""Greedy tokens identical to transformers' `generate` (fp32) on tiny random models."""
import pytest
import torch
import transformers

from atom import LLM, SamplingParams
from conftest import hf_greedy

PROMPT_LENS = (3, 17, 40, 90, 130)


def prompts(seed=1, lens=PROMPT_LENS, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def hf_reference(path, ps, n):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [hf_greedy(model, p, n) for p in ps]


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_llama3", "tiny_qwen3"])
def model_and_ref(request):
    path = request.getfixturevalue(request.param)
    ps = prompts()
    return path, ps, hf_reference(path, ps, 16)


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

SETTINGS = {
    "plain": dict(),
    "prefix_caching": dict(enable_prefix_caching=True),
    "chunked_prefill": dict(max_num_batched_tokens=32),
    "preemption": dict(num_kvcache_blocks=14, kv_cache_block_size=16),
    "block_32": dict(kv_cache_block_size=32),
    "async_scheduling": dict(async_scheduling=True, max_num_batched_tokens=48),
    "async_preemption": dict(async_scheduling=True, num_kvcache_blocks=14, kv_cache_block_size=16),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(model_and_ref, setting):
    path, ps, ref = model_and_ref
    kw = {"num_kvcache_blocks": 128, **SETTINGS[setting]}
    llm = LLM(path, enable_log_stats=False, **kw)
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    assert all(o.finish_reason == "length" for o in outs)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    steps = llm.stats.steps()
    if setting == "chunked_prefill":
        assert steps["prefill_tokens"].max() <= 32 and (steps["prefill_tokens"] + steps["decode_tokens"]).max() <= 32
    if setting == "preemption":
        assert steps["preemptions"].sum() > 0


def test_prefix_cache_hits_keep_tokens(model_and_ref):
    path, ps, ref = model_and_ref
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=128, enable_prefix_caching=True)
    first = llm.generate(ps, GREEDY, use_tqdm=False)
    second = llm.generate(ps, GREEDY, use_tqdm=False)  # same prompts: prefix hits
    assert [o.token_ids for o in second] == [o.token_ids for o in first] == ref
    assert sum(o.num_cached_tokens for o in second) > 0
    assert llm.engine.block_manager.hit_rate > 0


def test_shared_prefix_in_one_batch(tiny_llama):
    base = prompts(seed=3, lens=(64,))[0]
    ps = [base + [5 + i, 9, 11] for i in range(4)]
    ref = hf_reference(tiny_llama, ps, 8)
    llm = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=64, enable_prefix_caching=True)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate(ps[:1], sp, use_tqdm=False)
    rest = llm.generate(ps[1:], sp, use_tqdm=False)
    assert [o.token_ids for o in first + rest] == ref
    assert all(o.num_cached_tokens == 64 for o in rest)
