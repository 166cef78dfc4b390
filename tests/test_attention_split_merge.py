"""The split-KV merge inside the attention kernel (`unified_attention(merge_in_kernel=True)`,
`attention.split_merge`) against the two-launch path (the segments, then `_merge_kernel`) and
the torch reference: the same output and amax, the arrival counters back at 0 after every
launch, prefills left to the merge kernel, and the plan's "merge_in_attention" reaching the
kernel from an engine. CPU cases run under Triton's interpreter; GPU cases are marked gpu."""
import pytest
import torch

from test_triton_kernels import CPU, GPU, _check_close, _make_batch  # noqa: E402  (sets TRITON_INTERPRET)

from atom.model_ops.attention import split_merge, triton_unified  # noqa: E402
from atom.model_ops.attention.triton_unified import (AttentionWorkspace, DecodeRope,  # noqa: E402
                                                     paged_attention_ref, unified_attention)


def _args(batch, max_query_len=1):
    return dict(cu_seqlens_q=batch["cu_seqlens_q"], seq_lens=batch["seq_lens"], block_tables=batch["block_tables"],
                softmax_scale=batch["softmax_scale"], max_query_len=max_query_len)


def _both(batch, splits, ws, amax=False, rope=None, max_query_len=1):
    """(two launches, in-kernel merge): each (out, amax or None), same inputs and caches."""
    res = []
    for merge in (False, True):
        q = batch["q"]
        kc, vc = batch["k_cache"].clone(), batch["v_cache"].clone()
        out = torch.full_like(q, float("nan"))
        am = torch.full(q.shape[:2], -1.0, device=q.device) if amax else None
        unified_attention(q, kc, vc, out, **_args(batch, max_query_len), workspace=ws, num_kv_splits=splits,
                          amax=am, rope=rope, merge_in_kernel=merge)
        res.append((out, am, kc, vc))
    return res


def _assert_same(two, one, n, dtype, what):
    # the in-kernel merge's sums may run in another order than the merge kernel's: within fp32
    # rounding before the output's, so a step of the output dtype at most
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(one[0][:n], two[0][:n], atol=tol, rtol=tol, msg=what)
    if two[1] is not None:
        torch.testing.assert_close(one[1][:n], two[1][:n], atol=tol, rtol=tol, msg=what + " amax")
        assert torch.equal(one[1][n:], two[1][n:]), what + ": padding's amax untouched"
    assert torch.isnan(one[0][n:]).all(), what + ": padding tokens untouched"


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("splits", [2, 8])
@pytest.mark.parametrize("D,Hkv,qpkv,bs,dtype", [(64, 2, 2, 16, torch.float32), (32, 1, 3, 16, torch.float16),
                                                 (64, 2, 4, 32, torch.float32)])
@pytest.mark.parametrize("skip_empty", [False, True])
def test_in_kernel_merge_matches_the_merge_launch(device, D, Hkv, qpkv, bs, dtype, splits, skip_empty, monkeypatch):
    monkeypatch.setattr(triton_unified, "SKIP_EMPTY_SEGMENTS", skip_empty)
    kinds = ["decode", "decode", "empty", (1, 1), "decode", (1, 70)]  # a 1-token context; more splits than tiles
    batch = _make_batch(kinds, Hkv * qpkv, Hkv, D, bs, dtype, device, 90, seed=D + qpkv + splits, pad_tokens=2)
    ws = AttentionWorkspace(16, Hkv * qpkv, D, device=device)
    two, one = _both(batch, splits, ws, amax=True)
    n = int(batch["cu_seqlens_q"][-1])
    what = f"D={D} kv={Hkv} g={qpkv} splits={splits}"
    _assert_same(two, one, n, dtype, what)
    ref = paged_attention_ref(batch["q"], batch["k_cache"], batch["v_cache"], torch.empty_like(batch["q"]),
                              **_args(batch))
    _check_close(one[0][:n], ref[:n], dtype, what)
    assert not ws.arrival_counts.any(), "every counter back at 0 for the next launch"
    again = _both(batch, splits, ws, amax=True)[1]
    assert torch.equal(again[0][:n], one[0][:n]), "a second launch on the same counters"


