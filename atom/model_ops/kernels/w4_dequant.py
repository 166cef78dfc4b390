"""A 4-bit weight (the layouts of `kernels.w4_gemm`: int4 groups, MXFP4, MXFP4 pair words)
written out as a 16-bit (or fp32) [N, K] matrix, for products of many rows.

Past a few hundred rows a product is bound by its multiply-adds, not by the weight's bytes,
and the library GEMM on the dequantized weight runs them at the tensor cores' bf16 rate, where
the tiles that dequantize inside the product (`w4_dot`, `_w4_gemm_kernel`) spend issue slots on
every code for every row tile. Writing the weight out costs a read of its 4-bit bytes and a
write and read of 2 bytes a weight: at a 16,384-row prefill chunk of Llama-3.1-8B's gate-up
~0.1 ms against ~5 ms of multiply-adds. `w4_gemm.W4_DEQUANT_MIN_M` says from which M each
format takes this route (`w4_config`'s "w4_dequant"); the values are the same as the
in-kernel routes' (`dequantize_w4` is the torch reference of both). Where a group holds whole
words (GROUP a multiple of 8) the scale (and zero point) is loaded once a word rather than once
a code (int4 g128: 4 scale loads a thread instead of 32).
"""
from __future__ import annotations

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton
from atom.utils.pow2 import is_pow2

#: rows of the weight and words (8 codes) a program writes: 4 rows of 128 words over 4 warps, the
#: fastest at Llama-3.1-8B's four shapes in both formats of `scripts/w4_dequant_probe.py`'s grid (total
#: -4% int4, -6% MXFP4 pair words against 16 x 32; the MXFP4 workload +2%: docs/perf)
BLOCK_N, BLOCK_W, NUM_WARPS = 4, 128, 4

if HAS_TRITON:
    from atom.model_ops.kernels.w4_gemm import _dequant_each, _pair_word_std

    @triton.jit
    def _w4_dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, n_words, stride_wn, stride_sn, stride_zn,
                           stride_on, FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
        """Program (i, j): rows i BLOCK_N.. and words j BLOCK_W.. of the weight (int32, 8 codes,
        column 8w + c in bits 4c..4c+3; pair words put back in that layout first), each code
        times its group's scale (int4: minus its zero point first) into out [N, K]."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        jw = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        r64 = rows.to(tl.int64)
        m2 = (rows < N)[:, None] & (jw < n_words)[None, :]
        word = tl.load(w_ptr + r64[:, None] * stride_wn + jw[None, :], mask=m2, other=0)
        if FMT == 2:
            word = _pair_word_std(word)
        es = tl.arange(0, 8)
        u = (word[:, :, None] >> (es * 4)[None, None, :]) & 0xF  # [BLOCK_N, BLOCK_W, 8]
        ks = (jw[:, None] * 8 + es[None, :])[None, :, :]  # the column of every code
        m3 = m2[:, :, None] & (ks < K)
        if GROUP % 8 == 0:  # a word's codes share a group: one scale load a word, not one a code
            grp, g_mask = (jw * 8 // GROUP)[None, :, None], m2[:, :, None]
        else:
            grp, g_mask = ks // GROUP, m3
        w = _dequant_each(u, grp, r64, s_ptr, z_ptr, stride_sn, stride_zn, g_mask, FMT, HAS_ZP)
        tl.store(out_ptr + r64[:, None, None] * stride_on + ks, w.to(out_ptr.dtype.element_ty), mask=m3)


def w4_dequant(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, fmt_index: int, group: int,
               k: int, dtype: torch.dtype, tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """[N, k] in `dtype` of the weight as int32 words [N, n_words] (`w4_gemm.FORMATS[fmt_index]`
    layout; MXFP4's bytes viewed as int32), its scales [N, k / group] and int4 zero points;
    `tile` (BLOCK_N, BLOCK_W, num_warps), powers of two, for a probe (default: the module's)."""
    bn, bw, warps = tile or (BLOCK_N, BLOCK_W, NUM_WARPS)
    if not all(is_pow2(v) for v in (bn, bw, warps)):
        raise ValueError(f"w4_dequant: tile {tile!r} must be three powers of two (BLOCK_N, BLOCK_W, num_warps)")
    N, n_words = words.shape
    out = torch.empty(N, k, device=words.device, dtype=dtype)
    z = zeros if zeros is not None else scales
    grid = (triton.cdiv(N, bn), triton.cdiv(n_words, bw))
    _w4_dequant_kernel[grid](words, scales, z, out, N, k, n_words, words.stride(0), scales.stride(0), z.stride(0),
                             out.stride(0), FMT=fmt_index, GROUP=group, HAS_ZP=zeros is not None,
                             BLOCK_N=bn, BLOCK_W=bw, num_warps=warps)
    return out
