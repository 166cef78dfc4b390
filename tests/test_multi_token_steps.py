"""Multi-token steps (draft tokens verified against the target) and streamed step outputs.

A test proposer knows the greedy continuation from a first run without drafts and
proposes right and wrong tokens on purpose; greedy output must not change, rejected
drafts' blocks must go back, and the prefix cache must never hold a rejected token.
"""
import pytest

from atom import LLM, SamplingParams
from atom.model_engine.detokenizer import detokenize_incrementally, stream_text
from atom.model_engine.llm_engine import LLMEngine
from atom.model_engine.proposer import Proposer
from atom.model_engine.sequence import Sequence
from atom.outputs import RequestOutputKind

BS = 16
GREEDY = dict(temperature=0, ignore_eos=True)


def make_llm(path, **kw):
    kw = {"enable_log_stats": False, "num_kvcache_blocks": 64, "kv_cache_block_size": BS,
          "async_scheduling": False, **kw}
    return LLM(path, **kw)


def reference(llm, prompts, max_tokens):
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs)}


class ScriptedProposer:
    """Proposes from the known greedy continuation: by step number, all right, right then
    wrong, or wrong first (wrong = the right token + 1)."""

    def __init__(self, ref: dict, vocab: int, k: int = 3):
        self.ref, self.vocab, self.k, self.calls = ref, vocab, k, 0

    def propose(self, seqs):
        self.calls += 1
        out = []
        for s in seqs:
            cont = self.ref[tuple(s.token_ids[:s.num_prompt_tokens])]
            right = cont[s.num_output_tokens:s.num_output_tokens + self.k]
            drafts = list(right)
            mode = self.calls % 3
            if mode == 1 and len(drafts) > 1:
                drafts[1] = (drafts[1] + 1) % self.vocab
            elif mode == 2 and drafts:
                drafts[0] = (drafts[0] + 1) % self.vocab
            out.append(drafts)
        return out


def test_step_returns_accepted_tokens_and_trims_the_rejected_block(tiny_llama):
    prompt = list(range(20, 50))  # 30 tokens: the step's third query token opens block 2
    llm = make_llm(tiny_llama)
    ref = reference(llm, [prompt], 4)[tuple(prompt)]
    eng = llm.engine
    sch, bm, runner = eng.scheduler, eng.block_manager, eng.runner
    seq = Sequence(prompt, SamplingParams(max_tokens=4, **GREEDY))
    sch.add(seq)
    batch = sch.schedule()
    sch.postprocess(batch, runner.run(batch))          # prefill: seq = prompt + ref[0]
    assert seq.output_token_ids == ref[:1] and len(seq.block_table) == 2
    wrong = (ref[2] + 1) % eng.vocab_size
    seq.draft_token_ids = [ref[1], wrong]               # right, then wrong
    batch = sch.schedule()
    assert batch.num_new_tokens == [3] and batch.num_draft_tokens == 2
    assert len(seq.block_table) == 3                    # slot 32 (the wrong draft) opened block 2
    freed = seq.block_table[2]
    sampled = runner.run(batch)
    assert len(sampled) == 1 and len(sampled[0]) == 3 and sampled[0][:2] == ref[1:3]
    sch.postprocess(batch, sampled)
    assert batch.accepted == [ref[1:3]]                 # the right draft, then the target's token
    assert seq.output_token_ids == ref[:3] and seq.num_computed_tokens == 32
    assert len(seq.block_table) == 2 and freed in bm.free_blocks
    assert bm.num_free_blocks == bm.num_blocks - 2
    assert sch.num_draft_tokens == 2 and sch.num_accepted_drafts == 1
    batch = sch.schedule()                              # a plain decode follows
    sch.postprocess(batch, runner.run(batch))
    assert seq.is_finished and seq.output_token_ids == ref
    assert bm.num_free_blocks == bm.num_blocks


