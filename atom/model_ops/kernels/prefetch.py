"""Pull a tensor into the GPU's L2 cache ahead of its use (NVIDIA sm90+).

At batch 1 a decoder layer leaves HBM idle between its q/k/v projection and its output
projection: the rotary, attention and merge kernels read a few MB in ~10 us. Issued before
them, `prefetch_l2(o_proj.weight)` lets the copy engine stream the next weight (34 MB on
Llama-3.1-8B, of a 50 MB L2) meanwhile, so that the GEMV after attention reads it from L2.

Each thread of a one-to-few-program kernel issues one `cp.async.bulk.prefetch.L2` of up to
CHUNK bytes: a hint that returns at once, with no result and no effect on values. Being a
PDL kernel (see `triton_import`), it issues the prefetches before waiting for the kernel
in front, since no kernel writes weights.
"""
from __future__ import annotations

import functools

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, pdl_args, tl, triton

if HAS_TRITON:
    from atom.model_ops.kernels.triton_import import pdl_start

    @triton.jit
    def _l2_prefetch_kernel(base_ptr, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
        size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)  # <= 0 past the end: skipped
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [base_ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1)
        pdl_start(PDL)


CHUNK = 64 * 1024
BLOCK = 128
# A switch for A/B measurements: False makes `prefetch_l2` do nothing.
USE_L2_PREFETCH = True


@functools.lru_cache(maxsize=None)
def _l2_bytes(index: int) -> int:
    """L2 size of a CUDA device of compute capability 9.0 or more, else 0 (no prefetch)."""
    if torch.version.hip is not None or torch.cuda.get_device_capability(index)[0] < 9:
        return 0
    return int(getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0))


def prefetch_l2(t: torch.Tensor, max_fraction: float = 0.75) -> bool:
    """Start pulling the contiguous tensor `t` into L2; True if issued. Not issued off NVIDIA
    sm90+, under Triton's interpreter, or when `t` is over `max_fraction` of the L2 (it would
    evict itself)."""
    if not (USE_L2_PREFETCH and HAS_TRITON and t.is_cuda and t.is_contiguous()):
        return False
    nbytes = t.numel() * t.element_size()
    limit = _l2_bytes(t.device.index if t.device.index is not None else 0)
    if nbytes == 0 or nbytes > max_fraction * limit or nbytes % 16 or t.data_ptr() % 16:
        return False
    pdl = pdl_args(t)
    if not pdl["PDL"]:  # the interpreter (or no griddepcontrol): nothing to gain
        return False
    grid = (triton.cdiv(triton.cdiv(nbytes, CHUNK), BLOCK),)
    _l2_prefetch_kernel[grid](t.view(-1).view(torch.uint8), nbytes, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4, **pdl)
    return True