@pytest.mark.parametrize("device", [CPU])
def test_segments_without_keys_store_nothing(device, monkeypatch):
    """With the opt-in SKIP_EMPTY_SEGMENTS a short context's segments past its first n_seg (those
    without keys) store nothing (their scratch keeps its NaNs), and the merge counts and reads
    only those n_seg."""
    monkeypatch.setattr(triton_unified, "SKIP_EMPTY_SEGMENTS", True)
    D, Hkv, qpkv, splits = 64, 2, 2, 8
    kinds = [(1, 1), (1, 70), (1, 200), (1, 600)]  # 1, 2, 4 and 10 tiles of 64 keys
    batch = _make_batch(kinds, Hkv * qpkv, Hkv, D, 16, torch.float32, device, 600, seed=3)
    ws = AttentionWorkspace(8, Hkv * qpkv, D, device=device)
    ws.partial_out.fill_(float("nan"))
    ws.partial_lse.fill_(float("nan"))
    out = torch.full_like(batch["q"], float("nan"))
    unified_attention(batch["q"], batch["k_cache"], batch["v_cache"], out, **_args(batch), workspace=ws,
                      num_kv_splits=splits, merge_in_kernel=True)
    ref = paged_attention_ref(batch["q"], batch["k_cache"], batch["v_cache"], torch.empty_like(batch["q"]),
                              **_args(batch))
    _check_close(out, ref, torch.float32, "segments without keys")
    tile = triton_unified.pick_attention_config(4, 4, Hkv * qpkv, Hkv, D, 1, torch.device(device))["TILE_N"]
    assert tile == 64
    for b, n_seg in enumerate([1, 2, 4, 5]):  # 10 tiles: 2 a segment, so 5 of the 8 have keys
        assert not ws.partial_lse[b, :, :n_seg].isnan().any(), f"seq {b}: its {n_seg} segments stored"
        assert ws.partial_lse[b, :, n_seg:].isnan().all(), f"seq {b}: segments {n_seg}.. stored nothing"
        assert ws.partial_out[b, :, n_seg:].isnan().all(), f"seq {b}: segments {n_seg}.. stored nothing"
    assert not ws.arrival_counts.any(), "every counter back at 0 for the next launch"


@pytest.mark.parametrize("device", [CPU])
def test_skip_empty_needs_the_in_kernel_merge(device):
    """A call asking for "skip_empty" where no in-kernel merge runs (the merge launch, or one
    split) is refused, naming the field, before anything runs."""
    batch = _make_batch(["decode", (1, 70)], 4, 2, 64, 16, torch.float32, device, 80, seed=6)
    out = torch.full_like(batch["q"], float("nan"))
    for merge, splits in ((False, 4), (True, 1)):
        with pytest.raises(ValueError, match=r"config\['skip_empty'\]=True needs the in-kernel merge"):
            unified_attention(batch["q"], batch["k_cache"], batch["v_cache"], out, **_args(batch),
                              num_kv_splits=splits, merge_in_kernel=merge, config=dict(skip_empty=True))
    assert out.isnan().all()


@pytest.mark.parametrize("device", [CPU])
def test_merge_in_chunks_of_segments(device, monkeypatch):
    """Fewer segments a chunk than the step has (`merge_chunk`): the same output."""
    monkeypatch.setattr(split_merge, "MERGE_CHUNK_ELEMS", 4 * 2 * 64)
    assert split_merge.merge_chunk(4, 8, 64) == 2
    batch = _make_batch(["decode", "decode", (1, 60)], 8, 2, 64, 16, torch.float32, device, 80, seed=5)
    ws = AttentionWorkspace(8, 8, 64, device=device)
    two, one = _both(batch, 8, ws)
    _assert_same(two, one, 3, torch.float32, "chunks of 2 segments")


def test_merge_chunk_bounds_the_registers():
    assert split_merge.merge_chunk(4, 16, 128) == 16  # Llama's 4 query heads a kv head, 16 segments: one chunk
    assert split_merge.merge_chunk(8, 16, 128) == 8
    assert split_merge.merge_chunk(3, 16, 128) == 16  # 3 heads pad to 4
    assert split_merge.merge_chunk(16, 4, 256) == 2
    assert split_merge.merge_chunk(64, 2, 256) == 1  # never below one segment