def test_drafts_at_every_position_of_a_decode(tiny_llama):
    """Drafts all right: the step yields k + 1 tokens; a first wrong one: only the target's token."""
    prompt = [7, 8, 9, 10]
    llm = make_llm(tiny_llama)
    ref = reference(llm, [prompt], 8)[tuple(prompt)]
    sch, runner = llm.engine.scheduler, llm.engine.runner
    seq = Sequence(prompt, SamplingParams(max_tokens=8, **GREEDY))
    sch.add(seq)
    batch = sch.schedule()
    sch.postprocess(batch, runner.run(batch))
    seq.draft_token_ids = ref[1:4]
    batch = sch.schedule()
    sch.postprocess(batch, runner.run(batch))
    assert batch.accepted == [ref[1:5]]                 # 3 drafts + the bonus token
    seq.draft_token_ids = [(ref[5] + 1) % 512, ref[6]]
    batch = sch.schedule()
    sch.postprocess(batch, runner.run(batch))
    assert batch.accepted == [ref[5:6]]
    seq.draft_token_ids = ref[6:20]                     # more than max_tokens allows: capped
    batch = sch.schedule()
    assert batch.num_draft_tokens == 1                  # 6 tokens out, 8 allowed: 1 draft + 1
    sch.postprocess(batch, runner.run(batch))
    assert seq.is_finished and seq.output_token_ids == ref and seq.finish_reason == "length"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_output_unchanged_by_a_proposer(tiny_llama, async_scheduling):
    prompts = [[5, 6, 7], list(range(10, 40)), [9] * 20, [300, 301]]
    plain = make_llm(tiny_llama)
    ref = reference(plain, prompts, 24)
    sps = [SamplingParams(max_tokens=n, **GREEDY) for n in (24, 17, 9, 24)]
    expected = plain.generate(prompts, sps, use_tqdm=False)
    llm = make_llm(tiny_llama, async_scheduling=async_scheduling)
    llm.engine.proposer = proposer = ScriptedProposer(ref, llm.engine.vocab_size)
    assert isinstance(proposer, Proposer)
    got = llm.generate(prompts, sps, use_tqdm=False)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in expected]
    sch, bm = llm.engine.scheduler, llm.engine.block_manager
    assert sch.num_accepted_drafts > 0 and sch.num_draft_tokens > sch.num_accepted_drafts
    assert llm.stats.num_steps < plain.stats.num_steps / 2     # steps yield several tokens
    assert bm.num_free_blocks == bm.num_blocks and llm.engine.num_lookahead_steps == 0


def test_sampled_steps_with_drafts_run_to_length(tiny_llama):
    llm = make_llm(tiny_llama)
    ref = reference(llm, [[5, 6, 7]], 12)
    llm.engine.proposer = ScriptedProposer(ref, llm.engine.vocab_size)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3),
                       use_tqdm=False)[0]
    assert out.num_output_tokens == 12 and out.finish_reason == "length"


def published(bm):
    return {b.block_id: b.token_ids for b in bm.blocks if b.hash is not None}


@pytest.mark.parametrize("right_first", [False, True])
def test_prefix_cache_never_publishes_rejected_tokens(tiny_llama, right_first):
    """Prompt 14 tokens: the draft step's query tokens sit at positions 14, 15, 16, so a
    rejected draft at 15 or 16 would land in block 0's last slot or open block 1."""
    prompt = list(range(100, 114))
    llm = make_llm(tiny_llama, enable_prefix_caching=True)
    ref = reference(llm, [prompt], 6)[tuple(prompt)]
    eng = llm.engine
    sch, bm, runner = eng.scheduler, eng.block_manager, eng.runner
    for b in bm.blocks:  # forget what the reference run published
        b.hash, b.token_ids = None, ()
    bm.hash_to_block.clear()
    seq = Sequence(prompt, SamplingParams(max_tokens=6, **GREEDY))
    sch.add(seq)
    batch = sch.schedule()
    sch.postprocess(batch, runner.run(batch))
    wrong = [(t + 1) % 512 for t in ref[1:3]]
    seq.draft_token_ids = [ref[1], wrong[1]] if right_first else [wrong[0], ref[2]]
    batch = sch.schedule()
    sch.postprocess(batch, runner.run(batch))
    full = tuple(prompt + ref)
    for bid, toks in published(bm).items():
        i = seq.block_table.index(bid)
        assert toks == full[i * BS:(i + 1) * BS]     # only confirmed tokens
    if right_first:   # block 0 = prompt + ref[0] + ref[1]: full and confirmed
        assert seq.num_computed_tokens == 16 and list(published(bm)) == [seq.block_table[0]]
    else:             # position 15 was rejected: block 0 is not full yet
        assert seq.num_computed_tokens == 15 and not published(bm)
    while not seq.is_finished:
        batch = sch.schedule()
        sch.postprocess(batch, runner.run(batch))
    assert seq.output_token_ids == ref
    # a prompt sharing block 0 hits it and continues exactly like the reference
    again = eng.add_request(prompt + ref[:3], SamplingParams(max_tokens=3, **GREEDY))
    outs = {}
    while not eng.is_finished():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert outs[again].num_cached_tokens == BS and outs[again].token_ids == ref[3:6]


