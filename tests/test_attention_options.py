"""Sliding windows, attention sinks and the FP8 KV cache in the torch reference backend and the
Triton unified kernel (interpreter on CPU), against a plain dense-softmax torch reference.

The dense reference here is written independently of both: per sequence, the contiguous keys
and values, scores, the causal + window mask, the sink as one more softmax column, softmax,
then the product with the values."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from atom.model_ops.attention import Attention, AttentionMetadata  # noqa: E402
from atom.model_ops.attention.options import AttentionOptions  # noqa: E402
from atom.model_ops.attention.torch_native import paged_attention, write_kv_cache  # noqa: E402
from atom.model_ops.kernels.kv_cache import quantize_fp8  # noqa: E402
from atom.model_ops.attention.triton_unified import paged_attention_ref  # noqa: E402

FP8 = torch.float8_e4m3fn


def dense_attention(q, k, v, positions, scale, sinks=None, window=None):
    """q [n, Hq, D] at absolute `positions` [n]; k / v [L, Hkv, D] of the whole context."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    j = torch.arange(k.shape[0])[None, :]
    p = positions[:, None]
    visible = j <= p
    if window is not None:
        visible &= p - j < window
    s = s.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float()[:, None, None].expand(-1, s.shape[1], 1)], -1)
    w = torch.softmax(s, -1)[..., :k.shape[0]]
    return torch.einsum("hqk,khd->qhd", w, v)


def paged_batch(query_lens, context_lens, hq, hkv, d, bs, seed=0, dtype=torch.float32):
    """A ragged batch over scattered blocks, plus each sequence's contiguous K/V."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    max_blocks = max(-(-L // bs) for L in seq_lens) + 1
    num_blocks = sum(-(-L // bs) for L in seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32), 0
    kc = torch.zeros(num_blocks, bs, hkv, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    ks, vs = [], []
    for i, L in enumerate(seq_lens):
        nb = -(-L // bs)
        tables[i, :nb] = torch.tensor(perm[used:used + nb])
        used += nb
        k, v = torch.randn(L, hkv, d, generator=g).to(dtype), torch.randn(L, hkv, d, generator=g).to(dtype)
        slots = tables[i, torch.arange(L) // bs].long() * bs + torch.arange(L) % bs
        kc.view(-1, hkv, d)[slots], vc.view(-1, hkv, d)[slots] = k, v
        ks.append(k)
        vs.append(v)
    T = sum(query_lens)
    q = torch.randn(T, hq, d, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    meta = AttentionMetadata(cu, torch.tensor(seq_lens, dtype=torch.int32), tables,
                             torch.zeros(T, dtype=torch.int64), max(query_lens), max(seq_lens),
                             list(query_lens), seq_lens)
    return q, kc, vc, meta, ks, vs


def expected(q, meta, ks, vs, scale, sinks, window):
    out = torch.empty(q.shape, dtype=torch.float32)
    cu = meta.cu_seqlens_q.tolist()
    for i, L in enumerate(meta.seq_lens.tolist()):
        n = cu[i + 1] - cu[i]
        if n:
            out[cu[i]:cu[i + 1]] = dense_attention(q[cu[i]:cu[i + 1]], ks[i], vs[i], torch.arange(L - n, L),
                                                   scale, sinks, window)
    return out


# decodes of several lengths (the torch backend groups them), a fresh prefill, a chunked
# continuation over cached context (as after a prefix-cache hit), a one-token context
QUERY_LENS = [1, 1, 1, 1, 37, 20, 1, 6]
CONTEXT_LENS = [70, 66, 30, 0, 0, 45, 9, 50]
SHAPES = [(4, 2, 32, 16), (6, 3, 64, 16), (8, 8, 32, 32)]  # (hq, hkv, d, block_size)
WINDOWS = [None, 1, 7, 40, 4096]  # 1: only itself; 4096: longer than any context


def _sinks(hq, seed):
    return torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2.0


@pytest.mark.parametrize("hq,hkv,d,bs", SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
def test_torch_backend_window_and_sinks_match_dense(hq, hkv, d, bs, window, with_sinks):
    q, kc, vc, meta, ks, vs = paged_batch(QUERY_LENS, CONTEXT_LENS, hq, hkv, d, bs, seed=hq + d)
    sinks = _sinks(hq, hkv) if with_sinks else None
    want = expected(q, meta, ks, vs, d ** -0.5, sinks, window)
    out = paged_attention(q, kc, vc, meta, d ** -0.5, AttentionOptions(sinks, window))
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    ref = paged_attention_ref(q, kc, vc, torch.full_like(q, float("nan")), meta.cu_seqlens_q, meta.seq_lens,
                              meta.block_tables, d ** -0.5, meta.max_query_len, sinks=sinks, sliding_window=window)
    torch.testing.assert_close(ref, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5, 60])
def test_torch_single_decode_window_and_sinks(window):
    q, kc, vc, meta, ks, vs = paged_batch([1], [77], 6, 2, 32, 16, seed=3)
    sinks = _sinks(6, 1)
    out = paged_attention(q, kc, vc, meta, 0.2, AttentionOptions(sinks, window))
    torch.testing.assert_close(out, expected(q, meta, ks, vs, 0.2, sinks, window), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_sinks_and_window_as_transformers_gpt_oss_defines_them(window):
    """transformers' GPT-OSS attention (`eager_attention_forward`: the sinks as a last softmax
    column, dropped after; an additive causal + sliding-window mask) on a chunk over cached
    context gives the torch backend's output."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    hq, hkv, d, n, ctx = 8, 2, 16, 9, 14
    q, kc, vc, meta, ks, vs = paged_batch([n], [ctx], hq, hkv, d, 16, seed=8)
    sinks = _sinks(hq, 4)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups = sinks, hq // hkv
    L = ctx + n
    qpos, kpos = torch.arange(ctx, L)[:, None], torch.arange(L)[None, :]
    hidden = (kpos > qpos) | ((qpos - kpos >= window) if window else torch.zeros_like(kpos > qpos))
    mask = torch.zeros(n, L).masked_fill(hidden, float("-inf"))[None, None]
    hf, _ = eager_attention_forward(module, q.transpose(0, 1)[None], ks[0].transpose(0, 1)[None],
                                    vs[0].transpose(0, 1)[None], mask, scaling=d ** -0.5)
    out = paged_attention(q, kc, vc, meta, d ** -0.5, AttentionOptions(sinks, window))
    torch.testing.assert_close(out, hf[0], rtol=1e-4, atol=1e-5)


