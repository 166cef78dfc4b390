"""MoE layers over tensor-parallel ranks: experts split by width (tensor parallel) or whole
(`enable_expert_parallel`).

In one process (no collectives): each rank's FusedMoE holds its shard of the checkpoint
(per-expert and fused 3-D tensors, biases, shared experts), and the ranks' partial outputs
summed equal the unsplit layer's; routing statistics count global expert ids. On a CPU with
gloo (a worker process): TP=2 gives the greedy tokens of TP=1 and transformers for tiny
Qwen3-MoE (with and without expert parallel) and Mixtral (expert parallel, fused
checkpoint), the driver's experts are its shard, and routing statistics still add up. DP
attention: the MoE layer across two gloo ranks (threads) gathers unequal token counts and
pairs a dummy step with a real one; two TP=1 replicas give transformers' tokens (experts or
width split over them), also when one idles, and a replica killed mid-run ends the engine
with an error, leaving no process."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from atom import LLM, SamplingParams
from atom.distributed.state import ParallelState, building
from atom.model_ops.linear import MergedLinear, RowParallelLinear
from atom.model_ops.moe import ExpertLoadRecorder, FusedMoE, TopK
from parallel_helpers import PROMPTS, hf_tokens
from tiny_moe import make_tiny_moe

os.environ.setdefault("OMP_NUM_THREADS", "1")  # spawned workers inherit it
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KW = dict(num_kvcache_blocks=32, enable_log_stats=False)
E, H, I, K = 8, 16, 12, 2


def ranks(world, expert_parallel=False):
    return [ParallelState(rank=r, world_size=world, expert_parallel=expert_parallel) for r in range(world)]


class SharedMLP(torch.nn.Module):
    """Shared experts as a model builds them under TP: gate/up column-parallel, down
    row-parallel leaving its sum to the MoE layer."""

    def __init__(self):
        super().__init__()
        self.gate_up = MergedLinear(H, [I, I], prefix="t.shared.gate_up")
        self.down = RowParallelLinear(I, H, prefix="t.shared.down", reduce_results=False)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(g) * u)


def checkpoint(seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    t = {"gate": torch.randn(E, I, H, generator=g) * 0.3, "up": torch.randn(E, I, H, generator=g) * 0.3,
         "down": torch.randn(E, H, I, generator=g) * 0.3,
         "sgate": torch.randn(I, H, generator=g) * 0.3, "sup": torch.randn(I, H, generator=g) * 0.3,
         "sdown": torch.randn(H, I, generator=g) * 0.3}
    if bias:
        t.update(b1=torch.randn(E, I, generator=g), b3=torch.randn(E, I, generator=g), b2=torch.randn(E, H, generator=g))
    return t


def build(state, t, fused=False, bias=False, shared=False):
    with building(state):
        sh = SharedMLP() if shared else None
        moe = FusedMoE(E, H, I, TopK(E, K, renormalize=True), bias=bias, shared_experts=sh, prefix="t.experts")
    if fused:
        moe.w13_weight.weight_loader(moe.w13_weight, torch.cat([t["gate"], t["up"]], 1), (None, "w13"))
        moe.w2_weight.weight_loader(moe.w2_weight, t["down"], (None, "w2"))
    else:
        for e in range(E):
            for part, key, p in (("w1", "gate", moe.w13_weight), ("w3", "up", moe.w13_weight),
                                 ("w2", "down", moe.w2_weight)):
                p.weight_loader(p, t[key][e], (e, part))
    if bias:
        for e in range(E):
            moe.w13_bias.weight_loader(moe.w13_bias, t["b1"][e], (e, "w1"))
            moe.w13_bias.weight_loader(moe.w13_bias, t["b3"][e], (e, "w3"))
            moe.w2_bias.weight_loader(moe.w2_bias, t["b2"][e], (e, "w2"))
    if shared:
        for sid, key in ((0, "sgate"), (1, "sup")):
            sh.gate_up.weight.weight_loader(sh.gate_up.weight, t[key], sid)
        sh.down.weight.weight_loader(sh.down.weight, t["sdown"], None)
    assert moe.missing_shards() == []
    return moe


def inputs(T=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g), torch.randn(T, E, generator=g) * 2


@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused_3d"])
@pytest.mark.parametrize("bias,shared", [(False, False), (True, False), (False, True)],
                         ids=["plain", "bias", "shared"])
def test_tensor_parallel_shards_width_and_sums_to_the_whole(fused, bias, shared):
    t = checkpoint(bias=bias)
    x, logits = inputs()
    ref = build(ParallelState.single(), t, fused, bias, shared)(x, logits)
    parts = [build(s, t, fused, bias, shared) for s in ranks(2)]
    assert [tuple(m.w13_weight.shape) for m in parts] == [(E, I, H)] * 2  # I/2 gate rows + I/2 up rows
    assert [tuple(m.w2_weight.shape) for m in parts] == [(E, H, I // 2)] * 2
    # rank 1's gate rows are the checkpoint's rows [I/2, I) of each expert's gate, then its up rows
    torch.testing.assert_close(parts[1].w13_weight[:, :I // 2], t["gate"][:, I // 2:], rtol=0, atol=0)
    torch.testing.assert_close(parts[1].w13_weight[:, I // 2:], t["up"][:, I // 2:], rtol=0, atol=0)
    torch.testing.assert_close(parts[1].w2_weight, t["down"][:, :, I // 2:], rtol=0, atol=0)
    if bias:  # the down bias is added once: rank 0 holds it
        assert torch.equal(parts[0].w2_bias, t["b2"]) and not parts[1].w2_bias.any()
    assert parts[0].shared_partial is shared
    out = sum(m.rank_output(x, logits) for m in parts)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert "tp=1/2: width 6/12" in repr(parts[1])


@pytest.mark.parametrize("world,expected", [(2, [(0, 4), (4, 4)]), (3, [(0, 3), (3, 3), (6, 2)])])
@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused_3d"])
def test_expert_parallel_holds_whole_local_experts_and_sums_to_the_whole(world, expected, fused):
    t = checkpoint(bias=True)
    x, logits = inputs()
    ref = build(ParallelState.single(), t, fused, bias=True)(x, logits)
    parts = [build(s, t, fused, bias=True) for s in ranks(world, expert_parallel=True)]
    assert [(m.expert_start, m.num_local_experts) for m in parts] == expected
    for m, (start, n) in zip(parts, expected):
        assert tuple(m.w13_weight.shape) == (n, 2 * I, H) and tuple(m.w2_weight.shape) == (n, H, I)
        torch.testing.assert_close(m.w13_weight[:, :I], t["gate"][start:start + n], rtol=0, atol=0)
        torch.testing.assert_close(m.w2_bias, t["b2"][start:start + n], rtol=0, atol=0)  # its own experts' bias
        assert m.num_experts == E and m.intermediate_size == I
    out = sum(m.rank_output(x, logits) for m in parts)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert f"ep=1/{world}: experts [{expected[1][0]}, {sum(expected[1])})" in repr(parts[1])


def test_expert_parallel_routing_stats_count_global_experts():
    t = checkpoint()
    x, logits = inputs(T=20)
    ref = build(ParallelState.single(), t)
    rank1 = build(ranks(2, expert_parallel=True)[1], t)
    recs = [ExpertLoadRecorder([m], "cpu").attach() for m in (ref, rank1)]
    ref(x, logits)
    rank1.rank_output(x, logits)
    a, b = (r.take() for r in recs)
    assert a.shape == b.shape == (1, E) and torch.equal(a, b) and int(a.sum()) == 20 * K


def test_expert_parallel_needs_an_expert_per_rank_and_missing_experts_are_named():
    with pytest.raises(ValueError, match="has 2 experts, fewer than the 3 expert-parallel ranks"):
        with building(ranks(3, expert_parallel=True)[0]):
            FusedMoE(2, H, I, TopK(2, 1), prefix="t.experts")
    with building(ranks(2, expert_parallel=True)[1]):
        moe = FusedMoE(E, H, I, TopK(E, K), prefix="t.experts")
    t = checkpoint()
    for e in range(E):  # rank 1 takes experts 4..7 and skips the rest; leave out expert 6's up rows
        for part, key, p in (("w1", "gate", moe.w13_weight), ("w3", "up", moe.w13_weight),
                             ("w2", "down", moe.w2_weight)):
            if (e, part) != (6, "w3"):
                p.weight_loader(p, t[key][e], (e, part))
    assert moe.missing_shards() == ["t.experts.w13_weight[6].w3"]


def test_tensor_parallel_refuses_a_method_without_shard_dims(monkeypatch):
    from atom.model_ops.moe.method import UnquantizedMoEMethod

    class NoDims(UnquantizedMoEMethod):
        name = "nodims"

        def create_weights(self, layer, num_experts, hidden_size, intermediate_size, bias):
            layer.add_expert_param("w13_weight", torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                   ("w1", "w3"))
            layer.add_expert_param("w2_weight", torch.empty(num_experts, hidden_size, intermediate_size), ("w2",))

    monkeypatch.setattr("atom.model_ops.moe.layer.moe_method_for", lambda qc, prefix: NoDims())
    with building(ranks(2)[0]), pytest.raises(NotImplementedError, match=r"t\.experts\.w13_weight: the nodims MoE "
                                                                        "method does not declare how it shards"):
        FusedMoE(E, H, I, TopK(E, K), prefix="t.experts")
    with building(ranks(2, expert_parallel=True)[0]):  # whole experts need no width split
        assert FusedMoE(E, H, I, TopK(E, K), prefix="t.experts").num_local_experts == 4


# --- engines: TP=2 over gloo, one worker process ---------------------------------------
def tokens(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory):
    path = make_tiny_moe(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")
    return path, hf_tokens(path, PROMPTS, 8)


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "tp_ep"])
def test_tp2_qwen3_moe_matches_tp1_and_transformers(tiny_qwen3_moe, ep):
    path, ref = tiny_qwen3_moe
    with LLM(path, **KW) as tp1:
        assert tokens(tp1) == ref
    with LLM(path, tensor_parallel_size=2, enable_expert_parallel=ep, record_expert_load=True, **KW) as llm:
        assert tokens(llm) == ref
        assert [w.alive for w in llm.engine.executor.workers] == [True]
        moe = llm.engine.runner.model.model.layers[0].mlp.experts  # driver = rank 0
        if ep:  # 8 experts of width 32: rank 0 holds experts 0..3 whole
            assert (moe.expert_start, moe.num_local_experts) == (0, 4)
            assert tuple(moe.w13_weight.shape) == (4, 64, 64) and tuple(moe.w2_weight.shape) == (4, 64, 32)
        else:  # every expert, half its width
            assert tuple(moe.w13_weight.shape) == (8, 32, 64) and tuple(moe.w2_weight.shape) == (8, 64, 16)
        assert tuple(llm.engine.runner.model.model.layers[0].mlp.gate.weight.shape) == (8, 64)  # router replicated
        from atom.viz import moe_layers_frame
        frame = moe_layers_frame(llm)
        assert frame["parallel"].tolist() == ["expert" if ep else "tensor"] * 2 and set(frame["ranks"]) == {2}
        assert frame["local_experts"].tolist() == (["[0, 4)"] * 2 if ep else ["[0, 8)"] * 2)
        assert frame["width"].tolist() == [32 if ep else 16] * 2
        # routing statistics: every token counted top_k times over all 8 experts, each step
        load, steps = llm.stats.expert_load(), llm.stats.steps()
        assert load["expert"].max() == 7
        per = load.groupby(["step", "layer"])["tokens"].sum().unstack()
        n = (steps.set_index("step")["prefill_tokens"] + steps.set_index("step")["decode_tokens"]).loc[per.index]
        assert per[0].tolist() == per[2].tolist() == (n * 2).tolist()


def test_tp2_expert_parallel_mixtral_fused_checkpoint_matches_transformers(tmp_path):
    path = make_tiny_moe(tmp_path, "mixtral", fused=True)
    ref = hf_tokens(path, PROMPTS, 8)
    with LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, **KW) as llm:
        assert tokens(llm) == ref
        moe = llm.engine.runner.model.model.layers[1].mlp.experts
        assert (moe.num_local_experts, tuple(moe.w13_weight.shape)) == (2, (2, 96, 64))


def test_expert_parallel_on_a_dense_model_warns_and_runs(tiny_llama, caplog):
    with caplog.at_level(logging.WARNING, logger="atom.model_engine.model_runner"):
        llm = LLM(tiny_llama, enable_expert_parallel=True, **KW)
    assert "enable_expert_parallel=True has no effect on LlamaForCausalLM: it has no MoE layers" in caplog.text
    assert tokens(llm, PROMPTS[:1]) == hf_tokens(tiny_llama, PROMPTS[:1], 8)


# --- DP attention: the MoE layer across replicas (two gloo ranks in threads) -------------
def run_ranks(world, fn):
    """fn(state) on `world` gloo ranks of one TCP store, each in a thread; their results."""
    import threading
    from atom.distributed.group import init_group, make_store
    store = make_store("127.0.0.1", 0, world, True)
    results, errors = [None] * world, []

    def one(r):
        try:
            s = init_group(r, world, store if r == 0 else make_store("127.0.0.1", store.port, world, False), "cpu",
                           "moe-test", 60)
            results[r] = fn(s)
            s.shutdown()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("ep", [True, False], ids=["experts_split", "width_split"])
def test_moe_across_replicas_gathers_tokens_and_gives_each_its_rows(ep):
    t = checkpoint()
    x, logits = inputs(T=9)
    rows = [slice(0, 6), slice(6, 9)]  # replica 0: 6 tokens, replica 1: 3
    ref = build(ParallelState.single(), t)(x, logits)

    def replica(group):
        group.expert_parallel = ep
        moe = build(ParallelState(moe_group=group), t)
        shapes = (tuple(moe.w13_weight.shape), tuple(moe.w2_weight.shape))
        mine = rows[group.rank]
        out = moe(x[mine], logits[mine])
        empty = moe(x[:0], logits[:0])  # a dummy step of this replica while the other runs its tokens
        return shapes, out, empty

    (s0, out0, e0), (s1, out1, e1) = run_ranks(2, lambda g: replica(g))
    want = ((4, 2 * I, H), (4, H, I)) if ep else ((E, I, H), (E, H, I // 2))
    assert s0 == s1 == want
    torch.testing.assert_close(torch.cat([out0, out1]), ref, rtol=1e-5, atol=1e-5)
    assert e0.shape == e1.shape == (0, H)


def test_moe_across_replicas_pairs_a_dummy_step_with_a_real_one():
    t = checkpoint()
    x, logits = inputs(T=5)
    ref = build(ParallelState.single(), t)(x, logits)

    def replica(group):
        group.expert_parallel = True
        moe = build(ParallelState(moe_group=group), t)
        return moe(x, logits) if group.rank == 1 else moe(x[:0], logits[:0])

    idle, busy = run_ranks(2, replica)
    assert idle.shape == (0, H)
    torch.testing.assert_close(busy, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ep", [True, False], ids=["experts_split", "width_split"])
def test_dp2_attention_qwen3_moe_matches_transformers(tiny_qwen3_moe, ep):
    path, ref = tiny_qwen3_moe
    with LLM(path, data_parallel_size=2, enable_dp_attention=True, enable_expert_parallel=ep, **KW) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert {o.dp_rank for o in outs} == {0, 1}  # both replicas served
        # one request: replica 1 (or 0) idles in dummy steps while the other decodes
        assert tokens(llm, PROMPTS[1:2]) == ref[1:2]
        if ep:  # a replica killed while the other decodes (it idles in lockstep): an error, no hang
            import signal
            import threading
            from atom.distributed.data_parallel import ReplicaFailure
            from parallel_helpers import wait_gone
            pids = [p.pid for p in llm.engine.procs.values()]
            threading.Timer(0.3, os.kill, (pids[1], signal.SIGKILL)).start()
            long = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
            with pytest.raises(ReplicaFailure, match=r"data-parallel replica [01] "):
                llm.generate([[5, 6, 7]], long, use_tqdm=False)
            llm.shutdown()
            assert wait_gone(pids) == []


def test_dp_attention_refusals(tiny_qwen3_moe, monkeypatch):
    """Refused before any model (or replica) is built."""
    from atom.model_engine.model_runner import ModelRunner
    monkeypatch.setattr(ModelRunner, "__init__", lambda *a, **k: pytest.fail("ModelRunner built"))
    monkeypatch.setattr("atom.distributed.data_parallel.start_replicas", lambda *a, **k: pytest.fail("replicas"))
    path, _ = tiny_qwen3_moe
    with pytest.raises(ValueError, match="enable_dp_attention=True is invalid with data_parallel_size=1"):
        LLM(path, enable_dp_attention=True)
    with pytest.raises(ValueError, match=r"enable_dp_attention=True is not implemented.*tensor_parallel_size=1 "
                                         r"\(got 2\)"):
        LLM(path, enable_dp_attention=True, data_parallel_size=2, tensor_parallel_size=2)


@pytest.mark.parametrize("T", [11, 2], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("ep", [False, True], ids=["tensor", "expert"])
def test_rank_shards_run_on_the_triton_experts_kernel(ep, T):
    """The plan's Triton kernel (interpreted) on each rank's shard: local expert ids, the
    sharded width, the tiles of the local shape; the sum is the whole layer's."""
    from atom.tuning.plan import KernelPlan
    t = checkpoint()
    x, logits = inputs(T=T)
    ref = build(ParallelState.single(), t)(x, logits)
    parts = [build(s, t) for s in ranks(2, expert_parallel=ep)]
    plan = KernelPlan(moe_kernel="triton")
    for m in parts:
        m.plan = plan
    out = sum(m.rank_output(x, logits) for m in parts)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert (parts[0].tiles.experts, parts[0].tiles.width) == ((4, I) if ep else (E, I // 2))
