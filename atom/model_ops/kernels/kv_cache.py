"""Write this step's keys/values into the paged KV cache.

``slot = block * block_size + offset``; a negative slot (padding) is skipped.
Cache layout: ``[num_blocks, block_size, Hkv, D]``. An FP8 cache (its dtype says so) stores
``x / scale`` with the layer's ``k_scale`` / ``v_scale``, saturated at +-448 (a plain cast
past the largest e4m3 value gives NaN).
"""

from __future__ import annotations

import os

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def slot_offset(slot, stride_block, stride_row, BLOCK_SIZE: tl.constexpr):
        """Offset of a slot's row in a paged cache: block slot // BLOCK_SIZE, row slot %
        BLOCK_SIZE (the rotary, GEMV and attention kernels that write the cache use it too)."""
        return (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_row

    @triton.jit
    def fp8_saturate(x, scale_ptr, EXACT_ROUND: tl.constexpr):
        """x / scale in fp32, saturated at +-448 (the largest e4m3 value), for a store into an
        FP8 cache. EXACT_ROUND (Triton's interpreter only): round to the e4m3 grid here, nearest
        even, because the interpreter's fp32 -> fp8 cast drops the carry when the mantissa rounds
        up (1.96 -> 1.0); the GPUs' conversion instruction rounds correctly by itself."""
        x = tl.minimum(tl.maximum(x.to(tl.float32) / tl.load(scale_ptr), -448.0), 448.0)
        if EXACT_ROUND:
            e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
            e = tl.maximum(e, -6)  # below 2^-6 the e4m3 subnormals: a fixed step of 2^-9
            step = (((e - 3) + 127) << 23).to(tl.float32, bitcast=True)
            y = x / step
            r = tl.floor(y + 0.5)
            odd = (r.to(tl.int32) & 1) != 0
            r = tl.where((r - y == 0.5) & odd, r - 1.0, r)
            x = tl.where(r == 0.0, x * 0.0, r * step)  # (keeps the sign of a zero)
        return x

    @triton.jit
    def _reshape_and_cache_kernel(
        k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_kcb, stride_kcs, stride_kch,
        stride_vcb, stride_vcs, stride_vch,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr,
        EXACT_ROUND: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:
            return
        row_k = slot_offset(slot, stride_kcb, stride_kcs, BLOCK_SIZE)
        row_v = slot_offset(slot, stride_vcb, stride_vcs, BLOCK_SIZE)
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, D_PAD)
        mask = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        if KV_FP8:
            k = fp8_saturate(k, ks_ptr, EXACT_ROUND)
            v = fp8_saturate(v, vs_ptr, EXACT_ROUND)
        tl.store(kc_ptr + row_k + h[:, None] * stride_kch + d[None, :], k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + row_v + h[:, None] * stride_vch + d[None, :], v.to(vc_ptr.dtype.element_ty), mask=mask)


# FP8 caches are e4m3fn (largest finite value 448). AMD gfx942's e4m3fnuz (largest 240)
# is not supported yet: a cache of it would need its own saturation bound.
FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)
FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float | None, dtype: torch.dtype) -> torch.Tensor:
    """x / scale as FP8 `dtype`, saturated at the format's largest finite value (a plain cast
    would give NaN past it): the torch form of every FP8 store (cache writes, online weights)."""
    x = x.float() if scale is None else x.float() / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)


def interpreted() -> bool:
    """Whether Triton kernels run under its interpreter (TRITON_INTERPRET=1, the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """key/value [T, Hkv, D] (views with a contiguous last dim are fine) into the caches;
    an FP8 cache gets key / k_scale and value / v_scale (0-d fp32 tensors; 1.0 when None)."""
    if not HAS_TRITON:
        raise RuntimeError("reshape_and_cache needs triton; use reshape_and_cache_ref without it")
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key/value must be [T, Hkv, D], got {tuple(key.shape)}, {tuple(value.shape)}")
    T, H, D = key.shape
    if k_cache.shape[2:] != (H, D) or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not hold [*, *, {H}, {D}]")
    if slot_mapping.shape[0] < T:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {T} tokens")
    for name, x in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if T == 0:
        return
    fp8 = k_cache.dtype in FP8_CACHE_DTYPES
    if fp8 and (k_scale is None or v_scale is None):
        one = torch.ones((), dtype=torch.float32, device=key.device)
        k_scale, v_scale = (one if k_scale is None else k_scale), (one if v_scale is None else v_scale)
    H_PAD = triton.next_power_of_2(H)
    D_PAD = triton.next_power_of_2(D)
    _reshape_and_cache_kernel[(T,)](
        key, value, k_cache, v_cache, slot_mapping,
        k_scale if fp8 else key, v_scale if fp8 else key,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=H, HEAD_DIM=D, H_PAD=H_PAD, D_PAD=D_PAD, BLOCK_SIZE=k_cache.shape[1], KV_FP8=fp8,
        EXACT_ROUND=fp8 and interpreted(),
        num_warps=4 if H_PAD * D_PAD >= 1024 else 1,
    )


def reshape_and_cache_ref(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    T = key.shape[0]
    slots = slot_mapping[:T].long()
    keep = slots >= 0
    slots = slots[keep]
    bs = k_cache.shape[1]
    blk, off = slots // bs, slots % bs
    key, value = key[keep], value[keep]
    if k_cache.dtype in FP8_CACHE_DTYPES:
        key, value = quantize_fp8(key, k_scale, k_cache.dtype), quantize_fp8(value, v_scale, v_cache.dtype)
    k_cache[blk, off] = key.to(k_cache.dtype)
    v_cache[blk, off] = value.to(v_cache.dtype)
