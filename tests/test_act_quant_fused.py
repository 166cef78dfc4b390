"""The quantizer fused into the kernel in front of an 8-bit product (`kernels.act_quant_fused`:
add + RMSNorm + quantize, SiLU-and-mul + quantize), the product of an already-quantized input
(`quant.common.prequantized_product`, the methods' `apply_quantized`) and the split K folded
into the swap-AB kernel: under TRITON_INTERPRET=1 on the CPU bit for bit against the separate
kernels (fp8 and int8; rows of 100, 896, 4096, 14336; M 1, 3, 64) and near their torch
references; `@pytest.mark.gpu` checks of the same at Llama-3.1-8B shapes for the H200."""
from __future__ import annotations

import pytest
import torch

from atom.model_ops.kernels.act_quant import act_quant
from atom.model_ops.kernels.act_quant_fused import (SPLIT_BLOCK, SPLIT_MAX_ROWS, norm_quant, norm_quant_ref,
                                                    silu_amax, silu_quant, silu_quant_config, silu_quant_ref,
                                                    splits_rows)
from atom.model_ops.kernels.activation import silu_and_mul
from atom.model_ops.kernels.quant_gemm import quant_gemm_ref
from atom.model_ops.kernels.quant_gemv_dot import quant_gemv_dot_launch, small_m_config, split_k_lock
from atom.model_ops.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from atom.model_ops.kernels.triton_import import HAS_TRITON
from atom.model_ops.quant import common
from atom.tuning.fusions import FUSED_QUANT_MAX_ROWS

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (interpreter on CPU)")
FP8 = torch.float8_e4m3fn
DEV = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = [("fp8", 448.0), ("int8", 127.0), ("int8", 127.5)]


def _rows(M, N, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, N, generator=g) * scale
    x[0, : min(3, N)] *= 30  # outliers
    if M > 2:
        x[2] = 0  # an all-zero row (with a zero residual row below: the amax floor)
    return x.to(dtype).to(DEV)


def _separate_norm(x, residual, w, eps, kind, qmax):
    """What the unfused layer runs: the Triton add + RMSNorm (the full-row kernel, as
    `fused_add_rms_norm` and in-place `rms_norm` launch it), then `act_quant`."""
    if residual is None:
        h, res = rms_norm(x.clone(), w, eps, inplace=True), x
    else:
        h, res = fused_add_rms_norm(x, residual, w, eps)
    q, s = act_quant(h, kind, h.shape[1], qmax)
    return q, s, res


def _same(got, want):
    for i, (g, w) in enumerate(zip(got, want)):  # (q, scales, x + residual)
        assert g.dtype == w.dtype and g.shape == w.shape
        bad = (g.float() != w.float()).nonzero()  # (a NaN on either side differs)
        assert bad.numel() == 0, (f"output {i}: {bad.shape[0]} of {g.numel()} differ, the largest by "
                                  f"{(g.float() - w.float()).abs().max().item():.3g}, first at {bad[:4].tolist()}")


def _one_step_apart(q, qr, kind):
    """Each quantized value equals the reference's or is its neighbour on the grid (the
    row's sum in another order moves a value across a rounding boundary), in few places."""
    a, b = q.float(), qr.float()
    d = (a - b).abs()
    if kind == "int8":
        assert d.max() <= 1
    else:  # e4m3: the step at |v| is 2^(max(e, -6) - 3)
        e = torch.floor(torch.log2(torch.maximum(a.abs(), b.abs()).clamp(min=2.0 ** -9))).clamp(min=-6)
        assert (d <= 2.0 ** (e - 3)).all()
    assert (d > 0).float().mean() < 2e-3


