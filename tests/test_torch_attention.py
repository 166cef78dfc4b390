"""The CPU attention backend (batched decodes grouped by length, per-sequence prefills,
index_select gathers) against the plain per-sequence fp32 loop, on ragged paged batches."""
import pytest
import torch

from atom.model_ops.attention import AttentionMetadata
from atom.model_ops.attention.torch_native import paged_attention, write_kv_cache
from atom.model_ops.attention.triton_unified import paged_attention_ref


def ragged_batch(query_lens, context_lens, hq, hkv, d, bs, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    max_blocks = max(-(-L // bs) for L in seq_lens)
    num_blocks = sum(-(-L // bs) for L in seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks
    tables, used = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32), 0
    for i, L in enumerate(seq_lens):
        nb = -(-L // bs)
        tables[i, :nb] = torch.tensor(perm[used:used + nb])
        used += nb
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    T = sum(query_lens)
    q = torch.randn(T, hq, d, generator=g)
    cu = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    meta = AttentionMetadata(cu, torch.tensor(seq_lens, dtype=torch.int32), tables,
                             torch.zeros(T, dtype=torch.int64), max(query_lens), max(seq_lens),
                             list(query_lens), seq_lens)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (8, 8, 32, 32), (16, 2, 128, 16)])
def test_paged_attention_matches_reference(hq, hkv, d, bs):
    # decodes of very different lengths (several length groups), a fresh prefill,
    # a chunked continuation with cached context, and a one-token context
    query_lens = [1, 1, 1, 1, 1, 1, 37, 20, 1]
    context_lens = [300, 290, 120, 64, 9, 0, 0, 45, 230]
    q, kc, vc, meta = ragged_batch(query_lens, context_lens, hq, hkv, d, bs)
    out = paged_attention(q, kc, vc, meta, scale=d ** -0.5)
    ref = paged_attention_ref(q, kc, vc, torch.full_like(q, float("nan")), meta.cu_seqlens_q, meta.seq_lens,
                              meta.block_tables, d ** -0.5, meta.max_query_len)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_write_kv_cache_skips_padding_slots():
    kc, vc = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv_cache(k, v, kc, vc, torch.tensor([17, -1, 63]))
    assert torch.equal(kc[1, 1], k[0]) and torch.equal(vc[3, 15], v[2])
    assert int((kc != 0).any(-1).any(-1).sum()) == 2  # the padding row wrote nothing


def test_write_kv_cache_checks_padding_once_per_step():
    kc, vc = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    step = {}
    slots = torch.tensor([17, -1, 63])
    for layer in range(2):  # the second layer reuses the first one's padding mask
        k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
        write_kv_cache(k, v, kc, vc, slots, step)
        assert torch.equal(step["kv_valid"], slots >= 0)
        assert torch.equal(kc[1, 1], k[0]) and torch.equal(vc[3, 15], v[2])
    assert int((kc != 0).any(-1).any(-1).sum()) == 2
    full = {}
    write_kv_cache(k, v, kc, vc, torch.tensor([1, 2, 3]), full)
    assert full["kv_valid"] is None and torch.equal(kc[0, 3], k[2])


def test_single_decode_fast_path_matches_reference():
    q, kc, vc, meta = ragged_batch([1], [77], 9, 3, 64, 16)
    out = paged_attention(q, kc, vc, meta, scale=0.125)
    ref = paged_attention_ref(q, kc, vc, torch.full_like(q, float("nan")), meta.cu_seqlens_q, meta.seq_lens,
                              meta.block_tables, 0.125, 1)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
