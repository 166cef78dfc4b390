"""MLA over the latent cache: the torch reference (expanded prefill, absorbed decode) against
plain dense attention on expanded keys / values; the Triton decode kernel (split-KV) and cache
write against the reference (interpreter on CPU); the latent cache's size."""
import importlib.util
import math

import pytest
import torch

from atom.model_engine.kv_cache import FullAttentionSpec, KVCacheManager, LatentAttentionSpec
from atom.model_ops.attention import AttentionMetadata, forward_context
from atom.model_ops.attention.mla import MLAAttention
from atom.model_ops.attention.mla_torch import (TorchMLABackend, expanded_keys, latent_decode_ref,
                                                write_latent_cache)
from atom.model_ops.linear import Linear

H, R, NOPE, ROPE, V = 3, 16, 8, 4, 12
BS = 4


def _layer(seed=0, dtype=torch.float32, layer_idx=0):
    torch.manual_seed(seed)
    kv_b = Linear(R, H * (NOPE + V))
    kv_b.weight.data = torch.randn(H * (NOPE + V), R, dtype=dtype) * 0.3
    layer = MLAAttention(H, R, NOPE, ROPE, V, scale=0.35, layer_idx=layer_idx, kv_b_proj=kv_b)
    return layer, kv_b


def _meta(qlens, slens, tables, slots):
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(cu_seqlens_q=cu, seq_lens=torch.tensor(slens, dtype=torch.int32),
                             block_tables=tables.int(), slot_mapping=slots, max_query_len=max(qlens),
                             max_seq_len=max(slens), query_lens_host=list(qlens), seq_lens_host=list(slens))


def _dense_reference(q_nope, q_pe, latents, kv_b_weight, qlens, slens, scale):
    """Expand every sequence's latents to per-head K/V and attend with an explicit masked softmax."""
    out, at = [], 0
    for n, L, lat in zip(qlens, slens, latents):
        c, pe = lat[:, :R], lat[:, R:]
        kv = (c @ kv_b_weight.T).view(L, H, NOPE + V)
        k = torch.cat((kv[..., :NOPE], pe[:, None, :].expand(L, H, ROPE)), -1)
        v = kv[..., NOPE:]
        q = torch.cat((q_nope[at:at + n], q_pe[at:at + n]), -1)
        s = torch.einsum("nhd,lhd->hnl", q, k) * scale
        causal = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
        p = s.masked_fill(~causal, float("-inf")).softmax(-1)
        out.append(torch.einsum("hnl,lhd->nhd", p, v))
        at += n
    return torch.cat(out)


