"""Engine outputs at the edges: a stop string completed by the last allowed token, and a
request that outgrows the whole KV cache while it runs alone."""
import logging

from atom import LLM, SamplingParams
from atom.outputs import RequestOutputKind


def test_stop_string_completed_by_the_last_allowed_token_wins():
    llm = LLM("embedded", enable_log_stats=False)
    tok = llm.tokenizer
    prompt = "Once upon a time"
    ids = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].token_ids
    # the largest n whose last token adds text, and a stop string ending exactly there
    for n in range(len(ids), 2, -1):
        full, before = tok.decode(ids[:n]), tok.decode(ids[:n - 1])
        added = len(full) - len(before)
        stop = full[-(added + 2):]
        if full.startswith(before) and added > 0 and stop.strip() and full.find(stop) == len(full) - len(stop):
            break
    else:
        raise AssertionError(f"no usable stop string in {tok.decode(ids)!r}")
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        llm.engine.default_output_kind = kind
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, stop_strings=[stop]),
                           use_tqdm=False)[0]
        assert out.finish_reason == "stop", (n, stop, out.text)
        assert out.text == full[:len(full) - len(stop)] and out.token_ids == ids[:n]
    # the case reported: "metropolis" completed by the 10th token
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_strings=["metropolis"]),
                       use_tqdm=False)[0]
    assert tok.decode(out.token_ids).endswith("metropolis")
    assert out.finish_reason == "stop" and out.text == ", the city of Nova Haven was a thriving "


def test_request_outgrowing_the_whole_cache_comes_out_finished(tiny_llama, caplog):
    llm = LLM(tiny_llama, enable_log_stats=False, max_model_len=256, num_kvcache_blocks=4,
              async_scheduling=False)
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="atom.model_engine.scheduler"):
        out = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0]
    assert out.finish_reason == "length" and out.num_output_tokens == 4 * 16 - 3 + 1
    assert any("outgrew the whole KV cache" in r.getMessage() for r in caplog.records)
    eng, bm = llm.engine, llm.engine.block_manager
    assert eng.is_finished() and not eng.requests and bm.num_free_blocks == bm.num_blocks
    # driving the engine directly: the finished output comes out of step()
    rid = eng.add_request([5, 6, 7], sp)
    outs = []
    while not eng.is_finished():
        outs += eng.step()
    final = [o for o in outs if o.finished]
    assert [o.request_id for o in final] == [rid] and final[0].finish_reason == "length"
    assert final[0].token_ids == out.token_ids
    assert sum((o.new_token_ids for o in outs), []) == out.token_ids
    assert not eng.requests and bm.num_free_blocks == bm.num_blocks
