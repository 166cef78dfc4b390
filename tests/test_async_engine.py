"""`AsyncLLMEngine` in-process (tiny random Llama): concurrent requests stream the tokens
`LLM.generate` gives, a refused request fails alone, leaving a stream aborts the request and
frees its blocks, a failing step fails only the requests then in flight; the `[Cache Stats]`
line is cumulative and has its own gate."""
from __future__ import annotations

import asyncio
import logging

import pytest

from atom import LLM, SamplingParams
from atom.model_engine.async_engine import AsyncLLMEngine, EngineError
from engine_scenarios import refuse_one_and_leave_one


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, max_model_len=128, enforce_eager=True, enable_log_stats=False)


def _run(coro):
    return asyncio.run(coro)


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [40, 41], [100] * 20]
SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_concurrent_streams_equal_generate(llm):
    want = [o.token_ids for o in llm.generate(PROMPTS, SP, use_tqdm=False)]

    async def main():
        eng = AsyncLLMEngine.from_engine(llm.engine)
        await eng.start()
        try:
            async def one(p):
                toks, finals = [], []
                async for out in eng.generate(p, SP):
                    toks += out.outputs[0].new_token_ids
                    finals.append(out.finished)
                assert finals[-1] and not any(finals[:-1])
                return toks
            return await asyncio.gather(*map(one, PROMPTS)), repr(eng)
        finally:
            await eng.shutdown()

    got, text = _run(main())
    assert got == want
    assert "AsyncLLMEngine(running" in text
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_a_lagging_stream_gets_the_queued_steps_as_one_output(llm):
    """A consumer that reads its first output and then only after the engine has finished the
    request receives the rest as one merged output: the same tokens, text and logprobs as
    `LLM.generate`, the final one last."""
    import time
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    want = llm.generate([PROMPTS[1]], sp, use_tqdm=False)[0]

    async def main():
        eng = AsyncLLMEngine.from_engine(llm.engine)
        await eng.start()
        try:
            rid = await eng.add_request(PROMPTS[1], sp)
            outs, it = [], eng.stream(rid)
            outs.append(await it.__anext__())
            t0 = time.monotonic()
            while not eng.engine.is_finished() and time.monotonic() - t0 < 60:
                await asyncio.sleep(0.01)  # every later step's output queues up meanwhile
            await asyncio.sleep(0.05)      # and its hand-over to this loop runs
            outs += [o async for o in it]
            return outs
        finally:
            await eng.shutdown()

    outs = _run(main())
    assert len(outs) == 2 and outs[-1].finished and not outs[0].finished
    assert [t for o in outs for t in o.outputs[0].new_token_ids] == want.outputs[0].token_ids
    assert "".join(o.outputs[0].new_text for o in outs) == want.outputs[0].text
    assert len(outs[0].outputs[0].logprobs) == len(outs[0].outputs[0].token_ids)  # a DELTA output's own
    assert len(outs[-1].outputs[0].logprobs) == 24  # the final output carries them all


def test_merge_outputs_joins_deltas_and_keeps_other_completions():
    from atom.model_engine.async_engine import merge_outputs
    from atom.outputs import CompletionOutput, Logprob, RequestOutput

    def out(*comps, finished=False, plp=None):
        return RequestOutput("r", None, [1, 2], list(comps), finished, prompt_logprobs=plp)

    lp = lambda t: {t: Logprob(-0.5)}  # noqa: E731
    a = out(CompletionOutput(0, "a", [7], None, [lp(7)], new_token_ids=[7], new_text="a"),
            CompletionOutput(1, "x", [9], None, [lp(9)], finish_reason="length", new_token_ids=[9], new_text="x"),
            plp=[None, {2: Logprob(-1.0)}])
    b = out(CompletionOutput(0, "b", [8], None, [lp(8)], new_token_ids=[8], new_text="b"))
    m = merge_outputs(a, b)
    assert [c.index for c in m.outputs] == [0, 1] and m.prompt_logprobs == a.prompt_logprobs
    c0 = m.outputs[0]
    assert (c0.text, c0.token_ids, c0.new_token_ids, c0.new_text) == ("ab", [7, 8], [7, 8], "ab")
    assert [list(d) for d in c0.logprobs] == [[7], [8]] and m.outputs[1] is a.outputs[1]
    final = out(CompletionOutput(0, "abc", [7, 8, 5], None, None, finish_reason="stop", new_token_ids=[5],
                                 new_text="c"), finished=True)
    f = merge_outputs(m, final)
    assert f.finished and f.outputs[0].token_ids == [7, 8, 5] and f.outputs[0].new_token_ids == [7, 8, 5]
    assert f.outputs[0].new_text == "abc"
    # n > 1: completion 1 finished a step before the request; the final output repeats it with
    # no new tokens: its last delta must survive the merge
    fin = out(CompletionOutput(0, "abc", [7, 8, 5], None, None, finish_reason="stop", new_token_ids=[5],
                               new_text="c"),
              CompletionOutput(1, "x", [9], None, None, finish_reason="length"), finished=True)
    g = merge_outputs(a, fin)
    assert (g.outputs[1].new_token_ids, g.outputs[1].new_text) == ([9], "x")


