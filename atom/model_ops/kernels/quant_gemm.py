"""y = (xq * xs) (wq * ws)^T (+ b) for 8-bit quantized operands (FP8 e4m3 or INT8), in Triton.

Operands: xq [M, K] (float8_e4m3fn or int8, from `act_quant`), wq [N, K] of the same kind
(row-major), and scales in one of two layouts:
- row / column (`block_k` = 0): xs [M] or one value (per-token or per-tensor
  activations), ws [N] (per-channel weights, or a per-tensor weight scale repeated over its
  shard's rows); y = (sum_k xq wq) * xs[m] * ws[n], the scales applied once at the end;
- blocks (`block_k` > 0, FP8 block): xs [M, K / block_k], ws [N, K / block_k] (the
  weight's block scales expanded to one row per output row, so that each packed shard keeps
  its own partial edge blocks); y = sum_kb (sum_{k in kb} xq wq) * xs[m, kb] * ws[n, kb].

Two kernels:
- `_qgemv_kernel`, small M (decode, M <= GEMV_MAX_M): weight streaming on the CUDA cores,
  launched with programmatic dependent launch behind the activation quantizer.
  A program owns BLOCK_N output rows and every one of the M rows (so each weight byte is
  read once), walks K in BLOCK_K chunks with coalesced loads, accumulates in fp32. At M
  fp32 multiply-adds per weight byte it stays under the HBM limit up to M ~ 4 on an H200
  (33 T FMA/s against 4.3 TB/s), hence the threshold.
- `_qgemm_kernel`, M above that: tiles with tl.dot (fp8 x fp8 -> fp32, int8 x int8 ->
  int32, exact), programs grouped GROUP_M row tiles at a time so that neighbours share
  weight tiles in L2, pointer loads (no TMA). With blocks each K step is one block
  (BLOCK_K = block_k) and its product is scaled before it is added.
Tile tables are fixed (`gemv_config`, `gemm_config`): no autotuning at import.
Each launch is a torch custom op (`atom::quant_gemv`, `atom::quant_gemm`) so that
torch.compile traces through it.
"""
from __future__ import annotations

from typing import Optional

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, pdl_args, tl, triton

GEMV_MAX_M = 4

