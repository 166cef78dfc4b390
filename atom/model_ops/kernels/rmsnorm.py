"""RMSNorm and the fused residual-add + RMSNorm (math in fp32, output in x.dtype).

``fused_add_rms_norm(x, residual, w, eps)`` returns ``(rmsnorm(x + residual), x + residual)``.
The sum is rounded to the residual dtype first and the norm is taken of that
rounded value, as an unfused model would.  With ``inplace=True`` the normed
rows overwrite ``x`` and the new residual overwrites ``residual`` (each program
reads its row before writing it); the default allocates both outputs.

Short rows (a per-head norm: Qwen3's q/k norms over head_dim 128, half a million rows in a
16k-token prefill) take a second kernel: a program normalises BLOCK_R rows at once (one
program per 128-element row leaves most of each warp idle), and reads them in place from a
[tokens, heads, N] view with any token and head strides (the q / k slices of the fused
qkv output), so no contiguous copy is made first.
"""

from __future__ import annotations

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, pdl_args, tl, triton

if HAS_TRITON:
    from atom.model_ops.kernels.triton_import import pdl_start

    @triton.jit
    def add_rms_norm_row(x_ptr, r_ptr, w_ptr, rout_ptr, row, stride_x, stride_r, stride_ro, N, eps,
                         BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
        """Row `row` of rmsnorm(x + r) * w in fp32 ([BLOCK], zero past N), the sum x + r
        rounded to the residual's dtype, stored to rout and normalised as that rounded value
        (HAS_RES; else x alone). The one copy of the norm's arithmetic: the fused norm +
        quantizer (`act_quant_fused`) calls it too, so both give the same bits."""
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        return add_rms_norm_vals(x, r_ptr, w_ptr, rout_ptr, row, cols, mask, stride_r, stride_ro, N, eps, HAS_RES)

    @triton.jit
    def add_rms_norm_vals(x, r_ptr, w_ptr, rout_ptr, row, cols, mask, stride_r, stride_ro, N, eps,
                          HAS_RES: tl.constexpr):
        """`add_rms_norm_row` of the row's values x (fp32 [BLOCK] at `cols`, zero where masked)."""
        if HAS_RES:
            r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            s = (x + r).to(rout_ptr.dtype.element_ty)
            tl.store(rout_ptr + row * stride_ro + cols, s, mask=mask)
            x = s.to(tl.float32)
        var = tl.sum(x * x, 0) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        return x * rstd * w

    @triton.jit
    def _load_cols(ptrs, mask):
        """tl.load of ptrs, 0 where mask is false; mask None: every lane loads, without a mask."""
        if mask is None:
            v = tl.load(ptrs)
        else:
            v = tl.load(ptrs, mask=mask, other=0.0)
        return v

    @triton.jit
    def add_norm_cols(x, cols, mask, r_ptr, w_ptr, rout_ptr, sq, ACT: tl.constexpr, HAS_RES: tl.constexpr):
        """The norm prologue of the one-row GEMVs, for the columns `cols` of x (fp32) that a
        step reads: with HAS_RES x + r rounded to ACT (the unfused add's dtype; program 0 stores
        it to rout) replaces x. Returns (x w, sq + x^2): the caller scales its dot products by
        the row's 1 / rms once sq holds the whole row. mask None: every column is in the row
        (an even tile), loaded without a mask."""
        if HAS_RES:
            s = (x + _load_cols(r_ptr + cols, mask).to(tl.float32)).to(ACT)
            if tl.program_id(0) == 0:
                tl.store(rout_ptr + cols, s, mask=mask)
            x = s.to(tl.float32)
        return x * _load_cols(w_ptr + cols, mask).to(tl.float32), sq + x * x

    @triton.jit
    def store_added(y, rows, N, r_ptr, rout_ptr, ACT: tl.constexpr):
        """A one-row product's epilogue for its rows `rows` of y (float32): h = y + the residual
        at r_ptr, each rounded to ACT as the unfused product and add round them, stored to
        rout_ptr. Returns h (ACT)."""
        ok = rows < N
        h = (y.to(ACT).to(tl.float32) + tl.load(r_ptr + rows, mask=ok, other=0.0).to(tl.float32)).to(ACT)
        tl.store(rout_ptr + rows, h, mask=ok)
        return h

    @triton.jit
    def store_added_row(y, rows, N, r_ptr, rout_ptr, w_ptr, out_ptr, sq_ptr, ACT: tl.constexpr):
        """`store_added`, then h w (w the next RMSNorm's weight) in ACT to out_ptr, the next
        product's row, and the program's sum of h^2 to sq_ptr[program], for that product to
        scale by 1 / rms."""
        ok = rows < N
        hf = tl.where(ok, store_added(y, rows, N, r_ptr, rout_ptr, ACT).to(tl.float32), 0.0)
        tl.store(out_ptr + rows, (hf * tl.load(w_ptr + rows, mask=ok, other=0.0).to(tl.float32)).to(ACT), mask=ok)
        tl.store(sq_ptr + tl.program_id(0), tl.sum(hf * hf, axis=0))

    @triton.jit
    def _rmsnorm_kernel(
        x_ptr, r_ptr, w_ptr, out_ptr, rout_ptr,
        stride_x, stride_r, stride_o, stride_ro,
        N, eps,
        BLOCK: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        y = add_rms_norm_row(x_ptr, r_ptr, w_ptr, rout_ptr, row, stride_x, stride_r, stride_ro, N, eps,
                             BLOCK, HAS_RES)
        cols = tl.arange(0, BLOCK)
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=cols < N)


    @triton.jit
    def _rmsnorm_rows_kernel(
        x_ptr, w_ptr, out_ptr, R, H, stride_xt, stride_xh, N, eps,
        BLOCK_R: tl.constexpr, BLOCK: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK)
        r_ok = rows < R
        c_ok = cols < N
        src = (rows // H) * stride_xt + (rows % H) * stride_xh
        m = r_ok[:, None] & c_ok[None, :]
        x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / N + eps)
        w = tl.load(w_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :],
                 (x * rstd[:, None] * w[None, :]).to(out_ptr.dtype.element_ty), mask=m)


