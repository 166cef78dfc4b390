"""The start-up warm-up of eager steps (`gpu_setup.warm_up_eager_steps`): which batches it
builds, that it runs them through the runner, and that requests after it get the tokens they
get without it (it writes only blocks no request holds)."""
from __future__ import annotations

import pytest

from atom import LLM, SamplingParams
from atom.model_engine.gpu_setup import eager_step_shapes, warm_up_eager_steps


def test_shapes_cover_each_integer_kind_past_the_graphs():
    batches = eager_step_shapes(max_tokens=16384, max_model_len=4096, past_graphs=2048)
    assert len(batches) == 3
    totals = [sum(n for _, n in b) for b in batches]
    assert all(2048 < t <= 16384 for t in totals)
    odd, aligned, single = batches
    assert totals[0] % 2 == 1 and all(n % 2 == 1 for _, n in odd)
    assert sum(1 for c, n in odd if n == 1) >= 2 and any(c > 0 and n > 1 for c, n in odd)  # decodes, a chunk
    assert totals[1] % 16 == 0 and all(n % 16 == 0 and c % 16 == 0 for c, n in aligned)
    assert single == [(0, totals[2])]
    for b in batches:
        assert all(c + n <= 4096 for c, n in b)


def test_shapes_respect_the_limits():
    # no graphs: any step is eager, the batches still fit the token budget and the model length
    for max_tokens, max_len in ((512, 256), (100, 4096), (8192, 2100)):
        for b in eager_step_shapes(max_tokens, max_len, 0):
            assert sum(n for _, n in b) <= max_tokens
            assert all(c + n <= max_len for c, n in b)
    # a budget the graphs cover entirely: no eager step exists
    assert eager_step_shapes(2048, 4096, 2048) == []
    assert eager_step_shapes(32, 4096, 0) == []


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_llama"])
def test_warm_up_runs_and_changes_no_output(model, request):
    path = request.getfixturevalue(model)
    prompts = [[5, 9, 200, 7, 3, 11, 40], [8, 1, 2, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]

    ref = tokens(LLM(path, enable_log_stats=False, num_kvcache_blocks=96, max_num_batched_tokens=512,
                     max_model_len=512))
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=96, max_num_batched_tokens=512, max_model_len=512)
    steps = llm.engine.runner.num_steps
    ran = warm_up_eager_steps(llm.engine.runner)
    assert ran == eager_step_shapes(512, 512, 0) and len(ran) == 3
    assert llm.engine.runner.num_steps == steps + len(ran)
    assert tokens(llm) == ref


def test_warm_up_skips_what_the_cache_cannot_hold(tiny_qwen3):
    llm = LLM(tiny_qwen3, enable_log_stats=False, num_kvcache_blocks=8, max_num_batched_tokens=512,
              max_model_len=512)
    assert warm_up_eager_steps(llm.engine.runner) == []  # 8 blocks of 16 tokens hold none of them
