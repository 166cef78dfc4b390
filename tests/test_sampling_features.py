"""What a vLLM user reaches for first (issue 6): n completions sharing the prompt's blocks,
logprobs and prompt logprobs, presence / frequency / repetition penalties, min_tokens, and
outputs in vLLM's layout (CompletionOutput, stop_reason, metrics). References: transformers
on the same weights, and small torch implementations of vLLM's rules written here."""
import math

import pytest
import torch

from atom import LLM, SamplingParams
from atom.model_engine.llm_engine import LLMEngine
from atom.model_ops import logits_processors
from atom.model_ops.logits_processors import build_logits_processing
from atom.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutputKind

GREEDY = dict(temperature=0, ignore_eos=True)
PROMPT = list(range(10, 50))  # 40 tokens: two full blocks of 16, the last prompt token in the third


def make_llm(path, **kw):
    kw = {"enable_log_stats": False, "num_kvcache_blocks": 64, "async_scheduling": False, **kw}
    return LLM(path, **kw)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax (fp32) of the model's logits at every position of `ids`."""
    with torch.inference_mode():
        return hf(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)


def all_free(engine) -> bool:
    bm = engine.block_manager
    return (bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
            and engine.is_finished() and not engine.requests)


def run_engine(engine, prompts, sp):
    """Step an engine to the end; (final outputs by request id, every output, peak blocks used)."""
    rids = [engine.add_request(p, sp) for p in prompts]
    outs, peak = [], 0
    while not engine.is_finished():
        outs += engine.step()
        peak = max(peak, engine.block_manager.num_used_blocks)
    final = {o.request_id: o for o in outs if o.finished}
    return [final[r] for r in rids], outs, peak


# --- SamplingParams --------------------------------------------------------------------------
def test_new_fields_defaults_as_vllm():
    sp = SamplingParams()
    assert (sp.n, sp.logprobs, sp.prompt_logprobs, sp.min_tokens) == (1, None, None, 0)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert not sp.uses_penalties and not sp.needs_step_tokens
    ok = SamplingParams(n=3, logprobs=0, prompt_logprobs=5, presence_penalty=-2, frequency_penalty=2,
                        repetition_penalty=0.5, min_tokens=64)
    assert ok.uses_penalties and ok.needs_step_tokens and isinstance(ok.presence_penalty, float)


@pytest.mark.parametrize("field, value, allowed", [
    ("n", 0, "integer >= 1"), ("n", 1.0, "integer >= 1"), ("n", True, "integer >= 1"),
    ("logprobs", -1, "None or an integer >= 0"), ("logprobs", 2.0, "None or an integer >= 0"),
    ("prompt_logprobs", -3, "None or an integer >= 0"),
    ("presence_penalty", 2.5, r"in \[-2, 2\]"), ("presence_penalty", math.nan, r"in \[-2, 2\]"),
    ("frequency_penalty", -2.01, r"in \[-2, 2\]"), ("frequency_penalty", "0.1", r"in \[-2, 2\]"),
    ("repetition_penalty", 0, "> 0"), ("repetition_penalty", -1.0, "> 0"), ("repetition_penalty", math.inf, "> 0"),
    ("min_tokens", -1, "integer >= 0"), ("min_tokens", 65, "<= max_tokens=64"),
])
def test_bad_values_name_field_value_and_what_is_allowed(field, value, allowed):
    with pytest.raises(ValueError, match=rf"{field}={value!r} is invalid: must be .*{allowed}".replace("(", r"\(")):
        SamplingParams(**{field: value})


