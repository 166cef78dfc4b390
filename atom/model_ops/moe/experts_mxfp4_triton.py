"""MXFP4 experts on Triton: the grouped GEMM of `experts_triton` with each expert's packed
e2m1 weights and E8M0 scales dequantized in registers, weight only (GPT-OSS), so that an
MXFP4 MoE layer runs on the GPU without a host sync (CUDA graphs and torch.compile take it).

    y = fused_experts_mxfp4(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, activation,
                            w13_bias, w2_bias)

Weights as `mxfp4_method.Mxfp4MoEMethod` stores them: `w13` uint8 [E, 2I, H/2] (two e2m1
codes a byte, the low nibble the even column) with `w13_scale` uint8 [E, 2I, H/32] (E8M0, one
per 32 columns), `w2` [E, H, I/2] with `w2_scale` [E, H, I/32]. A K step of the tile loads
BLOCK_K / 2 bytes of BLOCK_N rows, splits the nibbles and interleaves them back into columns
(`tl.interleave`), decodes them (`w4_gemm._e2m1`: no conversion instruction), multiplies
each run of 32 by its scale (`_e8m0`, exact), and casts to the activations' dtype: an e2m1
value times a power of two is exact in bf16 (in fp16 too while the scale keeps it inside
fp16's exponent range), so the tile holds exactly the reference's dequantized weights and the
dot (fp32 accumulation, "ieee" for fp32 inputs) differs from the reference's fp32 product
only in summation order. (Under Triton's
interpreter the dot runs on fp32 operands instead: the same exact values.) The biases are added in
fp32, the routing weight multiplies the second product, the k rows of a token are summed
in fp32.

The pairs go through `moe_align` (sorted by expert, padded to BLOCK_M) at every batch size.
"""
from __future__ import annotations

from typing import Callable

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton
from atom.model_ops.moe.tile_configs import TileTable
from atom.model_ops.moe.topk_sum import topk_sum
from atom.model_ops.quant.mxfp4 import MX_GROUP

