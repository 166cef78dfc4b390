"""The swap-AB tensor-core small-M 8-bit product (`kernels.quant_gemv_dot`) against
`quant_gemm_ref`: under TRITON_INTERPRET=1 on tiny shapes (fp8 row / column scales, fp8
blocks, int8; M 1, 3, 16; SPLIT_K 1 and 2; N not a multiple of BLOCK_N; bias), the fused
activation quantizer against `act_quant_ref` + the reference, its dispatch table, and
`@pytest.mark.gpu` checks at the Llama-3.1-8B shapes for the H200."""
from __future__ import annotations

import pytest
import torch

from atom.model_ops.kernels.act_quant import act_quant_ref
from atom.model_ops.kernels.quant_gemm import quant_gemm_ref
from atom.model_ops.kernels.pending_quant import PendingQuant
from atom.model_ops.kernels.quant_gemv_dot import (DOT_MAX_M, MID_MAX_M, quant_gemv_dot, quant_gemv_dot_fused,
                                                    quant_gemv_dot_fused_launch, quant_gemv_dot_launch,
                                                    quant_gemv_dot_pending_launch, small_m_config)
from atom.model_ops.kernels.split_k import PendingSum
from atom.model_ops.kernels.triton_import import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (interpreter on CPU)")
FP8 = torch.float8_e4m3fn
DEV = "cuda" if torch.cuda.is_available() else "cpu"
QMAX = {"fp8": 448.0, "int8": 127.0}


