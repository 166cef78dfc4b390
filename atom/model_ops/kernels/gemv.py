"""y = x W^T for a single row x (batch-1 decode): a weight-streaming Triton GEMV,
optionally with the layer's RMSNorm before it and SiLU-and-mul after it.

At one token per step every linear layer only streams its weight once; cuBLAS picks
GEMM tiles for these shapes that reach about a quarter of HBM bandwidth on the 4-12 MB
matrices of a small model, and 2.5-3.7 TB/s on the 32-235 MB ones of an 8B model. Here a
program owns BLOCK_N output rows and walks K in BLOCK_K chunks (coalesced loads),
accumulating in fp32. Whether a layer uses it is measured per weight shape
(`atom.tuning.gemv_choice.choose_gemv_shapes`): never slower than cuBLAS where it is picked.

`gemv_fused` folds the two small kernels around a decoder layer's first and second
projections into the GEMV, which at batch 1 cost as much launch and tail as the work:
- norm prologue: every program reads the K activations (a few KB, from L2) with the
  weight tiles, adds the residual (rounded to the activation dtype, as the unfused add
  is; program 0 also writes it out), multiplies by the norm weight and sums the squares
  on the way; the row's 1 / rms, one scalar, then scales the dot products at the end.
  So the normalised activations are not rounded before the product, unlike the unfused
  layers: the difference is within the rounding of the activation dtype.
- gated epilogue: for a packed [gate | up] weight of 2I rows a program accumulates gate
  row n and up row I + n and writes silu(gate) * up, the MLP's activation, directly.
"""

from __future__ import annotations

import torch

from atom.model_ops.kernels.activation import silu_and_mul_ref
from atom.model_ops.kernels.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref
from atom.model_ops.kernels.triton_import import HAS_TRITON, pdl_args, tl, triton

if HAS_TRITON:
    from atom.model_ops.kernels.rmsnorm import add_norm_cols
    from atom.model_ops.kernels.triton_import import pdl_start

    @triton.jit
    def _gemv_stream(x_ptr, r_ptr, nw_ptr, w_ptr, rout_ptr, rows, row_ok, K, stride_wn, up_rows, eps,
                     NORM: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr):
        """The dot products of weight `rows` with the (normalised) row x, in fp32: (y, y_up),
        y_up the rows `up_rows` further down when GATED. Program 0 writes x + residual."""
        act = x_ptr.dtype.element_ty
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
        w_up = w_ptr + (rows.to(tl.int64) + up_rows)[:, None] * stride_wn  # GATED: row I + n
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        sq = tl.zeros([BLOCK_K], tl.float32)
        # The first weight tile is loaded before waiting for the kernels in front (PDL: see
        # triton_import), since the weights do not depend on them; with AHEAD each next tile is
        # loaded before the current one is used (two in flight), else after.
        ks = tl.arange(0, BLOCK_K)
        w_mask = row_ok[:, None] & (ks < K)[None, :]
        w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0)
        wu = tl.load(w_up + ks[None, :], mask=w_mask & GATED, other=0.0)
        pdl_start(PDL)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            nxt_mask = row_ok[:, None] & (ks + BLOCK_K < K)[None, :]
            if AHEAD:
                w_next = tl.load(w_rows + (ks + BLOCK_K)[None, :], mask=nxt_mask, other=0.0)
                wu_next = tl.load(w_up + (ks + BLOCK_K)[None, :], mask=nxt_mask & GATED, other=0.0)
            x = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            if NORM:
                x, sq = add_norm_cols(x, ks, k_ok, r_ptr, nw_ptr, rout_ptr, sq, act, HAS_RES)
            acc += w.to(tl.float32) * x[None, :]
            if GATED:
                acc_up += wu.to(tl.float32) * x[None, :]
            if AHEAD:
                w, wu = w_next, wu_next
            else:
                w = tl.load(w_rows + (ks + BLOCK_K)[None, :], mask=nxt_mask, other=0.0)
                wu = tl.load(w_up + (ks + BLOCK_K)[None, :], mask=nxt_mask & GATED, other=0.0)
        y = tl.sum(acc, axis=1)
        y_up = tl.sum(acc_up, axis=1)
        if NORM:  # the row's 1 / rms scales every dot product
            rstd = 1.0 / tl.sqrt(tl.sum(sq, 0) / K + eps)
            y = y * rstd
            y_up = y_up * rstd
        return y, y_up

    @triton.jit
    def _gemv_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, y_ptr, rout_ptr, N, K, stride_wn, up_rows, eps,
                     NORM: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr):
        act = x_ptr.dtype.element_ty
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        y, y_up = _gemv_stream(x_ptr, r_ptr, nw_ptr, w_ptr, rout_ptr, rows, row_ok, K, stride_wn, up_rows,
                               eps, NORM, HAS_RES, GATED, PDL, BLOCK_N, BLOCK_K, AHEAD)
        if GATED:
            g = y.to(act).to(tl.float32)
            y = g / (1.0 + tl.exp(-g)) * y_up.to(act).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def gemv_config(N: int, K: int, gated: bool = False) -> dict:
    """Two rows per program (one when gated: it then streams two rows per output) and K in
    chunks of 1024: the fastest tiling on the H200 for every Llama-3.1-8B shape, 32 to 1002 MB
    (`scripts/gemv_sweep.py`: 3.1-4.4 TB/s, 4-24% less time than cuBLAS; split-K, more rows
    per program or 8 warps were slower). The next tile is loaded ahead except when gated,
    where the two tiles in flight per step made the 235 MB gate-up 8% slower in the start-up
    choice's timing (65 vs 60 us; docs/perf, fourth session)."""
    return dict(BLOCK_N=1 if gated else 2, BLOCK_K=min(1024, triton.next_power_of_2(K)), num_warps=4,
                num_stages=3, AHEAD=not gated)