# --- streamed outputs ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm_tokenizer(smollm2_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)


def test_detokenizer_streams_multibyte_text_whole(smollm_tokenizer):
    tok = smollm_tokenizer
    text = "Café crème, naïve 🙂 — 東京 ünd 🎉!"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # the emoji and CJK take several byte-level tokens
    seq = Sequence([1], SamplingParams())
    pieces = []
    for t in ids:
        seq.append_token(t)
        detokenize_incrementally(tok, seq)
        pieces.append(stream_text(seq)[1])
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text
    assert any(p == "" for p in pieces)  # a half character was held back at least once


def test_streamed_outputs_add_up_to_the_final_ones(tiny_llama, smollm_tokenizer):
    """Several requests at once, each output kind, one with a stop string and one with
    drafts; the tiny model emits byte tokens, so many steps end inside a UTF-8 character."""
    plain = make_llm(tiny_llama)
    prompts = [[5, 6, 7], list(range(200, 230)), [300, 301], [9] * 12, [40, 41, 42]]
    ref = reference(plain, prompts, 20)
    eng = LLMEngine(plain.config, model_runner=plain.engine.runner, tokenizer=smollm_tokenizer,
                    async_scheduling=False)
    eng.proposer = ScriptedProposer(ref, eng.vocab_size)
    stop_text = smollm_tokenizer.decode(ref[tuple(prompts[3])][:12])[-3:]
    kinds = [None, RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, None, RequestOutputKind.FINAL_ONLY]
    rids = []
    for p, kind, stops in zip(prompts, kinds, [None, None, None, [stop_text], None]):
        rids.append(eng.add_request(p, SamplingParams(max_tokens=20, stop_strings=stops, **GREEDY)))
        if kind is not None:
            eng.set_output_kind(rids[-1], kind)
    seen = {r: [] for r in rids}
    while not eng.is_finished():
        for out in eng.step():
            seen[out.request_id].append(out)
    for rid, kind in zip(rids, kinds):
        outs = seen[rid]
        final = outs[-1]
        assert final.finished and not any(o.finished for o in outs[:-1])
        assert "".join(o.new_text for o in outs) == final.text
        assert sum((o.new_token_ids for o in outs), []) == final.token_ids
        if kind is RequestOutputKind.FINAL_ONLY:
            assert len(outs) == 1
        else:
            assert len(outs) > 3 and all(o.new_token_ids for o in outs[:-1])
        if kind is RequestOutputKind.DELTA:
            assert all(o.token_ids == o.new_token_ids and o.text == o.new_text for o in outs[:-1])
        elif kind is not RequestOutputKind.FINAL_ONLY:
            assert all(final.token_ids[:len(o.token_ids)] == o.token_ids for o in outs)
    assert seen[rids[0]][-1].token_ids == ref[tuple(prompts[0])]
    assert any(len(o.new_token_ids) > 1 for o in seen[rids[0]])       # a multi-token step
    assert any(not o.new_text for o in seen[rids[0]][:-1] if o.new_token_ids)  # text held back
    stopped = seen[rids[3]][-1]
    assert stopped.finish_reason == "stop" and stop_text not in stopped.text
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


class RightProposer(ScriptedProposer):
    def propose(self, seqs):
        return [self.ref[tuple(s.token_ids[:s.num_prompt_tokens])][s.num_output_tokens:][:self.k] for s in seqs]


