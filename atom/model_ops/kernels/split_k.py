"""The reduction behind split-K products: y[m, n] = sum_s part[s, m, n] (+ b[n]), cast.

Both small-M tensor-core kernels (`quant_gemv_dot` for 8-bit weights, `w4_dot` for 4-bit)
split K over programs for layers with few output rows; each split writes its fp32 partial to
a contiguous [SPLIT_K, M, N] buffer and this kernel adds them in split order: deterministic
(replays give the same bits), no atomics, no zeroed buffer, fixed shapes (CUDA-graph safe),
and it waits for the product through programmatic dependent launch.

A `PendingSum` is such a product whose sum has not run yet: the kernel that reads the product
next can add the partials itself (`split_sum_cols`, the same order and rounding, so the same
bits) instead of a launch of its own in between (the kernel plan's "sum+norm+quant": o_proj's
partials read by the norm-quantizer in front of gate-up, down's by the next decoder layer's in
front of q/k/v, `act_quant_fused.norm_quant`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, pdl_args, tl, triton

if HAS_TRITON:
    from atom.model_ops.kernels.triton_import import pdl_start

    @triton.jit
    def split_sum_at(p_ptr, b_ptr, i, n, mask, MN, SPLIT_K, HAS_BIAS: tl.constexpr):
        """The fp32 sum of part [SPLIT_K, M, N] (+ b) at flat outputs i (columns n; MN = M N):
        the splits added in order, then the bias. The one copy of the reduction's arithmetic,
        for `_split_k_sum_kernel` and the kernels that sum a `PendingSum` themselves."""
        acc = tl.load(p_ptr + i, mask=mask, other=0.0)
        for s in range(1, SPLIT_K):
            acc += tl.load(p_ptr + s * MN + i, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
        return acc

    @triton.jit
    def split_sum_cols(p_ptr, b_ptr, row, cols, mask, M, N, SPLIT_K, OUT: tl.constexpr, HAS_BIAS: tl.constexpr):
        """Columns `cols` of row `row` of that sum rounded to OUT, as fp32: what `split_k_sum`
        stores."""
        return split_sum_at(p_ptr, b_ptr, row * N + cols, cols, mask, M * N, SPLIT_K, HAS_BIAS).to(OUT).to(tl.float32)

    @triton.jit(do_not_specialize=["M", "SPLIT_K"])
    def _split_k_sum_kernel(p_ptr, b_ptr, y_ptr, M, N, stride_ym, SPLIT_K, BLOCK: tl.constexpr,
                            HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
        """One program per BLOCK of the M * N outputs."""
        pdl_start(PDL)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < M * N
        n = i % N
        acc = split_sum_at(p_ptr, b_ptr, i, n, ok, M * N, SPLIT_K, HAS_BIAS)
        tl.store(y_ptr + (i // N) * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=ok)


def split_k_sum(part: torch.Tensor, bias: Optional[torch.Tensor], y: torch.Tensor, pdl: dict) -> None:
    """y [M, N] (rows of stride y.stride(0)) = the sum of part [SPLIT_K, M, N] fp32 (+ bias);
    `pdl`: `triton_import.pdl_args` of the product's input."""
    split, M, N = part.shape
    block = 1024
    _split_k_sum_kernel[(triton.cdiv(M * N, block),)](
        part, bias if bias is not None else y, y, M, N, y.stride(0), split, BLOCK=block,
        HAS_BIAS=bias is not None, num_warps=4, **pdl)


@dataclass
class PendingSum:
    """A split-K product [M, N] in `dtype` whose sum has not run: `part` fp32 [SPLIT_K, M, N]
    (contiguous), `bias` [N] or None. `result()` runs the sum; a kernel that takes one adds
    the partials where it reads the product (`split_sum_cols`)."""
    part: torch.Tensor
    bias: Optional[torch.Tensor]
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.part.shape[1:]

    def result(self) -> torch.Tensor:
        """The product, summed by `split_k_sum`."""
        y = torch.empty(self.shape, dtype=self.dtype, device=self.part.device)
        split_k_sum(self.part, self.bias, y, pdl_args(y))
        return y

    def __repr__(self) -> str:
        return (f"PendingSum(splits={self.part.shape[0]}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"bias={self.bias is not None})")


def settle(x):
    """x itself, or a `PendingSum`'s result."""
    return x.result() if isinstance(x, PendingSum) else x
