"""LLMEngine step by step, the engine-status line, records, output fields."""
import logging

from atom import LLM, SamplingParams
from atom.model_engine.llm_engine import LLMEngine


def test_step_by_step(tiny_llama):
    llm = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=32)
    engine: LLMEngine = llm.engine
    a = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    b = engine.add_request([8, 9], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), request_id="b")
    assert b == "b" and not engine.is_finished()
    done = {}
    steps = 0
    while not engine.is_finished():
        for out in engine.step():
            done[out.request_id] = out
        steps += 1
    assert set(done) == {a, "b"} and steps == 5
    assert done[a].num_output_tokens == 3 and done["b"].num_output_tokens == 5
    assert done["b"].ttft is not None and done["b"].tpot is not None
    assert done[a]["token_ids"] == done[a].token_ids
    assert "LLMEngine(" in repr(engine) and "Scheduler(" in repr(engine)


def test_status_line_and_records(tiny_llama, caplog):
    llm = LLM(tiny_llama, num_kvcache_blocks=32, enable_log_stats=True, throughput_log_interval=1e-6,
              enable_prefix_caching=True)
    with caplog.at_level(logging.INFO, logger="atom.engine"):
        llm.generate([[5] * 40, [5] * 40 + [6]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "atom.engine"]
    assert lines and "running" in lines[-1] and "KV usage" in lines[-1] and "prefix-cache hit rate" in lines[-1]
    steps, reqs = llm.stats.steps(), llm.stats.requests()
    assert {"latency", "prefill_tokens", "decode_tokens", "kv_usage", "prefix_hit_tokens"} <= set(steps.columns)
    assert len(reqs) == 2 and reqs.output_tokens.tolist() == [4, 4]
    # every prompt token not served from the cache, plus 3 decode tokens per request
    assert steps.prefill_tokens.sum() + steps.decode_tokens.sum() == 40 + 41 - reqs.cached_tokens.sum() + 6


def test_records_can_be_turned_off(tiny_llama):
    llm = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=32, record_stats=False)
    llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.stats.steps().empty and llm.stats.num_steps > 0


def test_async_scheduling_matches_sync_with_stops(tiny_llama):
    """Look-ahead steps (launched before the previous tokens reach the host) change
    nothing: same tokens, finish reasons and freed blocks, also when requests stop early."""
    prompts = [[5, 6, 7], list(range(10, 60)), [9] * 20, [300, 301]]
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sync = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=32, async_scheduling=False)
    ref = sync.generate(prompts, base, use_tqdm=False)
    stop = ref[1].token_ids[4]  # a token that really occurs: some requests stop on it
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, stop_token_ids=[stop])
           for n in (12, 12, 3, 7)]
    expected = sync.generate(prompts, sps, use_tqdm=False)
    fast = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=32, async_scheduling=True)
    for _ in range(2):  # twice: a look-ahead step left over from the first call is harmless
        got = fast.generate(prompts, sps, use_tqdm=False)
        assert [(o.token_ids, o.finish_reason) for o in got] == \
               [(o.token_ids, o.finish_reason) for o in expected]
    assert any(o.finish_reason == "stop" for o in got) and any(o.finish_reason == "length" for o in got)
    bm = fast.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert fast.engine.num_lookahead_steps >= 10 and sync.engine.num_lookahead_steps == 0