if HAS_TRITON:
    from atom.model_ops.kernels.triton_import import FP8_PROMOTE, grouped_tile, pdl_start

    @triton.jit
    def _qgemv_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      stride_xs, stride_ws, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCKS: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr, AHEAD: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        ms = tl.arange(0, BLOCK_M)
        m_ok = ms < M
        ks = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + ks[None, :]
        x_ptrs = xq_ptr + ms.to(tl.int64)[:, None] * stride_xm + ks[None, :]
        if BLOCKS:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        else:
            acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        # The first weight tile is loaded before waiting for the quantizer in front (PDL):
        # the weights do not depend on it; with AHEAD each next tile is loaded before the
        # current one is used (two in flight, as the bf16 GEMV does), else after.
        w = tl.load(w_ptrs, mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
        pdl_start(PDL)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (ks + k0) < K
            if AHEAD:
                w_next = tl.load(w_ptrs + (k0 + BLOCK_K), mask=row_ok[:, None] & (ks + k0 + BLOCK_K < K)[None, :],
                                 other=0.0)
            x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            wf = w.to(tl.float32)
            if BLOCKS:  # BLOCK_K is the scale block: this chunk is block k0 // BLOCK_K
                kb = k0 // BLOCK_K
                part = tl.sum(x[:, None, :] * wf[None, :, :], axis=2)
                xs = tl.load(xs_ptr + ms * stride_xs + kb, mask=m_ok, other=0.0)
                ws = tl.load(ws_ptr + rows * stride_ws + kb, mask=row_ok, other=0.0)
                acc += part * xs[:, None] * ws[None, :]
            else:
                acc3 += x[:, None, :] * wf[None, :, :]
            if AHEAD:
                w = w_next
            else:
                w = tl.load(w_ptrs + (k0 + BLOCK_K), mask=row_ok[:, None] & (ks + k0 + BLOCK_K < K)[None, :],
                            other=0.0)
        if not BLOCKS:
            xs = tl.load(xs_ptr + ms * stride_xs, mask=m_ok, other=0.0)
            ws = tl.load(ws_ptr + rows * stride_ws, mask=row_ok, other=0.0)
            acc = tl.sum(acc3, axis=2) * xs[:, None] * ws[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + ms.to(tl.int64)[:, None] * stride_ym + rows[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & row_ok[None, :])

    @triton.jit
    def _qgemm_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      stride_xs, stride_ws, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, BLOCKS: tl.constexpr, INT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      IMPRECISE: tl.constexpr = 0):
        """IMPRECISE < 0: fp8 products summed in the tensor cores' accumulator over all of K
        (never promoted into fp32; 0: every FP8_PROMOTE, or BLOCK_K if smaller)."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = grouped_tile(pid, num_m, num_n, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        xp = xq_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
        wp = w_ptr + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]
        if INT:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(xp, mask=m_ok[:, None] & (rk[None, :] + k0 < K), other=0.0)
            b = tl.load(wp, mask=n_ok[None, :] & (rk[:, None] + k0 < K), other=0.0)
            if BLOCKS:
                kb = k0 // BLOCK_K
                xs = tl.load(xs_ptr + rm * stride_xs + kb, mask=m_ok, other=0.0)
                ws = tl.load(ws_ptr + rn * stride_ws + kb, mask=n_ok, other=0.0)
                acc += tl.dot(a, b) * xs[:, None] * ws[None, :]
            elif INT:  # int8 x int8 accumulates exactly in int32 (tl.dot's default is fp32)
                acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            else:  # partial sums carried into fp32 every FP8_PROMOTE products (triton_import)
                if IMPRECISE < 0:
                    acc = tl.dot(a, b, acc)
                else:
                    acc = tl.dot(a, b, acc, max_num_imprecise_acc=FP8_PROMOTE if BLOCK_K > FP8_PROMOTE else BLOCK_K)
            xp += BLOCK_K
            wp += BLOCK_K
        if BLOCKS:
            out = acc
        else:
            xs = tl.load(xs_ptr + rm * stride_xs, mask=m_ok, other=0.0)
            ws = tl.load(ws_ptr + rn * stride_ws, mask=n_ok, other=0.0)
            out = acc.to(tl.float32) * xs[:, None] * ws[None, :]
        if HAS_BIAS:
            out += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], out.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def gemv_config(M: int, block_k: int = 0) -> dict:
    """GEMV tiles: eight weight rows and 512 / M columns per step (4096 fp32 partial sums a
    program, 32 registers a thread at 4 warps), the tiling `scripts/quant_gemv_sweep.py`
    picked at M = 1 on the Llama-3.1-8B shapes (figures in docs/perf/raw/history.md; loading the
    next tile ahead, AHEAD, did not pay there, so it is off); with
    blocks the chunk is the block (128) and 16 rows share a program, so that a step's
    [16, 128] weight tile is one 16-byte load per thread (the block's partial sums are
    reduced at every step, M x 16 x 128 products at most 8192 at M = 4)."""
    bm = triton.next_power_of_2(max(M, 1))
    if block_k:
        return dict(BLOCK_M=bm, BLOCK_N=16, BLOCK_K=block_k, num_warps=4, num_stages=3, AHEAD=False)
    return dict(BLOCK_M=bm, BLOCK_N=8, BLOCK_K=max(128, 512 // bm), num_warps=4, num_stages=3, AHEAD=False)


def gemm_config(M: int, N: int, block_k: int = 0) -> dict:
    """GEMM tiles by rows (design values, not measured yet):
    M <= 16: 16-row tiles, 16 (N < 8192) or 32 weight rows per program so that the
             4096-6144-wide layers still spread over 192-384 programs (132 SMs), 256 K;
    M <= 64: 64 x 64 x 128; M <= 256: 64 x 128 x 128; larger: 128 x 128 x 128, 8 warps
    (two one-byte 128 x 128 operand tiles = 32 KiB a stage, 3 stages).
    With blocks BLOCK_K is the block width."""
    if M <= 16:
        cfg = dict(BLOCK_M=16, BLOCK_N=16 if N < 8192 else 32, BLOCK_K=256, num_warps=4, num_stages=4)
    elif M <= 64:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    elif M <= 256:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)
    if block_k:
        cfg["BLOCK_K"] = block_k
    return cfg


def check_block_k(block_k: int, K: int) -> None:
    """A block-scale width must be a power of two >= 16 that divides K."""
    if block_k < 16 or block_k & (block_k - 1) or K % block_k:
        raise ValueError(f"block_k={block_k} must be a power of two >= 16 that divides K={K}")


def check_weight_scales(ws, bias, N: int, K: int, block_k: int) -> None:
    """The weight's scales ([N, K / block_k] with blocks, else N values) and the bias ([N])."""
    if block_k:
        check_block_k(block_k, K)
    want_w = (N, K // block_k) if block_k else (N,)
    if (tuple(ws.shape) != want_w) if block_k else (ws.numel() != N):
        raise ValueError(f"ws shape {tuple(ws.shape)}: expected {want_w}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias shape {tuple(bias.shape)}: expected ({N},)")


def _check(xq, xs, w, ws, bias, block_k):
    if not HAS_TRITON:
        raise RuntimeError("quantized GEMM kernels need triton; use the torch reference without it")
    if xq.dim() != 2 or w.dim() != 2 or xq.shape[1] != w.shape[1]:
        raise ValueError(f"xq must be [M, K] and w [N, K], got {tuple(xq.shape)} and {tuple(w.shape)}")
    if xq.dtype != w.dtype or xq.dtype not in (torch.float8_e4m3fn, torch.int8):
        raise ValueError(f"xq and w must both be float8_e4m3fn or int8, got {xq.dtype} and {w.dtype}")
    M, K = xq.shape
    N = w.shape[0]
    check_weight_scales(ws, bias, N, K, block_k)
    want_x = (M, K // block_k) if block_k else None
    if block_k and tuple(xs.shape) != want_x or not block_k and xs.numel() not in (1, M):
        raise ValueError(f"xs shape {tuple(xs.shape)}: expected {want_x or f'[{M}] or one value'}")
    return M, N, K


def _launch(kernel, grid, xq, xs, w, ws, bias, out_dtype, block_k, cfg, **extra):
    M, N, K = xq.shape[0], w.shape[0], xq.shape[1]
    xq = xq if xq.stride(-1) == 1 else xq.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    xs, ws = xs.float().contiguous(), ws.float().contiguous()
    stride_xs = (xs.shape[-1] if block_k else (0 if xs.numel() == 1 else 1))
    stride_ws = ws.shape[-1] if block_k else 1
    y = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0 or N == 0:
        return y
    b = bias.contiguous() if bias is not None else y
    kernel[grid(cfg)](xq, xs, w, ws, b, y, M, N, K, xq.stride(0), w.stride(0), y.stride(0), stride_xs, stride_ws,
                      BLOCKS=bool(block_k), HAS_BIAS=bias is not None, **extra, **cfg)
    return y


def quant_gemv_launch(xq, xs, w, ws, bias, out_dtype, block_k=0, config=None):
    M, N, K = _check(xq, xs, w, ws, bias, block_k)
    cfg = dict(config or gemv_config(M, block_k))
    if block_k:  # a K step is one scale block
        cfg["BLOCK_K"] = block_k
    return _launch(_qgemv_kernel, lambda c: (triton.cdiv(N, c["BLOCK_N"]),), xq, xs, w, ws, bias, out_dtype,
                   block_k, cfg, **pdl_args(xq))


def quant_gemm_launch(xq, xs, w, ws, bias, out_dtype, block_k=0, config=None):
    M, N, K = _check(xq, xs, w, ws, bias, block_k)
    if block_k and xq.dtype == torch.int8:
        raise ValueError("block scales are an fp8 format; int8 runs with row / column scales")
    cfg = dict(config or gemm_config(M, N, block_k))
    if block_k:  # a K step is one scale block
        cfg["BLOCK_K"] = block_k
    return _launch(_qgemm_kernel, lambda c: (triton.cdiv(M, c["BLOCK_M"]) * triton.cdiv(N, c["BLOCK_N"]),),
                   xq, xs, w, ws, bias, out_dtype, block_k, cfg, GROUP_M=8, INT=xq.dtype == torch.int8)


@torch.library.custom_op("atom::quant_gemv", mutates_args=())
def quant_gemv(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bias: Optional[torch.Tensor],
               out_dtype: torch.dtype, block_k: int = 0) -> torch.Tensor:
    """Small-M weight-streaming product of the module docstring -> [M, N] in `out_dtype`."""
    return quant_gemv_launch(xq, xs, w, ws, bias, out_dtype, block_k)


@quant_gemv.register_fake
def _(xq, xs, w, ws, bias, out_dtype, block_k=0):
    return xq.new_empty(xq.shape[0], w.shape[0], dtype=out_dtype)


@torch.library.custom_op("atom::quant_gemm", mutates_args=())
def quant_gemm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bias: Optional[torch.Tensor],
               out_dtype: torch.dtype, block_k: int = 0) -> torch.Tensor:
    """Tiled tl.dot product of the module docstring -> [M, N] in `out_dtype`."""
    return quant_gemm_launch(xq, xs, w, ws, bias, out_dtype, block_k)


@quant_gemm.register_fake
def _(xq, xs, w, ws, bias, out_dtype, block_k=0):
    return xq.new_empty(xq.shape[0], w.shape[0], dtype=out_dtype)


def quant_gemm_ref(xq, xs, w, ws, bias, out_dtype, block_k=0):
    """The torch reference: both operands dequantized to fp32, F.linear, cast."""
    M, N, K = _check(xq, xs, w, ws, bias, block_k)
    if block_k:
        x32 = xq.float() * xs.float().repeat_interleave(block_k, 1)
        w32 = w.float() * ws.float().reshape(N, -1).repeat_interleave(block_k, 1)
    else:
        x32 = xq.float() * xs.float().reshape(-1, 1)
        w32 = w.float() * ws.float().reshape(N, 1)
    y = x32 @ w32.T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
