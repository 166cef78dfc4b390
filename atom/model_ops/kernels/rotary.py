"""Rotary embedding (NeoX / rotate_half style, as HF Llama and Qwen3, or interleaved pairs,
as DeepSeek's MLA rope dims), in place.

``cos_sin_cache[pos]`` holds ``cos(pos * inv_freq)`` in its first D/2 columns and
``sin(...)`` in its last D/2 (the model builds it, llama3 / YaRN scaling included). Pair i
rotates (x[i], x[i + D/2]) (rotate_half) or, with ``interleaved``, (x[2i], x[2i + 1]).
Optionally a per-head RMSNorm (Qwen3's q_norm/k_norm, weight [D]) is applied to
q and k before the rotation, and the rotated keys and the values are written into the
paged KV cache, all in the same kernel (one launch per layer instead of three).  Math in fp32.
"""

from __future__ import annotations

from typing import Optional

import torch

from atom.model_ops.kernels.kv_cache import reshape_and_cache_ref
from atom.model_ops.kernels.triton_import import HAS_TRITON, pdl_args, tl, triton

if HAS_TRITON:
    from atom.model_ops.kernels.kv_cache import slot_offset
    from atom.model_ops.kernels.triton_import import pdl_start

    @triton.jit
    def _rope_heads(base, stride_h, w_ptr, cos, sin, eps,
                    NH: tl.constexpr, NH_PAD: tl.constexpr,
                    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HAS_NORM: tl.constexpr,
                    INTERLEAVED: tl.constexpr = False):
        h = tl.arange(0, NH_PAD)
        d = tl.arange(0, HALF_PAD)
        mask = (h < NH)[:, None] & (d < HALF)[None, :]
        if INTERLEAVED:  # pair i is (x[2i], x[2i + 1])
            p1 = base + h[:, None] * stride_h + 2 * d[None, :]
            p2 = p1 + 1
        else:  # pair i is (x[i], x[i + D/2])
            p1 = base + h[:, None] * stride_h + d[None, :]
            p2 = p1 + HALF
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            var = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
            rstd = 1.0 / tl.sqrt(var + eps)
            w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
            x1 = x1 * rstd[:, None] * w1[None, :]
            x2 = x2 * rstd[:, None] * w2[None, :]
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
        tl.store(p1, o1.to(base.dtype.element_ty), mask=mask)
        tl.store(p2, o2.to(base.dtype.element_ty), mask=mask)
        return o1, o2

    @triton.jit
    def _rope_kernel(
        pos_ptr, q_ptr, k_ptr, cs_ptr, qw_ptr, kw_ptr,
        v_ptr, kc_ptr, vc_ptr, slot_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, eps,
        stride_vt, stride_vh, stride_cb, stride_co, stride_ch,
        HQ: tl.constexpr, HQ_PAD: tl.constexpr, HKV: tl.constexpr, HKV_PAD: tl.constexpr,
        HALF: tl.constexpr, HALF_PAD: tl.constexpr,
        Q_NORM: tl.constexpr, K_NORM: tl.constexpr,
        WRITE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, PDL: tl.constexpr,
        INTERLEAVED: tl.constexpr,
    ):
        pdl_start(PDL)
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        d = tl.arange(0, HALF_PAD)
        cos = tl.load(cs_ptr + pos * stride_cs + d, mask=d < HALF, other=0.0).to(tl.float32)
        sin = tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        _rope_heads(q_ptr + t * stride_qt, stride_qh, qw_ptr, cos, sin, eps,
                    HQ, HQ_PAD, HALF, HALF_PAD, Q_NORM, INTERLEAVED)
        k1, k2 = _rope_heads(k_ptr + t * stride_kt, stride_kh, kw_ptr, cos, sin, eps,
                             HKV, HKV_PAD, HALF, HALF_PAD, K_NORM, INTERLEAVED)
        if WRITE_KV:  # the rotated key and the value go straight into the paged cache
            slot = tl.load(slot_ptr + t).to(tl.int64)
            h = tl.arange(0, HKV_PAD)
            mask = ((h < HKV) & (h * 0 + slot >= 0))[:, None] & (d < HALF)[None, :]
            slot = tl.maximum(slot, 0)  # a padding row (slot < 0) is fully masked
            dst = slot_offset(slot, stride_cb, stride_co, BLOCK_SIZE) + h[:, None] * stride_ch + d[None, :]
            tl.store(kc_ptr + dst, k1.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(kc_ptr + dst + HALF, k2.to(kc_ptr.dtype.element_ty), mask=mask)
            src = v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :]
            tl.store(vc_ptr + dst, tl.load(src, mask=mask).to(vc_ptr.dtype.element_ty), mask=mask)
            tl.store(vc_ptr + dst + HALF, tl.load(src + HALF, mask=mask).to(vc_ptr.dtype.element_ty),
                     mask=mask)


def _heads_view(x: torch.Tensor, head_dim: int, name: str):
    """(row stride, head stride, num heads) of a [T, H*D] or [T, H, D] tensor."""
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension")
    if x.dim() == 2:
        if x.shape[1] % head_dim:
            raise ValueError(f"{name} width {x.shape[1]} is not a multiple of head_dim {head_dim}")
        return x.stride(0), head_dim, x.shape[1] // head_dim
    if x.dim() == 3 and x.shape[2] == head_dim:
        return x.stride(0), x.stride(1), x.shape[1]
    raise ValueError(f"{name} must be [T, H*{head_dim}] or [T, H, {head_dim}], got {tuple(x.shape)}")