# --- n -------------------------------------------------------------------------------------
def test_n_completions_sampled_greedy_seeded(llm):
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=8, ignore_eos=True, seed=11)
    out = llm.generate([PROMPT, [5, 6, 7]], sp, use_tqdm=False)
    assert len(out) == 2 and all(len(o.outputs) == 4 for o in out)
    for o in out:
        assert [c.index for c in o.outputs] == [0, 1, 2, 3]
        assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in o.outputs)
        assert len({tuple(c.token_ids) for c in o.outputs}) > 1  # independent streams
        assert o.token_ids == o.outputs[0].token_ids and o.finish_reason == "length"
    again = llm.generate([PROMPT, [5, 6, 7]], sp, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in again] == [[c.token_ids for c in o.outputs] for o in out]
    # completion i draws with seed + i (as vLLM): the same as a request of its own with that seed
    alone = [llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=11 + i),
                          use_tqdm=False)[0].token_ids for i in range(4)]
    assert alone == [c.token_ids for c in out[0].outputs]
    greedy = llm.generate([PROMPT], SamplingParams(n=3, max_tokens=8, **GREEDY), use_tqdm=False)[0]
    single = llm.generate([PROMPT], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
    assert [c.token_ids for c in greedy.outputs] == [single.token_ids] * 3
    assert all_free(llm.engine)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_n_shares_prompt_blocks(tiny_llama, prefix_caching):
    llm = make_llm(tiny_llama, enable_prefix_caching=prefix_caching)
    eng = llm.engine
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=6, ignore_eos=True, seed=1)
    (forked,), _, peak_forked = run_engine(eng, [PROMPT], sp)
    assert all_free(eng)
    if prefix_caching:  # forget what the first run published: the separate run must not hit it
        for b in eng.block_manager.blocks:
            b.hash, b.token_ids = None, ()
        eng.block_manager.hash_to_block.clear()
    separate, _, peak_separate = run_engine(
        eng, [PROMPT] * 4, SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=1))
    assert all_free(eng)
    # 40 + 6 tokens: 3 blocks each; forked: 2 shared + 1 each
    assert peak_separate == 12 and peak_forked == 2 + 4
    assert forked.outputs[0].token_ids == separate[0].token_ids


def test_n_streams_per_completion_and_aborts_cleanly(llm):
    eng = llm.engine
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=5, ignore_eos=True, seed=4, logprobs=1)
    (final,), outs, _ = run_engine(eng, [PROMPT], sp)
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    streamed = [o for o in outs if not o.finished]
    assert streamed and all(len(o.outputs) == 1 for o in streamed)
    for c in final.outputs:
        mine = [o.outputs[0] for o in outs if o.outputs[0].index == c.index and not o.finished]
        assert sum((m.new_token_ids for m in mine), []) + final.outputs[c.index].new_token_ids == c.token_ids
        assert len(c.logprobs) == 5 and c.cumulative_logprob == pytest.approx(
            sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))
    assert all_free(eng)
    # aborted before and after its siblings forked: every block back
    for steps in (0, 1, 3):
        rid = eng.add_request(PROMPT, SamplingParams(n=3, max_tokens=20, **GREEDY))
        for _ in range(steps):
            eng.step()
        out = eng.abort(rid)
        assert out.finished and len(out.outputs) == 3 and {c.finish_reason for c in out.outputs} == {"abort"}
        assert all_free(eng)


# --- logprobs ------------------------------------------------------------------------------
def check_logprobs(entry: dict, token: int, ref: torch.Tensor, k: int):
    """One position against the reference row: the scored token first with its logprob and
    rank, then exactly the top-k ids with their values and ranks."""
    assert next(iter(entry)) == token
    assert entry[token].logprob == pytest.approx(float(ref[token]), abs=1e-4)
    assert entry[token].rank == int((ref >= ref[token]).sum())
    top = ref.topk(k)
    ids = top.indices.tolist()
    assert set(entry) == {token} | set(ids)
    for rank, (t, v) in enumerate(zip(ids, top.values.tolist()), 1):
        assert entry[t].logprob == pytest.approx(v, abs=1e-4)
        assert entry[t].rank == rank


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_match_transformers(llm, hf, k):
    sp = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=5, logprobs=k, prompt_logprobs=k)
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    c = out.outputs[0]
    ref = hf_logprobs(hf, PROMPT + c.token_ids)
    assert len(c.logprobs) == 6
    for i, (entry, tok) in enumerate(zip(c.logprobs, c.token_ids)):
        check_logprobs(entry, tok, ref[len(PROMPT) - 1 + i], k)
    assert c.cumulative_logprob == pytest.approx(
        sum(float(ref[len(PROMPT) - 1 + i, t]) for i, t in enumerate(c.token_ids)), abs=1e-3)
    plp = out.prompt_logprobs
    assert len(plp) == len(PROMPT) and plp[0] is None
    for j in range(1, len(PROMPT)):
        check_logprobs(plp[j], PROMPT[j], ref[j - 1], k)
    plain = llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=5),
                         use_tqdm=False)[0]
    assert plain.token_ids == c.token_ids  # asking for logprobs changes no token
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    assert plain.prompt_logprobs is None


