"""The last step of a MoE layer: each token's k weighted expert rows summed, in one kernel.

    out[t] = sum_j y[t * k + j]   (y [T * k, H] -> out [T, H])

The down product already multiplied each pair's row by its routing weight; the k rows of a
token are neighbours (pair p = t * k + j). They are added in fp32 in order j = 0..k-1 and
rounded once to the output dtype. Torch's `y.view(T, k, H).sum(1)` also adds in fp32 (16-bit
inputs; in its own order) but, as a reduction over a middle dimension, reads the rows far
below the HBM rate at decode sizes (docs/perf has the profile), and the fp8 / MXFP4 paths
cast in a second kernel. One program per (token, BLOCK_H columns). `topk_sum_ref` is the
torch version.
"""
from __future__ import annotations

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _topk_sum_kernel(y_ptr, out_ptr, H, stride_y, stride_o, K: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = cols < H
        acc = tl.zeros([BLOCK_H], tl.float32)
        for j in tl.static_range(K):
            acc += tl.load(y_ptr + (t * K + j) * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def topk_sum_ref(y: torch.Tensor, top_k: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    T = y.shape[0] // top_k
    return y.view(T, top_k, y.shape[1]).sum(1, dtype=torch.float32).to(out_dtype or y.dtype)


def topk_sum(y: torch.Tensor, top_k: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[T * top_k, H] (a token's rows adjacent, unit column stride) -> [T, H] in `out_dtype`
    (default y's)."""
    if y.dim() != 2 or top_k < 1 or y.shape[0] % top_k:
        raise ValueError(f"topk_sum: y {tuple(y.shape)} is not [tokens * top_k, hidden] for top_k={top_k}")
    if not HAS_TRITON or y.stride(-1) != 1:
        return topk_sum_ref(y, top_k, out_dtype)
    T, H = y.shape[0] // top_k, y.shape[1]
    out = torch.empty(T, H, dtype=out_dtype or y.dtype, device=y.device)
    if T == 0 or H == 0:
        return out
    block = min(1024, triton.next_power_of_2(H))
    _topk_sum_kernel[(T, triton.cdiv(H, block))](y, out, H, y.stride(0), out.stride(0), K=top_k, BLOCK_H=block,
                                                 num_warps=4 if block >= 512 else 1)
    return out