#: rows up to this many elements go through the several-rows-per-program kernel
SHORT_ROW = 512


def _heads_view(x: torch.Tensor):
    """(rows, heads, token stride, head stride) of x [..., N] read in place, or None: a 2-D x
    (or a contiguous one) as rows of one head, a 3-D x [tokens, heads, N] with any strides."""
    if x.stride(-1) != 1:
        return None
    if x.dim() == 2 or x.is_contiguous():
        rows = x.numel() // x.shape[-1]
        return rows, 1, (x.stride(0) if x.dim() == 2 else x.shape[-1]), 0
    if x.dim() == 3:
        return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)
    return None


def _launch_rows(x: torch.Tensor, view: tuple, weight: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    """The short-row kernel on x read through `view` (`_heads_view`) into contiguous `out`."""
    rows, heads, st, sh = view
    N = x.shape[-1]
    if rows == 0:
        return
    BLOCK = triton.next_power_of_2(N)
    block_r = max(1, min(64, 4096 // BLOCK))
    _rmsnorm_rows_kernel[(triton.cdiv(rows, block_r),)](
        x, weight, out, rows, heads, st, sh, N, float(eps), BLOCK_R=block_r, BLOCK=BLOCK, num_warps=4)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t as 2-D rows with unit last stride (a copy only where needed)."""
    t2 = t.view(-1, t.shape[-1]) if t.is_contiguous() else t.reshape(-1, t.shape[-1])
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def check_norm_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    """The shapes (add +) RMSNorm needs: a weight per feature, a residual shaped like x."""
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({x.shape[-1]},)")


def _launch(x2, r2, w, o2, ro2, eps):
    if not HAS_TRITON:
        raise RuntimeError("rms_norm needs triton; use rms_norm_ref without it")
    M, N = x2.shape
    if M == 0:
        return
    _rmsnorm_kernel[(M,)](
        x2, r2 if r2 is not None else x2, w, o2, ro2 if ro2 is not None else o2,
        x2.stride(0), r2.stride(0) if r2 is not None else 0,
        o2.stride(0), ro2.stride(0) if ro2 is not None else 0,
        N, float(eps), HAS_RES=r2 is not None, **norm_row_config(N), **pdl_args(x2),
    )


def norm_row_config(N: int) -> dict:
    """BLOCK and warps of a program that normalises one row of N (the whole row in one block):
    shared with the fused norm + quantizer, so that its sum runs in the same order."""
    block = triton.next_power_of_2(N)
    return dict(BLOCK=block, num_warps=1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             inplace: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any leading shape)."""
    check_norm_args(x, weight)
    if not inplace and HAS_TRITON and 0 < x.shape[-1] <= SHORT_ROW and (view := _heads_view(x)) is not None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _launch_rows(x, view, weight, out, eps)
        return out
    x2 = as_rows(x)
    if inplace:
        if x2.data_ptr() != x.data_ptr():
            raise ValueError("inplace rms_norm needs x whose rows are addressable as a 2-D view")
        o2, out = x2, x
    else:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        o2 = out.view(-1, x.shape[-1])
    _launch(x2, None, weight, o2, None, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6, inplace: bool = False):
    """Returns ``(normed, new_residual)``; see the module doc for ``inplace``."""
    check_norm_args(x, weight, residual)
    x2, r2 = as_rows(x), as_rows(residual)
    if inplace:
        if x2.data_ptr() != x.data_ptr() or r2.data_ptr() != residual.data_ptr():
            raise ValueError("inplace fused_add_rms_norm needs row-addressable x and residual")
        o2, ro2, out, rout = x2, r2, x, residual
    else:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rout = torch.empty(residual.shape, dtype=residual.dtype, device=x.device)
        o2, ro2 = out.view(-1, x.shape[-1]), rout.view(-1, x.shape[-1])
    _launch(x2, r2, weight, o2, ro2, eps)
    return out, rout


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(x, residual, weight, eps: float = 1e-6):
    new_res = (x.float() + residual.float()).to(residual.dtype)
    return rms_norm_ref(new_res, weight, eps).to(x.dtype), new_res