def test_logprobs_are_of_the_raw_distribution_and_greedy_rank_one(llm, hf):
    sp = SamplingParams(temperature=0.3, top_k=5, max_tokens=4, ignore_eos=True, seed=2, logprobs=2,
                        repetition_penalty=1.4)
    c = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
    ref = hf_logprobs(hf, PROMPT + c.token_ids)
    for i, (entry, tok) in enumerate(zip(c.logprobs, c.token_ids)):
        check_logprobs(entry, tok, ref[len(PROMPT) - 1 + i], 2)  # not the scaled / penalized one
    g = llm.generate([PROMPT], SamplingParams(max_tokens=4, logprobs=1, **GREEDY), use_tqdm=False)[0].outputs[0]
    assert all(e[t].rank == 1 for e, t in zip(g.logprobs, g.token_ids))


def test_prompt_logprobs_over_chunked_prefill_and_no_prefix_hits(tiny_llama, hf):
    llm = make_llm(tiny_llama, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True)
    prompt = list(range(100, 150))  # 50 tokens: four chunks
    llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)  # publish its blocks
    out = llm.generate([prompt, prompt[:20]], SamplingParams(max_tokens=3, prompt_logprobs=2, **GREEDY),
                       use_tqdm=False)
    ref = hf_logprobs(hf, prompt)
    for o, n in zip(out, (50, 20)):
        assert o.num_cached_tokens == 0 and len(o.prompt_logprobs) == n  # computed whole, as vLLM
        for j in range(1, n):
            check_logprobs(o.prompt_logprobs[j], prompt[j], ref[j - 1], 2)
    assert llm.stats.steps().prefill_tokens.max() <= 16
    assert all_free(llm.engine)


def test_logprobs_with_multi_token_steps(tiny_llama):
    """Drafts verified: only the kept tokens' logprobs stay, equal to one-token steps'."""
    from test_multi_token_steps import ScriptedProposer, reference
    llm = make_llm(tiny_llama)
    prompts = [[5, 6, 7], list(range(10, 40))]
    sp = SamplingParams(max_tokens=12, logprobs=2, **GREEDY)
    plain = llm.generate(prompts, sp, use_tqdm=False)
    llm.engine.proposer = ScriptedProposer(reference(llm, prompts, 12), llm.engine.vocab_size)
    drafted = llm.generate(prompts, sp, use_tqdm=False)
    llm.engine.proposer = None
    assert llm.engine.scheduler.num_accepted_drafts > 0
    for a, b in zip(plain, drafted):
        assert a.token_ids == b.token_ids and len(b.outputs[0].logprobs) == 12
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert list(x) == list(y)
            assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4) for t in x)


# --- penalties -----------------------------------------------------------------------------
def ref_penalize(logits: torch.Tensor, prompt: list[int], output: list[int], presence=0.0, frequency=0.0,
                 repetition=1.0) -> torch.Tensor:
    """vLLM's rules, token by token."""
    x = logits.clone().float()
    for t in set(prompt) | set(output):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t in set(output):
        x[t] -= frequency * output.count(t) + presence
    return x


