"""FP8 experts on Triton: the grouped GEMM of `experts_triton` on e4m3 weights and e4m3
activations, with the formats' scales, so that an FP8 MoE layer runs on the GPU without a
host sync (CUDA graphs and torch.compile take it).

    y = fused_experts_fp8(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, activation,
                          act_group=0, block=None)

Numerics: those of `fp8_method.Fp8MoEMethod`'s torch reference, which fake-quantizes each
expert's input rows and multiplies by the dequantized weights in fp32. The activations are
row-local here (dynamic per token, or per 1 x `act_group` slice of a row), so a token's row
quantizes the same whichever expert it goes to: x is quantized once (`act_quant`), and the
activation output once per (token, expert) pair. Each tile multiplies e4m3 by e4m3 into fp32
(exact products) and applies the scales:
- per-row weight scales (`block` None; per channel, or a per-tensor scale repeated over its
  rows): after the K loop, acc x a_scale[row] x w_scale[e, n];
- bn x bk blocks: each K step is one block (BLOCK_K = bk), its product scaled by
  a_scale[row, kb] x w_scale[e, block row of n, kb] before it is added. w13's block rows are
  the gate's, then the up's (`part_rows` = I rows in `part_blocks` block rows each).
Static or dynamic per-tensor activations, whose scale depends on the expert's whole row set,
stay on the reference.

The pairs go through `moe_align` (sorted by expert, padded to BLOCK_M) at every batch size.
"""
from __future__ import annotations

from typing import Callable

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton
from atom.model_ops.moe.tile_configs import TileTable
from atom.model_ops.moe.topk_sum import topk_sum
from atom.model_ops.quant.common import FP8_MAX