@pytest.mark.parametrize("kind,qmax", KINDS[:2])
@pytest.mark.parametrize("M,N,split,bias", [(1, 4096, 4, False), (3, 896, 2, True), (2, 100, 3, True)])
def test_norm_quant_of_a_pending_split_k_sum(kind, qmax, M, N, split, bias):
    """A split-K product's partials left unsummed (`split_k.PendingSum`): norm_quant adds them
    as the reduction kernel stores them, then norms and quantizes: the bits of the reduction
    kernel followed by norm_quant of its output; `result()` is that output."""
    from atom.model_ops.kernels.split_k import PendingSum, split_k_sum
    g = torch.Generator().manual_seed(3)
    part = (torch.randn(split, M, N, generator=g) * 0.3).to(DEV)
    b = (torch.randn(N, generator=g)).to(torch.bfloat16).to(DEV) if bias else None
    r = _rows(M, N, torch.bfloat16, seed=4)
    w = (torch.rand(N, generator=g) + 0.5).to(torch.bfloat16).to(DEV)
    y = torch.empty(M, N, dtype=torch.bfloat16, device=DEV)
    split_k_sum(part, b, y, {"PDL": False})
    pending = PendingSum(part, b, torch.bfloat16)
    assert torch.equal(pending.result(), y) and pending.shape == (M, N) and "splits=" in repr(pending)
    _same(norm_quant(pending, r, w, 1e-5, kind, qmax), norm_quant(y, r, w, 1e-5, kind, qmax))
    with pytest.raises(ValueError, match="needs a residual"):
        norm_quant(pending, None, w, 1e-5, kind, qmax)