def test_stop_string_in_a_multi_token_step_drops_the_tokens_after_it(tiny_llama, smollm_tokenizer):
    """All drafts right (k=4): after the prefill's token, steps yield tokens 1-5, 6-10, ...
    A stop string completed by a token inside such a list ends the output there."""
    tok = smollm_tokenizer
    plain = make_llm(tiny_llama)
    prompt = [9] * 12
    ref = reference(plain, [prompt], 20)
    ids = ref[tuple(prompt)]
    for c in range(3, 15):  # c tokens: the stop is completed by token c - 1, not a step's last
        full, before = tok.decode(ids[:c]), tok.decode(ids[:c - 1])
        added = len(full) - len(before)
        stop = full[-(added + 1):]
        if ((c - 1) % 5 and added > 0 and full.startswith(before) and "\ufffd" not in full
                and stop.strip() and full.find(stop) == len(full) - len(stop)):
            break
    else:
        pytest.skip(f"no usable stop string in {tok.decode(ids)!r}")
    results = []
    for proposer in (None, RightProposer(ref, 512, k=4)):
        eng = LLMEngine(plain.config, model_runner=plain.engine.runner, tokenizer=tok,
                        async_scheduling=False, proposer=proposer)
        rid = eng.add_request(prompt, SamplingParams(max_tokens=20, stop_strings=[stop], **GREEDY))
        outs = []
        while not eng.is_finished():
            outs += [o for o in eng.step() if o.request_id == rid]
        results.append((outs[-1].token_ids, outs[-1].text, outs[-1].finish_reason))
        assert "".join(o.new_text for o in outs) == outs[-1].text
    assert results[0] == results[1] == (ids[:c], full[:len(full) - len(stop)], "stop")


# --- the scheduler alone (no model) --------------------------------------------------------
def test_scheduler_verifies_drafts_and_stops_token_by_token():
    from atom.model_engine.block_manager import BlockManager
    from atom.model_engine.scheduler import Scheduler
    sch = Scheduler(BlockManager(16, 4), 8, 64, 64)
    sch.eos_token_ids = frozenset({2})
    a = Sequence([5, 6, 7], SamplingParams(temperature=0, max_tokens=10))
    b = Sequence([5, 6, 7], SamplingParams(temperature=0, max_tokens=10))
    for s in (a, b):
        sch.add(s)
    batch = sch.schedule()
    sch.postprocess(batch, [[10], [10]])
    a.draft_token_ids, b.draft_token_ids = [11, 12, 13], [11, 12, 13]
    batch = sch.schedule()
    assert batch.num_new_tokens == [4, 4] and batch.sample_index == [4, 4] and not batch.num_prefill_tokens
    assert a.num_output_tokens == 1 and a.output_token_ids == [10]  # drafts are not output
    assert sch.schedule_lookahead(batch) is None                    # drafts: no look-ahead
    # a: 11 accepted, 12 rejected (the target says 20); b: 11 accepted, then EOS
    sch.postprocess(batch, [[11, 20, 30, 40], [11, 2, 13, 14]])
    assert batch.accepted == [[11, 20], [11, 2]]
    assert a.output_token_ids == [10, 11, 20] and a.num_computed_tokens == 5 and len(a.block_table) == 2
    assert b.is_finished and b.finish_reason == "stop" and b.output_token_ids == [10, 11, 2]
    assert sch.num_draft_tokens == 6 and sch.num_accepted_drafts == 2
    batch = sch.schedule()                                          # a plain decode follows
    assert batch.num_new_tokens == [1] and batch.sample_index == [6]


# --- GPU: CUDA graphs keyed by (batch size, q) ---------------------------------------------
@pytest.mark.gpu
def test_cuda_graphs_replay_multi_token_decodes(tiny_llama):
    """Graphs captured for q = 1 and q = 3 (two drafts a row): decode steps whose rows all
    carry two drafts replay a (bs, 3) graph, and greedy output equals the eager run's."""
    from atom.model_engine.cuda_graphs import CUDAGraphRunner
    prompts = [[5, 6, 7], list(range(10, 40)), [9] * 20, [300, 301]]
    sp = SamplingParams(max_tokens=24, **GREEDY)
    eager = make_llm(tiny_llama, enforce_eager=True)
    ref = reference(eager, prompts, 24)
    llm = make_llm(tiny_llama, max_num_seqs=4, compilation_config={"level": 0, "cudagraph_capture_sizes": [1, 2, 4]})
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.graphs.query_lens == (1,)
    graphs = CUDAGraphRunner(runner, [1, 2, 4], runner.graphs.block_tables.shape[1], query_lens=(1, 3))
    graphs.capture()
    runner.graphs = graphs
    llm.engine.proposer = ScriptedProposer(ref, llm.engine.vocab_size, k=2)
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.token_ids for o in got] == [ref[tuple(p)] for p in prompts]
    assert graphs.replays_by_key[4, 3] > 0 and graphs.last_q is not None
    assert llm.engine.scheduler.num_accepted_drafts > 0