def gemv_candidates(N: int, K: int, gated: bool = False) -> list[dict]:
    """The configurations the start-up choice times for a shape: the default with 1, 2 or 4
    rows per program, each with and without the tile loaded ahead, and the earlier 512-wide
    chunks with enough rows per program to cover the SMs about twice (4 or 8 warps), which
    small matrices may still prefer."""
    base = gemv_config(N, K, gated)
    out = [dict(base, BLOCK_N=bn, AHEAD=ahead) for bn in (1, 2, 4) for ahead in (True, False)]
    block_n, cap = 4, 16 if gated else 32
    while block_n < cap and N // (block_n * 2) >= 256:
        block_n *= 2
    for warps in (4, 8):
        out.append(dict(BLOCK_N=block_n, BLOCK_K=min(512, triton.next_power_of_2(K)), num_warps=warps,
                        num_stages=4, AHEAD=False))
    return out


def _check_row(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if not HAS_TRITON:
        raise RuntimeError("gemv needs triton; use gemv_ref without it")
    K = weight.shape[1]
    if x.numel() != K or weight.stride(1) != 1:
        raise ValueError(f"gemv takes one row of {K} values and a row-major weight, got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)} with strides {weight.stride()}")
    return x.reshape(K).contiguous()


def _norm_inputs(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor):
    """Checks the norm prologue's inputs for the row x [K]; returns (residual row to add, the
    buffer for x + residual): (x, x) without a residual (nothing added, nothing written)."""
    K = x.shape[0]
    if norm_weight.shape != (K,):
        raise ValueError(f"norm weight shape {tuple(norm_weight.shape)} != ({K},)")
    if residual is None:
        return x, x
    if residual.numel() != K:
        raise ValueError(f"residual has {residual.numel()} values, x has {K}")
    return residual.reshape(K).contiguous(), torch.empty(K, dtype=x.dtype, device=x.device)


def gemv(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [1, K] (or [K]), weight [N, K] with a contiguous last dim -> [1, N] in x's dtype.
    `config`: tile sizes and warps (default `gemv_config`)."""
    x = _check_row(x, weight)
    N, K = weight.shape
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    cfg = config or gemv_config(N, K)
    _gemv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](x, x, x, weight, y, y, N, K, weight.stride(0), 0, 0.0,
                                                    NORM=False, HAS_RES=False, GATED=False,
                                                    **pdl_args(x), **cfg)
    return y


def gemv_fused(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
               weight: torch.Tensor, gated: bool = False, config: dict | None = None):
    """One row: `h, res = rmsnorm(x + residual)` (no add when `residual` is None: `res` is x),
    then `y = h W^T`, or `silu(y[:I]) * y[I:]` for a [gate | up] weight of 2I rows when `gated`.
    Returns (y [1, N or I], res [1, K])."""
    x = _check_row(x, weight)
    K = x.shape[0]
    r, rout = _norm_inputs(x, residual, norm_weight)
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated GEMV needs an even number of weight rows, got {weight.shape[0]}")
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    cfg = config or gemv_config(N, K, gated)
    _gemv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x, r, norm_weight, weight, y, rout, N, K, weight.stride(0), N if gated else 0, float(eps),
        NORM=True, HAS_RES=residual is not None, GATED=gated, **pdl_args(x), **cfg)
    return y, rout.view(1, K)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.reshape(1, -1).float() @ weight.float().T).to(x.dtype)


def gemv_fused_ref(x, residual, norm_weight, eps, weight, gated: bool = False):
    """The unfused layers' references in order: (add +) RMSNorm, x W^T, (SiLU-and-mul)."""
    x = x.reshape(1, -1)
    if residual is None:
        h, res = rms_norm_ref(x, norm_weight, eps), x
    else:
        h, res = fused_add_rms_norm_ref(x, residual.reshape(1, -1), norm_weight, eps)
    y = gemv_ref(h, weight)
    return (silu_and_mul_ref(y) if gated else y), res