@pytest.mark.parametrize("kind,qmax", KINDS)
@pytest.mark.parametrize("M,N", [(1, 896), (3, 14336), (64, 4096), (3, 100)])
def test_norm_quant_is_the_separate_kernels(kind, qmax, M, N):
    x, r = _rows(M, N, torch.bfloat16), _rows(M, N, torch.bfloat16, seed=1)
    r[2:3] = 0
    w = (torch.rand(N, generator=torch.Generator().manual_seed(2)) + 0.5).to(torch.bfloat16).to(DEV)
    q, s, res = norm_quant(x, r, w, 1e-5, kind, qmax)
    assert q.dtype == (FP8 if kind == "fp8" else torch.int8) and s.shape == (M, 1) and s.dtype == torch.float32
    _same((q, s, res), _separate_norm(x, r, w, 1e-5, kind, qmax))
    if M > 2:
        assert s[2, 0] == torch.tensor(1e-12) / qmax  # the zero row takes the floor
    q, s, res = norm_quant(x, None, w, 1e-5, kind, qmax)  # the first layer: no residual
    assert res is x
    _same((q, s), _separate_norm(x, None, w, 1e-5, kind, qmax)[:2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("kind,qmax", KINDS[:2])
@pytest.mark.parametrize("M,N", [(1, 896), (3, 14336), (64, 4096)])
def test_norm_quant_near_the_torch_reference(kind, qmax, M, N, dtype):
    """Against the torch reference the sum of squares runs in another order (and, compiled,
    sqrt and division are approximate): the residual is exact, the scales within a few ulp,
    each quantized value at most one grid step off.
    (bf16 is left to the test above: the interpreter rounds bf16 casts unlike torch.)"""
    x, r = _rows(M, N, dtype), _rows(M, N, dtype, seed=1)
    w = (torch.rand(N, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype).to(DEV)
    for res_in in (r, None):
        q, s, res = norm_quant(x, res_in, w, 1e-5, kind, qmax)
        qr, sr, rr = norm_quant_ref(x, res_in, w, 1e-5, kind, qmax)
        assert torch.equal(res, rr)
        torch.testing.assert_close(s, sr, rtol=4e-6 if dtype == torch.float32 else 1e-3, atol=0)
        _one_step_apart(q, qr, kind)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind,qmax", KINDS)
@pytest.mark.parametrize("M,I", [(1, 896), (3, 14336), (64, 4096), (3, 100)])
def test_silu_quant_is_the_separate_kernels(kind, qmax, M, I, dtype):
    x = _rows(M, 2 * I, dtype, scale=2.0)
    q, s = silu_quant(x, kind, qmax)
    h = silu_and_mul(x)
    _same((q, s), act_quant(h, kind, I, qmax))
    if dtype != torch.bfloat16:  # the torch reference (its own exp and division): within a grid step
        qr, sr = silu_quant_ref(x, kind, qmax)
        torch.testing.assert_close(s, sr, rtol=4e-6, atol=0)
        _one_step_apart(q, qr, kind)


@pytest.mark.parametrize("kind,qmax", KINDS[:2])
def test_silu_quant_chunked_rows(kind, qmax):
    """Rows wider than one block (past SINGLE_PASS_MAX in the table; forced narrow here) are
    walked twice in chunks, the activation recomputed: the same result."""
    x = _rows(3, 2 * 200, torch.bfloat16, scale=2.0)
    cfg = silu_quant_config(200, single_pass_max=64)
    assert not cfg["SINGLE"]
    cfg["BLOCK"] = 64  # 200 columns: three full chunks and a partial one
    _same(silu_quant(x, kind, qmax, config=cfg), silu_quant(x, kind, qmax))
    assert silu_quant_config(14336) == dict(BLOCK=16384, SINGLE=True, num_warps=16)
    assert not silu_quant_config(28672)["SINGLE"]


@pytest.mark.parametrize("kind,qmax", KINDS)
@pytest.mark.parametrize("M,I", [(1, 14336), (2, 1500), (8, 4096)])
def test_silu_quant_split_rows(kind, qmax, M, I):
    """Wide rows at up to SPLIT_MAX_ROWS rows run over programs of SPLIT_BLOCK columns (the
    row's amax from their partials): the same values as one program a row (a config keeps
    that path), a zero row included."""
    assert M <= SPLIT_MAX_ROWS and I > SPLIT_BLOCK
    x = _rows(M, 2 * I, torch.bfloat16, scale=2.0)
    x[-1, :I] = 0  # silu(0) * up = 0: the floor scale
    q, s = silu_quant(x, kind, qmax)
    _same((q, s), silu_quant(x, kind, qmax, config=silu_quant_config(I)))
    _same((q, s), act_quant(silu_and_mul(x), kind, I, qmax))
    assert s[-1, 0] == torch.tensor(1e-12) / qmax
    # its first launch alone: the rows as silu_and_mul stores them and partials whose max is
    # each row's amax (what a product quantizing on load reads); the second launch on them
    pending = silu_amax(x, kind, qmax)
    assert torch.equal(pending.h, silu_and_mul(x)) and pending.pmax.shape == (M, -(-I // SPLIT_BLOCK))
    assert torch.equal(pending.pmax.amax(1), pending.h.float().abs().amax(1))
    _same(pending.quantize(), (q, s))
    assert splits_rows(M, I) and not splits_rows(M, SPLIT_BLOCK) and not splits_rows(SPLIT_MAX_ROWS + 1, I)
    assert "PendingQuant(" in repr(pending) and pending.shape == (M, I) and pending.dtype == torch.bfloat16


def test_empty_and_bad_input():
    x = torch.zeros(0, 64, dtype=torch.bfloat16, device=DEV)
    w = torch.ones(64, dtype=torch.bfloat16, device=DEV)
    q, s, res = norm_quant(x, x, w, 1e-5, "fp8", 448.0)
    assert q.shape == (0, 64) and s.shape == (0, 1) and res.shape == (0, 64)
    assert silu_quant(torch.zeros(0, 64, device=DEV), "int8", 127.0)[0].shape == (0, 32)
    x = _rows(2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="kind='int4'"):
        norm_quant(x, None, w, 1e-5, "int4", 7.0)
    with pytest.raises(ValueError, match="qmax=0"):
        silu_quant(x, "fp8", 0.0)
    with pytest.raises(ValueError, match=r"weight shape \(32,\)"):
        norm_quant(x, None, w[:32], 1e-5, "fp8", 448.0)
    with pytest.raises(ValueError, match="residual shape"):
        norm_quant(x, x[:1], w, 1e-5, "fp8", 448.0)
    with pytest.raises(ValueError, match=r"x \[M, 2I\]"):
        silu_quant(x[:, :63], "fp8", 448.0)


# ---------------------------------------------------------------------------
# the product of an already-quantized input, and the folded split K
# ---------------------------------------------------------------------------

def _weights(kind, N, K, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind == "fp8":
        wq = (torch.randn(N, K, generator=g) * 50).clamp(-448, 448).to(FP8)
    else:
        wq = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    ws = torch.rand(N, 1, generator=g) * 0.01 + 1e-3
    return wq.to(DEV), ws.to(DEV), torch.randn(N, generator=g).to(torch.bfloat16).to(DEV)


@pytest.mark.parametrize("kind,qmax", KINDS[:2])
def test_prequantized_product_is_quantized_product(kind, qmax, monkeypatch):
    """Every route (swap-AB at M <= 64, then the GEMM or torch._scaled_mm): the product of
    act_quant's (q, scale) is the product `quantized_product` computes from x, bit for bit,
    with and without the split K folded in; its torch reference is the methods'."""
    N, K = 64, 2048  # 2048 / 256 = 8 K steps: the table splits K in two at every M <= 64
    monkeypatch.setattr(common, "ONE_ROW_FP8", False)  # (the swap-AB kernel at one row too: its fold is checked)
    wq, ws, bias = _weights(kind, N, K)
    assert small_m_config(1, N, K)["SPLIT_K"] == 2
    lock = split_k_lock(N, DEV)
    for M in (1, 3, 64, 70):
        x = _rows(M, K, torch.bfloat16, seed=M)
        q, s = act_quant(x, kind, K, qmax)
        for b in (None, bias):
            want = common.quantized_product(x, wq, ws, b, kind, "token", qmax)
            for lk in (None, lock):
                got = common.prequantized_product(q, s, wq, ws, b, torch.bfloat16, lock=lk)
                assert got.dtype == torch.bfloat16 and torch.equal(got, want), (M, b is None, lk is None)
            assert torch.equal(lock, torch.zeros_like(lock))  # left zero for the next launch
        ref = common.prequantized_ref(q, s, wq.float() * ws, bias, torch.bfloat16)
        fake = common.product(x, common.fake_quant_act(x, kind, "token", qmax=qmax), wq.float() * ws, bias)
        assert torch.equal(ref, fake)  # q * scale is the fake-quantized input exactly
        want = quant_gemm_ref(q, s.reshape(-1), wq, ws.reshape(-1), bias, torch.bfloat16)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max().item())


def test_prequantized_product_one_scale_and_bad_input():
    wq, ws, bias = _weights("fp8", 48, 256)
    x = _rows(1, 256, torch.bfloat16)
    q, s = act_quant(x, "fp8", 256, 448.0)
    one = common.prequantized_product(q, s.reshape(()), wq, ws, bias, torch.bfloat16, w_scalar=ws[0, 0])
    assert torch.equal(one, common.prequantized_product(q, s, wq, ws, bias, torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[M, K=256\]"):
        common.prequantized_product(q[:, :128], s, wq, ws, None, torch.bfloat16)
    with pytest.raises(ValueError, match="!= the weight's"):
        common.prequantized_product(q.view(torch.int8), s, wq, ws, None, torch.bfloat16)
    with pytest.raises(ValueError, match="float8_e4m3fn or int8"):
        common.prequantized_product(x, s, wq, ws, None, torch.bfloat16)
    with pytest.raises(ValueError, match="one a row"):
        common.prequantized_product(q, torch.ones(3, device=DEV), wq, ws, None, torch.bfloat16)
    with pytest.raises(ValueError, match="split-K lock"):
        quant_gemv_dot_launch(q, s.reshape(-1), wq, ws.reshape(-1), None, torch.bfloat16,
                              config=dict(M_PAD=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=2, num_warps=4, num_stages=2),
                              lock=torch.zeros(2, dtype=torch.int32, device=DEV))


@pytest.mark.parametrize("split", [2, 3])
def test_folded_split_k_with_uneven_splits(split):
    """The fold with the kernel's own tiles: N not a multiple of BLOCK_N, splits of unequal
    length (K = 160: five 32-wide steps), bias, int8's exact int32 sums: the separate
    reduction's bits, the counters back at zero."""
    for kind, qmax in KINDS[:2]:
        M, N, K = 3, 40, 160
        wq, ws, bias = _weights(kind, N, K)
        q, s = act_quant(_rows(M, K, torch.bfloat16), kind, K, qmax)
        cfg = dict(M_PAD=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=split, num_warps=4, num_stages=2)
        lock = split_k_lock(N, DEV)
        want = quant_gemv_dot_launch(q, s.reshape(-1), wq, ws.reshape(-1), bias, torch.bfloat16, config=cfg)
        got = quant_gemv_dot_launch(q, s.reshape(-1), wq, ws.reshape(-1), bias, torch.bfloat16, config=cfg,
                                    lock=lock)
        assert torch.equal(got, want) and not lock.any()


def test_kernels_compile_for_sm90():
    """The fused kernels build for sm90 (the norm-quantizer also summing a pending split-K
    product) with the quantizer's correctly rounded division and e4m3 conversion, and PDL's
    wait (tests/act_quant_fused_sm90.py, a child process)."""
    from sm90_child import run_sm90_check
    got = run_sm90_check("act_quant_fused_sm90.py")
    assert len(got) == 10 and "norm_quant_sum_fp8" in got
    # and the norm-quantizer holds the row's columns as the norm kernel does (the sum of
    # squares in its order: the one-byte q stores alone spread 16 columns a thread, and the
    # fp32 sums then round differently now and then)
    assert {"norm_layout_bf16", "norm_layout_fp16", "norm_layout_fp32", "norm_layout_sum_bf16"} <= set(got)
    for name, flags in got.items():
        assert all(flags.values()), (name, flags)


# ---------------------------------------------------------------------------
# H200: Llama-3.1-8B shapes
# ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind,qmax,M", [(k, q, m) for k, q in KINDS[:2] for m in (1, 3, 64, 100, 128, 300, 2048)
                                          if m <= FUSED_QUANT_MAX_ROWS.get(k, m)])
def test_fused_quantizers_on_gpu_are_the_separate_kernels(kind, qmax, M):
    """Compiled for the GPU, the fused kernels give the separate kernels' bits (the norm's
    sum in the same order: the same jit function, block and warps) at the 8B shapes, for the
    rows the fusions take (fp8 every row count; int8 up to FUSED_QUANT_MAX_ROWS, set where
    it differed by a step at 128 rows, and at 300, before the quantizer's stores took the
    norm's layout)."""
    H, I = 4096, 14336
    x, r = _rows(M, H, torch.bfloat16), _rows(M, H, torch.bfloat16, seed=1)
    w = (torch.rand(H, device="cuda") + 0.5).to(torch.bfloat16)
    for res in (r, None):
        got = norm_quant(x, res, w, 1e-5, kind, qmax)
        _same(got, _separate_norm(x, res, w, 1e-5, kind, qmax))
        qr, sr, _ = norm_quant_ref(x, res, w, 1e-5, kind, qmax)
        torch.testing.assert_close(got[1], sr, rtol=1e-2, atol=0)
    y = _rows(M, 2 * I, torch.bfloat16, scale=2.0)
    _same(silu_quant(y, kind, qmax), act_quant(silu_and_mul(y), kind, I, qmax))
    _same(silu_quant(y[:, :2 * 896], kind, qmax), act_quant(silu_and_mul(y[:, :2 * 896]), kind, 896, qmax))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind,qmax", KINDS[:2])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_folded_split_k_on_gpu(kind, qmax, N, K, monkeypatch):
    """The folded split K against the separate reduction on the GPU, bit for bit, many times
    over (a missing barrier or fence would show as a moving result), eagerly and replayed in
    a CUDA graph, and the counters left at zero; and against the reference. (One row of fp8
    runs the swap-AB kernel here too, `ONE_ROW_FP8` off: `fp8_gemv1` splits no K to fold.)"""
    monkeypatch.setattr(common, "ONE_ROW_FP8", False)
    wq, ws, bias = _weights(kind, N, K)
    lock = split_k_lock(N, "cuda")
    for M in (1, 8, 64):
        x = _rows(M, K, torch.bfloat16, seed=M)
        q, s = act_quant(x, kind, K, qmax)
        want = common.prequantized_product(q, s, wq, ws, bias, torch.bfloat16)
        assert torch.equal(want, common.quantized_product(x, wq, ws, bias, kind, "token", qmax))
        for _ in range(50):
            assert torch.equal(common.prequantized_product(q, s, wq, ws, bias, torch.bfloat16, lock=lock), want)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = common.prequantized_product(q, s, wq, ws, bias, torch.bfloat16, lock=lock)
        for _ in range(50):
            out.zero_()
            g.replay()
            assert torch.equal(out, want)
        assert not lock.any()
        ref = quant_gemm_ref(q, s.reshape(-1), wq, ws.reshape(-1), bias, torch.bfloat16)
        torch.testing.assert_close(want.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())