def test_processed_logits_match_the_reference():
    torch.manual_seed(0)
    V = 40
    logits = torch.randn(5, V) * 3
    rows = [  # (tokens, prompt length, params)
        ([1, 2, 3, 4, 4, 9, 9, 9], 4, SamplingParams(presence_penalty=0.7, frequency_penalty=0.3,
                                                       repetition_penalty=1.6)),
        ([5, 5, 6], 1, SamplingParams()),                         # untouched
        ([7, 8, 8, 8, 30], 2, SamplingParams(frequency_penalty=-1.2)),
        ([1, 2, 3], 2, SamplingParams(repetition_penalty=0.5, min_tokens=4, stop_token_ids=[11])),
        ([0, 39, 39], 1, SamplingParams(presence_penalty=2.0, min_tokens=1)),  # 2 generated: no ban
    ]
    toks, plens, sps = zip(*rows)
    proc = build_logits_processing(list(toks), list(plens), [len(t) for t in toks], list(sps), V, "cpu",
                                   frozenset({2}))
    got = proc.apply(logits.clone())
    for i, (t, p, sp) in enumerate(rows):
        want = ref_penalize(logits[i], t[:p], t[p:], sp.presence_penalty, sp.frequency_penalty,
                            sp.repetition_penalty)
        if sp.min_tokens and len(t) - p < sp.min_tokens:
            want[[2, 11]] = float("-inf")
        assert torch.allclose(got[i], want, atol=1e-6, equal_nan=False), i
    assert build_logits_processing([[1, 2]], [1], [2], [SamplingParams(logprobs=2)], V, "cpu") is None


def hf_greedy_penalized(hf, prompt, n, sp):
    out = []
    for _ in range(n):
        with torch.inference_mode():
            logits = hf(input_ids=torch.tensor([prompt + out])).logits[0, -1]
        out.append(int(ref_penalize(logits, prompt, out, sp.presence_penalty, sp.frequency_penalty,
                                    sp.repetition_penalty).argmax()))
    return out


@pytest.mark.parametrize("prompt, kw", [
    ([5, 6, 7], dict(repetition_penalty=0.7)),
    ([9] * 20, dict(repetition_penalty=1.3)),
    (PROMPT, dict(frequency_penalty=-1.0)),
    ([5, 6, 7], dict(presence_penalty=-2.0)),
    ([9] * 20, dict(repetition_penalty=0.7, frequency_penalty=0.8, presence_penalty=0.5)),
])
def test_penalized_greedy_matches_transformers(llm, hf, prompt, kw):
    sp = SamplingParams(max_tokens=16, **GREEDY, **kw)
    plain = llm.generate([prompt], SamplingParams(max_tokens=16, **GREEDY), use_tqdm=False)[0].token_ids
    # beside a plain request in the same batches: its tokens must not change
    got, other = llm.generate([prompt, prompt], [sp, SamplingParams(max_tokens=16, **GREEDY)], use_tqdm=False)
    assert got.token_ids == hf_greedy_penalized(hf, prompt, 16, sp)
    assert got.token_ids != plain and other.token_ids == plain


def test_plain_batches_never_process_logits(llm, monkeypatch):
    from atom.model_engine import model_runner, step_extras
    fail = lambda *a, **k: pytest.fail("processed")  # noqa: E731
    for mod, name in ((model_runner, "sample_processed"), (model_runner, "score_prompts"),
                      (step_extras, "build_logits_processing"), (logits_processors, "apply_penalties")):
        monkeypatch.setattr(mod, name, fail)
    llm.generate([PROMPT, [5, 6]], [SamplingParams(max_tokens=4, **GREEDY),
                                    SamplingParams(temperature=0.8, top_k=5, max_tokens=4, seed=1)],
                 use_tqdm=False)


def test_rows_needing_tokens_get_no_lookahead_step(tiny_llama):
    prompts = [[5, 6, 7], list(range(10, 40))]
    sps = [SamplingParams(max_tokens=10, frequency_penalty=-1.0, **GREEDY),
           SamplingParams(max_tokens=10, **GREEDY)]
    sync = make_llm(tiny_llama).generate(prompts, sps, use_tqdm=False)
    fast = make_llm(tiny_llama, async_scheduling=True)
    got = fast.generate(prompts, sps, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in sync]
    assert fast.engine.num_lookahead_steps == 0
    fast.generate(prompts, SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)
    assert fast.engine.num_lookahead_steps > 0  # plain batches still look ahead