if HAS_TRITON:
    from atom.model_ops.moe.experts_triton import sorted_tile, store_tile
    from atom.model_ops.kernels.w4_gemm import _e2m1, _e8m0

    @triton.jit
    def _moe_mxfp4_gemm_kernel(a_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, sorted_ptr, block_expert_ptr, rw_ptr,
                               N, K, num_pairs, num_m_blocks, a_div,
                               stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                               DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
        """out[p] = a[p // a_div] @ dequant(w[e])^T (+ b[e]) (* rw[p]) for the BLOCK_M pairs p
        of one expert e in the sorted order."""
        e, pairs, valid, a_rows, rn = sorted_tile(block_expert_ptr, sorted_ptr, num_pairs, num_m_blocks, N, a_div,
                                                  BLOCK_M, BLOCK_N, GROUP_M)
        if e < 0:
            return
        e64 = e.to(tl.int64)
        n_ok = rn < N
        rk = tl.arange(0, BLOCK_K)
        rb = tl.arange(0, BLOCK_K // 2)
        rs = tl.arange(0, BLOCK_K // 32)
        ap = a_ptr + a_rows[:, None] * stride_am + rk[None, :]
        wp = w_ptr + e64 * stride_we + rn.to(tl.int64)[:, None] * stride_wn + rb[None, :]
        sp = ws_ptr + e64 * stride_se + rn.to(tl.int64)[:, None] * stride_sn + rs[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, K, BLOCK_K):
            a = tl.load(ap, mask=valid[:, None] & (rk[None, :] + k < K), other=0.0)
            packed = tl.load(wp, mask=n_ok[:, None] & (rb[None, :] * 2 + k < K), other=0).to(tl.int32)
            codes = tl.interleave(packed & 0xF, packed >> 4)  # [BLOCK_N, BLOCK_K]: column 2j, 2j + 1
            s = _e8m0(tl.load(sp, mask=n_ok[:, None] & (rs[None, :] * 32 + k < K), other=127).to(tl.int32))
            w = tl.reshape(tl.reshape(_e2m1(codes), [BLOCK_N, BLOCK_K // 32, 32]) * s[:, :, None],
                           [BLOCK_N, BLOCK_K])
            if DOT_F32:
                acc = tl.dot(a.to(tl.float32), tl.trans(w), acc, input_precision=DOT_PREC)
            else:
                acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=DOT_PREC)
            ap += BLOCK_K
            wp += BLOCK_K // 2
            sp += BLOCK_K // 32
        store_tile(acc, b_ptr, rw_ptr, out_ptr, e, pairs, valid, rn, N, stride_be, stride_om, HAS_BIAS, MUL_WEIGHT)


def mxfp4_expert_product(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                         topk_ids: torch.Tensor, a_div: int, weights: torch.Tensor | None, cfg: dict,
                         layout) -> torch.Tensor:
    """[pairs, N]: row p = a[p // a_div] @ dequant(w[ids[p]])^T (+ bias) (* weights[p])."""
    P = topk_ids.numel()
    E, N, half_k = w.shape
    K = half_k * 2
    out = torch.empty(P, N, dtype=a.dtype, device=a.device)
    if P == 0:
        return out
    a = a if a.stride(-1) == 1 else a.contiguous()
    sorted_pairs, block_expert = layout
    b = bias if bias is not None else out
    rw = weights.reshape(-1) if weights is not None else out
    from atom.model_ops.kernels.kv_cache import interpreted
    bk = max(MX_GROUP, min(cfg["BLOCK_K"], 128))  # whole scale groups per K step
    # fp32 dots for fp32 activations, and under Triton's interpreter, whose dot of a tile
    # computed in bf16 / fp16 (not loaded) returns garbage (triton 3.9): exact either way
    dot_f32 = a.dtype == torch.float32 or interpreted()
    num_m = block_expert.numel()
    grid = (num_m * triton.cdiv(N, cfg["BLOCK_N"]),)
    _moe_mxfp4_gemm_kernel[grid](a, w, w_scale, b, out, sorted_pairs, block_expert, rw, N, K, P, num_m, a_div,
                                 a.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1),
                                 bias.stride(0) if bias is not None else 0, out.stride(0),
                                 BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk,
                                 GROUP_M=cfg.get("GROUP_M", 1), HAS_BIAS=bias is not None,
                                 MUL_WEIGHT=weights is not None,
                                 DOT_PREC="ieee" if dot_f32 else "tf32", DOT_F32=dot_f32,
                                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def fused_experts_mxfp4(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                        w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        activation: Callable[[torch.Tensor], torch.Tensor], w13_bias: torch.Tensor | None = None,
                        w2_bias: torch.Tensor | None = None, tiles: TileTable | None = None,
                        config: dict | None = None) -> torch.Tensor:
    """The routed sum of MXFP4 experts, [T, H] (module docstring)."""
    if not HAS_TRITON:
        raise RuntimeError("fused_experts_mxfp4 needs triton; the torch reference is Mxfp4MoEMethod's apply")
    from atom.model_ops.moe.experts_triton import pair_layout
    T, H = x.shape
    E, two_i, half_h = w13.shape
    k = topk_ids.shape[1]
    I = two_i // 2
    if half_h * 2 != H or w2.shape != (E, H, I // 2) or H % MX_GROUP or I % MX_GROUP:
        raise ValueError(f"MXFP4 experts w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit hidden {H} "
                         f"(packed two a byte, widths multiples of {MX_GROUP})")
    if T == 0:
        return torch.zeros_like(x)
    cfg, layout = pair_layout(topk_ids, E, tiles, config)
    h = mxfp4_expert_product(x, w13, w13_scale, w13_bias, topk_ids, k, None, cfg, layout)
    y = mxfp4_expert_product(activation(h), w2, w2_scale, w2_bias, topk_ids, 1, topk_weights, cfg, layout)
    return topk_sum(y, k, x.dtype)
