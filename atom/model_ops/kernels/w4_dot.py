"""The tensor-core 4-bit kernel `_w4_dot_kernel` ("swap-AB"): y = x W^T (+ b) with the
weight as the first tl.dot operand, for any M (which M it runs is `w4_gemm.w4_config`'s table).

The weight bytes are the checkpoint's (see `w4_gemm`'s module docstring for the layouts).
A program owns BLOCK_N weight rows and BLOCK_M rows of x (BLOCK_M >= 16: tl.dot's smallest
tile; at M = 1 the 15 padding columns of the product cost tensor-core time, which is idle in a
weight-streaming kernel anyway, and no weight row is wasted: the weight is operand A).

Per K step of BLOCK_K columns it loads the packed words of a [BLOCK_N, BLOCK_K] tile and
walks it in chunks of DOT_K = gcd(BLOCK_K, group) columns (a power of two >= 16: every chunk
lies in one group). Each chunk is unpacked to exact small values in the activations' dtype
and multiplied by x^T [DOT_K, BLOCK_M] with fp32 accumulation; the group's scale multiplies
the chunk's fp32 partial [BLOCK_N, BLOCK_M] after the dot, so the products are exact and only
fp32 accumulation rounds (closer to the fp32 reference than rounding (q - z) * s to bf16).

Unpacking (no int-to-float conversion instruction):
- int4: for i in 0..3, p = (word >> 4i) & 0x000F000F | MAGIC2 holds nibbles i and i + 4 as
  two 16-bit floats 2^b + u (bf16 0x4300 | u = 128 + u, fp16 0x6400 | u = 1024 + u: exact);
  one shift and one and-or per two weights. The dot then sums (2^b + u) x, and the zero point
  comes out per chunk: sum (u - u_z) x = dot - (2^b + u_z) sum x (u_z = 8 symmetric, else the
  stored zero point), an outer product of [BLOCK_N] by [BLOCK_M] per chunk, not per weight.
  The cancellation costs ~log2(2^b / 8) bits of fp32 (4 for bf16, 7 for fp16): ~2^-17 of the
  result, far below the output dtype's rounding.
- MXFP4: the same pair extraction gives the e2m1 codes; their values come from `_e2m1`'s
  float-bit arithmetic (exact), then the activation dtype; the E8M0 scale applies per chunk.

Column order: the two halves of p are adjacent along K in the unpacked tile (tl.join), so the
tile's columns within each word run 0, 4, 1, 5, 2, 6, 3, 7. With ORDER=0 (default) x is
loaded in that same order (a gather within each 16 bytes of x; the dot sums over K, so any
order shared by both operands is the same product); ORDER=1 permutes the weight tile back to
the natural order (tl.permute) and loads x contiguously (the table picks it for int4 at small M).

SPLIT_K > 1 (layers with too few row blocks to fill the GPU): program (.., s) takes the K
steps s, s + SPLIT_K, ...; it writes an fp32 partial to a [SPLIT_K, M, N] buffer and
`split_k.split_k_sum` adds them (and the bias) in a fixed order: deterministic, no atomics,
CUDA-graph safe (the buffer comes from torch's allocator, the graph pool under capture).

Compiler notes (Triton 3.6): the int32 -> int16 truncation and the int16 -> bf16/fp16
bitcast are same-width or plain integer casts; tl.join + reshape is the standard way to
interleave. The sm90 compile is checked in tests/test_quant_kernels_4bit.py (mma present,
no int-to-float conversion in the loop).
"""
from __future__ import annotations

import math

import torch

from atom.model_ops.kernels.split_k import split_k_sum
from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton

#: 16-bit float bit patterns 2^b in both halves of an int32: bf16 128.0, fp16 1024.0
MAGIC2 = {torch.bfloat16: (0x43004300, 128.0), torch.float16: (0x64006400, 1024.0)}