if HAS_TRITON:
    from atom.model_ops.kernels.triton_import import FP8_PROMOTE
    from atom.model_ops.moe.experts_triton import sorted_tile, store_tile

    @triton.jit
    def _moe_fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, block_expert_ptr, rw_ptr,
                             N, K, num_pairs, num_m_blocks, a_div, part_rows, part_blocks,
                             stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr, BN_W: tl.constexpr, BLOCKS: tl.constexpr,
                             MUL_WEIGHT: tl.constexpr):
        """out[p] = (a[p // a_div] * a_scale) @ (w[e] * w_scale)^T (* rw[p]) for the BLOCK_M
        pairs p of one expert e in the sorted order (the module docstring's two scale layouts)."""
        e, pairs, valid, a_rows, rn = sorted_tile(block_expert_ptr, sorted_ptr, num_pairs, num_m_blocks, N, a_div,
                                                  BLOCK_M, BLOCK_N, GROUP_M)
        if e < 0:
            return
        e64 = e.to(tl.int64)
        n_ok = rn < N
        rk = tl.arange(0, BLOCK_K)
        ap = a_ptr + a_rows[:, None] * stride_am + rk[None, :]
        wp = w_ptr + e64 * stride_we + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if BLOCKS:
            srow = (rn // part_rows) * part_blocks + (rn % part_rows) // BN_W
            sp = ws_ptr + e64 * stride_wse + srow.to(tl.int64) * stride_wsn
        for k in range(0, K, BLOCK_K):
            a = tl.load(ap, mask=valid[:, None] & (rk[None, :] + k < K), other=0.0)
            w = tl.load(wp, mask=n_ok[None, :] & (rk[:, None] + k < K), other=0.0)
            if BLOCKS:
                kb = k // BLOCK_K
                sa = tl.load(as_ptr + a_rows * stride_as + kb, mask=valid, other=0.0)
                sw = tl.load(sp + kb, mask=n_ok, other=0.0)
                acc += tl.dot(a, w) * sa[:, None] * sw[None, :]
            else:  # partial sums carried into fp32 every FP8_PROMOTE products (triton_import)
                acc = tl.dot(a, w, acc, max_num_imprecise_acc=FP8_PROMOTE if BLOCK_K > FP8_PROMOTE else BLOCK_K)
            ap += BLOCK_K
            wp += BLOCK_K
        if not BLOCKS:
            sa = tl.load(as_ptr + a_rows * stride_as, mask=valid, other=0.0)
            sw = tl.load(ws_ptr + e64 * stride_wse + rn.to(tl.int64) * stride_wsn, mask=n_ok, other=0.0)
            acc = acc * sa[:, None] * sw[None, :]
        store_tile(acc, rw_ptr, rw_ptr, out_ptr, e, pairs, valid, rn, N, 0, stride_om, False, MUL_WEIGHT)


def _quantize(x: torch.Tensor, act_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x -> (e4m3 [M, K], fp32 scales [M, K / group]); group 0: one scale per row."""
    from atom.model_ops.kernels.act_quant import act_quant
    K = x.shape[1]
    return act_quant(x if x.is_contiguous() else x.contiguous(), "fp8", act_group or K, FP8_MAX)


def fp8_expert_product(aq: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                       topk_ids: torch.Tensor, a_div: int, weights: torch.Tensor | None, cfg: dict,
                       layout, out_dtype: torch.dtype, block: tuple[int, int] | None, parts: int) -> torch.Tensor:
    """[pairs, N]: row p = the fp8 product of aq[p // a_div] and expert ids[p]'s w (module docstring)."""
    P = topk_ids.numel()
    E, N, K = w.shape
    out = torch.empty(P, N, dtype=out_dtype, device=aq.device)
    if P == 0:
        return out
    sorted_pairs, block_expert = layout
    rw = weights.reshape(-1) if weights is not None else out
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if block is not None:
        bk, bn_w = block[1], block[0]
        part_rows = N // parts
        part_blocks = w_scale.shape[1] // parts
    else:  # e4m3 dots take K steps of at least 32
        bk, bn_w, part_rows, part_blocks = max(cfg["BLOCK_K"], 32), 1, N, 0
    num_m = block_expert.numel()
    grid = (num_m * triton.cdiv(N, bn),)
    _moe_fp8_gemm_kernel[grid](aq, a_scale, w, w_scale, out, sorted_pairs, block_expert, rw,
                               N, K, P, num_m, a_div, part_rows, part_blocks,
                               aq.stride(0), a_scale.stride(0), w.stride(0), w.stride(1),
                               w_scale.stride(0), w_scale.stride(1), out.stride(0),
                               BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.get("GROUP_M", 1), BN_W=bn_w,
                               BLOCKS=block is not None, MUL_WEIGHT=weights is not None,
                               num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def layout_problem(act_group: int, block: tuple[int, int] | None) -> str | None:
    """Why the kernel cannot compute these scale layouts (None: it can): per-row weight scales
    take per-token activations (act_group 0), bn x bk blocks take 1 x bk activation groups
    with bk a power of two >= 32 (the e4m3 dots' K step). `Fp8MoEMethod.triton_fits` asks
    the same question to route a layer."""
    if block is None:
        if act_group:
            return (f"act_group={act_group} is invalid with per-row weight scales: the kernel applies "
                    "one activation scale per row (per-token, act_group=0)")
        return None
    if act_group != block[1]:
        return (f"act_group={act_group} is invalid with {block[0]}x{block[1]} weight blocks: "
                f"the activations' groups must be the blocks' width ({block[1]})")
    if block[1] < 32 or block[1] & (block[1] - 1):
        return f"block={block} is invalid: the blocks' width is the K step of the e4m3 dots, a power of two >= 32"
    return None


def fused_experts_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      activation: Callable[[torch.Tensor], torch.Tensor], act_group: int = 0,
                      block: tuple[int, int] | None = None, tiles: TileTable | None = None,
                      config: dict | None = None) -> torch.Tensor:
    """The routed sum of FP8 experts, [T, H]. Scales: per-row `w13_scale` [E, 2I, 1] /
    `w2_scale` [E, H, 1], or with `block` (bn, bk) the block scales [E, 2 ceil(I/bn),
    ceil(H/bk)] / [E, ceil(H/bn), ceil(I/bk)]; `act_group`: 0 per token, else the 1 x group
    slices (equal to bk with blocks)."""
    if not HAS_TRITON:
        raise RuntimeError("fused_experts_fp8 needs triton; the torch reference is Fp8MoEMethod's apply")
    from atom.model_ops.moe.experts_triton import check_shapes, pair_layout
    T, H = x.shape
    E = check_shapes(x, w13, w2)
    k = topk_ids.shape[1]
    problem = layout_problem(act_group, block)
    if problem is not None:
        raise ValueError(problem)
    if T == 0:
        return torch.zeros_like(x)
    cfg, layout = pair_layout(topk_ids, E, tiles, config)
    xq, xs = _quantize(x, act_group)
    h = fp8_expert_product(xq, xs, w13, w13_scale, topk_ids, k, None, cfg, layout, x.dtype, block, 2)
    aq, a_s = _quantize(activation(h), act_group)
    y = fp8_expert_product(aq, a_s, w2, w2_scale, topk_ids, 1, topk_weights, cfg, layout, x.dtype, block, 1)
    return topk_sum(y, k, x.dtype)
