"""The reduction behind split-K products: y[m, n] = sum_s part[s, m, n] (+ b[n]), cast.

Both small-M tensor-core kernels (`quant_gemv_dot` for 8-bit weights, `w4_dot` for 4-bit)
split K over programs for layers with few output rows; each split writes its fp32 partial to
a contiguous [SPLIT_K, M, N] buffer and this kernel adds them in split order: deterministic
(replays give the same bits), no atomics, no zeroed buffer, fixed shapes (CUDA-graph safe),
and it waits for the product through programmatic dependent launch.
"""
from __future__ import annotations

from typing import Optional

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton

if HAS_TRITON:
    from atom.model_ops.kernels.triton_import import pdl_start

    @triton.jit(do_not_specialize=["M", "SPLIT_K"])
    def _split_k_sum_kernel(p_ptr, b_ptr, y_ptr, M, N, stride_ym, SPLIT_K, BLOCK: tl.constexpr,
                            HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
        """One program per BLOCK of the M * N outputs."""
        pdl_start(PDL)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < M * N
        acc = tl.load(p_ptr + i, mask=ok, other=0.0)
        for s in range(1, SPLIT_K):
            acc += tl.load(p_ptr + s * M * N + i, mask=ok, other=0.0)
        n = i % N
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + (i // N) * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=ok)


def split_k_sum(part: torch.Tensor, bias: Optional[torch.Tensor], y: torch.Tensor, pdl: dict) -> None:
    """y [M, N] (rows of stride y.stride(0)) = the sum of part [SPLIT_K, M, N] fp32 (+ bias);
    `pdl`: `triton_import.pdl_args` of the product's input."""
    split, M, N = part.shape
    block = 1024
    _split_k_sum_kernel[(triton.cdiv(M * N, block),)](
        part, bias if bias is not None else y, y, M, N, y.stride(0), split, BLOCK=block,
        HAS_BIAS=bias is not None, num_warps=4, **pdl)