def dot_k(block_k: int, group: int) -> int:
    """Columns per tl.dot: the largest power of two dividing both BLOCK_K and the group
    (every chunk in one group); 0 when that is below 16 (the kernel cannot run the group)."""
    d = math.gcd(block_k, group)
    d = d & -d  # its largest power-of-two factor
    return d if d >= 16 else 0


def supports(x_dtype: torch.dtype, group: int) -> bool:
    """Whether `_w4_dot_kernel` runs activations of x_dtype with this group size: 16-bit
    activations (the dot's operand dtype) and groups with a power-of-two factor >= 16."""
    return x_dtype in MAGIC2 and dot_k(256, group) > 0


if HAS_TRITON:
    from atom.model_ops.kernels.triton_import import pdl_start
    from atom.model_ops.kernels.w4_gemm import _e2m1, _e2m1_pairs_at, _e8m0

    @triton.jit
    def _unpack_tile(word, FMT: tl.constexpr, MAGIC: tl.constexpr, DTYPE: tl.constexpr, ORDER: tl.constexpr,
                     BLOCK_N: tl.constexpr, DK: tl.constexpr):
        """Words [BLOCK_N, DK / 8] -> [BLOCK_N, DK] weights in DTYPE: int4 2^b + u, MXFP4
        e2m1 values (FMT 2: from pair words, `w4_gemm._e2m1_pairs_at`); column order
        0,4,1,5,2,6,3,7 per word (ORDER=0) or natural (ORDER=1)."""
        i4 = tl.arange(0, 4)
        if FMT == 2:  # pair words: columns i and i + 4 each from its own places, joined as the others
            lo = _e2m1_pairs_at(word[:, :, None], i4[None, None, :])
            v = tl.join(lo, _e2m1_pairs_at(word[:, :, None], i4[None, None, :] + 4)).to(DTYPE)
        else:
            p = (word[:, :, None] >> (i4 * 4)[None, None, :]) & 0x000F000F  # nibbles i, i + 4
            if FMT == 0:
                p = p | MAGIC
                v = tl.join(p.to(tl.int16), (p >> 16).to(tl.int16)).to(DTYPE, bitcast=True)  # [BN, W, 4, 2]
            else:
                v = _e2m1(tl.join(p & 0xF, p >> 16)).to(DTYPE)
        if ORDER == 1:
            v = tl.permute(v, (0, 1, 3, 2))
        return tl.reshape(v, [BLOCK_N, DK])

    @triton.jit(do_not_specialize=["M", "SPLIT_K", "stride_ys"])  # one compile per tile for every M and split
    def _w4_dot_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, n_words,
                       stride_xm, stride_wn, stride_sn, stride_zn, stride_ym, stride_ys,
                       FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
                       PDL: tl.constexpr, DOT_F32: tl.constexpr, MAGIC: tl.constexpr, MAGIC_F: tl.constexpr,
                       ORDER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, DK: tl.constexpr, SPLIT_K, PARTIAL: tl.constexpr):
        """acc[n, m] = sum_k W[n, k] x[m, k] for a BLOCK_N x BLOCK_M tile (the M tiles of one
        weight tile are neighbours: it is fetched from HBM about once). PARTIAL (SPLIT_K > 1;
        SPLIT_K is a runtime argument, so every split count shares one compiled kernel) stores
        the fp32 partial of K split pid(1) at y_ptr + pid(1) * stride_ys (y_ptr then fp32)."""
        pdl_start(PDL)
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_m = tl.cdiv(M, BLOCK_M)
        pid_m = pid % num_m
        pid_n = pid // num_m
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        r64 = rows.to(tl.int64)
        ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = ms < M
        m64 = ms.to(tl.int64)
        DTYPE: tl.constexpr = x_ptr.dtype.element_ty
        CW: tl.constexpr = DK // 8
        f = tl.arange(0, DK)
        if ORDER == 0:  # tile column f holds column 8 (f // 8) + (f % 8) // 2 + 4 (f % 2) of the chunk
            fcol = (f // 8) * 8 + (f % 8) // 2 + (f % 2) * 4
        else:
            fcol = f
        jc = tl.arange(0, CW)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            for c in tl.static_range(BLOCK_K // DK):
                kc = k0 + c * DK
                jw = kc // 8 + jc
                word = tl.load(w_ptr + r64[:, None] * stride_wn + jw[None, :],
                               mask=row_ok[:, None] & (jw < n_words)[None, :], other=0)
                w = _unpack_tile(word, FMT, MAGIC, DTYPE, ORDER, BLOCK_N, DK)
                ks = kc + fcol
                xt = tl.load(x_ptr + m64[None, :] * stride_xm + ks[:, None],
                             mask=(ks < K)[:, None] & m_ok[None, :], other=0.0)  # x^T [DK, BLOCK_M]
                if DOT_F32:  # the interpreter (numpy has no bf16): the same exact operands in fp32
                    d = tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
                else:
                    d = tl.dot(w, xt)
                g_ok = row_ok & (rows * 0 + kc < K)
                g = kc // GROUP
                s_raw = tl.load(s_ptr + r64 * stride_sn + g, mask=g_ok, other=0)
                if FMT == 0:
                    if HAS_ZP:
                        zc = tl.load(z_ptr + r64 * stride_zn + g, mask=g_ok, other=8).to(tl.float32) + MAGIC_F
                    else:
                        zc = tl.zeros([BLOCK_N], tl.float32) + (MAGIC_F + 8.0)
                    sx = tl.sum(xt.to(tl.float32), axis=0)  # [BLOCK_M]
                    d = d - zc[:, None] * sx[None, :]
                    scale = s_raw.to(tl.float32)
                else:
                    scale = _e8m0(s_raw.to(tl.int32))
                acc += d * scale[:, None]
        out = y_ptr + pid_k.to(tl.int64) * stride_ys + m64[None, :] * stride_ym + rows[:, None]
        if not PARTIAL:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & m_ok[None, :])
        else:
            tl.store(out, acc, mask=row_ok[:, None] & m_ok[None, :])


def w4_dot_launch(x, words, scales, z, bias, y, fmt_id: int, group: int, k: int, cfg: dict, common: dict,
                  dot_f32: bool) -> None:
    """Runs `_w4_dot_kernel` (and the split-K sum) into y [M, N]; `words` int32 [N, ceil(K/8)]
    (MXFP4's bytes viewed as int32), `z` the zero points or any tensor, `common` the PDL
    arguments; cfg: BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, ORDER, num_warps, num_stages."""
    cfg = dict(cfg)
    M, N = y.shape
    split = cfg.pop("SPLIT_K", 1)
    dk = dot_k(cfg["BLOCK_K"], group)
    if dk == 0:
        raise ValueError(f"w4_linear: the w4_dot kernel needs BLOCK_K={cfg['BLOCK_K']} and group={group} to share "
                         "a power-of-two factor >= 16")
    if cfg["BLOCK_M"] < 16:
        raise ValueError(f"w4_linear: the w4_dot kernel's BLOCK_M={cfg['BLOCK_M']} must be >= 16 (tl.dot)")
    magic, magic_f = MAGIC2[x.dtype]
    pdl = {k_: v for k_, v in common.items() if k_ in ("PDL", "launch_pdl")}
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), split)
    out = y if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=y.device)
    b = bias if bias is not None else y
    _w4_dot_kernel[grid](x, words, scales, z, b, out, M, N, k, words.shape[1], x.stride(0), words.stride(0),
                         scales.stride(0), z.stride(0), N, M * N if split > 1 else 0,
                         FMT=fmt_id, GROUP=group, HAS_ZP=common["HAS_ZP"], HAS_BIAS=bias is not None,
                         DOT_F32=dot_f32, MAGIC=magic, MAGIC_F=magic_f, DK=dk,
                         SPLIT_K=split, PARTIAL=split > 1, **pdl, **{"ORDER": 0, **cfg})
    if split > 1:
        split_k_sum(out, bias, y, pdl)
