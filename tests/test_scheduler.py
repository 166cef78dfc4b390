"""Scheduler on the real classes: budgets, chunked prefill, mixing, preemption, stops."""
import pytest

from atom.model_engine.block_manager import BlockManager
from atom.model_engine.scheduler import Scheduler
from atom.model_engine.sequence import Sequence, SequenceStatus
from atom.sampling_params import SamplingParams


def make(num_blocks=64, block=4, seqs=8, tokens=32, max_len=256, prefix=False):
    return Scheduler(BlockManager(num_blocks, block, prefix), seqs, tokens, max_len)


def step(sch, token=7):
    batch = sch.schedule()
    sampled = [[token] if s.samples_this_step else [] for s in batch.seqs]
    finished = sch.postprocess(batch, sampled)
    return batch, finished


def sp(n=4, **kw):
    return SamplingParams(temperature=0, max_tokens=n, **kw)


def test_chunked_prefill_under_token_budget():
    sch = make(tokens=16)
    s = Sequence(list(range(40)), sp())
    sch.add(s)
    chunks = []
    while s.num_output_tokens == 0:
        b, _ = step(sch)
        chunks.append(b.seqs[0].num_computed_tokens)
    assert chunks == [16, 32, 40]


def test_prefill_and_decode_share_a_batch():
    sch = make(tokens=20)
    a = Sequence(list(range(5)), sp(10))
    sch.add(a)
    step(sch)                       # a prefilled, has 1 output token
    b = Sequence(list(range(100, 140)), sp())
    sch.add(b)
    batch, _ = step(sch)
    assert [s.num_computed_tokens for s in batch.seqs] == [6, 19]  # a decoded 1, b got 19
    assert batch.seqs[0] is a and batch.seqs[1] is b


def test_decode_batches_run_longest_context_first():
    """A decode-only batch is ordered by descending context (ties keep their order), with its
    per-sequence lists permuted alike; a batch with prefill tokens keeps the schedule order."""
    sch = make(num_blocks=128, tokens=1000)
    seqs = [Sequence(list(range(n)), sp(8)) for n in (5, 30, 12, 30)]
    for s in seqs:
        sch.add(s)
    prefill, _ = step(sch)
    assert prefill.seqs == seqs and prefill.num_new_tokens == [5, 30, 12, 30]
    decode, _ = step(sch)
    assert decode.seqs == [seqs[1], seqs[3], seqs[2], seqs[0]]
    assert decode.num_new_tokens == [1] * 4
    assert decode.sample_index == [s.num_tokens - 1 for s in decode.seqs]  # each row's own slot


def test_lookahead_steps_run_longest_context_first():
    """The look-ahead step after a prefill batch (where all prompts completed, in schedule
    order) is ordered longest first too: in the steady state only look-ahead steps run."""
    sch = make(num_blocks=128, tokens=1000)
    seqs = [Sequence(list(range(n)), sp(8)) for n in (5, 30, 12)]
    for s in seqs:
        sch.add(s)
    prefill = sch.schedule()
    assert prefill.seqs == seqs
    sch.advance(prefill)
    ahead = sch.schedule_lookahead(prefill)
    assert ahead is not None and ahead.seqs == [seqs[1], seqs[2], seqs[0]]


def test_max_num_seqs():
    sch = make(seqs=2, tokens=1000)
    for i in range(3):
        sch.add(Sequence([i + 1] * 3, sp()))
    batch, _ = step(sch)
    assert len(batch) == 2 and len(sch.waiting) == 1


def test_max_tokens_and_eos_and_stop_ids():
    sch = make()
    sch.eos_token_ids = frozenset({2})
    a = Sequence([5, 6], sp(3))
    b = Sequence([5, 6], sp(10))
    c = Sequence([5, 6], sp(10, ignore_eos=True))
    d = Sequence([5, 6], sp(10, ignore_eos=True, stop_token_ids=[9]))
    for s in (a, b, c, d):
        sch.add(s)
    step(sch, token=7)
    step(sch, token=7)
    _, fin = step(sch, token=7)
    assert a in fin and a.finish_reason == "length" and a.num_output_tokens == 3
    _, fin = step(sch, token=2)
    assert b in fin and b.finish_reason == "stop"
    assert c not in fin
    _, fin = step(sch, token=9)
    assert d in fin and d.finish_reason == "stop" and c.status == SequenceStatus.RUNNING