def _x(M, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * 0.7
    x[0, : min(3, K)] *= 30  # outliers
    if M > 2:
        x[2] = 0  # an all-zero row takes the amax floor
    return x.to(dtype).to(DEV)


def _weights(kind, N, K, block_k, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind == "fp8":
        wq = (torch.randn(N, K, generator=g) * 50).clamp(-448, 448).to(FP8)
    else:
        wq = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    ws = torch.rand(*((N, K // block_k) if block_k else (N,)), generator=g) * 0.01 + 1e-3
    bias = torch.randn(N, generator=g)
    return wq.to(DEV), ws.to(DEV), bias.to(DEV)


def _close(y, ref, dtype):
    assert y.dtype == ref.dtype == dtype and y.shape == ref.shape
    tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(y.float(), ref.float(), **tol)


def _cfg(M, split, block_n=16, block_k=32):
    return dict(M_PAD=max(16, 1 << (M - 1).bit_length()), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
                num_warps=4, num_stages=2)


# N = 40: two full 16-row tiles and a partial one; K = 96 / 160: three / five 32-wide steps,
# so SPLIT_K = 2 gives splits of unequal length
CASES = [(1, 40, 96), (3, 40, 160), (16, 24, 96)]


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("M,N,K", CASES)
def test_row_column_scales(kind, M, N, K, split):
    dtype = torch.bfloat16
    x = _x(M, K, dtype)
    wq, ws, bias = _weights(kind, N, K, 0)
    xq, xs = act_quant_ref(x, kind, K, QMAX[kind])
    xs = xs.reshape(-1)
    for b in (None, bias):
        ref = quant_gemm_ref(xq, xs, wq, ws, b, dtype)
        _close(quant_gemv_dot_launch(xq, xs, wq, ws, b, dtype, config=_cfg(M, split)), ref, dtype)
        # the quantizer folded in: the same quantized operand, so the same product
        _close(quant_gemv_dot_fused_launch(x, wq, ws, b, kind, QMAX[kind], config=_cfg(M, split)), ref, dtype)
    # one (per-tensor) activation scale, pre-quantized and static-fused
    scale = torch.tensor(0.05, device=DEV)
    xq1, xs1 = act_quant_ref(x, kind, K, QMAX[kind], scale)
    ref1 = quant_gemm_ref(xq1, xs1[:1, 0], wq, ws, bias, dtype)
    _close(quant_gemv_dot_launch(xq1, xs1[:1, 0], wq, ws, bias, dtype, config=_cfg(M, split)), ref1, dtype)
    _close(quant_gemv_dot_fused_launch(x, wq, ws, bias, kind, QMAX[kind], static_scale=scale,
                                       config=_cfg(M, split)), ref1, dtype)


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("M,N,K,bk", [(1, 40, 96, 32), (3, 40, 128, 32), (16, 24, 128, 64)])
def test_block_scales(M, N, K, bk, split):
    dtype = torch.bfloat16
    x = _x(M, K, dtype)
    wq, ws, bias = _weights("fp8", N, K, bk)
    xq, xs = act_quant_ref(x, "fp8", bk, 448.0)
    ref = quant_gemm_ref(xq, xs, wq, ws, bias, dtype, bk)
    _close(quant_gemv_dot_launch(xq, xs, wq, ws, bias, dtype, bk, config=_cfg(M, split)), ref, dtype)
    _close(quant_gemv_dot_fused_launch(x, wq, ws, bias, "fp8", 448.0, bk, config=_cfg(M, split)), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_activation_dtypes_and_the_default_table(dtype):
    """fp16 / fp32 in and out, through the custom ops (the table's own tiles)."""
    M, N, K = 3, 72, 256
    x = _x(M, K, dtype)
    wq, ws, bias = _weights("fp8", N, K, 0)
    xq, xs = act_quant_ref(x, "fp8", K, 448.0)
    ref = quant_gemm_ref(xq, xs.reshape(-1), wq, ws, bias, dtype)
    _close(quant_gemv_dot(xq, xs.reshape(-1), wq, ws, bias, dtype), ref, dtype)
    _close(quant_gemv_dot_fused(x, wq, ws, bias, "fp8", 448.0), ref, dtype)


def test_fused_quantizer_is_act_quant_bit_for_bit():
    """With one-hot weights (w = I, unit scales) the product returns the fused quantizer's
    dequantized activations: they equal act_quant_ref's exactly (fp32 out)."""
    M, K = 3, 64
    x = _x(M, K, torch.float32)
    for kind, bk in (("fp8", 0), ("int8", 0), ("fp8", 32)):
        w = torch.eye(K, device=DEV).to(FP8 if kind == "fp8" else torch.int8)
        ws = torch.ones(*((K, K // bk) if bk else (K,)), device=DEV)
        y = quant_gemv_dot_fused_launch(x, w, ws, None, kind, QMAX[kind], bk, config=_cfg(M, 1, 16, bk or 32))
        q, s = act_quant_ref(x, kind, bk or K, QMAX[kind])
        deq = (q.float().reshape(M, -1, bk or K) * s.unsqueeze(-1)).reshape(M, K)
        assert torch.equal(y, deq), kind


def _pending(x, kind, chunk):
    """x's rows with one partial amax per `chunk` columns (as the kernel in front writes them)."""
    M, K = x.shape
    cols = torch.arange(K, device=x.device)
    pmax = torch.stack([x.float().abs().masked_fill((cols // chunk != p)[None, :], 0).amax(1)
                        for p in range(-(-K // chunk))], 1)
    return PendingQuant(x, pmax.contiguous(), kind, QMAX[kind])


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("M,N,K", CASES)
def test_rows_quantized_on_load_are_the_prequantized_product(kind, M, N, K, split):
    """Rows quantized inside the product with the scale from their partial amaxes (one row
    quantized alone and placed in the padded operand, X1; or every row): the bits of
    act_quant's q and scales through the same tiles; a split K left pending sums to them too.
    The fused quantizer (its own amax walk) gives them as well."""
    x = _x(M, K, torch.bfloat16)
    wq, ws, bias = _weights(kind, N, K, 0)
    pending = _pending(x, kind, 48)
    q, s = act_quant_ref(x, kind, K, QMAX[kind])
    _same_bits = lambda a, b: a.dtype == b.dtype and torch.equal(a, b)  # noqa: E731
    assert all(_same_bits(a, b) for a, b in zip(pending.quantize(), (q, s)))
    cfg = _cfg(M, split)
    want = quant_gemv_dot_launch(q, s.reshape(-1), wq, ws, bias, torch.bfloat16, config=cfg)
    assert _same_bits(quant_gemv_dot_pending_launch(pending, wq, ws, bias, torch.bfloat16, config=cfg), want)
    assert _same_bits(quant_gemv_dot_fused_launch(x, wq, ws, bias, kind, QMAX[kind], config=cfg), want)
    later = quant_gemv_dot_pending_launch(pending, wq, ws, bias, torch.bfloat16, config=cfg, defer_sum=True)
    assert isinstance(later, PendingSum) == (split > 1)
    assert _same_bits(later.result() if split > 1 else later, want)


def test_pending_rows_refuse_what_they_cannot_be():
    x = _x(2, 64, torch.bfloat16)
    wq, ws, _ = _weights("fp8", 16, 64, 0)
    with pytest.raises(ValueError, match="pending rows quantize to int8, the weight is torch.float8_e4m3fn"):
        quant_gemv_dot_pending_launch(_pending(x, "int8", 32), wq, ws, None, torch.bfloat16)
    bad = _pending(x, "fp8", 32)
    bad.pmax = bad.pmax[:1]
    with pytest.raises(ValueError, match=r"partial amaxes: fp32 \[M=2, P\] wanted"):
        quant_gemv_dot_pending_launch(bad, wq, ws, None, torch.bfloat16)


def test_table():
    assert small_m_config(DOT_MAX_M + 1, 6144, 4096) is None  # q/k/v: torch._scaled_mm from 65 rows
    assert small_m_config(DOT_MAX_M + 1, 4096, 4096, kind="int8") is None
    # ptpc fp8 into narrow outputs from long rows (o_proj, down): one 128-row tile to 128 rows
    for M, N, K in ((65, 4096, 4096), (128, 4096, 14336)):
        mid = small_m_config(M, N, K)
        assert (mid["M_PAD"], mid["BLOCK_N"], mid["BLOCK_K"], mid["SPLIT_K"], mid["FUSE"]) == (128, 64, 128, 4, False)
    for kw in (dict(M=129), dict(N=4097), dict(K=2048), dict(block_k=128), dict(act="tensor"), dict(big_smem=False)):
        args = dict(dict(M=100, N=4096, K=4096), **kw)
        assert small_m_config(args.pop("M"), args.pop("N"), args.pop("K"), **args) is None, kw
    c = small_m_config(1, 4096, 4096)
    assert c["M_PAD"] == 16 and c["SPLIT_K"] > 1 and not c["FUSE"]  # fusing measured slower
    assert small_m_config(1, 28672, 4096)["SPLIT_K"] == 1  # 448 row tiles already fill the GPU
    assert small_m_config(64, 4096, 4096)["M_PAD"] == 64 and not small_m_config(64, 4096, 4096)["FUSE"]
    assert small_m_config(8, 4096, 4096, block_k=128)["BLOCK_K"] == 128
    down, qkv = small_m_config(1, 4096, 14336), small_m_config(16, 6144, 4096)  # the decode tiles of the wide sweep
    assert (down["BLOCK_N"], down["num_warps"], down["SPLIT_K"]) == (128, 8, 4)
    assert (qkv["BLOCK_K"], qkv["num_stages"], qkv["SPLIT_K"]) == (128, 6, 4)
    assert small_m_config(17, 4096, 14336)["BLOCK_N"] == 64 and small_m_config(1, 4096, 4096)["BLOCK_K"] == 256
    assert small_m_config(1, 4096, 14336, block_k=128)["BLOCK_N"] == 64  # block scales keep the measured tiles
    assert small_m_config(1, 4096, 14336, kind="int8")["BLOCK_N"] == 64  # int8 was not swept so
    assert small_m_config(1, 4096, 14336, big_smem=False)["num_stages"] == 4  # sm86 / sm89: the older tile
    assert small_m_config(1, 4096, 14336, big_smem=False)["BLOCK_N"] == 64
    for M in (1, 5, 33, 64):  # every split keeps K steps
        for N, K in LLAMA:
            c = small_m_config(M, N, K)
            assert (K // c["BLOCK_K"]) // c["SPLIT_K"] >= 4


def test_mid_rows_take_one_128_row_tile():
    """ptpc fp8 at 65-128 rows into a narrow output from long rows: the table's 128-row tile
    (the rows past M masked) against the reference, and the product's route: the swap-AB
    kernel there, torch._scaled_mm from 129 rows."""
    from atom.model_ops.quant import common
    M, N, K = 100, 64, 4096
    dtype = torch.bfloat16
    x = _x(M, K, dtype)
    wq, ws, bias = _weights("fp8", N, K, 0)
    xq, xs = act_quant_ref(x, "fp8", K, 448.0)
    xs = xs.reshape(-1)
    _close(quant_gemv_dot_launch(xq, xs, wq, ws, bias, dtype), quant_gemm_ref(xq, xs, wq, ws, bias, dtype), dtype)
    assert common.product_route("fp8", M, x, N) == "dot"
    assert common.product_route("fp8", MID_MAX_M + 1, x, N) == "scaled_mm"
    assert common.product_route("fp8", M, x, N, act="tensor") == "scaled_mm"


def test_rejects_bad_input():
    x = _x(3, 64, torch.bfloat16)
    wq, ws, _ = _weights("fp8", 16, 64, 0)
    with pytest.raises(ValueError, match="M <= 64"):
        quant_gemv_dot_fused_launch(_x(65, 64, torch.bfloat16), wq, ws, None, "fp8", 448.0)
    with pytest.raises(ValueError, match="M_PAD=8"):
        quant_gemv_dot_fused_launch(x, wq, ws, None, "fp8", 448.0, config=dict(_cfg(3, 1), M_PAD=8))
    with pytest.raises(ValueError, match="kind='int4'"):
        quant_gemv_dot_fused_launch(x, wq, ws, None, "int4", 7.0)
    with pytest.raises(ValueError, match="w dtype"):
        quant_gemv_dot_fused_launch(x, wq, ws, None, "int8", 127.0)
    with pytest.raises(ValueError, match="ws shape"):
        quant_gemv_dot_fused_launch(x, wq, ws[:3], None, "fp8", 448.0)
    with pytest.raises(ValueError, match="static_scale with block_k"):
        quant_gemv_dot_fused_launch(x, wq, torch.ones(16, 2, device=DEV), None, "fp8", 448.0, 32,
                                    static_scale=torch.tensor(0.1, device=DEV))
    with pytest.raises(ValueError, match="block_k=48"):
        quant_gemv_dot_fused_launch(x, wq, ws, None, "fp8", 448.0, 48)


# ---------------------------------------------------------------------------
# H200: Llama-3.1-8B shapes
# ---------------------------------------------------------------------------

LLAMA = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("M", [1, 8, 64])
@pytest.mark.parametrize("N,K", LLAMA)
@pytest.mark.parametrize("fmt", ["fp8_channel", "fp8_block", "int8"])
def test_llama_shapes_on_gpu(fmt, N, K, M):
    """Both launchers with the table's tiles; errors against max|ref| (Hopper's fp8 tensor
    cores accumulate with fewer mantissa bits than fp32: see test_quant_kernels_fp8)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    x = (torch.randn(M, K, device="cuda") * 0.5).to(dtype)
    w = torch.randn(N, K, device="cuda") * 0.02
    if fmt == "fp8_block":
        s = w.reshape(N // 128, 128, K // 128, 128).abs().amax((1, 3)) / 448
        full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
        wq, bk, kind = (w / full).to(FP8), 128, "fp8"
        ws = s.repeat_interleave(128, 0).contiguous()
    elif fmt == "int8":
        ws = w.abs().amax(1) / 127
        wq, bk, kind = torch.round(w / ws[:, None]).clamp(-128, 127).to(torch.int8), 0, "int8"
    else:
        ws = w.abs().amax(1) / 448
        wq, bk, kind = (w / ws[:, None]).to(FP8), 0, "fp8"
    bias = torch.randn(N, device="cuda").to(dtype)
    xq, xs = act_quant_ref(x, kind, bk or K, QMAX[kind])
    xs = xs if bk else xs.reshape(-1)
    ref = quant_gemm_ref(xq, xs, wq, ws, bias, dtype, bk)
    tol = dict(rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())
    y = quant_gemv_dot_launch(xq, xs, wq, ws, bias, dtype, bk)
    torch.testing.assert_close(y.float(), ref.float(), **tol)
    y = quant_gemv_dot_fused_launch(x, wq, ws, bias, kind, QMAX[kind], bk)
    torch.testing.assert_close(y.float(), ref.float(), **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("N,K", [(4096, 4096), (4096, 14336)])
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_rows_quantized_on_load_on_gpu(kind, N, K, M):
    """o_proj's and down's shapes with the table's tiles: rows quantized on load from partial
    amaxes (X1 at one row) give the prequantized product's bits."""
    x = (torch.randn(M, K, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 0.5).to(torch.bfloat16)
    wq, ws, bias = _weights(kind, N, K, 0)
    pending = _pending(x, kind, 1024)
    q, s = pending.quantize()
    want = quant_gemv_dot_launch(q, s.reshape(-1), wq, ws, bias.to(torch.bfloat16), torch.bfloat16)
    got = quant_gemv_dot_pending_launch(pending, wq, ws, bias.to(torch.bfloat16), torch.bfloat16)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("M", [65, 80, 128])
@pytest.mark.parametrize("N,K", [(4096, 4096), (4096, 14336)])
def test_mid_rows_on_gpu(N, K, M):
    """ptpc fp8 products of 65-128 rows at Llama-3.1-8B's o_proj and down shapes, as the
    engine runs them (`quantized_product`: the quantizer, then the swap-AB kernel's 128-row
    tile), against the reference and torch._scaled_mm (the route before)."""
    from atom.model_ops.quant import common
    torch.manual_seed(M)
    x = (torch.randn(M, K, device="cuda") * 0.5).bfloat16()
    w = torch.randn(N, K, device="cuda") * 0.02
    ws = w.abs().amax(1) / 448
    wq = (w / ws[:, None]).to(FP8)
    assert common.product_route("fp8", M, x, N) == "dot"
    xq, xs = act_quant_ref(x, "fp8", K, 448.0)
    ref = quant_gemm_ref(xq, xs.reshape(-1), wq, ws, None, torch.bfloat16)
    tol = dict(rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())
    y = common.quantized_product(x, wq, ws, None, "fp8", "token", 448.0)
    torch.testing.assert_close(y.float(), ref.float(), **tol)
    mm = common._scaled_mm(xq, xs.reshape(-1), wq, ws, None, torch.bfloat16, None)
    torch.testing.assert_close(y.float(), mm.float(), **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("M", [1, 16, 64, 128])
@pytest.mark.parametrize("N,K", LLAMA + [(40, 96)])
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_weights_through_tma_give_the_pointer_loads_bits(kind, N, K, M):
    """Weight tiles through TMA (and, fp8, the first one loaded before the PDL wait) give the
    masked pointer loads' bits: the same tiles summed in the same order; TMA's zero fill
    stands for the masks past N (40 rows in 16-row tiles) and past K."""
    cfg = small_m_config(M, N, K, kind=kind) if (N, K) != (40, 96) else dict(_cfg(M, 2), num_stages=3)
    if cfg is None:
        pytest.skip(f"{kind} takes another route at M={M}")
    cfg = {k: v for k, v in cfg.items() if k != "FUSE"}
    x = (torch.randn(M, K, device="cuda", generator=torch.Generator("cuda").manual_seed(M)) * 0.5).bfloat16()
    wq, ws, bias = _weights(kind, N, K, 0)
    xq, xs = act_quant_ref(x, kind, K, QMAX[kind])
    xs, bias = xs.reshape(-1), bias.bfloat16()
    want = quant_gemv_dot_launch(xq, xs, wq, ws, bias, torch.bfloat16, config=dict(cfg, TMA=False))
    ref = quant_gemm_ref(xq, xs, wq, ws, bias, torch.bfloat16)
    torch.testing.assert_close(want.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())
    assert torch.equal(quant_gemv_dot_launch(xq, xs, wq, ws, bias, torch.bfloat16, config=dict(cfg, TMA=True)), want)
    early = quant_gemv_dot_launch(xq, xs, wq, ws, bias, torch.bfloat16, config=dict(cfg, TMA=True, EARLY=True))
    assert torch.equal(early, want)


def test_tma_asked_where_it_cannot_run_names_why():
    """A config asking for TMA on a device without it is refused with the reason; the table's
    own launches fall back to pointer loads there."""
    if torch.cuda.is_available():
        pytest.skip("the CPU's refusal")
    x = _x(1, 96, torch.bfloat16)
    wq, ws, _ = _weights("fp8", 40, 96, 0)
    xq, xs = act_quant_ref(x, "fp8", 96, 448.0)
    with pytest.raises(ValueError, match="TMA=True: .*not an NVIDIA sm90"):
        quant_gemv_dot_launch(xq, xs.reshape(-1), wq, ws, None, torch.bfloat16, config=dict(_cfg(1, 1), TMA=True))
    y = quant_gemv_dot_launch(xq, xs.reshape(-1), wq, ws, None, torch.bfloat16, config=_cfg(1, 1))
    _close(y, quant_gemm_ref(xq, xs.reshape(-1), wq, ws, None, torch.bfloat16), torch.bfloat16)


def test_kernel_compiles_for_sm90():
    """The compiled (not interpreted) kernel builds for sm90 with tensor-core instructions and
    pipelined (asynchronous) weight copies, fused and not, fp8 and int8, the folded split K's
    counter, rows quantized on load from partial amaxes, weight tiles through TMA (the first
    one before the PDL wait with EARLY) (tests/quant_gemv_dot_sm90.py in a
    child process without the interpreter)."""
    from sm90_child import run_sm90_check
    got = run_sm90_check("quant_gemv_dot_sm90.py")
    assert len(got) == 19
    for name, flags in got.items():
        assert all(flags.values()), (name, flags)