# --- min_tokens ----------------------------------------------------------------------------
def test_min_tokens_suppresses_stop_tokens_and_eos(llm):
    first = llm.generate([PROMPT], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0].token_ids[0]
    stop = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first])
    early = llm.generate([PROMPT], stop, use_tqdm=False)[0]
    assert early.token_ids == [first] and early.finish_reason == "stop" and early.stop_reason == first
    held = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first],
                                                 min_tokens=3), use_tqdm=False)[0]
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 3
    # the model's EOS: pretend the greedy first token is EOS
    eng = llm.engine
    saved = eng.scheduler.eos_token_ids, eng.runner.eos_token_ids
    eng.scheduler.eos_token_ids = eng.runner.eos_token_ids = frozenset({first})
    try:
        eos = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
        assert eos.token_ids == [first] and eos.finish_reason == "stop" and eos.stop_reason is None
        held = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, min_tokens=5),
                            use_tqdm=False)[0]
        assert first not in held.token_ids[:5] and len(held.token_ids) >= 5
        free = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, min_tokens=5, ignore_eos=True),
                            use_tqdm=False)[0]
        assert free.token_ids[0] == first  # ignore_eos: EOS is not suppressed, only not a stop
    finally:
        eng.scheduler.eos_token_ids, eng.runner.eos_token_ids = saved


# --- vLLM's output layout ------------------------------------------------------------------
def test_vllm_layout_with_stop_string_and_stop_token(tiny_llama, llm, tokenizer):
    eng = LLMEngine(llm.config, model_runner=llm.engine.runner, tokenizer=tokenizer, async_scheduling=False)
    ref = llm.generate([PROMPT], SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0].token_ids
    text = tokenizer.decode(ref)
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip()
                and text.find(text[i:i + 2]) == i)
    (out,), _, _ = run_engine(eng, [PROMPT], SamplingParams(max_tokens=12, stop_strings=[stop], logprobs=1,
                                                            **GREEDY))
    c = out.outputs[0]
    assert isinstance(c, CompletionOutput) and c.index == 0 and c.finish_reason == "stop"
    assert c.stop_reason == stop and c.text == text[:text.find(stop)] and out.text == c.text == out["text"]
    assert len(c.logprobs) == len(c.token_ids) and isinstance(next(iter(c.logprobs[0].values())), Logprob)
    assert all(lp.decoded_token == tokenizer.decode([t]) for d in c.logprobs for t, lp in d.items())
    (tok_out,), _, _ = run_engine(eng, [PROMPT], SamplingParams(max_tokens=12, stop_token_ids=[ref[3]], **GREEDY))
    assert tok_out.token_ids == ref[:4] and tok_out.stop_reason == ref[3] and tok_out.finish_reason == "stop"
    (length,), _, _ = run_engine(eng, [PROMPT], SamplingParams(max_tokens=3, **GREEDY))
    assert length.stop_reason is None and length.finish_reason == "length"
    m = length.metrics
    assert isinstance(m, RequestMetrics)
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert length.ttft == m.ttft == pytest.approx(m.first_token_time - m.arrival_time)
    assert length.tpot == m.tpot == pytest.approx((m.finished_time - m.first_token_time) / 2)
    assert length.prompt_token_ids == PROMPT and length.num_cached_tokens == 0 and length.prompt_logprobs is None


def test_streamed_delta_logprobs_add_up(llm):
    eng = llm.engine
    rid = eng.add_request(PROMPT, SamplingParams(max_tokens=6, logprobs=1, **GREEDY))
    eng.set_output_kind(rid, RequestOutputKind.DELTA)
    outs = []
    while not eng.is_finished():
        outs += eng.step()
    final = outs[-1].outputs[0]
    assert len(outs) > 2 and all(len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids) for o in outs)
    streamed = sum((o.outputs[0].logprobs for o in outs[:-1]), [])
    assert len(streamed) == 6 - len(final.new_token_ids) and streamed == final.logprobs[:len(streamed)]
    assert all_free(eng)
