"""Decode attention with the rotary embedding folded in (`unified_attention(..., rope=
DecodeRope(...))`) against the two-step reference: the rotary embedding with its cache write
(Qwen3's q/k norm included), then paged attention. Output and the whole caches must agree,
unsplit and split (where only one program of a sequence writes its token). CPU cases run
under Triton's interpreter; GPU cases are marked gpu."""

import pytest
import torch

from test_triton_kernels import CPU, GPU, _check_close, _make_batch  # noqa: E402  (sets TRITON_INTERPRET)

from atom.model_ops.attention.triton_unified import DecodeRope, paged_attention_ref, unified_attention  # noqa: E402
from atom.model_ops.kernels import rotary_embedding_ref  # noqa: E402
from atom.model_ops.kernels.split_k import split_k_sum  # noqa: E402


def _cos_sin(max_pos, D):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    f = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return torch.cat((f.cos(), f.sin()), dim=-1)


def _case(device, D, Hkv, qpkv, bs, dtype, splits, qk_norm, kinds, max_ctx, seed):
    Hq = Hkv * qpkv
    batch = _make_batch(kinds, Hq, Hkv, D, bs, dtype, device, max_ctx, seed=seed)
    T = batch["q"].shape[0]
    g = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dtype).to(device)  # packed, as the layer has it
    q, k, v = (t.view(T, -1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1))
    cu, sl, bt = (batch[n].cpu() for n in ("cu_seqlens_q", "seq_lens", "block_tables"))
    pos, slots = torch.zeros(T, dtype=torch.int64), torch.zeros(T, dtype=torch.int64)
    for b in range(len(sl)):
        for t in range(int(cu[b]), int(cu[b + 1])):  # one token per decode sequence
            p = int(sl[b]) - 1
            pos[t], slots[t] = p, int(bt[b, p // bs]) * bs + p % bs
    slots[0] = -1  # a token whose k / v are not written (padding's slot): both paths read the old cache entry
    pos, slots = pos.to(device), slots.to(device)
    cs = _cos_sin(max_ctx + 1, D).to(device)
    qw, kw = ((torch.rand(D, generator=g) + 0.5).to(dtype).to(device) for _ in range(2)) if qk_norm else (None, None)
    args = dict(cu_seqlens_q=batch["cu_seqlens_q"], seq_lens=batch["seq_lens"], block_tables=batch["block_tables"],
                softmax_scale=batch["softmax_scale"], max_query_len=1)

    kc_ref, vc_ref = batch["k_cache"].clone(), batch["v_cache"].clone()
    q_ref, k_ref = q.reshape(T, -1).clone(), k.reshape(T, -1).clone()
    rotary_embedding_ref(pos, q_ref, k_ref, cs, D, qw, kw, 1e-6, kv_cache=(v.reshape(T, -1), kc_ref, vc_ref, slots))
    ref = paged_attention_ref(q_ref.view(T, Hq, D), kc_ref, vc_ref, torch.full_like(q, float("nan")), **args)

    kc, vc = batch["k_cache"], batch["v_cache"]
    out = torch.full_like(q, float("nan"))
    qkv_before = qkv.clone()
    unified_attention(q, kc, vc, out, num_kv_splits=splits, rope=DecodeRope(cs, k, v, slots, qw, kw, 1e-6), **args)
    n = int(cu[-1])
    what = f"D={D} kv={Hkv} g={qpkv} bs={bs} splits={splits} norm={qk_norm}"
    _check_close(out[:n], ref[:n], dtype, what)
    _check_close(kc, kc_ref, dtype, what + " k cache")
    assert torch.equal(vc, vc_ref), what + " v cache"
    assert torch.equal(qkv, qkv_before), "q, k and v are inputs only"


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("D,Hkv,qpkv,bs,dtype,qk_norm", [(64, 2, 2, 16, torch.float32, False),
                                                         (128, 1, 4, 32, torch.float16, True),
                                                         (64, 2, 1, 16, torch.float16, False)])
def test_decode_rope_interpreted(device, D, Hkv, qpkv, bs, dtype, qk_norm, splits):
    kinds = ["decode", "decode", "empty", (1, 1), "decode", (1, 70)]  # a 1-token context; more splits than tiles
    _case(device, D, Hkv, qpkv, bs, dtype, splits, qk_norm, kinds, 90, seed=D + bs + qpkv)


@pytest.mark.parametrize("device", [GPU])
@pytest.mark.parametrize("splits", [None, 1, 8])
@pytest.mark.parametrize("D,Hkv,qpkv,bs,qk_norm", [(128, 8, 4, 16, False), (128, 8, 2, 16, True),
                                                   (64, 2, 8, 64, False), (128, 4, 4, 32, True)])
def test_decode_rope_gpu(device, D, Hkv, qpkv, bs, qk_norm, splits):
    kinds = ["decode"] * 40 + ["empty", (1, 1), (1, 4000)]
    for dtype in (torch.bfloat16, torch.float32):
        _case(device, D, Hkv, qpkv, bs, dtype, splits, qk_norm, kinds, 4096, seed=D + bs)


@pytest.mark.parametrize("device", [CPU])
def test_decode_rope_refuses_bad_input(device):
    batch = _make_batch(["decode", "decode"], 4, 2, 64, 16, torch.float32, device, 40, seed=3)
    q = batch.pop("q")
    T = q.shape[0]
    k = torch.zeros(T, 2, 64)
    good = DecodeRope(_cos_sin(64, 64), k, k, torch.zeros(T, dtype=torch.int64))
    out = torch.empty_like(q)
    batch["max_query_len"] = 2
    with pytest.raises(ValueError, match="decode steps only"):
        unified_attention(q, out=out, rope=good, **batch)
    batch["max_query_len"] = 1
    for bad, msg in ((good._replace(cos_sin_cache=_cos_sin(64, 32)), "cos_sin_cache must be"),
                     (good._replace(k=torch.zeros(T, 2, 32)), "rope.k must be"),
                     (good._replace(slot_mapping=torch.zeros(T - 1, dtype=torch.int64)), "slot_mapping needs"),
                     (good._replace(q_norm_weight=torch.ones(64)), "both q_norm_weight and k_norm_weight")):
        with pytest.raises(ValueError, match=msg):
            unified_attention(q, out=out, rope=bad, **batch)


def _summed_case(device, dtype, splits, qk_norm, S=3, seed=11):
    """q / k / v given as a split-K product's fp32 partials [S, T, N] (`qkv_sum`) against the
    same attention over their reduction (`split_k_sum`: summed in split order, rounded to
    dtype): the same output and caches, bit for bit."""
    D, Hkv, qpkv, bs = 64, 2, 2, 16
    Hq = Hkv * qpkv
    kinds = ["decode", "decode", (1, 1), "decode", (1, 70)]
    batch = _make_batch(kinds, Hq, Hkv, D, bs, dtype, device, 90, seed=seed)
    T = batch["q"].shape[0]
    N = (Hq + 2 * Hkv) * D
    g = torch.Generator().manual_seed(seed)
    part = torch.randn(S, T, N, generator=g).to(device)
    qkv = torch.empty(T, N, dtype=dtype, device=device)
    split_k_sum(part, None, qkv, {"PDL": False})  # the reduction the fold replaces

    def views(t):
        return [x.view(T, -1, D) for x in t.split([Hq * D, Hkv * D, Hkv * D], dim=-1)]

    cu, sl, bt = (batch[n].cpu() for n in ("cu_seqlens_q", "seq_lens", "block_tables"))
    slots = torch.zeros(T, dtype=torch.int64)
    for b in range(len(sl)):
        p = int(sl[b]) - 1
        slots[int(cu[b])] = int(bt[b, p // bs]) * bs + p % bs
    cs = _cos_sin(91, D).to(device)
    qw, kw = ((torch.rand(D, generator=g) + 0.5).to(dtype).to(device) for _ in range(2)) if qk_norm else (None, None)
    args = dict(cu_seqlens_q=batch["cu_seqlens_q"], seq_lens=batch["seq_lens"], block_tables=batch["block_tables"],
                softmax_scale=batch["softmax_scale"], max_query_len=1, num_kv_splits=splits)
    got = {}
    for name, src, extra in (("reduced", qkv, {}), ("on load", part[0], {"qkv_sum": (S, T * N)})):
        kc, vc = batch["k_cache"].clone(), batch["v_cache"].clone()
        q, k, v = views(src)
        out = torch.full((T, Hq, D), float("nan"), dtype=dtype, device=device)
        unified_attention(q, kc, vc, out, rope=DecodeRope(cs, k, v, slots.to(device), qw, kw, 1e-6), **args, **extra)
        got[name] = (out[:int(cu[-1])], kc, vc)
    for a, b in zip(got["on load"], got["reduced"]):
        assert torch.equal(a, b), (dtype, splits, qk_norm)
    return batch, part, views, cs, slots, args


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype,qk_norm", [(torch.float16, False), (torch.bfloat16, True), (torch.float32, False)])
def test_decode_rope_sums_split_qkv_on_load(device, dtype, qk_norm, splits):
    batch, part, views, cs, slots, args = _summed_case(device, dtype, splits, qk_norm)
    q, k, v = views(part[0])
    out = torch.empty(q.shape, dtype=dtype, device=device)
    rope = DecodeRope(cs, k, v, slots.to(device))
    for bad in ((1, 10), (3, 0)):
        with pytest.raises(ValueError, match="qkv_sum=.* is invalid"):
            unified_attention(q, batch["k_cache"], batch["v_cache"], out, rope=rope, qkv_sum=bad, **args)
    with pytest.raises(ValueError, match="qkv_sum=.* is invalid"):  # no rope: not a decode step's fold
        unified_attention(q, batch["k_cache"], batch["v_cache"], out, qkv_sum=(3, 10), **args)


@pytest.mark.parametrize("device", [GPU])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_rope_sums_split_qkv_on_load_gpu(device, splits):
    for dtype, qk_norm in ((torch.bfloat16, False), (torch.bfloat16, True)):
        _summed_case(device, dtype, splits, qk_norm)