def test_preemption_by_recompute_when_blocks_run_out():
    sch = make(num_blocks=10, block=4, tokens=64)
    a = Sequence(list(range(10)), sp(20, ignore_eos=True))
    b = Sequence(list(range(10)), sp(20, ignore_eos=True))
    sch.add(a)
    sch.add(b)
    step(sch)                    # 3 + 3 blocks; both grow to 8 blocks > 10
    preempted = 0
    for _ in range(20):
        batch, _ = step(sch)
        preempted += batch.num_preempted
    assert preempted >= 1 and sch.num_preemptions >= 1
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    # the preempted sequence kept its generated tokens and recomputes them
    while not sch.is_finished():
        step(sch)
    assert a.num_output_tokens == 20 and b.num_output_tokens == 20
    assert sch.block_manager.num_free_blocks == 10


def test_too_long_prompt_rejected_alone():
    sch = make(max_len=16)
    with pytest.raises(ValueError, match="max_model_len=16"):
        sch.add(Sequence(list(range(20)), sp()))
    ok = Sequence([1, 2, 3], sp(2))
    sch.add(ok)
    while not sch.is_finished():
        step(sch)
    assert ok.num_output_tokens == 2


def test_generation_capped_by_max_model_len():
    sch = make(max_len=8)
    s = Sequence(list(range(6)), sp(100, ignore_eos=True))
    sch.add(s)
    while not sch.is_finished():
        step(sch)
    assert s.num_tokens == 8 and s.finish_reason == "length"


def test_delay_factor_holds_new_prompts_back():
    sch = make(tokens=100)
    sch.scheduler_delay_factor = 1000.0
    a = Sequence([1, 2, 3], sp(50, ignore_eos=True))
    sch.add(a)
    b0 = sch.schedule()
    sch.postprocess(b0, [[7]], step_latency=1.0)  # a prompt step took "1 s"
    b = Sequence([4, 5, 6], sp())
    sch.add(b)
    batch, _ = step(sch)
    assert b not in batch.seqs and b in sch.waiting


def test_abort_frees_blocks():
    sch = make()
    s = Sequence(list(range(9)), sp())
    sch.add(s)
    step(sch)
    sch.finish(s, "abort")
    assert s.finish_reason == "abort" and sch.block_manager.num_free_blocks == 64
    assert sch.is_finished()


def test_prefix_hits_skip_computation():
    sch = make(block=4, prefix=True, tokens=100)
    a = Sequence(list(range(13)), sp(1))
    sch.add(a)
    while not sch.is_finished():
        step(sch)
    b = Sequence(list(range(13)), sp(1))
    sch.add(b)
    batch, _ = step(sch)
    assert b.num_cached_tokens == 12 and batch.num_tokens == 1


def test_sequence_outgrowing_the_whole_cache_finishes_as_length():
    sch = make(num_blocks=3, block=4)
    s = Sequence(list(range(10)), sp(50, ignore_eos=True))
    sch.add(s)
    finished = []
    for _ in range(10):
        finished += step(sch)[1]
        if sch.is_finished():
            break
    assert finished == [s] and s.finish_reason == "length" and s.num_tokens == 13  # 12 slots + the last sampled token
    assert sch.block_manager.num_free_blocks == 3


def test_a_forked_completion_that_waits_keeps_its_shared_blocks():
    """n > 1: a completion forked onto its parent's prompt blocks that cannot be admitted
    (no free block for the rest of its prompt) keeps the shared blocks while it waits, and
    computes only the tokens after them once admitted (before: it dropped them and
    recomputed the whole prompt)."""
    bm = BlockManager(3, 16)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = list(range(1, 41))  # 40 tokens: 3 blocks, the first 2 full ones shareable
    parent, child = Sequence(ids, sp), Sequence(ids, sp)
    child.index, parent.forks = 1, [child]
    sched.add(parent)
    sched.postprocess(sched.schedule(), [[7]])  # the prompt's K/V exist: the child is forked
    assert child.block_table == parent.block_table[:2] and child.num_computed_tokens == 32
    batch = sched.schedule()  # the parent decodes; the child finds no free block for tokens 32-39
    assert batch.seqs == [parent] and child in sched.waiting
    assert child.block_table == parent.block_table[:2] and child.num_computed_tokens == 32
    sched.finish(parent, "length")
    batch = sched.schedule()
    assert batch.seqs == [child] and batch.num_new_tokens == [8]  # only the tokens after the shared blocks