def _cache_args(kv_cache: tuple, T: int, HKV: int, head_dim: int) -> tuple:
    """Checks the `kv_cache` argument of :func:`rotary_embedding`; returns the kernel's view."""
    value, k_cache, v_cache, slot_mapping = kv_cache
    svt, svh, hv = _heads_view(value, head_dim, "value")
    if value.shape[0] != T or hv != HKV:
        raise ValueError(f"value must be [{T}, {HKV}*{head_dim}], got {tuple(value.shape)}")
    check_cache_write(k_cache, v_cache, slot_mapping, T, HKV, head_dim)
    return (value, k_cache, v_cache, slot_mapping, (svt, svh), k_cache.stride()[:3], k_cache.shape[1])


def check_cache_write(k_cache, v_cache, slot_mapping, T: int, HKV: int, head_dim: int) -> None:
    """What a kernel that writes T tokens' k and v into the paged caches needs of them (this
    one and the rotary GEMV of `gemv_rope`)."""
    if k_cache.dim() != 4 or k_cache.shape[2:] != (HKV, head_dim):
        raise ValueError(f"k_cache must be [num_blocks, block_size, {HKV}, {head_dim}], got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have the same shape and strides, with a contiguous last dim")
    if slot_mapping.shape[0] < T:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {T} tokens")


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    kv_cache: Optional[tuple] = None,
    interleaved: bool = False,
):
    """Rotates q [T, Hq*D] and k [T, Hkv*D] in place (views are fine); returns (q, k).

    `kv_cache=(value, k_cache, v_cache, slot_mapping)` also writes the rotated keys and the
    values [T, Hkv*D] into the paged caches [num_blocks, block_size, Hkv, D] at the slots
    (negative = padding, skipped): the cache write of `reshape_and_cache` in the same launch.
    `interleaved` rotates the pairs (x[2i], x[2i + 1]) (no cache write: the one MLA model that
    rotates so writes its latent cache itself)."""
    if not HAS_TRITON:
        raise RuntimeError("rotary_embedding needs triton; use rotary_embedding_ref without it")
    if head_dim % 2 or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(f"cos_sin_cache must be [max_pos, {head_dim}] with an even head_dim, "
                         f"got {tuple(cos_sin_cache.shape)}")
    T = positions.shape[0]
    sqt, sqh, HQ = _heads_view(q, head_dim, "q")
    skt, skh, HKV = _heads_view(k, head_dim, "k")
    if q.shape[0] != T or k.shape[0] != T:
        raise ValueError(f"positions ({T}), q ({q.shape[0]}) and k ({k.shape[0]}) disagree on T")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None and w.shape != (head_dim,):
            raise ValueError(f"{name} must be [{head_dim}], got {tuple(w.shape)}")
    if interleaved and kv_cache is not None:
        raise ValueError("rotary_embedding: interleaved=True does not write a KV cache (kv_cache must be None)")
    write = _cache_args(kv_cache, T, HKV, head_dim) if kv_cache is not None else None
    if T == 0:
        return q, k
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = head_dim // 2
    np2 = triton.next_power_of_2
    no_write = (cs, cs, cs, positions, (0, 0), (0, 0, 0), 1)  # unused pointers and strides
    v, kc, vc, slots, (svt, svh), (scb, sco, sch), block_size = write or no_write
    _rope_kernel[(T,)](
        positions, q, k, cs,
        q_norm_weight if q_norm_weight is not None else cs,
        k_norm_weight if k_norm_weight is not None else cs,
        v, kc, vc, slots,
        sqt, sqh, skt, skh, cs.stride(0), float(eps),
        svt, svh, scb, sco, sch,
        HQ=HQ, HQ_PAD=np2(HQ), HKV=HKV, HKV_PAD=np2(HKV), HALF=half, HALF_PAD=np2(half),
        Q_NORM=q_norm_weight is not None, K_NORM=k_norm_weight is not None,
        WRITE_KV=write is not None, BLOCK_SIZE=block_size, INTERLEAVED=bool(interleaved),
        num_warps=4 if np2(HQ) * np2(half) >= 1024 else 2, **pdl_args(q),
    )
    return q, k


def _rope_ref_one(x, positions, cos_sin_cache, head_dim, w, eps, interleaved=False):
    T = x.shape[0]
    xf = x.reshape(T, -1, head_dim).float()
    if w is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    half = head_dim // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        y = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:
        x1, x2 = xf[..., :half], xf[..., half:]
        y = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x.copy_(y.reshape(x.shape).to(x.dtype))


def rotary_embedding_ref(positions, q, k, cos_sin_cache, head_dim,
                         q_norm_weight=None, k_norm_weight=None, eps: float = 1e-6, kv_cache=None,
                         interleaved: bool = False):
    """Torch reference of :func:`rotary_embedding` (also in place)."""
    _rope_ref_one(q, positions, cos_sin_cache, head_dim, q_norm_weight, eps, interleaved)
    _rope_ref_one(k, positions, cos_sin_cache, head_dim, k_norm_weight, eps, interleaved)
    if kv_cache is not None:
        value, k_cache, v_cache, slot_mapping = kv_cache
        T = k.shape[0]
        reshape_and_cache_ref(k.reshape(T, -1, head_dim), value.reshape(T, -1, head_dim),
                              k_cache, v_cache, slot_mapping)
    return q, k
