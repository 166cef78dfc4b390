"""Steps with prefill tokens padded to a token bucket (what a mixed-step CUDA graph runs):
the real tokens' hidden states equal the unpadded step's, padding writes no cache slot, and
an engine whose prefill steps go through the padded buffers gives transformers' tokens.
On the CPU the padded forward runs eagerly under Triton's interpreter (a graph replays the
same launches); tests/test_gpu_engine.py replays the captured graphs on a GPU."""
import pytest
import torch
import transformers
from pandas import isna as pd_isna

from atom import LLM, SamplingParams
from atom.model_engine.mixed_graphs import MixedGraphRunner, bucket_keys, token_buckets
from conftest import hf_greedy
from test_triton_engine import _on_triton

pytest.importorskip("triton")


class EagerReplay:
    """Stands in for a captured graph: replay() runs the bucket's forward on the buffers."""

    def __init__(self, mixed: MixedGraphRunner, key: tuple[int, int]):
        self.mixed, self.key = mixed, key

    def replay(self) -> None:
        self.mixed.run(self.key)


def _mixed(runner, sizes, max_seqs) -> MixedGraphRunner:
    blocks = -(-runner.config.max_model_len // runner.block_size)
    mixed = MixedGraphRunner(runner, sizes, max_seqs, blocks)
    mixed.graphs = {k: EagerReplay(mixed, k) for k in mixed.keys}
    return mixed


def test_token_buckets():
    assert token_buckets(8192) == [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048]
    assert token_buckets(100) == [16, 32, 64, 128]  # the last bucket covers 65..100
    assert token_buckets(16) == [16]
    assert bucket_keys(64, 8) == [(t, r) for t in (16, 32, 64) for r in (1, 4, 8)]
    assert bucket_keys(300, 512)[-6:] == [(384, 1), (384, 4), (384, 16), (384, 64), (384, 256), (384, 384)]
    with pytest.raises(ValueError, match="at least one token size"):
        MixedGraphRunner(None, [], 4, 8)


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_llama"])
def test_padded_step_equals_the_step(model, request):
    """Two prefills and a decode, padded to 32 tokens and 4 or 8 sequence rows: the same hidden
    states on the real tokens, the same KV cache (padding's slot -1 writes nothing)."""
    llm = LLM(request.getfixturevalue(model), enable_log_stats=False, num_kvcache_blocks=32,
              max_num_batched_tokens=64, enforce_eager=True)
    runner = llm.engine.runner
    _on_triton(runner, fused=True)
    seqs, _ = runner.dummy_prefills([5, 11, 3])
    seqs[2].num_computed_tokens, seqs[2].num_new_tokens = 2, 1  # a decode of its third token
    host = runner.prepare_host(seqs)
    t = int(host.cu_seqlens_q[-1])
    assert t == 17
    layers = runner.attn_layers
    with torch.inference_mode():
        ids, pos, meta = runner.to_device(host)
        ref = runner.forward(ids, pos, meta).clone()
        cache_ref = [(a.k_cache.clone(), a.v_cache.clone()) for a in layers]
        for a in layers:
            a.k_cache.zero_()
            a.v_cache.zero_()
        mixed = _mixed(runner, [16, 32], max_seqs=8)
        assert mixed.keys == [(16, 1), (16, 4), (16, 8), (32, 1), (32, 4), (32, 8)]
        assert mixed.bucket(host) == (32, 4)
        outs = []
        for key in ((32, 4), (32, 8)):  # the step's bucket, and one with more spare rows
            mixed.fill(host, key)
            assert mixed.slot_mapping[t:32].eq(-1).all()
            assert mixed.cu_seqlens_q[4:key[1] + 1].eq(t).all() and mixed.seq_lens[3:key[1]].eq(0).all()
            outs.append(mixed.forward(key)[:t].clone())
    for out in outs:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    written = torch.from_numpy(host.slot_mapping)
    rest = torch.ones(layers[0].k_cache.shape[0] * layers[0].k_cache.shape[1], dtype=torch.bool)
    rest[written] = False
    for a, (k_ref, v_ref) in zip(layers, cache_ref):
        for got, want in ((a.k_cache.flatten(0, 1), k_ref.flatten(0, 1)), (a.v_cache.flatten(0, 1), v_ref.flatten(0, 1))):
            assert torch.equal(got[written], want[written]), "the step's k / v differ"
            assert not got[rest].any(), "a padding token wrote the KV cache"


def test_bucket_refuses_what_it_cannot_hold(tiny_qwen3):
    llm = LLM(tiny_qwen3, enable_log_stats=False, num_kvcache_blocks=32, enforce_eager=True)
    runner = llm.engine.runner
    mixed = MixedGraphRunner(runner, [16, 32], max_seqs=4, max_blocks_per_seq=8)
    seqs, _ = runner.dummy_prefills([40])
    assert mixed.bucket(runner.prepare_host(seqs)) is None  # 40 tokens > 32
    seqs, _ = runner.dummy_prefills([2, 2, 2, 2, 2])
    assert mixed.bucket(runner.prepare_host(seqs)) is None  # 5 sequences > 4 rows
    seqs, _ = runner.dummy_prefills([2, 2, 2, 2])
    assert mixed.bucket(runner.prepare_host(seqs)) == (16, 4)
    seqs, _ = runner.dummy_prefills([20])
    assert mixed.bucket(runner.prepare_host(seqs)) == (32, 1)
    assert "MixedGraphRunner(token_sizes=[16, 32], max_seqs=4" in repr(mixed)


def test_engine_with_padded_prefill_steps_gives_transformers_tokens(tiny_qwen3):
    """Prefill and mixed steps (chunked, beside decodes, from the prefix cache) through the
    padded buffers; decodes unpadded; greedy tokens as transformers'."""
    llm = LLM(tiny_qwen3, enable_log_stats=False, num_kvcache_blocks=64, max_num_batched_tokens=32,
              enable_prefix_caching=True, kv_cache_block_size=16)
    runner = llm.engine.runner
    _on_triton(runner, fused=True)
    mixed = runner.mixed_graphs = _mixed(runner, [16, 32], max_seqs=8)
    shared = list(range(100, 120))
    ps = [[5, 6, 7, 8, 9], list(range(10, 50)), shared + [1, 2, 3], shared + [4, 5]]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate(ps[:2], sp, use_tqdm=False) + llm.generate(ps[2:], sp, use_tqdm=False)
    assert sum(mixed.replays.values()) >= 3 and mixed.padded_tokens > 0
    steps = llm.stats.steps()
    assert set(steps.mixed_graph_tokens.dropna().astype(int)) <= {16, 32}
    assert (steps.mixed_graph_tokens.notna() == (steps.prefill_tokens > 0)).all()  # every prefill step, no decode
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 3) for p in ps]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_which_modes_record_mixed_step_graphs(tiny_qwen3):
    """The unset mode: decode and token graphs at level 0, decode graphs only at levels 1-2
    (TR_HYBRID is set at level 3 by the config); on the torch backend there are none."""
    from types import SimpleNamespace

    from atom.compilation_config import CompilationConfig, CUDAGraphMode
    from atom.model_engine.gpu_setup import effective_graph_mode, mixed_graphs_refusal

    def mode(level, eager=False, **kw):
        cc = CompilationConfig(level=level, **kw)
        return effective_graph_mode(SimpleNamespace(enforce_eager=eager, compilation_config=cc, capture_sizes=[1, 2]))
    assert mode(0) is CUDAGraphMode.FULL_AND_TR_HYBRID
    assert mode(0).mixed_mode() is CUDAGraphMode.TR_HYBRID
    assert mode(2) is CUDAGraphMode.FULL_DECODE_ONLY and mode(3) is CUDAGraphMode.TR_HYBRID
    assert mode(0, cudagraph_mode="FULL_DECODE_ONLY").mixed_mode() is CUDAGraphMode.NONE
    assert mode(0, eager=True) is CUDAGraphMode.NONE
    llm = LLM(tiny_qwen3, enable_log_stats=False, num_kvcache_blocks=16)
    assert "torch attention backend" in mixed_graphs_refusal(llm.engine.runner)
    _on_triton(llm.engine.runner)
    assert mixed_graphs_refusal(llm.engine.runner) == ""


