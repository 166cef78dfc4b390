"""SiLU-and-multiply of the gated MLP: ``silu(x[:, :I]) * x[:, I:]``."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from atom.model_ops.kernels.triton_import import HAS_TRITON, pdl_args, tl, triton

if HAS_TRITON:
    from atom.model_ops.kernels.triton_import import pdl_start

    @triton.jit
    def silu_mul_cols(x_row, cols, mask, I):
        """silu(x[cols]) * x[I + cols] of one row in fp32 (zero where masked): the one copy of
        the arithmetic, which the fused SiLU + quantizer (`act_quant_fused`) shares."""
        a = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(x_row + I + cols, mask=mask, other=0.0).to(tl.float32)
        return a / (1.0 + tl.exp(-a)) * g

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        y = silu_mul_cols(x_ptr + row * stride_x, cols, mask, I)
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., 2I] -> [..., I]; math in fp32, output in x.dtype (or ``out``)."""
    if not HAS_TRITON:
        raise RuntimeError("silu_and_mul needs triton; use silu_and_mul_ref without it")
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension, got {x.shape[-1]}")
    I = x.shape[-1] // 2
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((*lead, I), dtype=x.dtype, device=x.device)
    o2 = out.view(-1, I)
    T = x2.shape[0]
    if T == 0:
        return out
    BLOCK = min(1024, triton.next_power_of_2(I))
    grid = (T, triton.cdiv(I, BLOCK))
    _silu_and_mul_kernel[grid](x2, o2, x2.stride(0), o2.stride(0), I, BLOCK=BLOCK,
                               num_warps=4 if BLOCK >= 512 else 2, **pdl_args(x2))
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    I = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :I]) * xf[..., I:]).to(x.dtype)
