"""Triton kernels against their torch references.

Two parametrizations: ``cpu`` runs the kernels under Triton's interpreter
(small shapes, fp32/fp16: the interpreter's bf16 ``tl.dot`` is wrong) and
``gpu`` (marked ``gpu``, skipped without CUDA) runs bigger shapes incl. bf16
and contexts up to 8k.  Outputs are poisoned with NaN before every call so an
element the kernel forgot to write fails the comparison.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from atom.model_ops.attention.triton_unified import (  # noqa: E402
    AttentionWorkspace,
    paged_attention_ref,
    unified_attention,
)
from atom.model_ops.kernels import (  # noqa: E402
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    reshape_and_cache,
    reshape_and_cache_ref,
    rms_norm,
    rms_norm_ref,
    rotary_embedding,
    rotary_embedding_ref,
    gumbel_sample,
    gumbel_sample_ref,
    gemv,
    gemv_fused,
    gemv_fused_ref,
    gemv_ref,
    silu_and_mul,
    silu_and_mul_ref,
)

from atom.model_ops.attention import triton_unified as _tu  # noqa: E402

# Triton decides at kernel-definition time: if another module imported the kernels
# before TRITON_INTERPRET was set, they are compiled kernels and the CPU cases skip.
_INTERPRET = type(_tu._unified_attn_kernel).__name__ == "InterpretedFunction"

CPU = pytest.param(
    "cpu", id="cpu",
    marks=pytest.mark.skipif(not _INTERPRET, reason="CPU cases need the kernels defined under TRITON_INTERPRET=1"))
GPU = pytest.param(
    "cuda", id="gpu",
    marks=[pytest.mark.gpu,
           pytest.mark.skipif(not torch.cuda.is_available() or _INTERPRET, reason="needs CUDA")])

# (atol, rtol, max relative-norm error) per dtype
TOL = {
    torch.float32: (1e-4, 1e-4, 1e-5),
    torch.float16: (5e-3, 1e-2, 2e-3),
    torch.bfloat16: (3e-2, 3e-2, 1.2e-2),
}


def _check_close(out, ref, dtype, what=""):
    atol, rtol, rel_max = TOL[dtype]
    out, ref = out.float(), ref.float()
    assert not torch.isnan(out).any(), f"{what}: NaN in output (unwritten elements?)"
    rel = ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    assert rel < rel_max, f"{what}: relative error {rel:.2e} >= {rel_max:.0e}"
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------- attention


def _make_batch(kinds, Hq, Hkv, D, block_size, dtype, device, max_ctx, seed, pad_tokens=0):
    """A ragged batch: each kind is prefill / chunk (cached context + several
    tokens) / decode / empty (query_len 0).  Block tables are a random
    permutation of the pool with -1 past each sequence's blocks."""
    rng = random.Random(seed)
    qlens, slens = [], []
    for kind in kinds:
        if kind == "prefill":
            L = rng.randint(1, max_ctx)
            q = L
        elif kind == "chunk":
            L = rng.randint(3, max_ctx)
            q = rng.randint(2, L - 1)
        elif kind == "decode":
            L = rng.randint(1, max_ctx)
            q = 1
        elif kind == "empty":
            L = rng.randint(1, max_ctx)
            q = 0
        else:  # a fixed (query_len, seq_len) pair
            q, L = kind
        qlens.append(q)
        slens.append(L)
    B = len(kinds)
    nblk = [-(-L // block_size) for L in slens]
    max_blocks = max(nblk) + 2
    pool = sum(nblk) + 7
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(pool, block_size, Hkv, D, generator=g).to(dtype).to(device)
    v_cache = torch.randn(pool, block_size, Hkv, D, generator=g).to(dtype).to(device)
    perm = torch.randperm(pool, generator=g)
    bt = torch.full((B, max_blocks), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[i:i + n].int()
        i += n
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(qlens).cumsum(0)
    T = int(cu[-1]) + pad_tokens
    q = torch.randn(T, Hq, D, generator=g).to(dtype).to(device)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu.to(device),
                seq_lens=torch.tensor(slens, dtype=torch.int32, device=device),
                block_tables=bt.to(device), softmax_scale=1.0 / math.sqrt(D),
                max_query_len=max(qlens) if qlens else 0)


def _run_attention(batch, dtype, what, num_kv_splits=None, workspace=None, n_valid=None, config=None):
    q = batch["q"]
    out = torch.full_like(q, float("nan"))
    ref = torch.full_like(q, float("nan"))
    args = {k: v for k, v in batch.items() if k != "q"}
    unified_attention(q, out=out, workspace=workspace, num_kv_splits=num_kv_splits, config=config, **args)
    paged_attention_ref(q, out=ref, **args)
    n = int(batch["cu_seqlens_q"][-1]) if n_valid is None else n_valid
    if n:
        _check_close(out[:n], ref[:n], dtype, what)
    return out


MIXED = ["prefill", "chunk", "decode", "empty", "decode", "chunk", "decode", "prefill", "decode"]

CPU_ATTN = [  # (D, Hkv, qpkv, block_size, dtype)
    (64, 2, 1, 16, torch.float32),
    (64, 1, 2, 32, torch.float16),
    (128, 1, 4, 16, torch.float16),
    (64, 1, 8, 64, torch.float32),
    (128, 2, 8, 32, torch.float16),
    (64, 3, 3, 16, torch.float16),  # SmolLM2's 9 q / 3 kv heads
    (32, 2, 2, 16, torch.float32),
    (128, 2, 2, 64, torch.float16),  # Qwen3's grouping
    (64, 4, 1, 32, torch.float16),
    (80, 1, 2, 16, torch.float32),  # head dim padded to 128 inside the kernel
]
GPU_ATTN = [
    (D, Hkv, qpkv, bs, dt)
    for D in (64, 128) for qpkv in (1, 2, 4, 8) for bs in (16, 32, 64)
    for Hkv, dt in ((8 // qpkv if qpkv < 8 else 1, torch.bfloat16),)
] + [
    (128, 8, 2, 16, torch.float16), (64, 3, 3, 16, torch.bfloat16),
    (128, 2, 4, 32, torch.float32), (256, 1, 8, 16, torch.bfloat16),
]


def _attn_cases():
    cases = [pytest.param("cpu", *c, id=f"cpu-D{c[0]}-kv{c[1]}-g{c[2]}-bs{c[3]}-{str(c[4])[6:]}",
                          marks=CPU.marks) for c in CPU_ATTN]
    cases += [pytest.param("cuda", *c, id=f"gpu-D{c[0]}-kv{c[1]}-g{c[2]}-bs{c[3]}-{str(c[4])[6:]}",
                           marks=GPU.marks) for c in GPU_ATTN]
    return cases


@pytest.mark.parametrize("device,D,Hkv,qpkv,block_size,dtype", _attn_cases())
def test_attention_mixed_batch(device, D, Hkv, qpkv, block_size, dtype):
    max_ctx = 100 if device == "cpu" else 3000
    kinds = MIXED if device == "cpu" else MIXED * 3
    batch = _make_batch(kinds, Hkv * qpkv, Hkv, D, block_size, dtype, device, max_ctx,
                        seed=D * 7 + qpkv * 3 + block_size)
    _run_attention(batch, dtype, "mixed")


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("kinds", [["prefill"], ["chunk", "chunk"], [(1, 1), (1, 2), (5, 5)]],
                         ids=["one-prefill", "two-chunks", "tiny"])
def test_attention_edge_batches(device, kinds):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    batch = _make_batch(kinds, 4, 2, 64, 16, dtype, device, 90, seed=len(kinds))
    _run_attention(batch, dtype, str(kinds))


@pytest.mark.parametrize("device", [CPU, GPU])
def test_attention_register_cap(device, monkeypatch):
    """`maxnreg` in the tuning config reaches the kernel's launch (a cap on registers per
    thread, for more programs per SM; the GPU compiles under it, spilling what does not fit)
    and keeps the results; without it the launch carries no cap."""
    launches = []
    kernel = _tu._unified_attn_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs)
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(_tu, "_unified_attn_kernel", Recording())
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    kinds = ["decode"] * 5 + ["prefill", "chunk"]
    batch = _make_batch(kinds, 32, 8, 128, 16, dtype, device, 90 if device == "cpu" else 2000, seed=11)
    _run_attention(batch, dtype, "maxnreg 96", config={"maxnreg": 96})
    _run_attention(batch, dtype, "no cap")
    assert [k.get("maxnreg") for k in launches] == [96, None]


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("splits", [None, 4])
def test_attention_rows_ahead(device, splits):
    """`rows_ahead` (each tile's block-table entries loaded one tile ahead, carried through the
    masked and unmasked tile loops) gives the reference's result on mixed batches: prefills,
    chunks, decodes and sequences shorter than a tile; with 3 stages on a GPU."""
    cpu = device == "cpu"
    dtype = torch.float32 if cpu else torch.bfloat16
    cfg = {"rows_ahead": True} if cpu else {"rows_ahead": True, "num_stages": 3}
    for D, Hkv, qpkv, bs in ((64, 2, 2, 16), (128, 1, 4, 32)):
        batch = _make_batch(MIXED + [(1, 1), (1, 3)], Hkv * qpkv, Hkv, D, bs, dtype, device,
                            100 if cpu else 3000, seed=D + bs + 1)
        _run_attention(batch, dtype, f"rows_ahead D={D}", num_kv_splits=splits, config=cfg)
        decode = _make_batch(["decode"] * 5, Hkv * qpkv, Hkv, D, bs, dtype, device, 150 if cpu else 5000, seed=D)
        _run_attention(decode, dtype, f"rows_ahead decode D={D}", num_kv_splits=splits, config=cfg)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("splits", [None, 2, 8])
def test_attention_split_kv_decode(device, splits):
    cpu = device == "cpu"
    dtype = torch.float16 if cpu else torch.bfloat16
    n = 3 if cpu else 6
    kinds = ["decode"] * n + [(1, 1)]  # incl. a sequence shorter than the split count
    for D, Hkv, qpkv, bs in ((64, 1, 4, 16), (128, 2, 2, 32)) if cpu else \
            ((128, 8, 2, 16), (64, 1, 8, 64), (128, 2, 4, 16)):
        batch = _make_batch(kinds, Hkv * qpkv, Hkv, D, bs, dtype, device,
                            120 if cpu else 8192, seed=D + bs)
        _run_attention(batch, dtype, f"split={splits} D={D}", num_kv_splits=splits)


def test_decode_split_choice_by_programs():
    """Segments for decode batches of fewer than 3 programs per SM in the grid (132 SMs off
    the GPU); none for more, nor for batches with prefill tokens."""
    from atom.model_ops.attention.triton_unified import pick_attention_config
    cpu = torch.device("cpu")

    def splits(seqs, max_q=1):
        return pick_attention_config(seqs * max_q, seqs, 32, 8, 128, max_q, cpu)["num_splits"]

    assert splits(1) == 16 and splits(8) == 8  # 8 / 64 programs
    assert splits(23) == 4 and splits(37) == 2  # 224 / 368 programs: the workload's tail
    assert splits(48) == 1 and splits(256) == 1  # 480+ programs
    assert splits(4, max_q=16) == 1  # prefill tokens: one pass


def test_fp8_cache_decode_tile_by_sequences():
    """Decode batches of FP8_WIDE_TILE_MIN_SEQS sequences or more over an FP8 cache take 128-key
    tiles; fewer sequences, prefill tokens, a bf16 cache and wide heads keep the 64 (32) of bf16."""
    from atom.model_ops.attention.triton_unified import FP8_WIDE_TILE_MIN_SEQS, pick_attention_config
    cpu = torch.device("cpu")

    def tile(seqs, max_q=1, fp8=True, d=128):
        return pick_attention_config(seqs * max_q, seqs, 32, 8, d, max_q, cpu, kv_fp8=fp8)["TILE_N"]

    n = FP8_WIDE_TILE_MIN_SEQS
    assert tile(n) == 128 and tile(256) == 128
    assert tile(n - 1) == 64 and tile(1) == 64
    assert tile(n, fp8=False) == 64 and tile(256, fp8=False) == 64
    assert tile(n, max_q=16) == 64  # prefill tokens
    assert tile(n, d=256) == 32  # heads wider than 128: the bf16 tile
    # the rest of the choice is the bf16 cache's
    a = pick_attention_config(n, n, 32, 8, 128, 1, cpu, kv_fp8=True)
    b = pick_attention_config(n, n, 32, 8, 128, 1, cpu)
    assert {k: v for k, v in a.items() if k != "TILE_N"} == {k: v for k, v in b.items() if k != "TILE_N"}


@pytest.mark.parametrize("device", [CPU, GPU])
def test_attention_split_kv_on_mixed_batch(device):
    """Forced splits also serve prefills and chunks (the merge is general)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    batch = _make_batch(["chunk", "decode", "prefill", "empty"], 4, 1, 64, 16, dtype, device,
                        80 if device == "cpu" else 2000, seed=5)
    _run_attention(batch, dtype, "split mixed", num_kv_splits=4)


@pytest.mark.parametrize("device", [CPU, GPU])
def test_attention_workspace_and_padding(device):
    """Workspace reuse across batches; tokens past cu_seqlens_q[-1] stay untouched."""
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    ws = AttentionWorkspace(16, 8, 64, max_splits=8, device=device)
    assert "AttentionWorkspace" in repr(ws)
    for seed, kinds in enumerate((["decode"] * 3, ["decode"] * 5, ["decode", (1, 1)])):
        batch = _make_batch(kinds, 8, 2, 64, 16, dtype, device, 70, seed=seed, pad_tokens=2)
        out = _run_attention(batch, dtype, f"ws {seed}", num_kv_splits=8, workspace=ws)
        assert torch.isnan(out[-2:]).all(), "padding tokens were written"
    # too many tokens for the workspace: falls back to one pass, still right
    batch = _make_batch(["decode"] * 20, 8, 2, 64, 16, dtype, device, 40, seed=9)
    _run_attention(batch, dtype, "ws overflow", num_kv_splits=8, workspace=ws)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("splits", [1, 4])
def test_attention_stores_each_heads_amax(device, splits):
    """`amax`: each token's and head's largest |value| of the output as stored, from the
    one-pass kernel and from the split merge (a product quantizing the output on load reads
    them as partial amaxes); padding tokens' entries are left as they were; a bad buffer is
    refused by name."""
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    batch = _make_batch(["decode", "decode", (1, 1)], 8, 2, 64, 16, dtype, device, 70, seed=3, pad_tokens=2)
    q = batch["q"]
    args = {k: v for k, v in batch.items() if k != "q"}
    out = torch.full_like(q, float("nan"))
    amax = torch.full(q.shape[:2], -1.0, dtype=torch.float32, device=q.device)
    unified_attention(q, out=out, num_kv_splits=splits, amax=amax, **args)
    n = int(batch["cu_seqlens_q"][-1])
    assert torch.equal(amax[:n], out[:n].float().abs().amax(-1)) and (amax[n:] == -1).all()
    plain = torch.full_like(q, float("nan"))
    unified_attention(q, out=plain, num_kv_splits=splits, **args)
    assert torch.equal(plain[:n], out[:n])  # the amax changes nothing else
    with pytest.raises(ValueError, match=r"amax must be fp32 \[T, Hq\]"):
        unified_attention(q, out=out, num_kv_splits=splits, amax=amax[:, :4], **args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or _INTERPRET, reason="needs CUDA")
def test_attention_long_context_gpu():
    for kinds in ([(1, 8192), (1, 8000), (1, 4096)], [(300, 8192), (1, 6000), (2048, 2048)]):
        batch = _make_batch(kinds, 16, 8, 128, 16, torch.bfloat16, "cuda", 8192, seed=1)
        _run_attention(batch, torch.bfloat16, f"long {kinds}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or _INTERPRET, reason="needs CUDA")
def test_attention_cuda_graph_replay():
    """Captured once (split path + workspace), replayed with new lengths and tables."""
    dtype, dev, B, Hq, Hkv, D, bs = torch.bfloat16, "cuda", 4, 16, 8, 128, 16
    max_blocks = 64
    ws = AttentionWorkspace(B, Hq, D, device=dev)
    pool = B * max_blocks
    k_cache = torch.randn(pool, bs, Hkv, D, device=dev, dtype=dtype)
    v_cache = torch.randn(pool, bs, Hkv, D, device=dev, dtype=dtype)
    q = torch.randn(B, Hq, D, device=dev, dtype=dtype)
    out = torch.empty_like(q)
    cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
    seq_lens = torch.full((B,), 5, device=dev, dtype=torch.int32)
    bt = torch.randperm(pool, device=dev).int().view(B, max_blocks)

    def step():
        unified_attention(q, k_cache, v_cache, out, cu, seq_lens, bt, D ** -0.5, 1, ws)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for lens in ([1, 17, 300, 1000], [1024, 3, 64, 999]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.normal_()
        bt.copy_(torch.randperm(pool, device=dev).int().view(B, max_blocks))
        out.fill_(float("nan"))
        g.replay()
        ref = paged_attention_ref(q, k_cache, v_cache, torch.empty_like(q), cu, seq_lens, bt,
                                  D ** -0.5, 1)
        _check_close(out, ref, dtype, f"graph {lens}")


# --------------------------------------------------------------------------- small kernels


def _dtypes(device):
    return (torch.float32, torch.float16) if device == "cpu" else \
        (torch.float32, torch.float16, torch.bfloat16)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("D", [64, 128])
def test_reshape_and_cache(device, D):
    for dtype in _dtypes(device):
        T, Hq, Hkv, nb, bs = 11, 4, 2, 6, 16
        qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device=device).to(dtype)
        key = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)  # strided views, as a model has
        value = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
        slots = torch.randperm(nb * bs)[:T].to(device)
        slots[3] = -1
        slots[7] = -5
        kc = torch.full((nb, bs, Hkv, D), float("nan"), device=device, dtype=dtype)
        vc = kc.clone()
        kc_r, vc_r = kc.clone(), vc.clone()
        reshape_and_cache(key, value, kc, vc, slots)
        reshape_and_cache_ref(key, value, kc_r, vc_r, slots)
        assert torch.equal(kc.isnan(), kc_r.isnan()) and torch.equal(vc.isnan(), vc_r.isnan())
        assert torch.equal(kc.nan_to_num(0), kc_r.nan_to_num(0))
        assert torch.equal(vc.nan_to_num(0), vc_r.nan_to_num(0))


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("N", [576, 1024, 4096, 100, 128])
def test_rms_norm(device, N):
    for dtype in _dtypes(device):
        T = 9
        x = torch.randn(T, N, device=device).to(dtype)
        r = torch.randn(T, N, device=device).to(dtype)
        w = (1 + 0.1 * torch.randn(N, device=device)).to(dtype)
        _check_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), dtype, "rms_norm")
        n, nr = fused_add_rms_norm(x, r, w, 1e-6)
        n_ref, nr_ref = fused_add_rms_norm_ref(x, r, w, 1e-6)
        _check_close(n, n_ref, dtype, "fused normed")
        _check_close(nr, nr_ref, dtype, "fused residual")
        x2, r2 = x.clone(), r.clone()
        a, b = fused_add_rms_norm(x2, r2, w, 1e-6, inplace=True)
        assert a.data_ptr() == x2.data_ptr() and b.data_ptr() == r2.data_ptr()
        _check_close(x2, n_ref, dtype, "inplace normed")
        _check_close(r2, nr_ref, dtype, "inplace residual")
        x3 = torch.randn(2, 3, N, device=device).to(dtype)  # leading dims
        _check_close(rms_norm(x3, w), rms_norm_ref(x3, w), dtype, "3-D")
        # per-head norms read in place: the q heads of a fused [q | k | v] row, 4-D leading dims
        qkv = torch.randn(T, 7 * N, device=device).to(dtype)
        q = qkv[:, :4 * N].view(T, 4, N)
        _check_close(rms_norm(q, w), rms_norm_ref(q, w), dtype, "strided heads")
        x4 = torch.randn(2, 3, 2, N, device=device).to(dtype)
        _check_close(rms_norm(x4, w), rms_norm_ref(x4, w), dtype, "4-D")
        _check_close(rms_norm(x4.transpose(1, 2), w), rms_norm_ref(x4.transpose(1, 2), w), dtype, "4-D strided")


def _cos_sin(max_pos, D, theta, device):
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    f = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None]
    return torch.cat([f.cos(), f.sin()], dim=-1).to(device)


def _hf_rotate(x, cos, sin):  # HF Llama's apply_rotary_pos_emb on [T, H, D]
    D = x.shape[-1]
    c = torch.cat([cos, cos], -1)[:, None]
    s = torch.cat([sin, sin], -1)[:, None]
    rot = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * c + rot * s


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 9, 3), (128, 16, 8)])
@pytest.mark.parametrize("norm", [False, True])
def test_rotary_embedding(device, D, Hq, Hkv, norm):
    for dtype in _dtypes(device):
        T, max_pos = 13, 4096
        cs = _cos_sin(max_pos, D, 1e6, device)
        pos = torch.randint(0, max_pos, (T,), device=device)
        qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device=device).to(dtype)
        q, k = qkv[:, :Hq * D], qkv[:, Hq * D:(Hq + Hkv) * D]  # views into qkv
        qw = kw = None
        if norm:
            qw = (1 + 0.1 * torch.randn(D, device=device)).to(dtype)
            kw = (1 + 0.1 * torch.randn(D, device=device)).to(dtype)
        q_r, k_r = q.clone(), k.clone()
        v_before = qkv[:, (Hq + Hkv) * D:].clone()
        rotary_embedding(pos, q, k, cs, D, qw, kw, 1e-6)
        rotary_embedding_ref(pos, q_r, k_r, cs, D, qw, kw, 1e-6)
        _check_close(q, q_r, dtype, "rope q")
        _check_close(k, k_r, dtype, "rope k")
        assert torch.equal(qkv[:, (Hq + Hkv) * D:], v_before), "rope wrote past k"
        if not norm and dtype == torch.float32:  # the reference agrees with HF's formula
            half = D // 2
            c, s = cs[pos][:, :half], cs[pos][:, half:]
            q0 = torch.randn(T, Hq, D, device=device)
            q1 = q0.clone().view(T, Hq * D)
            rotary_embedding_ref(pos, q1, torch.zeros(T, D, device=device), cs, D)
            torch.testing.assert_close(q1.view(T, Hq, D), _hf_rotate(q0, c, s))


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_embedding_on_mla_views(device, interleaved):
    """DeepSeek's rope dims, rotated in place inside the projections' outputs (q_pe [T, H, 64]
    of q [T, H, 192], k_pe [T, 64] of kv_a [T, 576]) == `DeepseekRotaryEmbedding`'s torch
    path (fresh tensors), pairs (2i, 2i + 1) or (i, i + 32); nothing else of q / kv_a moves."""
    from atom.model_ops.rotary_yarn import DeepseekRotaryEmbedding
    params = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
              "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}
    rope = DeepseekRotaryEmbedding(64, 8192, params, interleaved=interleaved).to(device)
    for dtype in _dtypes(device):
        T, H = 11, 5
        pos = torch.randint(0, 8192, (T,), device=device)
        q = torch.randn(T, H * 192, device=device).to(dtype)
        kv_a = torch.randn(T, 576, device=device).to(dtype)
        q_pe, k_pe = q.view(T, H, 192)[..., 128:], kv_a[:, 512:]
        q_ref, k_ref = rope.rotate(q_pe, *_mla_cos_sin(rope, pos)), rope.rotate(k_pe[:, None], *_mla_cos_sin(rope, pos))
        q0, kv0 = q.clone(), kv_a.clone()
        rotary_embedding(pos, q_pe, k_pe, rope.cos_sin_cache, 64, interleaved=interleaved)
        _check_close(q_pe, q_ref, dtype, "rope q_pe")
        _check_close(k_pe, k_ref[:, 0], dtype, "rope k_pe")
        assert torch.equal(q.view(T, H, 192)[..., :128], q0.view(T, H, 192)[..., :128]), "rope wrote q_nope"
        assert torch.equal(kv_a[:, :512], kv0[:, :512]), "rope wrote kv_c"
        q2, k2 = q0.view(T, H, 192)[..., 128:].clone(), kv0[:, 512:].clone()
        rotary_embedding_ref(pos, q2, k2, rope.cos_sin_cache, 64, interleaved=interleaved)
        _check_close(q2, q_ref, dtype, "rope ref q_pe")
        _check_close(k2, k_ref[:, 0], dtype, "rope ref k_pe")
    with pytest.raises(ValueError, match="interleaved"):
        rotary_embedding(pos, q_pe, k_pe, rope.cos_sin_cache, 64, interleaved=True,
                         kv_cache=(k_pe, None, None, pos))


def _mla_cos_sin(rope, pos):
    cos, sin = rope.cos_sin_cache[pos].chunk(2, dim=-1)
    return cos[:, None, :], sin[:, None, :]


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("D,Hq,Hkv,bs", [(64, 9, 3, 16), (128, 16, 8, 32)])
@pytest.mark.parametrize("norm", [False, True])
def test_rotary_embedding_writes_kv_cache(device, D, Hq, Hkv, bs, norm):
    """rope(+norm) with the cache write fused == rope, then reshape_and_cache (two launches)."""
    for dtype in _dtypes(device):
        T, max_pos, nblk = 11, 2048, 6
        cs = _cos_sin(max_pos, D, 1e4, device)
        pos = torch.randint(0, max_pos, (T,), device=device)
        qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device=device).to(dtype)
        qw = kw = None
        if norm:
            qw = (1 + 0.1 * torch.randn(D, device=device)).to(dtype)
            kw = (1 + 0.1 * torch.randn(D, device=device)).to(dtype)
        slots = torch.randperm(nblk * bs, device=device)[:T].to(torch.int64)
        slots[3] = -1  # a padding row: must write nothing
        split = lambda t: (t[:, :Hq * D], t[:, Hq * D:(Hq + Hkv) * D], t[:, (Hq + Hkv) * D:])  # noqa: E731
        caches = [torch.full((nblk, bs, Hkv, D), float("nan"), device=device, dtype=dtype) for _ in range(4)]
        q, k, v = split(qkv.clone())
        rotary_embedding(pos, q, k, cs, D, qw, kw, 1e-6, kv_cache=(v, caches[0], caches[1], slots))
        q_r, k_r, v_r = split(qkv.clone())
        rotary_embedding_ref(pos, q_r, k_r, cs, D, qw, kw, 1e-6, kv_cache=(v_r, caches[2], caches[3], slots))
        _check_close(q, q_r, dtype, "fused rope q")
        _check_close(k, k_r, dtype, "fused rope k")
        written = torch.zeros(nblk * bs, dtype=torch.bool, device=device)
        written[slots[slots >= 0]] = True
        for got, ref, name in ((caches[0], caches[2], "k_cache"), (caches[1], caches[3], "v_cache")):
            flat_got, flat_ref = got.view(nblk * bs, -1), ref.view(nblk * bs, -1)
            assert torch.isnan(flat_got[~written]).all(), f"{name}: a slot outside the mapping was written"
            _check_close(flat_got[written], flat_ref[written], dtype, name)
        kc2, vc2 = caches[2].clone(), caches[3].clone()  # the two-launch path gives the same cache
        reshape_and_cache_ref(k_r.view(T, Hkv, D), v_r.view(T, Hkv, D), kc2, vc2, slots)
        assert torch.equal(kc2.nan_to_num(), caches[2].nan_to_num())


def test_rotary_embedding_kv_cache_shape_errors():
    T, D = 3, 64
    q, k, v = torch.zeros(T, 2 * D), torch.zeros(T, D), torch.zeros(T, D)
    cs, pos, slots = torch.zeros(16, D), torch.zeros(T, dtype=torch.long), torch.arange(T)
    with pytest.raises(ValueError, match="k_cache must be"):
        rotary_embedding(pos, q, k, cs, D, kv_cache=(v, torch.zeros(2, 16, 2, D), torch.zeros(2, 16, 2, D), slots))
    with pytest.raises(ValueError, match="slot_mapping has 2 entries"):
        rotary_embedding(pos, q, k, cs, D, kv_cache=(v, torch.zeros(2, 16, 1, D), torch.zeros(2, 16, 1, D), slots[:2]))
    with pytest.raises(ValueError, match="value must be"):
        rotary_embedding(pos, q, k, cs, D, kv_cache=(v[:2], torch.zeros(2, 16, 1, D), torch.zeros(2, 16, 1, D), slots))


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("I", [1536, 3072, 100])
def test_silu_and_mul(device, I):
    for dtype in _dtypes(device):
        x = (2 * torch.randn(7, 2 * I, device=device)).to(dtype)
        _check_close(silu_and_mul(x), silu_and_mul_ref(x), dtype, "silu_and_mul")


@pytest.mark.parametrize("device", [CPU, GPU])
def test_gumbel_sample_distribution(device):
    """Each row's draws follow softmax(logits / T); T = 0 rows are the argmax; bf16 logits are
    read as they are. Frequencies over many rows against the exact probabilities."""
    # the interpreter runs each program in Python: few rows (a looser bound) on the CPU
    V, rows = (8, 400) if device == "cpu" else (37, 60000)
    g = torch.Generator().manual_seed(0)
    base = 2 * torch.randn(V, generator=g)
    cases = ((torch.float32, 0.7),) if device == "cpu" else ((torch.float32, 0.7), (torch.bfloat16, 1.3))
    for dtype, T in cases:
        logits = base.to(dtype).to(device)[None].expand(rows, V).contiguous()
        temps = torch.full((rows,), T, device=device)
        ids = gumbel_sample(logits, temps, seed=1234)
        assert ids.dtype == torch.int64 and ids.shape == (rows,) and int(ids.min()) >= 0 and int(ids.max()) < V
        freq = torch.bincount(ids.cpu(), minlength=V).float() / rows
        p = torch.softmax(base.to(dtype).float() / T, dim=-1)
        tol = 4 * (p * (1 - p) / rows).sqrt() + 1e-3  # ~4 standard deviations per token
        assert ((freq - p).abs() <= tol).all(), f"{dtype}: max gap {(freq - p).abs().max():.4f}"
        ref = gumbel_sample_ref(logits.cpu(), temps.cpu(), torch.Generator().manual_seed(1))
        freq_ref = torch.bincount(ref, minlength=V).float() / rows
        assert ((freq_ref - p).abs() <= tol).all()  # the reference draws from the same distribution
    assert not torch.equal(gumbel_sample(logits[:64], temps[:64], 1), gumbel_sample(logits[:64], temps[:64], 2))


@pytest.mark.parametrize("device", [CPU, GPU])
def test_gumbel_sample_greedy_rows_and_shapes(device):
    V = 2100 if device == "cpu" else 151936  # more than one block of the vocab loop
    logits = torch.randn(6, V, device=device)
    temps = torch.tensor([0.0, 0.8, 0.0, 1.0, 0.0, 0.5], device=device)
    ids = gumbel_sample(logits, temps, seed=7)
    greedy = logits.argmax(-1)
    assert torch.equal(ids[temps == 0], greedy[temps == 0])
    logits[4, V - 1] = 1e4  # the max in the last, partial block
    assert int(gumbel_sample(logits, temps, seed=7)[4]) == V - 1
    wide = torch.randn(3, 2 * V, device=device)[:, :V]  # a row stride larger than V
    assert torch.equal(gumbel_sample(wide, torch.zeros(3, device=device), 0), wide.argmax(-1))
    with pytest.raises(ValueError, match="temperatures must be"):
        gumbel_sample(logits, temps[:2], 0)


def test_split_vocab_covers_the_vocab():
    from atom.model_ops.kernels.sampling import split_vocab
    for rows in (1, 3, 64, 200, 1000):
        for V in (8, 2048, 2100, 128256, 151936):
            chunk, n = split_vocab(rows, V)
            assert chunk % 2048 == 0 and (n - 1) * chunk < V <= n * chunk, (rows, V, chunk, n)
    assert split_vocab(1, 128256)[1] == 63 and split_vocab(512, 128256)[1] == 1


@pytest.mark.parametrize("device", [CPU, GPU])
def test_gumbel_sample_equal_logits_equally_often(device):
    """Columns spread over the first 2048-column block, and one in the next block, with equal
    logits: each is drawn about equally often (a noise counter shared by two of them would
    make the lower one always win over the other; a block's mass counted wrongly would skew
    the last one)."""
    rows = 400 if device == "cpu" else 20000
    cols = [3, 515, 1027, 1539, 2051]
    logits = torch.full((rows, 2100), float("-inf"), device=device)
    logits[:, cols] = 0.0
    ids = gumbel_sample(logits, torch.ones(rows, device=device), seed=11).cpu()
    counts = torch.tensor([(ids == c).sum().item() for c in cols], dtype=torch.float32)
    assert counts.sum() == rows  # only the finite columns are ever drawn
    freq = counts / rows
    tol = 5 * (0.2 * 0.8 / rows) ** 0.5
    assert ((freq - 0.2).abs() <= tol).all(), freq


@pytest.mark.parametrize("device", [CPU, GPU])
def test_gumbel_sample_across_blocks(device):
    """The two levels (a 2048-column block by its mass, then a column inside it) give
    softmax(logits / T) over columns in three blocks, four of them in the first block (whose
    mass is then ~3.5 times a column's: a block weighed by its max alone would be drawn
    ~0.3 times as often), NaN beside them (never drawn) and a block of -inf and NaN only."""
    rows = 800 if device == "cpu" else 60000
    V = 6200
    cols = torch.tensor([1, 700, 1500, 2047, 2048, 6199])
    vals = torch.tensor([1.0, 1.0, 0.5, 1.0, 1.0, 2.0])
    T = 0.8
    logits = torch.full((rows, V), float("-inf"), device=device)
    logits[:, cols.to(device)] = vals.to(device)
    logits[:, 701:710] = float("nan")  # in the first block, beside drawn columns
    logits[:, 4100:4110] = float("nan")  # the third block: NaN and -inf only
    ids = gumbel_sample(logits, torch.full((rows,), T, device=device), seed=5).cpu()
    assert bool(torch.isin(ids, cols).all()), ids[~torch.isin(ids, cols)][:5]
    freq = torch.stack([(ids == c).float().mean() for c in cols])
    p = torch.softmax(vals / T, dim=0)
    tol = 4 * (p * (1 - p) / rows).sqrt() + 1e-3
    assert ((freq - p).abs() <= tol).all(), (freq, p)


@pytest.mark.parametrize("device", [CPU, GPU])
def test_gumbel_sample_block_mass_counts_every_column(device):
    """A block's mass sums all its columns, not only its max: block 0 holds one logit 0 and
    2047 logits -2, the next block one logit ln(1 + 2047 e^-2): each half the mass."""
    rows = 800 if device == "cpu" else 20000
    logits = torch.full((rows, 4096), float("-inf"), device=device)
    logits[:, :2048] = -2.0
    logits[:, 0] = 0.0
    logits[:, 3000] = math.log(1 + 2047 * math.exp(-2))
    ids = gumbel_sample(logits, torch.ones(rows, device=device), seed=9).cpu()
    assert int(((ids >= 2048) & (ids != 3000)).sum()) == 0
    in_first = (ids < 2048).float().mean()
    assert abs(float(in_first) - 0.5) <= 4 * (0.25 / rows) ** 0.5, float(in_first)
    assert abs(float((ids == 0).float().mean()) - 0.5 / (1 + 2047 * math.exp(-2))) <= 0.02


@pytest.mark.parametrize("device", [CPU, GPU])
def test_gumbel_sample_infinities_and_ties(device):
    """+inf logits: a sampled row takes its first +inf column, like a greedy row; an all -inf
    row gives column 0 either way; greedy ties inside one block go to the lowest column, with
    and without temperatures in the batch."""
    V = 4300
    logits = torch.randn(4, V, device=device)
    logits[0, 3000] = float("inf")
    logits[1, [2500, 4200]] = float("inf")
    logits[2] = float("-inf")
    logits[3, [7, 9]] = 100.0  # a tie inside the first block
    for temps in (torch.ones(4, device=device), torch.zeros(4, device=device), None):
        ids = gumbel_sample(logits, temps, seed=3).tolist()
        assert ids[:3] == [3000, 2500, 0], (temps, ids)
        if temps is None or not bool(temps.any()):
            assert ids[3] == 7, ids


@pytest.mark.parametrize("device", [CPU, GPU])
def test_gumbel_sample_chunks_agree(device, monkeypatch):
    """The vocab split over programs: greedy (no temperatures) is the argmax with ties to the
    lowest index across chunk borders; a sampled row's draw does not depend on how its vocab
    is split over programs (the noise is counted per (row, block) and (row, column))."""
    V = 4200 if device == "cpu" else 151936  # three 2048-wide chunks on the CPU
    logits = torch.randn(2, V, device=device)
    logits[0, 5] = logits[0, V - 3] = 50.0  # a tie across the first and last chunk
    logits[1, 2048] = 60.0                  # the first column of the second chunk
    assert gumbel_sample(logits, None).tolist() == [5, 2048]
    assert torch.equal(gumbel_sample(logits, None), gumbel_sample(logits, torch.zeros(2, device=device)))
    temps = torch.tensor([1.0, 1.0], device=device)
    flat = torch.zeros(2, V, device=device)  # uniform rows: the draw is wherever the noise peaks
    split = gumbel_sample(flat, temps, seed=3)
    from atom.model_ops.kernels import sampling
    monkeypatch.setattr(sampling, "_TARGET_PROGRAMS", 1)  # one program per row
    assert sampling.split_vocab(2, V)[1] == 1
    assert torch.equal(gumbel_sample(flat, temps, seed=3), split)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("N,K", [(40, 96), (130, 600), (1024, 3072), (6144, 1024)])
def test_gemv(device, N, K):
    if device == "cpu" and N * K > 100_000:
        pytest.skip("large shapes on the GPU only")
    for dtype in _dtypes(device):
        x = torch.randn(1, K, device=device).to(dtype)
        w = (torch.randn(N, 2 * K, device=device) / K ** 0.5).to(dtype)[:, :K]  # row stride 2K
        _check_close(gemv(x, w), gemv_ref(x, w), dtype, "gemv")
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.zeros(2, K, device=device), w)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("gated", [False, True])
def test_gemv_every_candidate_config(device, gated):
    """Each tiling the start-up choice may pick (1-4 rows per program, with and without the
    next tile loaded ahead, K chunks of 512 and 1024 with a partial last chunk, a partial last
    row block) gives the reference's result and residual, plain and fused."""
    from atom.model_ops.kernels.gemv import gemv_candidates
    N, K = 130, 2600
    x = torch.randn(1, K, device=device)
    res = torch.randn(1, K, device=device)
    w = torch.randn(N, K, device=device) / K ** 0.5
    nw = torch.rand(K, device=device) + 0.5
    y_ref, res_ref = gemv_fused_ref(x, res, nw, 1e-6, w, gated)
    for cfg in gemv_candidates(N // 2 if gated else N, K, gated):
        if not gated:
            _check_close(gemv(x, w, cfg), gemv_ref(x, w), torch.float32, f"gemv {cfg}")
        y, new_res = gemv_fused(x, res, nw, 1e-6, w, gated, cfg)
        _check_close(y, y_ref, torch.float32, f"gemv_fused {cfg}")
        assert torch.equal(new_res, res_ref), cfg


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("N,K", [(40, 96), (130, 600), (4096, 1024), (12288, 1024), (1024, 3072)])
@pytest.mark.parametrize("gated", [False, True])
def test_gemv_fused(device, N, K, gated):
    """RMSNorm (with and without the residual add) folded into the GEMV, and the SiLU-and-mul
    epilogue of a [gate | up] weight, against the reference and the new residual exactly."""
    if device == "cpu" and N * K > 100_000:
        pytest.skip("large shapes on the GPU only")
    for dtype in _dtypes(device):
        x = torch.randn(1, K, device=device).to(dtype)
        res = torch.randn(1, K, device=device).to(dtype)
        nw = (torch.rand(K, device=device) + 0.5).to(dtype)
        w = (torch.randn(N, 2 * K, device=device) / K ** 0.5).to(dtype)[:, :K]  # row stride 2K
        for r in (res, None):
            y, new_res = gemv_fused(x, r, nw, 1e-6, w, gated)
            y_ref, res_ref = gemv_fused_ref(x, r, nw, 1e-6, w, gated)
            assert y.shape == (1, N // 2 if gated else N)
            _check_close(y, y_ref, dtype, f"gemv_fused gated={gated} residual={r is not None}")
            assert torch.equal(new_res, res_ref)
    with pytest.raises(ValueError, match="norm weight"):
        gemv_fused(x, res, nw[:-1], 1e-6, w, gated)


def test_gemv_fused_ref_is_the_unfused_layers():
    """The reference composes the layers' own references: add + RMSNorm, x W^T, SiLU-and-mul."""
    g = torch.Generator().manual_seed(3)
    x, res = torch.randn(1, 64, generator=g).half(), torch.randn(1, 64, generator=g).half()
    nw, w = torch.rand(64, generator=g).half() + 0.5, torch.randn(48, 64, generator=g).half() / 8
    h, r = fused_add_rms_norm_ref(x, res, nw, 1e-6)
    y, r2 = gemv_fused_ref(x, res, nw, 1e-6, w, gated=True)
    assert torch.equal(r2, r)
    torch.testing.assert_close(y, silu_and_mul_ref(gemv_ref(h, w)), atol=2e-3, rtol=2e-3)
