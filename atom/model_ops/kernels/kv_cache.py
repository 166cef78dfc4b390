"""Write this step's keys/values into the paged KV cache.

``slot = block * block_size + offset``; a negative slot (padding) is skipped.
Cache layout: ``[num_blocks, block_size, Hkv, D]``.
"""

from __future__ import annotations

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def slot_offset(slot, stride_block, stride_row, BLOCK_SIZE: tl.constexpr):
        """Offset of a slot's row in a paged cache: block slot // BLOCK_SIZE, row slot %
        BLOCK_SIZE (the rotary, GEMV and attention kernels that write the cache use it too)."""
        return (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_row

    @triton.jit
    def _reshape_and_cache_kernel(
        k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_kcb, stride_kcs, stride_kch,
        stride_vcb, stride_vcs, stride_vch,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
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
        tl.store(kc_ptr + row_k + h[:, None] * stride_kch + d[None, :], k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + row_v + h[:, None] * stride_vch + d[None, :], v.to(vc_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] (views with a contiguous last dim are fine) into the caches."""
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
    H_PAD = triton.next_power_of_2(H)
    D_PAD = triton.next_power_of_2(D)
    _reshape_and_cache_kernel[(T,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=H, HEAD_DIM=D, H_PAD=H_PAD, D_PAD=D_PAD, BLOCK_SIZE=k_cache.shape[1],
        num_warps=4 if H_PAD * D_PAD >= 1024 else 1,
    )


def reshape_and_cache_ref(key, value, k_cache, v_cache, slot_mapping) -> None:
    T = key.shape[0]
    slots = slot_mapping[:T].long()
    keep = slots >= 0
    slots = slots[keep]
    bs = k_cache.shape[1]
    blk, off = slots // bs, slots % bs
    k_cache[blk, off] = key[keep].to(k_cache.dtype)
    v_cache[blk, off] = value[keep].to(v_cache.dtype)