def _run(path, padded: bool, prompts, sp, proposer=None, **kw):
    """(outputs, LLM, its MixedGraphRunner or None) of an engine on the Triton backend, its
    prefill steps through padded buckets (`padded`) or as they are."""
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=64, max_num_batched_tokens=32,
              async_scheduling=False, **kw)
    runner = llm.engine.runner
    _on_triton(runner)  # the attention op and its cache write (the plan's other kernels: above)
    mixed = None
    if padded:
        mixed = runner.mixed_graphs = _mixed(runner, [16, 32], max_seqs=4)
    if proposer is not None:
        llm.engine.proposer = proposer(llm)
    return llm.generate(prompts, sp, use_tqdm=False), llm, mixed


def _gpt_oss(tmp_path):
    from tiny_gpt_oss import make_tiny_gpt_oss
    return make_tiny_gpt_oss(tmp_path / "gpt_oss", num_hidden_layers=2)  # a sliding-window and a full layer


@pytest.mark.parametrize("setting", ["gpt_oss", "fp8_kv", "prompt_logprobs", "drafts"])
def test_padded_steps_change_no_output(setting, tiny_llama, tiny_qwen3, tmp_path):
    """Padded prefill steps give the unpadded engine's outputs with attention sinks, sliding
    windows and MoE experts (GPT-OSS), an FP8 KV cache (the first prefill computes the scales
    eagerly: a graph would skip that host code), prompt logprobs, and draft-verification
    steps (1 + k query tokens a sequence)."""
    from conftest import random_prompts
    prompts = random_prompts((5, 20, 37), seed=4)  # the last one chunked: 32 tokens a step
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    path, kw, proposer = tiny_qwen3, {}, None
    if setting == "gpt_oss":
        path = _gpt_oss(tmp_path)
    elif setting == "fp8_kv":
        path, kw = tiny_llama, {"kv_cache_dtype": "fp8"}
    elif setting == "prompt_logprobs":
        sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1, logprobs=1)
    else:
        from test_multi_token_steps import ScriptedProposer, reference
        path = tiny_llama
        ref = reference(LLM(path, enable_log_stats=False, num_kvcache_blocks=64), prompts, 3)
        proposer = lambda llm: ScriptedProposer(ref, llm.engine.vocab_size)  # noqa: E731
    want, _, _ = _run(path, False, prompts, sp, proposer, **kw)
    got, llm, mixed = _run(path, True, prompts, sp, proposer, **kw)
    assert sum(mixed.replays.values()) > 0, mixed
    steps = llm.stats.steps()
    if setting == "drafts":  # steps of decodes with drafts (no prefill tokens) replayed buckets too
        assert (steps.mixed_graph_tokens.notna() & (steps.prefill_tokens == 0)).any()
    if setting == "fp8_kv":  # the first prefill ran eagerly: it computed the scales
        assert pd_isna(steps.mixed_graph_tokens.iloc[0])
        assert all(a.kv_scale_source == "computed" for a in llm.engine.runner.attn_layers), \
            {a.kv_scale_source for a in llm.engine.runner.attn_layers}
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    if setting == "prompt_logprobs":
        for g, w in zip(got, want):
            assert len(g.prompt_logprobs) == len(w.prompt_logprobs)
            for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
                assert a.keys() == b.keys()
                for t in a:
                    assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)