def test_refused_request_fails_alone_and_leaving_aborts(llm):
    bm = llm.engine.block_manager

    async def main():
        seen = []
        eng = AsyncLLMEngine.from_engine(llm.engine, on_step=lambda outs, now: seen.extend(outs))
        await eng.start()
        try:
            outs = await refuse_one_and_leave_one(
                eng, SP, lambda: bm.num_free_blocks == bm.num_blocks and not llm.engine.requests)
            return outs, eng.snapshot, [o.outputs[0].finish_reason for o in seen if o.finished]
        finally:
            await eng.shutdown()

    outs, snap, reasons = _run(main())
    assert sum(len(o.outputs[0].new_token_ids) for o in outs) == 10
    assert snap.num_free_blocks == snap.num_blocks and bm.num_free_blocks == bm.num_blocks
    assert sorted(reasons) == ["abort", "length"]


async def _collect(eng, prompt, sp):
    toks = []
    async for out in eng.generate(prompt, sp):
        toks += out.outputs[0].new_token_ids
    return toks


def test_a_failing_step_fails_the_requests_in_flight_and_the_loop_goes_on(llm, monkeypatch):
    real = llm.engine.step
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
        return real()

    async def main():
        eng = AsyncLLMEngine.from_engine(llm.engine)
        await eng.start()
        monkeypatch.setattr(llm.engine, "step", flaky)
        try:
            with pytest.raises(EngineError, match="injected"):
                await _collect(eng, [5, 6, 7], SP)
            return await _collect(eng, [5, 6, 7], SP)   # served after the failure
        finally:
            await eng.shutdown()

    toks = _run(main())
    monkeypatch.undo()
    assert toks == llm.generate([[5, 6, 7]], SP, use_tqdm=False)[0].token_ids
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_cache_stats_line_is_cumulative_with_its_own_gate(tiny_llama, caplog):
    caplog.set_level(logging.INFO, logger="atom.engine")
    on = LLM(tiny_llama, max_model_len=128, enforce_eager=True, enable_prefix_caching=True,
             enable_log_stats=False, throughput_log_interval=1e-6)
    prompt = list(range(10, 60))               # three full 16-token blocks
    sp = SamplingParams(temperature=0, max_tokens=2)
    on.generate([prompt], sp, use_tqdm=False)
    on.generate([prompt], sp, use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if "[Cache Stats]" in r.getMessage()]
    assert lines and not any("Engine: running" in r.getMessage() for r in caplog.records)
    bm = on.engine.block_manager
    assert lines[-1].endswith(f"{bm.num_hit_tokens} of {bm.num_query_tokens} queried prompt tokens "
                              f"hit ({bm.num_hit_tokens / bm.num_query_tokens:.1%})")
    assert bm.num_hit_tokens >= 48
    caplog.clear()
    off = LLM(tiny_llama, max_model_len=128, enforce_eager=True, throughput_log_interval=1e-6)
    off.generate([prompt], sp, use_tqdm=False)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("Engine: running" in m for m in msgs) and not any("[Cache Stats]" in m for m in msgs)
