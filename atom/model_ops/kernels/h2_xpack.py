"""One row prepared once for the one-row 4-bit GEMV's fp16 pair products (HALF2), by the
kernel in front of it, instead of by each of the GEMV's programs.

`w4_gemv1`'s HALF2 loop scales every word column of x (8 values) by the power of two that puts
its largest |x| in [2^14, 2^15), packs the columns (i, i + 4) into four fp16 pairs, and sums
the column for int4's zero point: per program and step, for the rows of that program only,
though every program computes the same (what that costs the compiled loop:
`python scripts/w4_gemv_sass.py`, "prepared x"; figures in docs/perf). Here the kernel that makes the row
writes it in that form, a word column as 8 int32: the four pairs, e (the biased exponent of the
largest |x|, at least 40), the float32 bits of the column's sum, then unused ints (left
unwritten, but for int 6 below); the GEMV's XPACK loop loads them
(`w4_gemv1._word_sums_packed`), with the same products.

    add + RMSNorm -> prepared row (`norm_prepare`: gate-up's input)
    SiLU-and-mul  -> prepared row (`silu_prepare`: down's input)
    any row       -> prepared row (`prepare_row`: tests, the sweep)
    a product's epilogue: + residual, prepared for the next RMSNorm
                  (`store_added_prepared`: h w with each column's sum of h^2 in int 6; the
                   consuming loop applies 1 / rms, `PreparedRow.eps`)

Each producer rounds the row to its dtype first (the value the unfused kernel would store and
the GEMV would load), by the unfused kernel's own arithmetic (`rmsnorm.add_rms_norm_row`,
`activation.silu_mul_cols`). `ODD16` (int4): odd columns also / 16, as int4's odd nibbles are
16 u 2^-24. `prepare_ref` is the same in torch. Batch 1 only; the plan's "w4_prepared_x"
runs it (`fusions`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, pdl_args, tl, triton

#: word columns a program of `silu_prepare` / `prepare_row` writes
COLUMNS = 128


class PreparedRow(NamedTuple):
    """A row of `k` values prepared for the HALF2 GEMV: `cols` int32 [k / 8, 8]; `odd16` whether
    int4's odd columns carry the extra 1 / 16; `dtype` the row's own dtype (the GEMV's output);
    `eps` None, or the columns are of h w for an RMSNorm with this eps and weight w and carry
    their sums of h^2 (int 6), and the GEMV applies 1 / rms (`store_added_prepared`)."""
    cols: torch.Tensor
    k: int
    odd16: bool
    dtype: torch.dtype
    eps: float | None = None


def scaled_halves(xf: torch.Tensor, odd16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of x (float32 [runs, ..., 8]) as the HALF2 loop scales them: each run by 2^(141 - e),
    e the biased exponent of its largest |x| (at least 40), int4's odd columns also by 1 / 16,
    rounded to fp16. Returns (e int32 [runs], the fp16 values)."""
    e = (xf.abs().flatten(1).amax(dim=1).view(torch.int32) >> 23).clamp(min=40)
    sc = ((268 - e) << 23).view(torch.float32).reshape(-1, *[1] * (xf.dim() - 1))
    odd = torch.tensor([1.0, 0.0625] * 4 if odd16 else [1.0] * 8, device=xf.device)
    return e, (xf * sc * odd).to(torch.float16)


def prepare_ref(x: torch.Tensor, odd16: bool) -> torch.Tensor:
    """The prepared columns of one row x [K] (any float dtype, K % 8 == 0) in torch: int32 [K / 8, 8]."""
    if x.numel() % 8:
        raise ValueError(f"prepare_ref: a row of whole words (K % 8 == 0), got {x.numel()} values")
    xf = x.reshape(-1, 8).float()
    e, halves = scaled_halves(xf, odd16)
    h = halves.view(torch.int16).to(torch.int32)  # [C, 8]
    pairs = (h[:, 4:] << 16) | (h[:, :4] & 0xFFFF)  # pair i: column i low, i + 4 high
    out = torch.zeros(xf.shape[0], 8, dtype=torch.int32, device=x.device)
    out[:, :4] = pairs
    out[:, 4] = e
    out[:, 5] = xf.sum(dim=1).view(torch.int32)
    return out


if HAS_TRITON:
    from atom.model_ops.kernels.activation import silu_mul_cols
    from atom.model_ops.kernels.rmsnorm import add_rms_norm_row, norm_row_config, store_added
    from atom.model_ops.kernels.triton_import import pdl_start

    @triton.jit
    def _h2_pack(hi, lo, ASM: tl.constexpr = True):
        """Two float32 tensors as one int32 of two fp16 halves (lo in bits 0-15), rounded to
        nearest even: one PTX conversion, or (ASM False: Triton's interpreter) two."""
        if ASM:
            t = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [hi, lo], dtype=tl.int32,
                                          is_pure=True, pack=1)
        else:
            h16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
            l16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
            t = (h16 << 16) | (l16 & 0xFFFF)
        return t

    @triton.jit
    def _h2_column_e(xv):
        """The biased exponent of the largest |x| of each word column of x [1, BLOCK_W, 8] (at
        least 40, for all-zero columns): [1, BLOCK_W, 1]."""
        return tl.maximum(tl.max(tl.abs(xv), axis=2, keep_dims=True).to(tl.int32, bitcast=True) >> 23, 40)

    @triton.jit
    def _h2_pairs(xv, e, es, ODD16: tl.constexpr, BLOCK_W: tl.constexpr, ASM: tl.constexpr = True):
        """x [1, BLOCK_W, 8] scaled by 2^(141 - e) (e from `_h2_column_e`, of these columns or
        of a run of them), so that the largest |x| lies in [2^14, 2^15) (odd columns also / 16
        when ODD16), as the fp16 pairs (i, i + 4) for i = 0..3: four int32 [1, BLOCK_W]."""
        sc = ((268 - e) << 23).to(tl.float32, bitcast=True)
        if ODD16:
            xs = xv * tl.where(es % 2 == 1, sc * 0.0625, sc)
        else:
            xs = xv * sc
        x_lo, x_hi = tl.split(tl.permute(tl.reshape(xs, [1, BLOCK_W, 2, 4]), (0, 1, 3, 2)))
        xa, xb = tl.split(tl.reshape(_h2_pack(x_hi, x_lo, ASM), [1, BLOCK_W, 2, 2]))
        x0, x2 = tl.split(xa)
        x1, x3 = tl.split(xb)
        return x0, x1, x2, x3


    @triton.jit
    def unpack_cols(pairs, e, ODD16: tl.constexpr, BLOCK_W: tl.constexpr):
        """The x values prepared columns stand for (pairs [1, BLOCK_W, 4], e [1, BLOCK_W]): each
        fp16 half times 2^(e - 141) (16x more for int4's odd columns), float32 [1, BLOCK_W, 8]:
        the float32 loop's x where the fp16 pair products do not run (Triton's interpreter)."""
        lo = (pairs & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = ((pairs >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        unscale = ((e - 14) << 23).to(tl.float32, bitcast=True)[:, :, None]  # 2^(e - 141)
        if ODD16:
            unscale = unscale * tl.where(tl.arange(0, 4)[None, None, :] % 2 == 1, 16.0, 1.0)
        return tl.reshape(tl.permute(tl.join(lo * unscale, hi * unscale), (0, 1, 3, 2)), [1, BLOCK_W, 8])

    @triton.jit
    def store_prepared(out_ptr, xv, col0, n_cols, ODD16: tl.constexpr, C: tl.constexpr, ASM: tl.constexpr):
        """Columns col0 .. col0 + C - 1 of a row (xv float32 [1, C, 8], the values the GEMV would
        load) prepared into out_ptr (int32, 8 a column), those below n_cols."""
        es = tl.arange(0, 8)[None, None, :]
        e = _h2_column_e(xv)  # [1, C, 1]
        x0, x1, x2, x3 = _h2_pairs(xv, e, es, ODD16, C, ASM)
        sx = tl.sum(xv, axis=2)
        cols = col0 + tl.arange(0, C)[None, :]
        ok = cols < n_cols
        base = out_ptr + cols.to(tl.int64) * 8
        tl.store(base, x0, mask=ok)
        tl.store(base + 1, x1, mask=ok)
        tl.store(base + 2, x2, mask=ok)
        tl.store(base + 3, x3, mask=ok)
        tl.store(base + 4, tl.reshape(e, [1, C]), mask=ok)
        tl.store(base + 5, sx.to(tl.int32, bitcast=True), mask=ok)

    @triton.jit
    def store_added_prepared(y, rows, N, r_ptr, rout_ptr, nw_ptr, out_ptr, ACT: tl.constexpr, ODD16: tl.constexpr,
                             BLOCK_N: tl.constexpr, ASM: tl.constexpr):
        """A one-row product's epilogue (`w4_gemv1`'s EPI) for rows `rows` (BLOCK_N, a multiple of
        8, from a multiple of 8) of its output y (float32): h = y + the residual at r_ptr, each
        rounded as the unfused product and add round them (to ACT), stored to rout_ptr; then
        each word column (8 rows) of h w (w the next RMSNorm's weight at nw_ptr) prepared as
        `store_prepared` writes it, with the column's sum of h^2 in int 6, for a loop that
        applies 1 / rms at its end (PNORM)."""
        ok = rows < N
        hf = store_added(y, rows, N, r_ptr, rout_ptr, ACT).to(tl.float32)
        C: tl.constexpr = BLOCK_N // 8
        hw = tl.reshape(hf * tl.load(nw_ptr + rows, mask=ok, other=0.0).to(tl.float32), [1, C, 8])
        col0 = tl.program_id(0) * C
        store_prepared(out_ptr, hw, col0, N // 8, ODD16, C, ASM)
        h3 = tl.reshape(hf, [1, C, 8])
        cols = col0 + tl.arange(0, C)[None, :]
        tl.store(out_ptr + cols.to(tl.int64) * 8 + 6, tl.sum(h3 * h3, axis=2).to(tl.int32, bitcast=True),
                 mask=cols < N // 8)

    @triton.jit
    def _prepare_row_kernel(x_ptr, out_ptr, n_cols, ODD16: tl.constexpr, C: tl.constexpr, ASM: tl.constexpr):
        col0 = tl.program_id(0) * C
        idx = (col0 + tl.arange(0, C))[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
        xv = tl.load(x_ptr + idx, mask=idx < n_cols * 8, other=0.0).to(tl.float32)
        store_prepared(out_ptr, xv, col0, n_cols, ODD16, C, ASM)

    @triton.jit
    def _silu_prepare_kernel(y_ptr, out_ptr, I, ODD16: tl.constexpr, C: tl.constexpr, ASM: tl.constexpr,
                             PDL: tl.constexpr):
        pdl_start(PDL)
        col0 = tl.program_id(0) * C
        idx = (col0 + tl.arange(0, C))[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
        act = silu_mul_cols(y_ptr, idx, idx < I, I)  # silu_and_mul's arithmetic, then its rounding
        store_prepared(out_ptr, act.to(y_ptr.dtype.element_ty).to(tl.float32), col0, I // 8, ODD16, C, ASM)

    @triton.jit
    def _norm_prepare_kernel(x_ptr, r_ptr, w_ptr, h_ptr, rout_ptr, out_ptr, N, eps, ODD16: tl.constexpr,
                             BLOCK: tl.constexpr, HAS_RES: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        h = add_rms_norm_row(x_ptr, r_ptr, w_ptr, rout_ptr, 0, 0, 0, 0, N, eps, BLOCK, HAS_RES)
        cols = tl.arange(0, BLOCK)
        tl.store(h_ptr + cols, h.to(h_ptr.dtype.element_ty), mask=cols < N)  # the rmsnorm kernel's output
        tl.debug_barrier()  # the row, read back a word column a thread
        idx = tl.arange(0, BLOCK // 8)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
        xv = tl.load(h_ptr + idx, mask=idx < N, other=0.0).to(tl.float32)
        store_prepared(out_ptr, xv, 0, N // 8, ODD16, BLOCK // 8, ASM)


def _asm(x: torch.Tensor) -> bool:
    """The PTX pack on NVIDIA GPUs; two conversions elsewhere (Triton's interpreter)."""
    import os
    return x.is_cuda and torch.version.hip is None and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def _check_row(x: torch.Tensor, k: int, what: str) -> None:
    if x.numel() != k or k % 8 or k == 0:
        raise ValueError(f"{what}: one row of whole words (K % 8 == 0), got shape {tuple(x.shape)}")


def prepare_row(x: torch.Tensor, odd16: bool) -> PreparedRow:
    """One row x (its K values, K % 8 == 0) prepared for the HALF2 GEMV, in one launch."""
    k = x.numel()
    _check_row(x, k, "prepare_row")
    x = x.reshape(k).contiguous()
    out = torch.empty(k // 8, 8, dtype=torch.int32, device=x.device)
    _prepare_row_kernel[(triton.cdiv(k // 8, COLUMNS),)](x, out, k // 8, ODD16=odd16, C=COLUMNS, ASM=_asm(x),
                                                         num_warps=4)
    return PreparedRow(out, k, odd16, x.dtype)


def silu_prepare(y: torch.Tensor, odd16: bool) -> PreparedRow:
    """silu(y[:I]) y[I:] of one row y [1, 2I] (`activation.silu_and_mul`'s values, rounded to
    y's dtype) prepared for the HALF2 GEMV, in one launch."""
    if y.dim() != 2 or y.shape[0] != 1 or y.shape[1] % 16:
        raise ValueError(f"silu_prepare: one row [1, 2I] with I % 8 == 0, got shape {tuple(y.shape)}")
    y = y.contiguous()
    i = y.shape[1] // 2
    out = torch.empty(i // 8, 8, dtype=torch.int32, device=y.device)
    _silu_prepare_kernel[(triton.cdiv(i // 8, COLUMNS),)](y, out, i, ODD16=odd16, C=COLUMNS, ASM=_asm(y),
                                                          num_warps=4, **pdl_args(y))
    return PreparedRow(out, i, odd16, y.dtype)


def norm_prepare(x: torch.Tensor, residual, weight: torch.Tensor, eps: float, odd16: bool):
    """rmsnorm(x + residual) * weight of one row x [1, K] (`rmsnorm.fused_add_rms_norm`'s values
    and sum order, rounded to x's dtype; no add when `residual` is None) prepared for the HALF2
    GEMV, in one launch. Returns (PreparedRow, x + residual as the add rounds it, or x)."""
    k = x.shape[-1]
    if x.dim() != 2 or x.shape[0] != 1 or k % 8:
        raise ValueError(f"norm_prepare: one row [1, K] with K % 8 == 0, got shape {tuple(x.shape)}")
    if weight.shape != (k,):
        raise ValueError(f"norm_prepare: norm weight shape {tuple(weight.shape)} != ({k},)")
    x = x.contiguous()
    if residual is not None:
        if residual.numel() != k:
            raise ValueError(f"norm_prepare: residual has {residual.numel()} values, x has {k}")
        r, rout = residual.reshape(1, k).contiguous(), torch.empty_like(x)
    else:
        r, rout = x, x
    h = torch.empty_like(x)
    out = torch.empty(k // 8, 8, dtype=torch.int32, device=x.device)
    _norm_prepare_kernel[(1,)](x, r, weight, h, rout, out, k, float(eps), ODD16=odd16, HAS_RES=residual is not None,
                               ASM=_asm(x), **norm_row_config(k), **pdl_args(x))
    return PreparedRow(out, k, odd16, x.dtype), rout