@pytest.mark.parametrize("device", [CPU])
def test_in_kernel_merge_with_the_rotary_folded_in(device):
    """Decode with `DecodeRope`: the program that writes the token's k / v may be any segment;
    the merge still sees every segment's partial."""
    D, Hkv, qpkv, bs = 64, 2, 2, 16
    batch = _make_batch(["decode", "decode", (1, 40)], Hkv * qpkv, Hkv, D, bs, torch.float32, device, 60, seed=9)
    T = batch["q"].shape[0]
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(T, Hkv, D, generator=g).to(device) for _ in range(2))
    sl, bt = batch["seq_lens"].cpu(), batch["block_tables"].cpu()
    slots = torch.tensor([int(bt[b, (int(sl[b]) - 1) // bs]) * bs + (int(sl[b]) - 1) % bs for b in range(T)])
    pos = torch.arange(64, dtype=torch.float32)[:, None] / (10000 ** (torch.arange(0, D, 2) / D))[None, :]
    cs = torch.cat((pos.cos(), pos.sin()), dim=-1).to(device)
    rope = DecodeRope(cs, k, v, slots.to(device))
    two, one = _both(batch, 4, AttentionWorkspace(8, Hkv * qpkv, D, device=device), rope=rope)
    _assert_same(two, one, T, torch.float32, "rope")
    assert torch.equal(one[2], two[2]) and torch.equal(one[3], two[3]), "the same cache writes"


@pytest.mark.parametrize("device", [CPU])
def test_prefill_steps_keep_the_merge_launch(device, monkeypatch):
    """A step with more than one query token (forced splits) merges in `_merge_kernel`: the
    in-kernel merge is for decode steps, whose query blocks hold one token."""
    launched = []
    real = triton_unified._merge_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]
    monkeypatch.setattr(triton_unified, "_merge_kernel", Spy())
    batch = _make_batch(["prefill", "decode"], 4, 2, 32, 16, torch.float32, device, 40, seed=4)
    ws = AttentionWorkspace(64, 4, 32, device=device)
    mq = int((batch["cu_seqlens_q"][1:] - batch["cu_seqlens_q"][:-1]).max())
    two, one = _both(batch, 2, ws, max_query_len=mq)
    assert len(launched) == 2, "both paths launched the merge kernel for a prefill step"
    _assert_same(two, one, int(batch["cu_seqlens_q"][-1]), torch.float32, "prefill")
    launched.clear()
    dec = _make_batch(["decode", "decode"], 4, 2, 32, 16, torch.float32, device, 40, seed=4)
    _both(dec, 2, ws)
    assert len(launched) == 1, "a decode step merged in the kernel launches no merge kernel"


def test_workspace_counters_and_their_bound():
    ws = AttentionWorkspace(4, 8, 64)
    assert ws.arrivals(64).shape == (64,) and ws.arrivals(65) is None
    assert ws.arrival_counts.dtype == torch.int32 and not ws.arrival_counts.any()
    assert "MiB" in repr(ws)


def test_plan_names_the_fusion():
    from types import SimpleNamespace

    from atom.model_ops.attention.triton_backend import _merge_in_kernel
    from atom.tuning.plan import KernelPlan
    meta = SimpleNamespace(plan=None)
    assert not _merge_in_kernel(meta)
    meta.plan = KernelPlan(backend="triton", fusions=("merge_in_attention",))
    assert _merge_in_kernel(meta)
    meta.plan = KernelPlan(backend="triton")
    assert not _merge_in_kernel(meta)


def test_engine_with_the_merge_in_attention(tiny_llama, monkeypatch):
    """An engine with "merge_in_attention" (a GPU default; the interpreter on CPU) and one
    without it: with it, its decode steps ask the kernel to merge and launch no merge kernel,
    and the tokens of both are transformers'."""
    import transformers

    from atom import LLM, SamplingParams
    from atom.model_ops import kernel_backend, kernels
    from atom.model_ops.attention import triton_backend
    from atom.model_ops.attention.triton_backend import TritonAttentionBackend
    from atom.tuning.fusions import default_fusions
    from atom.tuning.launches import KernelLaunches
    from atom.tuning.plan import KernelPlan
    from conftest import hf_greedy
    llm = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=32, max_num_batched_tokens=32)
    runner = llm.engine.runner
    runner.set_attention_backend(TritonAttentionBackend(runner.attn_layers, 64, runner.device))
    monkeypatch.setattr(kernel_backend, "get", lambda x: kernels)
    asked, real = [], triton_backend.unified_attention
    monkeypatch.setattr(triton_backend, "unified_attention",
                        lambda *a, **kw: asked.append((a[8], kw["merge_in_kernel"])) or real(*a, **kw))
    ps = [[5, 6, 7, 8, 9], list(range(10, 30))]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens, merges = {}, {}
    assert "merge_in_attention" in default_fusions("triton")
    without = tuple(f for f in default_fusions("triton") if f != "merge_in_attention")
    for extra in ((), ("merge_in_attention",)):
        runner.install_plan(KernelPlan(backend="triton", fusions=without + extra, force_kernels=True))
        asked.clear()
        with KernelLaunches() as trace:
            tokens[extra] = [o.token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
        merges[extra] = trace.counts().get("_merge_kernel", 0)
        assert any(mq == 1 for mq, _ in asked) and all(merge == bool(extra) for _, merge in asked)
    layers = len(runner.attn_layers)
    assert merges[()] >= 3 * layers and merges[("merge_in_attention",)] == 0, merges
    assert not runner.attn_backend.workspace.arrival_counts.any()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    assert tokens[()] == tokens[("merge_in_attention",)] == [hf_greedy(hf, p, 4) for p in ps]


@pytest.mark.parametrize("device", [GPU])
@pytest.mark.parametrize("splits", [2, 4, 16])
@pytest.mark.parametrize("D,Hkv,qpkv,bs", [(128, 8, 4, 16), (128, 8, 2, 16), (64, 2, 8, 64), (128, 4, 6, 32)])
@pytest.mark.parametrize("skip_empty", [False, True])
def test_gpu_in_kernel_merge_matches_the_merge_launch(device, D, Hkv, qpkv, bs, splits, skip_empty, monkeypatch):
    """Many programs count in on their counters at once (40 decode sequences, a long one; the
    splits forced: the rule would run this batch unsplit); with SKIP_EMPTY_SEGMENTS, short
    contexts' segments without keys do not."""
    monkeypatch.setattr(triton_unified, "SKIP_EMPTY_SEGMENTS", skip_empty)
    kinds = ["decode"] * 40 + ["empty", (1, 1), (1, 4000)]
    for dtype in (torch.bfloat16, torch.float32):
        batch = _make_batch(kinds, Hkv * qpkv, Hkv, D, bs, dtype, device, 4096, seed=D + bs, pad_tokens=3)
        ws = AttentionWorkspace(64, Hkv * qpkv, D, device=device)
        two, one = _both(batch, splits, ws, amax=True)
        n = int(batch["cu_seqlens_q"][-1])
        _assert_same(two, one, n, dtype, f"D={D} kv={Hkv} g={qpkv} splits={splits} {dtype}")
        assert not ws.arrival_counts.any()


@pytest.mark.parametrize("device", [GPU])
def test_gpu_in_kernel_merge_in_a_cuda_graph(device):
    """Replays of one captured launch (counters reset by each) give the first launch's output."""
    D, Hkv, qpkv = 128, 8, 4
    batch = _make_batch(["decode"] * 2 + [(1, 900)], Hkv * qpkv, Hkv, D, 16, torch.bfloat16, device, 2000, seed=3)
    ws = AttentionWorkspace(8, Hkv * qpkv, D, device=device)
    out = torch.empty_like(batch["q"])

    def step():
        unified_attention(batch["q"], batch["k_cache"], batch["v_cache"], out, **_args(batch), workspace=ws,
                          merge_in_kernel=True)
    step()
    torch.cuda.synchronize()
    first = out.clone()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        step()
        with torch.cuda.graph(g, stream=s):
            step()
    torch.cuda.synchronize()
    for _ in range(5):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
    assert not ws.arrival_counts.any()
