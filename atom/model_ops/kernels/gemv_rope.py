"""One-row q/k/v projection with the layer's RMSNorm before it and the rotary embedding and
KV-cache write after it: at batch 1 the rotary kernel (~3 us a layer on the H200, mostly
launch and ramp-up) folds into the GEMV's epilogue.

The packed weight has rows [q heads | k heads | v heads] of `head_dim` each. Rotate-half
pairs element d of a head with element d + D/2, so a program owns pairs of rows
(h*D + d, h*D + d + D/2) instead of neighbours: it has both halves of each rotation. The
products are rounded to the activation dtype first, as the unfused path stores them before
its rotary kernel reads them; the rotation is in fp32. q comes out rotated in the output
row; k (rotated) and v go into the paged caches at the step's slot (k and v also stay in
the output row, unused). Models with a per-head q/k norm (Qwen3) need the whole head before
rotating and keep the separate kernel.
"""

from __future__ import annotations

import torch

from atom.model_ops.kernels.gemv import _check_row, _norm_inputs, gemv_config, gemv_fused_ref
from atom.model_ops.kernels.rotary import check_cache_write, rotary_embedding_ref
from atom.model_ops.kernels.triton_import import HAS_TRITON, pdl_args, tl, triton

if HAS_TRITON:
    from atom.model_ops.kernels.gemv import _gemv_stream
    from atom.model_ops.kernels.kv_cache import slot_offset

    @triton.jit
    def _gemv_rope_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, y_ptr, rout_ptr, K, stride_wn, eps,
                          pos_ptr, cs_ptr, stride_cs, kc_ptr, vc_ptr, slot_ptr,
                          stride_cb, stride_co, stride_ch,
                          NUM_PAIRS, Q_ROWS, KV_ROWS,
                          HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_RES: tl.constexpr,
                          PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          AHEAD: tl.constexpr):
        act = x_ptr.dtype.element_ty
        PAIRS: tl.constexpr = BLOCK_N // 2
        i = tl.arange(0, BLOCK_N)  # i = 2 * pair + half
        pair = tl.program_id(0) * PAIRS + i // 2
        rows = (pair // HALF) * (2 * HALF) + pair % HALF + (i % 2) * HALF
        row_ok = pair < NUM_PAIRS
        y, _ = _gemv_stream(x_ptr, r_ptr, nw_ptr, w_ptr, rout_ptr, rows, row_ok, K, stride_wn, 0, eps,
                            True, HAS_RES, False, PDL, BLOCK_N, BLOCK_K, AHEAD)
        y = y.to(act).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(y, [PAIRS, 2]))
        # the rows of each pair, and their frequency
        p = tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)
        first = (p // HALF) * (2 * HALF) + p % HALF
        pos = tl.load(pos_ptr).to(tl.int64)
        cos = tl.load(cs_ptr + pos * stride_cs + p % HALF).to(tl.float32)
        sin = tl.load(cs_ptr + pos * stride_cs + HALF + p % HALF).to(tl.float32)
        rot = first < Q_ROWS + KV_ROWS  # q and k heads; v passes through
        o1 = tl.where(rot, x1 * cos - x2 * sin, x1)
        o2 = tl.where(rot, x2 * cos + x1 * sin, x2)
        out = tl.reshape(tl.join(o1, o2), [BLOCK_N]).to(act)
        tl.store(y_ptr + rows, out, mask=row_ok)
        # k and v into the paged caches (a negative slot is graph padding: nothing written)
        slot = tl.load(slot_ptr).to(tl.int64)
        kv = rows - Q_ROWS
        is_v = kv >= KV_ROWS
        kv = tl.where(is_v, kv - KV_ROWS, kv)
        dst = slot_offset(tl.maximum(slot, 0), stride_cb, stride_co, BLOCK_SIZE) \
            + (kv // (2 * HALF)) * stride_ch + kv % (2 * HALF)
        ok = row_ok & (kv >= 0) & (rows * 0 + slot >= 0)  # a vector compare: the interpreter
        tl.store(kc_ptr + dst, out.to(kc_ptr.dtype.element_ty), mask=ok & (rows < Q_ROWS + KV_ROWS))
        tl.store(vc_ptr + dst, out.to(vc_ptr.dtype.element_ty), mask=ok & is_v)


def _rope_cache_check(weight, head_dim, q_size, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
    N = weight.shape[0]
    kv_size = (N - q_size) // 2
    if head_dim % 2 or q_size % head_dim or kv_size % head_dim or q_size + 2 * kv_size != N:
        raise ValueError(f"weight of {N} rows is not [q {q_size} | k | v] heads of head_dim {head_dim}")
    if cos_sin_cache.shape[-1] != head_dim or cos_sin_cache.stride(-1) != 1:
        raise ValueError(f"cos_sin_cache must be [max_pos, {head_dim}] contiguous, got {tuple(cos_sin_cache.shape)}")
    check_cache_write(k_cache, v_cache, slot_mapping, 1, kv_size // head_dim, head_dim)
    if positions.numel() < 1:
        raise ValueError("positions needs the row's entry")
    return kv_size


def gemv_norm_rope(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                   weight: torch.Tensor, head_dim: int, q_size: int, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, config: dict | None = None):
    """One row: `h, res = rmsnorm(x + residual)`, `qkv = h W^T`, then q and k rotated at
    `positions[0]` and k, v written into the caches at `slot_mapping[0]`.
    Returns (qkv [1, N] with q rotated, res [1, K])."""
    x = _check_row(x, weight)
    N, K = weight.shape
    kv_size = _rope_cache_check(weight, head_dim, q_size, positions, cos_sin_cache, k_cache, v_cache,
                                slot_mapping)
    r, rout = _norm_inputs(x, residual, norm_weight)
    cfg = dict(config or gemv_config(N, K))
    if cfg["BLOCK_N"] % 2:
        raise ValueError(f"the rotary GEMV takes row pairs: BLOCK_N must be even, got {cfg['BLOCK_N']}")
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    _gemv_rope_kernel[(triton.cdiv(N // 2, cfg["BLOCK_N"] // 2),)](
        x, r, norm_weight, weight, y, rout, K, weight.stride(0), float(eps),
        positions, cos_sin_cache, cos_sin_cache.stride(0), k_cache, v_cache, slot_mapping,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        N // 2, q_size, kv_size,
        HALF=head_dim // 2, BLOCK_SIZE=k_cache.shape[1], HAS_RES=residual is not None,
        **pdl_args(x), **cfg)
    return y, rout.view(1, K)


def gemv_norm_rope_ref(x, residual, norm_weight, eps, weight, head_dim, q_size, positions, cos_sin_cache,
                       k_cache, v_cache, slot_mapping):
    """The unfused layers' references in order: (add +) RMSNorm, x W^T, rotary with the cache write."""
    qkv, res = gemv_fused_ref(x, residual, norm_weight, eps, weight)
    kv_size = (weight.shape[0] - q_size) // 2
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    rotary_embedding_ref(positions[:1], q, k, cos_sin_cache, head_dim,
                         kv_cache=(v, k_cache, v_cache, slot_mapping[:1]))
    return qkv, res