def test_sinks_change_the_output():
    """A check that could not fail otherwise: large sinks take mass off the values."""
    q, kc, vc, meta, ks, vs = paged_batch([5, 1], [3, 20], 4, 2, 32, 16, seed=1)
    plain = paged_attention(q, kc, vc, meta, 0.2)
    sunk = paged_attention(q, kc, vc, meta, 0.2, AttentionOptions(torch.full((4,), 8.0), None))
    assert sunk.norm() < 0.05 * plain.norm()


def test_window_layers_share_nothing_in_the_step_cache():
    """Layers with different windows in one step each get their own decode plan."""
    q, kc, vc, meta, ks, vs = paged_batch([1, 1, 1], [40, 20, 5], 4, 2, 32, 16, seed=2)
    for window in (None, 4, None, 4, 12):
        out = paged_attention(q, kc, vc, meta, 0.2, AttentionOptions(None, window))
        torch.testing.assert_close(out, expected(q, meta, ks, vs, 0.2, None, window), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------ FP8 cache

def _fp8_cache_like(kc, vc, k_scale, v_scale):
    """The same entries, written through the cache write into an FP8 cache."""
    kq, vq = torch.zeros(kc.shape, dtype=FP8), torch.zeros(vc.shape, dtype=FP8)
    n = kc.shape[0] * kc.shape[1]
    write_kv_cache(kc.view(n, *kc.shape[2:]), vc.view(n, *vc.shape[2:]), kq, vq, torch.arange(n), None,
                   k_scale, v_scale)
    return kq, vq


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# FP8 e4m3 keeps 3 mantissa bits: each entry within 2^-4 relative (6.25%), so attention
# outputs over random data land ~2-4% off in relative norm; 6% is the bound asserted.
FP8_REL_TOL = 0.06


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 0.02)], ids=["unit-scales", "scaled"])
def test_fp8_cache_write_and_torch_attention_close_to_full_precision(scales):
    hq, hkv, d, bs = 6, 3, 64, 16
    q, kc, vc, meta, ks, vs = paged_batch(QUERY_LENS, CONTEXT_LENS, hq, hkv, d, bs, seed=7)
    k_scale, v_scale = torch.tensor(scales[0]), torch.tensor(scales[1])
    kq, vq = _fp8_cache_like(kc, vc, k_scale, v_scale)
    assert kq.dtype == FP8 and kq.element_size() == 1
    # what was stored is x / scale rounded to e4m3 (saturating), read back as fp8 * scale
    torch.testing.assert_close(kq.float() * k_scale, kc, rtol=0.07, atol=0.02 * scales[0])
    assert torch.equal(kq, quantize_fp8(kc, k_scale, FP8))
    opts = AttentionOptions(_sinks(hq, 0), 30, k_scale, v_scale)
    full = paged_attention(q, kc, vc, meta, d ** -0.5, AttentionOptions(opts.sinks, 30))
    out = paged_attention(q, kq, vq, meta, d ** -0.5, opts)
    assert torch.isfinite(out).all()
    assert _rel(out, full) < FP8_REL_TOL
    # and exactly the dense math on the dequantized entries
    ref = paged_attention_ref(q, kq, vq, torch.empty_like(q), meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                              d ** -0.5, meta.max_query_len, sinks=opts.sinks, sliding_window=30,
                              k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_fp8_cache_write_saturates_instead_of_nan():
    kc, vc = torch.zeros(2, 16, 1, 8, dtype=FP8), torch.zeros(2, 16, 1, 8, dtype=FP8)
    k = torch.full((1, 1, 8), 1e4)
    write_kv_cache(k, -k, kc, vc, torch.tensor([3]))
    assert torch.equal(kc[0, 3].float(), torch.full((1, 8), 448.0))
    assert torch.equal(vc[0, 3].float(), torch.full((1, 8), -448.0))


# ------------------------------------------------------------------------------ Triton kernel

triton = pytest.importorskip("triton")
from atom.model_ops.attention import triton_unified as _tu  # noqa: E402
from atom.model_ops.attention.triton_unified import DecodeRope, unified_attention  # noqa: E402

_INTERPRET = type(_tu._unified_attn_kernel).__name__ == "InterpretedFunction"
needs_kernel = pytest.mark.skipif(not (_INTERPRET or torch.cuda.is_available()),
                                  reason="the kernels were defined compiled without a GPU")


def _unified(q, kc, vc, meta, scale, opts, **kw):
    out = torch.full_like(q, float("nan"))
    unified_attention(q, kc, vc, out, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale,
                      meta.max_query_len, options=opts, **kw)
    assert not torch.isnan(out).any(), "unwritten output rows"
    return out


# interpreter-sized: fewer / shorter sequences than the torch cases
TRITON_Q = [1, 1, 1, 23, 9, 1]
TRITON_CTX = [70, 40, 0, 0, 60, 9]


@needs_kernel
@pytest.mark.parametrize("hq,hkv,d,bs", [(4, 2, 32, 16), (6, 3, 64, 32)])
@pytest.mark.parametrize("window", [None, 1, 20, 100])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
def test_triton_window_and_sinks_match_dense(hq, hkv, d, bs, window, with_sinks):
    q, kc, vc, meta, ks, vs = paged_batch(TRITON_Q, TRITON_CTX, hq, hkv, d, bs, seed=hq * d)
    sinks = _sinks(hq, 5) if with_sinks else None
    out = _unified(q, kc, vc, meta, d ** -0.5, AttentionOptions(sinks, window))
    torch.testing.assert_close(out, expected(q, meta, ks, vs, d ** -0.5, sinks, window), rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("window", [None, 9, 33])
def test_triton_rows_ahead_with_window_and_sinks(window):
    """Block-table entries loaded a tile ahead (`rows_ahead`) through the window's edge tiles,
    the unmasked tiles and the diagonal ones, with a sink, split and unsplit."""
    q, kc, vc, meta, ks, vs = paged_batch(TRITON_Q, TRITON_CTX, 4, 2, 32, 16, seed=window or 1)
    sinks = _sinks(4, 3)
    ref = expected(q, meta, ks, vs, 0.25, sinks, window)
    out = _unified(q, kc, vc, meta, 0.25, AttentionOptions(sinks, window), config={"TILE_N": 16, "rows_ahead": True})
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    dq, dkc, dvc, dmeta, dks, dvs = paged_batch([1, 1, 1], [130, 70, 8], 4, 1, 32, 16, seed=5)
    dsinks = _sinks(4, 2)
    out = _unified(dq, dkc, dvc, dmeta, 0.25, AttentionOptions(dsinks, window), num_kv_splits=2,
                   config={"TILE_N": 16, "rows_ahead": True})
    torch.testing.assert_close(out, expected(dq, dmeta, dks, dvs, 0.25, dsinks, window), rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("window", [None, 9, 33])
def test_triton_split_kv_with_window_and_sinks(splits, window):
    """Decode segments: the sink counts once (first segment), windowed tiles are split too."""
    q, kc, vc, meta, ks, vs = paged_batch([1, 1, 1, 1], [130, 70, 8, 0], 4, 1, 32, 16, seed=splits)
    sinks = _sinks(4, splits)
    out = _unified(q, kc, vc, meta, 0.25, AttentionOptions(sinks, window), num_kv_splits=splits)
    torch.testing.assert_close(out, expected(q, meta, ks, vs, 0.25, sinks, window), rtol=1e-4, atol=1e-5)


@needs_kernel
def test_triton_window_tiles_smaller_than_query_block():
    """A 64-token prefill and a chunk with TILE_N 16: windows cut through several tiles of one
    query block (edge, unmasked and diagonal tile ranges all non-empty)."""
    q, kc, vc, meta, ks, vs = paged_batch([64, 30], [0, 50], 4, 2, 32, 16, seed=4)
    for window in (3, 17, 40):
        out = _unified(q, kc, vc, meta, 0.2, AttentionOptions(None, window), config={"TILE_N": 16})
        torch.testing.assert_close(out, expected(q, meta, ks, vs, 0.2, None, window), rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 0.02)], ids=["unit-scales", "scaled"])
def test_triton_fp8_cache_close_to_full_precision(scales):
    from atom.model_ops.kernels import reshape_and_cache, reshape_and_cache_ref
    hq, hkv, d, bs = 4, 2, 64, 16
    q, kc, vc, meta, ks, vs = paged_batch(TRITON_Q, TRITON_CTX, hq, hkv, d, bs, seed=9)
    k_scale, v_scale = torch.tensor(scales[0]), torch.tensor(scales[1])
    # the Triton cache write quantizes exactly like the reference write (x / scale, saturated, RNE)
    n = kc.shape[0] * bs
    kq, vq = torch.zeros(kc.shape, dtype=FP8), torch.zeros(kc.shape, dtype=FP8)
    reshape_and_cache(kc.view(n, hkv, d), vc.view(n, hkv, d), kq, vq, torch.arange(n), k_scale, v_scale)
    kr, vr = torch.zeros_like(kq), torch.zeros_like(vq)
    reshape_and_cache_ref(kc.view(n, hkv, d), vc.view(n, hkv, d), kr, vr, torch.arange(n), k_scale, v_scale)
    assert torch.equal(kq.view(torch.uint8), kr.view(torch.uint8))
    assert torch.equal(vq.view(torch.uint8), vr.view(torch.uint8))
    opts = AttentionOptions(_sinks(hq, 1), 25, k_scale, v_scale)
    out = _unified(q, kq, vq, meta, d ** -0.5, opts)
    full = _unified(q, kc, vc, meta, d ** -0.5, AttentionOptions(opts.sinks, 25))
    assert _rel(out, full) < FP8_REL_TOL
    # the kernel's dequantization is exact: the same as the torch reference on the same fp8 cache
    torch.testing.assert_close(out, paged_attention(q, kq, vq, meta, d ** -0.5, opts),
                               rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("window", [None, 25])
def test_triton_fp8_cache_with_bf16_queries(window):
    """bf16 queries over an FP8 cache run their dots in fp16 (KV_F16: e4m3 -> fp16 is exact and
    one instruction per two values): the result is the fp32 reference on the same FP8 cache
    within bf16's output rounding, for prefills, chunks and decodes, split and unsplit."""
    from atom.model_ops.kernels import reshape_and_cache
    hq, hkv, d, bs = 4, 2, 64, 16
    q, kc, vc, meta, ks, vs = paged_batch(TRITON_Q, TRITON_CTX, hq, hkv, d, bs, seed=12)
    k_scale, v_scale = torch.tensor(0.05), torch.tensor(0.02)
    n = kc.shape[0] * bs
    kq, vq = torch.zeros(kc.shape, dtype=FP8), torch.zeros(kc.shape, dtype=FP8)
    reshape_and_cache(kc.view(n, hkv, d), vc.view(n, hkv, d), kq, vq, torch.arange(n), k_scale, v_scale)
    opts = AttentionOptions(_sinks(hq, 2), window, k_scale, v_scale)
    ref = paged_attention(q, kq, vq, meta, d ** -0.5, opts)  # fp32 queries
    for splits in (None, 2):
        out = _unified(q.to(torch.bfloat16), kq, vq, meta, d ** -0.5, opts, num_kv_splits=splits)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@needs_kernel
@pytest.mark.parametrize("splits", [None, 1])
def test_triton_fp8_cache_wide_decode_tile(splits, monkeypatch):
    """A decode batch of FP8_WIDE_TILE_MIN_SEQS sequences over an FP8 cache (128-key tiles: one
    whole tile, tiles cut by the context's end, a context inside one tile) equals the torch
    reference on the same cache, split (the engine's choice: 16 segments, most without keys)
    and unsplit; split, with bf16 queries, within bf16's output rounding."""
    from atom.model_ops.attention import triton_unified
    from atom.model_ops.attention.triton_unified import FP8_WIDE_TILE_MIN_SEQS, pick_attention_config
    launched = []  # the tiles `unified_attention` asks for (its cached choice, before any override)
    choose = triton_unified._cached_config
    monkeypatch.setattr(triton_unified, "_cached_config",
                        lambda *a, **kw: launched.append(choose(*a, **kw)["TILE_N"]) or choose(*a, **kw))
    hq, hkv, d, bs = 4, 2, 64, 16
    n_seqs = FP8_WIDE_TILE_MIN_SEQS
    ctx = [(37 * i) % 300 + 5 for i in range(n_seqs - 1)] + [127]
    q, kc, vc, meta, ks, vs = paged_batch([1] * n_seqs, ctx, hq, hkv, d, bs, seed=21)
    cfg = pick_attention_config(n_seqs, n_seqs, hq, hkv, d, 1, q.device, kv_fp8=True)
    assert cfg["TILE_N"] == 128
    k_scale, v_scale = torch.tensor(0.05), torch.tensor(0.02)
    kq, vq = _fp8_cache_like(kc, vc, k_scale, v_scale)  # the torch write: fast beside the interpreter's
    opts = AttentionOptions(None, None, k_scale, v_scale)
    ref = paged_attention(q, kq, vq, meta, d ** -0.5, opts)
    out = _unified(q, kq, vq, meta, d ** -0.5, opts, num_kv_splits=splits)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert launched == [128]  # the FP8 cache reached the choice
    _unified(q, kc, vc, meta, d ** -0.5, AttentionOptions())
    assert launched == [128, 64]  # the same batch over the full-precision cache
    if splits is None:
        out = _unified(q.to(torch.bfloat16), kq, vq, meta, d ** -0.5, opts)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@needs_kernel
def test_triton_decode_rope_writes_fp8():
    """The decode path with the rotary embedding folded in writes k / v into an FP8 cache
    quantized with the layer's scales, and attends over it (against the torch reference)."""
    from atom.model_ops.kernels import rotary_embedding_ref
    hq, hkv, d, bs = 4, 2, 32, 16
    q, kc, vc, meta, ks, vs = paged_batch([1, 1], [20, 5], hq, hkv, d, bs, seed=6)
    k_scale, v_scale = torch.tensor(0.5), torch.tensor(0.25)
    kq, vq = _fp8_cache_like(kc, vc, k_scale, v_scale)
    kr, vr = kq.clone(), vq.clone()
    g = torch.Generator().manual_seed(0)
    k_new, v_new = torch.randn(2, hkv, d, generator=g), torch.randn(2, hkv, d, generator=g)
    pos = meta.seq_lens.long() - 1
    slots = (meta.block_tables[torch.arange(2), pos // bs].long() * bs + pos % bs)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(128).float()[:, None] * inv[None, :]
    cs = torch.cat([ang.cos(), ang.sin()], -1)
    opts = AttentionOptions(_sinks(hq, 2), 12, k_scale, v_scale)
    out = _unified(q, kq, vq, meta, 0.2, opts, rope=DecodeRope(cs, k_new, v_new, slots))
    # reference: rotate, write through the torch cache write, attend
    qr, kr_new = rotary_embedding_ref(pos, q.reshape(2, -1).clone(), k_new.reshape(2, -1).clone(), cs, d)
    write_kv_cache(kr_new.view(2, hkv, d), v_new, kr, vr, slots, None, k_scale, v_scale)
    close = (kq.view(torch.uint8) == kr.view(torch.uint8)).float().mean()
    assert close > 0.95, close
    ref = paged_attention(qr.view(2, hq, d), kr, vr, meta, 0.2, opts)
    torch.testing.assert_close(out, ref, rtol=0.02, atol=0.02)


@needs_kernel
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_layer_hands_its_options_to_the_backend(backend):
    """`Attention(..., sliding_window=W, sinks=param)`: the layer's own forward (cache write +
    attention) over a prefill and then a decode, on each backend, against the dense reference;
    the sinks stay the caller's parameter (not registered twice)."""
    from atom.model_engine.kv_cache import KVCacheManager
    from atom.model_ops.attention import forward_context
    from atom.model_ops.attention.triton_backend import TritonAttentionBackend
    hq, hkv, d, bs, W = 4, 2, 32, 16, 5
    sinks = torch.nn.Parameter(_sinks(hq, 3))
    layer = Attention(hq, hkv, d, d ** -0.5, 0, sliding_window=W, sinks=sinks)
    assert [n for n, _ in layer.named_parameters()] == [] and layer.sinks is sinks
    assert sorted(n for n, _ in layer.named_buffers()) == ["k_scale", "v_scale"]
    KVCacheManager({0: (layer, layer.kv_cache_spec(torch.float32))}, bs).allocate(4)
    if backend == "triton":
        layer.backend = TritonAttentionBackend([layer], 64, "cpu")
    g = torch.Generator().manual_seed(0)
    n = 20
    q, k, v = (torch.randn(n + 1, h, d, generator=g) for h in (hq, hkv, hkv))
    for lo, hi in ((0, n), (n, n + 1)):  # the prompt, then one decode step over the cache
        meta = AttentionMetadata(torch.tensor([0, hi - lo], dtype=torch.int32), torch.tensor([hi], dtype=torch.int32),
                                 torch.tensor([[2, 0]], dtype=torch.int32),
                                 torch.tensor([(2 if p < bs else 0) * bs + p % bs for p in range(lo, hi)]),
                                 hi - lo, hi, [hi - lo], [hi])
        meta.attn_backend = layer.backend
        with forward_context(meta):
            out = layer(q[lo:hi].reshape(hi - lo, -1), k[lo:hi].reshape(hi - lo, -1), v[lo:hi].reshape(hi - lo, -1))
        want = dense_attention(q[lo:hi], k[:hi], v[:hi], torch.arange(lo, hi), d ** -0.5, sinks.detach(), W)
        torch.testing.assert_close(out.view(hi - lo, hq, d), want, rtol=1e-4, atol=1e-5)
