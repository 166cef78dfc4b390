"""A Triton GEMM, y = x W^T (+ b), for `ATOM_USE_TRITON_GEMM=1` (the guide: Triton GEMM
kernels instead of the default back end, which is cuBLAS / hipBLASLt through `F.linear`).

A program owns a BLOCK_M x BLOCK_N tile of y and walks K; programs are ordered in groups
of GROUP_M row tiles so that neighbours share weight tiles in L2 (a prefill's x does not
fit there). On NVIDIA sm90+ the x and W tiles come through TMA (tensor descriptors, the
copy engine fills shared memory for the tensor cores); elsewhere (ROCm, older NVIDIA, the
interpreter unless asked) through masked pointer loads. fp32 products are computed in
fp32 (no TF32), as `F.linear` does by default.

What it is worth on the H200: per shape, the probe's best TMA tiling came within -11% .. +8%
of cuBLAS at M <= 128 and lost by up to 18% on the 28672-wide gate-up at M >= 192
(`scripts/gemm_tma_probe.py`, Llama-3.1-8B decode shapes); in the engine, with the fixed
tilings of `gemm_config`, the nano-vllm workload ran at 24,320 tok/s against cuBLAS's
25,646 (Qwen3-0.6B) and 8,651 against ~10,000 (Llama-3.1-8B), and Llama decode at batch 8
took 8.37 ms/step against 5.03 (docs/perf, sixth session). The default therefore stays
cuBLAS; the switch is there for comparisons, and for GPUs where the vendor library is the
weaker one.
"""
from __future__ import annotations

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, compiled_for_sm90, tl, triton

if HAS_TRITON:
    from atom.model_ops.kernels.triton_import import grouped_tile
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover - older triton: pointer loads only
        TensorDescriptor = None

    @triton.jit
    def _gemm_kernel(x, w, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, TMA: tl.constexpr, HAS_BIAS: tl.constexpr,
                     DOT_PREC: tl.constexpr):
        """x, w: tensor descriptors when TMA, else pointers ([M, K] and [N, K], unit K stride)."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = grouped_tile(pid, num_m, num_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if TMA:
            for k in tl.range(0, K, BLOCK_K):
                a = x.load([off_m, k])
                b = w.load([off_n, k])
                acc = tl.dot(a, b.T, acc, input_precision=DOT_PREC)
        else:
            rk = tl.arange(0, BLOCK_K)
            xp = x + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
            wp = w + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]
            for k in range(0, K, BLOCK_K):
                a = tl.load(xp, mask=(rm[:, None] < M) & (rk[None, :] + k < K), other=0.0)
                b = tl.load(wp, mask=(rn[None, :] < N) & (rk[:, None] + k < K), other=0.0)
                acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
                xp += BLOCK_K
                wp += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemm_config(M: int, tma: bool, elem_bytes: int = 2) -> dict:
    """Tiles by the number of rows: decode batches (M <= 256) from the H200 probe's best
    tilings of the Llama-3.1-8B shapes, prefills the usual large Hopper tile; without TMA
    smaller K tiles and two stages, so that a stage of the largest tile fits ROCm's 64 KiB
    of shared memory (48 KiB in 16-bit, 48 KiB in fp32 with K tiles of 32)."""
    if M <= 64:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    elif M <= 256:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
    if not tma:
        cfg.update(BLOCK_K=64 if elem_bytes <= 2 else 32, num_stages=2)
    return cfg


def _tma_device(index: int) -> bool:
    return TensorDescriptor is not None and compiled_for_sm90(index)


def _tma_layout_problem(**tensors: torch.Tensor) -> str | None:
    """What keeps these 2-D operands from TMA (unit last stride, 16-byte aligned rows and
    base), or None."""
    for name, t in tensors.items():
        if t.stride(-1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return (f"{name} (strides {tuple(t.stride())} of {t.element_size()}-byte elements, base address "
                    f"{t.data_ptr() % 16} bytes past 16-byte alignment) is not laid out for TMA: it needs unit "
                    "last stride and 16-byte aligned rows and base")
    return None


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         tma: bool | None = None, config: dict | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias [N]) -> [..., N] in x's dtype. `tma`: None picks
    (NVIDIA sm90+, layout allowing), False forces pointer loads, True forces descriptors
    (the interpreter runs both); `config` overrides `gemm_config`'s tiles."""
    if not HAS_TRITON:
        raise RuntimeError("gemm needs triton; use F.linear without it")
    K = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"weight must be [N, {K}], got {tuple(weight.shape)}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight must be {x.dtype} on {x.device} like x, got {weight.dtype} on {weight.device}")
    N = weight.shape[0]
    if bias is not None:
        if bias.shape != (N,) or bias.device != x.device:
            raise ValueError(f"bias must be [{N}] on {x.device}, got {tuple(bias.shape)} on {bias.device}")
        bias = bias.contiguous()
    lead = x.shape[:-1]
    M = x.numel() // K if K else int(torch.Size(lead).numel())
    if M == 0 or N == 0 or K == 0:  # nothing to launch (K = 0: the empty sum, then the bias)
        y = torch.zeros(M, N, dtype=x.dtype, device=x.device)
        return (y if bias is None else y + bias.to(x.dtype)).view(*lead, N)
    x2 = x.reshape(M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if tma is None:  # 16-bit operands: fp32 takes the pointer path's full-precision dot
        tma = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _tma_device(x.device.index or 0) \
            and _tma_layout_problem(x=x2, weight=w) is None
    elif tma:
        if TensorDescriptor is None:
            raise RuntimeError("tma=True needs triton.tools.tensor_descriptor, which this triton lacks")
        if (problem := _tma_layout_problem(x=x2, weight=w)) is not None:
            raise ValueError(f"tma=True: {problem}")
    cfg = dict(gemm_config(M, tma, x.element_size()), **(config or {}))
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    xa, wa = (TensorDescriptor.from_tensor(x2, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk])) if tma \
        else (x2, w)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _gemm_kernel[grid](xa, wa, bias if bias is not None else y, y, M, N, K, x2.stride(0), w.stride(0), y.stride(0),
                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, TMA=tma, HAS_BIAS=bias is not None,
                       DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
                       num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y.view(*lead, N)
