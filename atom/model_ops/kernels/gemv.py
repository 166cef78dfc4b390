"""y = x W^T for a single row x (batch-1 decode): a weight-streaming Triton GEMV.

At one token per step every linear layer only streams its weight once; cuBLAS picks
GEMM tiles for these shapes that reach about a quarter of HBM bandwidth on the 4-12 MB
matrices of a small model. Here a program owns BLOCK_N output rows and walks K in
BLOCK_K chunks (coalesced, pipelined loads), accumulating in fp32. Whether a layer uses
it is measured per weight shape (`atom.model_ops.linear.choose_gemv_shapes`): never slower
than cuBLAS where it is picked.
"""

from __future__ import annotations

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_wn,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=row_ok)


def gemv_config(N: int, K: int) -> dict:
    """Rows per program: enough programs to cover the GPU's SMs about twice."""
    block_n = 4
    while block_n < 32 and N // (block_n * 2) >= 256:
        block_n *= 2
    return dict(BLOCK_N=block_n, BLOCK_K=min(512, triton.next_power_of_2(K)), num_warps=4, num_stages=4)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, K] (or [K]), weight [N, K] with a contiguous last dim -> [1, N] in x's dtype."""
    if not HAS_TRITON:
        raise RuntimeError("gemv needs triton; use gemv_ref without it")
    K = weight.shape[1]
    if x.numel() != K or weight.stride(1) != 1:
        raise ValueError(f"gemv takes one row of {K} values and a row-major weight, got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)} with strides {weight.stride()}")
    x = x.reshape(K).contiguous()
    N = weight.shape[0]
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    cfg = gemv_config(N, K)
    _gemv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](x, weight, y, N, K, weight.stride(0), **cfg)
    return y


def gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.reshape(1, -1).float() @ weight.float().T).to(x.dtype)