def _mixed_step(layer, gen, qlens, slens):
    """A step over a cache already holding each sequence's first slens - qlens latents."""
    B = len(qlens)
    nb = [math.ceil(L / BS) for L in slens]
    perm = torch.randperm(sum(nb) + 3, generator=gen)
    tables = torch.full((B, max(nb)), -1, dtype=torch.int64)
    at = 0
    for i, n in enumerate(nb):
        tables[i, :n] = perm[at:at + n]
        at += n
    layer.kv_cache = torch.zeros(sum(nb) + 3, BS, R + ROPE)
    latents = [torch.randn(L, R + ROPE, generator=gen) for L in slens]
    slots_all = [tables[i, torch.arange(L) // BS] * BS + torch.arange(L) % BS for i, L in enumerate(slens)]
    for i, (L, n) in enumerate(zip(slens, qlens)):  # the cached prefix
        write_latent_cache(latents[i][:L - n, :R], latents[i][:L - n, R:], layer.kv_cache, slots_all[i][:L - n])
    new = torch.cat([lat[L - n:] for lat, L, n in zip(latents, slens, qlens)])
    slots = torch.cat([s[L - n:] for s, L, n in zip(slots_all, slens, qlens)])
    T = sum(qlens)
    q_nope, q_pe = torch.randn(T, H, NOPE, generator=gen), torch.randn(T, H, ROPE, generator=gen)
    return _meta(qlens, slens, tables, slots), latents, new, q_nope, q_pe


@pytest.mark.parametrize("qlens,slens", [
    ([1, 1, 1], [5, 1, 13]),            # decodes only: the absorbed form
    ([6, 1, 3, 1], [6, 9, 11, 2]),      # a whole prefill, decodes, a chunk over a cached prefix
    ([4], [17]),                        # one chunk over a cached prefix (prefix-cache hit)
])
def test_mla_reference_matches_dense_attention(qlens, slens):
    layer, kv_b = _layer()
    gen = torch.Generator().manual_seed(1)
    meta, latents, new, q_nope, q_pe = _mixed_step(layer, gen, qlens, slens)
    with forward_context(meta):
        out = layer(q_nope, q_pe, new[:, :R], new[:, R:])
    ref = _dense_reference(q_nope, q_pe, latents, kv_b.weight, qlens, slens, layer.scale)
    assert out.shape == (sum(qlens), H * V)
    torch.testing.assert_close(out.view(-1, H, V), ref, atol=2e-5, rtol=2e-5)
    # the step's latents went into the cache (the backend is the one place that writes it)
    flat = layer.kv_cache.view(-1, R + ROPE)
    torch.testing.assert_close(flat[meta.slot_mapping], new)


def test_absorbed_decode_equals_expanded_decode():
    """The decode path (absorbed) and the prefill path (expanded) agree on one query token."""
    layer, _ = _layer(seed=3)
    gen = torch.Generator().manual_seed(2)
    meta, latents, new, q_nope, q_pe = _mixed_step(layer, gen, [1], [10])
    with forward_context(meta):
        absorbed = layer(q_nope, q_pe, new[:, :R], new[:, R:])
    k_nope, k_pe, v = layer.expand_latent(
        layer.kv_cache.view(-1, R + ROPE)[meta.block_tables[0].long().repeat_interleave(BS) * BS
                                          + torch.arange(meta.block_tables.shape[1] * BS) % BS][:10])
    k = expanded_keys(k_nope, k_pe)
    q = torch.cat((q_nope, q_pe), -1)
    p = (torch.einsum("hd,lhd->hl", q[0], k) * layer.scale).softmax(-1)
    torch.testing.assert_close(absorbed.view(H, V), torch.einsum("hl,lhd->hd", p, v), atol=2e-5, rtol=2e-5)


def test_padding_slots_are_not_written():
    cache = torch.zeros(4, BS, R + ROPE)
    c, pe = torch.randn(3, R), torch.randn(3, ROPE)
    write_latent_cache(c, pe, cache, torch.tensor([2, -1, 9]))
    flat = cache.view(-1, R + ROPE)
    assert torch.equal(flat[2], torch.cat((c[0], pe[0]))) and torch.equal(flat[9], torch.cat((c[2], pe[2])))
    assert int((flat.abs().sum(-1) > 0).sum()) == 2


def test_latent_spec_block_count():
    """One block of latent cache costs (R + P) values per token and layer; the same budget
    holds (2 * H * (nope + rope)) / (R + P) times more blocks than expanded K/V would."""
    layer, _ = _layer()
    spec = TorchMLABackend().kv_cache_spec(layer, torch.float32)
    assert spec == LatentAttentionSpec(R + ROPE, torch.float32)
    layers = {i: (_layer(i, layer_idx=i)[0], spec) for i in range(3)}
    m = KVCacheManager(layers, block_size=BS)
    assert m.bytes_per_block == 3 * BS * (R + ROPE) * 4
    budget = 1 << 20
    expanded = KVCacheManager({i: (object(), FullAttentionSpec(H, NOPE + ROPE, torch.float32)) for i in range(3)}, BS)
    assert m.num_blocks_for(budget) == budget // (3 * BS * (R + ROPE) * 4)
    assert m.num_blocks_for(budget) // expanded.num_blocks_for(budget) == (2 * H * (NOPE + ROPE)) // (R + ROPE)
    m.allocate(5)
    assert layers[1][0].kv_cache.shape == (5, BS, R + ROPE)
    assert list(m.to_frame()["kind"]) == ["latent"] * 3


# --- the Triton kernels (interpreter on CPU) ----------------------------------------------

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


@needs_triton
@pytest.mark.parametrize("splits", [1, 2, 4, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_mla_decode_matches_reference(splits, dtype):
    from atom.model_ops.kernels.mla_decode import mla_decode
    g = torch.Generator().manual_seed(0)
    B, Hq, Rk, P, bs, nb = 3, 5, 32, 8, 4, 24
    lens = [7, 1, 21]
    cache = torch.randn(nb, bs, Rk + P, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(nb, generator=g)[:6] for _ in range(B)]).int()
    ql, qp = torch.randn(B, Hq, Rk, generator=g).to(dtype), torch.randn(B, Hq, P, generator=g).to(dtype)
    ref = latent_decode_ref(ql.float(), qp.float(), cache.float(), tables, lens, 0.3)
    # min_split_tokens=1: the short test contexts really are cut into `splits` segments
    out = mla_decode(ql, qp, cache, tables, torch.tensor(lens, dtype=torch.int32), Rk, 0.3, num_kv_splits=splits,
                     config=dict(min_split_tokens=1, TILE_N=16))
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@needs_triton
@pytest.mark.parametrize("dims", [(16, 8, 16), (32, 16, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_mla_prefill_matches_reference(dims, dtype):
    """Every span of a step in one launch == the per-sequence reference: fresh prompts (n == L)
    and chunks after a cached prefix (n < L), spans longer than a tile, rope widths below tl.dot's
    16 (padded), views of wider tensors as the layer passes them; rows outside the spans untouched."""
    from atom.model_ops.attention.mla_torch import expanded_prefill_ref
    from atom.model_ops.kernels.mla_prefill import mla_prefill, prefill_tiles
    nope, rope, vd = dims
    g = torch.Generator().manual_seed(nope)
    H = 3
    spans = [(0, 5, 0, 5), (6, 40, 5, 70), (46, 2, 75, 9), (49, 19, 84, 19)]  # (q row, n, ctx row, L); row 5 decodes
    T, Lt = 68, 103
    q = torch.randn(T, H, nope + rope + 4, generator=g).to(dtype)  # a wider projection's views
    kv = torch.randn(Lt, H, nope + vd, generator=g).to(dtype)
    lat = torch.randn(Lt, 24 + rope, generator=g).to(dtype)
    q_nope, q_pe = q[..., :nope], q[..., nope:nope + rope]
    k_nope, v, k_pe = kv[..., :nope], kv[..., nope:], lat[:, 24:]
    out = torch.full((T, H, vd), 7.0, dtype=dtype)
    work = prefill_tiles(spans, 16, "cpu")
    mla_prefill(q_nope, q_pe, k_nope, k_pe, v, work, 0.25, out, config=dict(BLOCK_N=16))
    with pytest.raises(ValueError, match="BLOCK_M"):  # tables for 16-row tiles run only with 16-row tiles
        mla_prefill(q_nope, q_pe, k_nope, k_pe, v, work, 0.25, out, config=dict(BLOCK_M=32))
    qf = torch.cat((q_nope, q_pe), -1).float()
    kf = torch.cat((k_nope, k_pe[:, None].expand(Lt, H, rope)), -1).float()
    tol = 2e-5 if dtype == torch.float32 else 3e-3
    for s, n, c, L in spans:
        ref = expanded_prefill_ref(qf[s:s + n], kf[c:c + L], v[c:c + L].float(), 0.25)
        torch.testing.assert_close(out[s:s + n].float(), ref, atol=tol, rtol=tol)
    assert torch.all(out[5] == 7.0) and torch.all(out[48] == 7.0), "a row outside the spans was written"


@needs_triton
def test_triton_mla_prefill_rejects_mismatched_shapes():
    from atom.model_ops.kernels.mla_prefill import mla_prefill, prefill_tiles
    work = prefill_tiles([(0, 2, 0, 2)], 16, "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        mla_prefill(torch.randn(2, 3, 16), torch.randn(2, 3, 8), torch.randn(2, 3, 16), torch.randn(2, 8),
                    torch.randn(2, 3, 16), work, 0.1, torch.empty(2, 4, 16))


@needs_triton
def test_triton_mla_decode_workspace_and_split_choice():
    """Small batches split (the choice depends on shapes only); the workspace's views are used,
    and a batch too big for the workspace runs unsplit with the same result."""
    from atom.model_ops.kernels.mla_decode import MLAWorkspace, mla_decode, pick_mla_config
    assert pick_mla_config(1, 16, 512)["num_splits"] == 32
    assert pick_mla_config(1, 16, 512, max_splits=8)["num_splits"] == 8
    assert pick_mla_config(128, 16, 512)["num_splits"] == 4  # the H200 sweep: 4 beat 2 at 128 sequences
    assert pick_mla_config(256, 16, 512)["num_splits"] == 2  # and 2 beat 4 at 256
    assert pick_mla_config(600, 16, 512)["num_splits"] == 1 and pick_mla_config(1, 16, 512)["TILE_N"] == 64
    assert not pick_mla_config(128, 16, 512)["page_loads"]  # one block-table entry per token
    assert pick_mla_config(256, 16, 512)["TILE_N"] == 32
    g = torch.Generator().manual_seed(1)
    B, Hq, Rk, P, bs = 2, 4, 16, 8, 8
    cache = torch.randn(10, bs, Rk + P, generator=g)
    tables = torch.tensor([[3, 1, 7], [0, 9, 2]], dtype=torch.int32)
    lens = torch.tensor([20, 11], dtype=torch.int32)
    ql, qp = torch.randn(B, Hq, Rk, generator=g), torch.randn(B, Hq, P, generator=g)
    ref = latent_decode_ref(ql, qp, cache, tables, lens.tolist(), 0.5)
    ws = MLAWorkspace(4, Hq, Rk, max_splits=4)
    ws.partial_lse.fill_(float("nan"))
    out = mla_decode(ql, qp, cache, tables, lens, Rk, 0.5, workspace=ws, num_kv_splits=4,
                     config=dict(min_split_tokens=1))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert not torch.isnan(ws.partial_lse[:B * Hq * 4]).any()  # the split path wrote its partial results there
    small = MLAWorkspace(1, Hq, Rk, max_splits=4)
    torch.testing.assert_close(mla_decode(ql, qp, cache, tables, lens, Rk, 0.5, workspace=small, num_kv_splits=4),
                               ref, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="num_kv_splits"):
        mla_decode(ql, qp, cache, tables, lens, Rk, 0.5, num_kv_splits=3)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_decode(ql, qp, cache, tables, lens, Rk + 1, 0.5)


@needs_triton
def test_triton_latent_write_matches_reference():
    from atom.model_ops.kernels.mla_decode import write_latent
    g = torch.Generator().manual_seed(2)
    c, pe = torch.randn(5, R, generator=g), torch.randn(5, ROPE, generator=g)
    slots = torch.tensor([3, -1, 17, 40, 8])
    a, b = torch.zeros(12, BS, R + ROPE), torch.zeros(12, BS, R + ROPE)
    write_latent(c, pe, a, slots)
    write_latent_cache(c, pe, b, slots)
    assert torch.equal(a, b) and a.abs().sum() > 0


@needs_triton
def test_triton_backend_matches_torch_backend_on_a_mixed_step():
    from atom.model_ops.attention.mla_triton import TritonMLABackend
    outs = []
    for make in (lambda layer: TorchMLABackend(), lambda layer: TritonMLABackend([layer], 16)):
        layer, _ = _layer(seed=5)
        layer.backend = make(layer)
        gen = torch.Generator().manual_seed(4)
        meta, _, new, q_nope, q_pe = _mixed_step(layer, gen, [5, 1, 2, 1], [5, 9, 10, 3])
        meta.attn_backend = layer.backend
        with forward_context(meta):
            outs.append((layer(q_nope, q_pe, new[:, :R], new[:, R:]), layer.kv_cache.clone()))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=2e-5, rtol=2e-5)
    assert torch.equal(outs[1][1], outs[0][1])


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_triton_mla_decode_v2_lite_shape_on_gpu(batch):
    """DeepSeek-V2-Lite's decode shape (16 heads, latent 512 + 64, bf16, block 16) on the GPU,
    with the split count the shape picks, against the reference in fp32."""
    from atom.model_ops.kernels.mla_decode import MLAWorkspace, mla_decode
    g = torch.Generator(device="cuda").manual_seed(0)
    Hq, Rk, P, bs = 16, 512, 64, 16
    lens = torch.randint(1, 2048, (batch,), generator=g, device="cuda", dtype=torch.int32)
    nb = int((lens + bs - 1).div(bs, rounding_mode="floor").sum())
    cache = torch.randn(nb, bs, Rk + P, generator=g, device="cuda").bfloat16()
    perm = torch.randperm(nb, generator=g, device="cuda").int()
    width = -(-int(lens.max()) // bs)
    tables = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
    at = 0
    for b, L in enumerate(lens.tolist()):
        n = -(-L // bs)
        tables[b, :n] = perm[at:at + n]
        at += n
    ql = torch.randn(batch, Hq, Rk, generator=g, device="cuda").bfloat16()
    qp = torch.randn(batch, Hq, P, generator=g, device="cuda").bfloat16()
    ws = MLAWorkspace(64, Hq, Rk, device="cuda")
    out = mla_decode(ql, qp, cache, tables, lens, Rk, 0.1147, workspace=ws)
    ref = latent_decode_ref(ql.float(), qp.float(), cache.float(), tables, lens.tolist(), 0.1147)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_quantized_kv_b_proj_is_refused_at_build():
    kv_b = Linear(R, H * (NOPE + V), prefix="model.layers.0.self_attn.kv_b_proj")
    kv_b.method = type("FakeFp8", (), {"name": "fp8"})()
    with pytest.raises(ValueError, match="kv_b_proj is quantized"):
        MLAAttention(H, R, NOPE, ROPE, V, scale=0.3, layer_idx=0, kv_b_proj=kv_b)


FP8 = torch.float8_e4m3fn


def test_fp8_latent_spec_and_refused_dtypes():
    """An e4m3 latent costs a byte a value (twice the blocks of bf16 in one budget); other
    one-byte dtypes have no kernels here."""
    layer, _ = _layer()
    spec = layer.kv_cache_spec(FP8)
    assert spec == LatentAttentionSpec(R + ROPE, FP8)
    m8 = KVCacheManager({0: (layer, spec)}, block_size=BS)
    m16 = KVCacheManager({0: (layer, layer.kv_cache_spec(torch.bfloat16))}, block_size=BS)
    assert 2 * m8.bytes_per_block == m16.bytes_per_block
    assert m8.num_blocks_for(1 << 20) == (1 << 20) // m8.bytes_per_block >= 2 * m16.num_blocks_for(1 << 20)
    with pytest.raises(ValueError, match="kv_cache_dtype=int8 is not supported for MLA"):
        layer.kv_cache_spec(torch.int8)


def _fp8_step(seed, qlens, slens, scale):
    """The same mixed step over an FP8 latent cache (k_scale `scale`) and over an fp32 cache
    holding exactly the latents the FP8 one dequantizes to (the numerics reference)."""
    layer, _ = _layer(seed=seed)
    meta, latents, new, q_nope, q_pe = _mixed_step(layer, torch.Generator().manual_seed(seed), qlens, slens)
    plain = layer.kv_cache.clone()
    layer.k_scale.fill_(scale)
    deq = lambda x: (x.float() / scale).clamp(-448, 448).to(FP8).float() * scale  # noqa: E731
    layer.kv_cache = deq(plain)
    fp8 = (plain / scale).clamp(-448, 448).to(FP8)
    return layer, meta, new, q_nope, q_pe, plain, fp8, deq


@pytest.mark.parametrize("qlens,slens", [([1, 1, 1], [5, 1, 13]), ([6, 1, 3, 1], [6, 9, 11, 2])])
def test_fp8_latent_cache_reads_back_fp8_times_its_scale(qlens, slens):
    """A mixed step (absorbed decodes, a prefill over a cached prefix) over an FP8 latent cache
    gives what the same step gives over an fp32 cache of the dequantized latents (the step's own
    latents written as e4m3 of latent / k_scale), and not what the unquantized cache gives."""
    scale = 0.013
    layer, meta, new, q_nope, q_pe, plain, fp8, deq = _fp8_step(4, qlens, slens, scale)
    new_deq = deq(new)
    with forward_context(meta):  # reference: fp32 cache, the step's latents pre-rounded
        ref = layer(q_nope, q_pe, new_deq[:, :R], new_deq[:, R:])
    layer.kv_cache = fp8.clone()
    with forward_context(meta):
        out = layer(q_nope, q_pe, new[:, :R], new[:, R:])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    written = layer.kv_cache.view(-1, R + ROPE)[meta.slot_mapping]
    assert written.dtype == FP8 and torch.equal(written.float() * scale, new_deq)
    layer.kv_cache = plain.clone()
    with forward_context(meta):
        exact = layer(q_nope, q_pe, new[:, :R], new[:, R:])
    assert (exact - out).abs().max() > 1e-3, "the FP8 cache changed nothing: is it quantizing?"


def test_fp8_latent_scale_is_computed_once_from_the_first_write():
    layer, _ = _layer()
    layer.kv_scale_pending = True
    c, pe = torch.randn(4, R), torch.randn(4, ROPE)
    pe[2, 1] = 9.0  # the amax is over the whole latent
    layer.calibrate_kv_scales(c, pe)
    assert float(layer.k_scale) == pytest.approx(9.0 / 200) and layer.kv_scale_source == "computed"
    layer.calibrate_kv_scales(c * 100, pe)  # not armed any more: unchanged
    assert float(layer.k_scale) == pytest.approx(9.0 / 200)


@needs_triton
def test_triton_backend_on_a_padded_graph_batch():
    """A decode batch as a CUDA graph replays it: no host lists, padding rows with no query
    token, context 0 and slot -1 (nothing written, output rows left finite)."""
    from atom.model_ops.attention.mla_triton import TritonMLABackend
    layer, _ = _layer(seed=6)
    layer.backend = TritonMLABackend([layer], 16)
    gen = torch.Generator().manual_seed(7)
    meta, _, new, q_nope, q_pe = _mixed_step(layer, gen, [1, 1], [6, 11])
    ref_cache = layer.kv_cache.clone()
    with forward_context(meta):
        ref = TorchMLABackend().forward(layer, q_nope, q_pe, new[:, :R], new[:, R:])
    layer.kv_cache.copy_(ref_cache)
    pad = lambda x: torch.cat((x, torch.randn(2, *x.shape[1:], generator=gen)))  # noqa: E731
    graph_meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32),
        seq_lens=torch.tensor([6, 11, 0, 0], dtype=torch.int32),
        block_tables=torch.cat((meta.block_tables, torch.zeros(2, meta.block_tables.shape[1], dtype=torch.int32))),
        slot_mapping=torch.cat((meta.slot_mapping, torch.tensor([-1, -1]))), max_query_len=1, max_seq_len=64,
        attn_backend=layer.backend)
    with forward_context(graph_meta):
        out = layer.backend.forward(layer, pad(q_nope), pad(q_pe), pad(new[:, :R]), pad(new[:, R:]))
    torch.testing.assert_close(out[:2], ref, atol=2e-5, rtol=2e-5)
    assert torch.isfinite(out).all()
    assert torch.equal(layer.kv_cache.view(-1, R + ROPE)[meta.slot_mapping], new)
    written = (layer.kv_cache != ref_cache).any(-1).sum()
    assert int(written) == 2  # only the two real rows' slots


@needs_triton
@pytest.mark.parametrize("splits", [1, 4])
def test_triton_fp8_latent_write_and_decode_match_the_reference(splits):
    """The Triton write of an FP8 latent cache stores the torch reference's bytes (e4m3 of
    latent / k_scale, saturated), and the split-KV decode over it gives the reference's output."""
    from atom.model_ops.kernels.mla_decode import mla_decode, write_latent
    g = torch.Generator().manual_seed(5)
    scale = torch.tensor(0.02)
    c, pe = torch.randn(6, R, generator=g), torch.randn(6, ROPE, generator=g)
    c[0, 0] = 50.0  # past 448 * scale: saturates
    slots = torch.tensor([3, -1, 17, 40, 8, 21])
    a, b = torch.zeros(12, BS, R + ROPE, dtype=FP8), torch.zeros(12, BS, R + ROPE, dtype=FP8)
    write_latent(c, pe, a, slots, scale)
    write_latent_cache(c, pe, b, slots, kv_scale=scale)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and a.float().abs().sum() > 0
    assert float(a.view(-1, R + ROPE)[3, 0]) == 448.0
    Hq, Rk, P, nb = 4, 32, 8, 16
    cache = (torch.randn(nb, BS, Rk + P, generator=g) * 3).to(FP8)
    tables = torch.stack([torch.randperm(nb, generator=g)[:5] for _ in range(2)]).int()
    lens = [17, 6]
    ql, qp = torch.randn(2, Hq, Rk, generator=g), torch.randn(2, Hq, P, generator=g)
    ref = latent_decode_ref(ql, qp, cache, tables, lens, 0.3, kv_scale=scale)
    assert not torch.allclose(ref, latent_decode_ref(ql, qp, cache, tables, lens, 0.3))  # the scale matters
    out = mla_decode(ql, qp, cache, tables, torch.tensor(lens, dtype=torch.int32), Rk, 0.3, num_kv_splits=splits,
                     config=dict(min_split_tokens=1, TILE_N=16), kv_scale=scale)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_triton_mla_prefill_v2_lite_shape_on_gpu():
    """DeepSeek-V2-Lite's heads (16 x (128 + 64), values 128) in bf16: fresh prompts up to 1024
    tokens and a 256-token chunk after a 900-token prefix, against the per-sequence reference."""
    from atom.model_ops.attention.mla_torch import expanded_prefill_ref
    from atom.model_ops.kernels.mla_prefill import PREFILL_TILE, mla_prefill, prefill_tiles
    g = torch.Generator().manual_seed(3)
    H, nope, rope, vd = 16, 128, 64, 128
    lens = [(300, 300), (1024, 1024), (256, 1156), (17, 17)]
    spans, s, c = [], 0, 0
    for n, L in lens:
        spans.append((s, n, c, L))
        s, c = s + n, c + L
    q = torch.randn(s, H, nope + rope, generator=g).to(torch.bfloat16).cuda()
    kv = torch.randn(c, H, nope + vd, generator=g).to(torch.bfloat16).cuda()
    lat = torch.randn(c, 512 + rope, generator=g).to(torch.bfloat16).cuda()
    out = torch.empty(s, H, vd, dtype=torch.bfloat16, device="cuda")
    work = prefill_tiles(spans, PREFILL_TILE["BLOCK_M"], "cuda")
    mla_prefill(q[..., :nope], q[..., nope:], kv[..., :nope], lat[:, 512:], kv[..., nope:], work, 0.1, out)
    kf = torch.cat((kv[..., :nope], lat[:, None, 512:].expand(c, H, rope)), -1)
    for s0, n, c0, L in spans:
        ref = expanded_prefill_ref(q[s0:s0 + n].float(), kf[c0:c0 + L].float(), kv[c0:c0 + L, :, nope:].float(), 0.1)
        torch.testing.assert_close(out[s0:s0 + n].float(), ref, atol=2e-2, rtol=2e-2)