def test_per_tensor_activation_scale_leaves_padding_rows_out():
    """Dynamic per-tensor FP8 / INT8 activation scales take one amax over the rows: in a padded
    graph step the padding rows (whatever memory held: here 1e38 and NaN) are left out."""
    from atom.model_ops.attention import AttentionMetadata, forward_context
    from atom.model_ops.quant.common import tensor_scale
    x = torch.tensor([[1.0, -3.0], [2.0, 0.5], [0.25, 2.5], [-1.0, 1.0], [1e38, 0.0], [float("nan"), 1.0]])
    z = torch.zeros(3, dtype=torch.int32)

    def meta(padded):
        return AttentionMetadata(torch.tensor([0, 2, 4, 4], dtype=torch.int32), z, z.reshape(3, 1),
                                 torch.tensor([5, 6, 7, 8, -1, -1]), 4, 8, padded=padded)
    assert tensor_scale(x, 448.0) != tensor_scale(x, 448.0)  # no context: every row, the NaN too
    with forward_context(meta(padded=True)):
        assert tensor_scale(x, 448.0).item() == pytest.approx(3.0 / 448.0)
        assert tensor_scale(x[:5], 448.0).item() == pytest.approx(1e38 / 448.0, rel=1e-3)  # not token rows: all
    with forward_context(meta(padded=False)):  # an eager step has no padding: every row
        assert torch.isnan(tensor_scale(x, 448.0))
