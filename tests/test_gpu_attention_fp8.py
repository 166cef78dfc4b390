"""On the GPU: the unified attention kernel over an FP8 KV cache (bf16 queries, whose dots run
in fp16: `KV_F16`) and with the block-table entries loaded a tile ahead (`rows_ahead`), against
the torch reference on the same cache. `tests/test_attention_options.py` checks the same under
the Triton interpreter with CPU tensors; this runs the compiled kernel on CUDA tensors."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn


def _fp8_cache_on_gpu(kc, vc, k_scale: float, v_scale: float):
    """kc / vc (CPU, [blocks, block_size, Hkv, D]) written by the Triton cache write into FP8
    caches on the GPU with these scales: (kq, vq, k_scale, v_scale), the scales as 0-d CUDA tensors."""
    from atom.model_ops.kernels import reshape_and_cache
    n, hkv, d = kc.shape[0] * kc.shape[1], kc.shape[2], kc.shape[3]
    ks, vs = torch.tensor(k_scale, device="cuda"), torch.tensor(v_scale, device="cuda")
    kq = torch.zeros(kc.shape, dtype=FP8, device="cuda")
    vq = torch.zeros_like(kq)
    reshape_and_cache(kc.cuda().view(n, hkv, d), vc.cuda().view(n, hkv, d), kq, vq, torch.arange(n, device="cuda"),
                      ks, vs)
    return kq, vq, ks, vs


def _cuda(meta):
    return dataclasses.replace(meta, **{f.name: getattr(meta, f.name).cuda() for f in dataclasses.fields(meta)
                                        if isinstance(getattr(meta, f.name), torch.Tensor)})


@pytest.mark.parametrize("window", [None, 25])
@pytest.mark.parametrize("splits", [None, 2])
@pytest.mark.parametrize("config", [None, {"TILE_N": 16, "rows_ahead": True}], ids=["table", "rows_ahead"])
def test_fp8_cache_with_bf16_queries_on_the_gpu(window, splits, config):
    from test_attention_options import _sinks, paged_batch

    from atom.model_ops.attention.options import AttentionOptions
    from atom.model_ops.attention.torch_native import paged_attention
    from atom.model_ops.attention.triton_unified import unified_attention
    hq, hkv, d, bs = 8, 2, 128, 16
    # decodes over 72-560 tokens, a prefill, a chunk after its context
    q, kc, vc, meta, _, _ = paged_batch([1, 1, 1, 92, 36, 1], [560, 320, 8, 0, 480, 72], hq, hkv, d, bs, seed=3)
    kq, vq, k_scale, v_scale = _fp8_cache_on_gpu(kc, vc, 0.05, 0.02)
    opts = AttentionOptions(_sinks(hq, 2).cuda(), window, k_scale, v_scale)
    gmeta = _cuda(meta)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    unified_attention(q.cuda().bfloat16(), kq, vq, out, gmeta.cu_seqlens_q, gmeta.seq_lens, gmeta.block_tables,
                      d ** -0.5, gmeta.max_query_len, options=opts, num_kv_splits=splits, config=config)
    ref_opts = AttentionOptions(opts.sinks.cpu(), window, k_scale.cpu(), v_scale.cpu())
    ref = paged_attention(q, kq.cpu(), vq.cpu(), meta, d ** -0.5, ref_opts)  # fp32 queries
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("splits", [None, 1])
def test_fp8_cache_wide_decode_tile_on_the_gpu(splits):
    """A decode batch of `FP8_WIDE_TILE_MIN_SEQS` + 7 sequences over an FP8 cache at
    Llama-3.1-8B's head shape (128-key tiles; contexts of 5 to ~3,000 tokens: whole tiles, cut
    ones, one inside a tile), split as the engine picks and unsplit, against the torch
    reference on the same cache."""
    from test_attention_options import paged_batch

    from atom.model_ops.attention.options import AttentionOptions
    from atom.model_ops.attention.torch_native import paged_attention
    from atom.model_ops.attention.triton_unified import FP8_WIDE_TILE_MIN_SEQS, pick_attention_config, unified_attention
    hq, hkv, d, bs = 32, 8, 128, 16
    seqs = FP8_WIDE_TILE_MIN_SEQS + 7
    ctx = [(389 * i) % 3000 + 5 for i in range(seqs)]
    q, kc, vc, meta, _, _ = paged_batch([1] * seqs, ctx, hq, hkv, d, bs, seed=8)
    assert pick_attention_config(seqs, seqs, hq, hkv, d, 1, torch.device("cuda"), kv_fp8=True)["TILE_N"] == 128
    kq, vq, k_scale, v_scale = _fp8_cache_on_gpu(kc, vc, 0.05, 0.02)
    gmeta = _cuda(meta)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    unified_attention(q.cuda().bfloat16(), kq, vq, out, gmeta.cu_seqlens_q, gmeta.seq_lens, gmeta.block_tables,
                      d ** -0.5, 1, options=AttentionOptions(None, None, k_scale, v_scale), num_kv_splits=splits,
                      merge_in_kernel=splits is None)
    ref = paged_attention(q, kq.cpu(), vq.cpu(), meta, d ** -0.5,
                          AttentionOptions(None, None, k_scale.cpu(), v_scale.cpu()))
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)
