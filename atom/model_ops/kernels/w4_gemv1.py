"""The one-row 4-bit GEMV (batch-1 decode): y = x W^T (+ b) for x [1, K], int4 groups or MXFP4,
the weight bytes as the checkpoint packs them (layouts in `w4_gemm`'s module docstring).

At one row the product is a weight stream with one multiply-add per weight on the CUDA
cores, and what bounds it on the H200 is the issue rate: ~33 T thread-instructions/s
against ~8.6 T packed weights/s at 4.3 TB/s leaves ~4 instructions a weight. This kernel is
`w4_gemm._w4_gemv_kernel` at M = 1 with its loop cut to that budget
(`scripts/w4_gemv_sass.py` counts the compiled loop):
- int4: a nibble is masked where it lies (nibbles 0-5; 6 and 7 after one shift of the word
  by 8) and read as a float32: the bits u << p are the subnormal u 2^(p - 149), exact. x is
  multiplied by 2^(85 - p) once per value (shared by the program's BLOCK_N rows), so each
  weight costs one mask and one FMA and every product is u x 2^-64; per word
  sum (u - z) x 2^-64 = sum f x' - z 2^-64 sum x, then times 2^64 and the group's scale;
- MXFP4: codes i and i + 4 of a word are built as the two bf16 halves of one int32 (one
  shift and one mask for both signs, one shift and one mask for both exponent-mantissa
  fields): each half is e2m1 x 2^-126 (`w4_gemm._e2m1_at`'s placement, bf16 sharing float32's
  exponent), widened to float32 by one shift or one mask; x is multiplied by 2^64 once per
  value so that the products v x 2^-62 stay normal floats; per word the sum is multiplied by
  2^62, then by the E8M0 scale (`w4_gemm._e8m0`);
- no masks or index clamps in the loop when the rows and the words tile evenly (EVEN: every
  Llama / Qwen shape), and pointers that advance by a constant.
Rounding: fp32 products and sums; the int4 zero point comes out of each word's partial sum
(cancellation of a few bits of fp32, far below bf16's 2^-9). The powers of two keep x 2^85
below fp32's range for |x| < 2^43 (activations are far smaller).
"""
from __future__ import annotations

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton

#: tiles: BLOCK_N rows a program, BLOCK_W words (8 columns each) a step, one word per thread per
#: row (BLOCK_W = 32 x num_warps). From the H200 sweep (`scripts/w4_gemv1_sweep.py`, Llama-3.1-8B
#: shapes): 8 rows over 8 warps for layers of up to WIDE_N outputs (4096 x 4096 / 14336, 6144 x
#: 4096), over 4 warps above (28672 x 4096)
TILES = dict(BLOCK_N=8, BLOCK_W=256, num_warps=8, num_stages=3)
TILES_WIDE = dict(BLOCK_N=8, BLOCK_W=128, num_warps=4, num_stages=3)
WIDE_N = 8192


def tiles(n: int) -> dict:
    """The tile config for a layer of n outputs."""
    return dict(TILES_WIDE if n > WIDE_N else TILES)


def supports(fmt: str, group: int, k: int) -> bool:
    """Whether `_w4_gemv1_kernel` runs this format: whole words (K % 8 == 0) and int4 groups of
    whole words (a word's 8 nibbles share one scale)."""
    return k % 8 == 0 and (fmt == "mxfp4" or group % 8 == 0)


if HAS_TRITON:
    from atom.model_ops.kernels.triton_import import pdl_start
    from atom.model_ops.kernels.w4_gemm import _e8m0

    @triton.jit
    def _fma2(a, b, t):
        """t + a[.., 0] b[.., 0] + a[.., 1] b[.., 1]: two FMAs."""
        a0, a1 = tl.split(a)
        b0, b1 = tl.split(b)
        return t + a0 * b0 + a1 * b1

    @triton.jit
    def _fma4(a, b, t):
        """t + the sum over the last dim (4) of a b as a chain of FMAs (tl.sum's tree would add
        a multiply and adds per four products)."""
        a0, a1 = tl.split(tl.reshape(a, [a.shape[0], a.shape[1], 2, 2]))
        b0, b1 = tl.split(tl.reshape(b, [b.shape[0], b.shape[1], 2, 2]))
        return _fma2(a1, b1, _fma2(a0, b0, t))

    @triton.jit
    def _fma8(a, b, t):
        """`_fma4` over a last dim of 8."""
        a0, a1 = tl.split(tl.reshape(a, [a.shape[0], a.shape[1], 4, 2]))
        b0, b1 = tl.split(tl.reshape(b, [b.shape[0], b.shape[1], 4, 2]))
        return _fma4(a1, b1, _fma4(a0, b0, t))

    @triton.jit(do_not_specialize=["stride_wn", "stride_sn", "stride_zn"])
    def _w4_gemv1_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, N, n_words, stride_wn, stride_sn, stride_zn,
                         FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
                         PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, EVEN: tl.constexpr,
                         AHEAD: tl.constexpr = False):
        """Program p owns rows p BLOCK_N.. of y; a [BLOCK_N, BLOCK_W, 8] tile a step, one word
        per thread per row, its 8 x values one 16-byte load shared by the rows. The row
        strides are not specialized (their alignment unknown to the compiler), which keeps
        the word loads one word per thread along the row, the layout x's tile has: aligned,
        they would be vectorized or laid out along the rows, and converted through shared
        memory every step. AHEAD (tiles that fit evenly only): the next step's words are
        loaded before this step's are used, two word tiles in flight per thread."""
        pdl_start(PDL)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        j2 = tl.arange(0, BLOCK_W)[None, :]
        js = j2[:, :, None]
        es = tl.arange(0, 8)[None, None, :]
        if FMT == 0:  # nibble i kept at bit 4i (i <= 5) or 4i - 8 (i = 6, 7: one shift by 8 for both)
            right = tl.where(es >= 6, 8, 0)
            pos = 4 * es - right
            mask = 0xF << pos
            # x 2^(85 - pos): the float of bits u << pos is u 2^(pos - 149), so every product is u x 2^-64
            xmul = ((127 + 85 - pos) << 23).to(tl.float32, bitcast=True)
        else:  # codes i and i + 4 as the two halves of one int32 (bf16 bits): signs to bits 15 / 31
            i4 = tl.arange(0, 4)[None, None, :]  # (left by 12 - 4i), exponent and mantissa bits to 6-8 / 22-24
            sign_left = 12 - 4 * i4
            mag_left = tl.maximum(6 - 4 * i4, 0)
            mag_right = tl.maximum(4 * i4 - 6, 0)
        wp = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + j2  # [BLOCK_N, BLOCK_W]
        s_row = s_ptr + rows.to(tl.int64)[:, None] * stride_sn
        z_row = z_ptr + rows.to(tl.int64)[:, None] * stride_zn
        sp = s_row + (j2 * 8) // GROUP
        zp = z_row + (j2 * 8) // GROUP
        # groups that tile a step advance the scale pointers by a constant; others (e.g. 96, or
        # channel-wise groups wider than a step) index each word's group
        GROUP_STEPS: tl.constexpr = (BLOCK_W * 8) % GROUP == 0
        xp = x_ptr + js * 8 + es
        acc = tl.zeros([BLOCK_N, BLOCK_W, 1], tl.float32)
        if AHEAD:
            word_next = tl.load(wp)
        for w0 in range(0, n_words, BLOCK_W):
            if not GROUP_STEPS:
                sp = s_row + ((w0 + j2) * 8) // GROUP
                zp = z_row + ((w0 + j2) * 8) // GROUP
            if EVEN:
                if AHEAD:
                    word = word_next[:, :, None]
                    word_next = tl.load(wp + BLOCK_W, mask=w0 + BLOCK_W + j2 < n_words, other=0)
                else:
                    word = tl.load(wp)[:, :, None]
                xv = tl.load(xp).to(tl.float32)
                s_raw = tl.load(sp)[:, :, None]
            else:
                ok = (rows < N)[:, None] & (w0 + j2 < n_words)  # [BLOCK_N, BLOCK_W]
                word = tl.load(wp, mask=ok, other=0)[:, :, None]
                xv = tl.load(xp, mask=(w0 + js < n_words) & (es < 8), other=0.0).to(tl.float32)
                s_raw = tl.load(sp, mask=ok, other=0)[:, :, None]
            wu = word.to(tl.uint32, bitcast=True)
            if FMT == 0:
                f = ((wu >> right) & mask).to(tl.float32, bitcast=True)  # u 2^(pos - 149), exact
                t = _fma8(f, xv * xmul, tl.zeros([BLOCK_N, BLOCK_W], tl.float32))[:, :, None]  # sum u x 2^-64
                sx = tl.sum(xv, axis=2, keep_dims=True) * 5.421010862427522e-20  # sum x 2^-64
                if HAS_ZP:
                    if EVEN:
                        z_raw = tl.load(zp)[:, :, None]
                    else:
                        z_raw = tl.load(zp, mask=ok, other=8)[:, :, None]
                    c = sx * z_raw.to(tl.float32)
                else:
                    c = sx * 8.0
                acc += ((t - c) * 18446744073709551616.0) * s_raw.to(tl.float32)  # 2^64 first: no underflow
            else:
                mag = ((wu << mag_left) >> mag_right) & 0x01C001C0
                h = ((wu << sign_left) & 0x80008000) | mag  # [BLOCK_N, BLOCK_W, 4]: two bf16 e2m1 x 2^-126
                lo = (h << 16).to(tl.float32, bitcast=True)  # columns 0-3 of the word, as float32
                hi = (h & 0xFFFF0000).to(tl.float32, bitcast=True)  # columns 4-7
                x_lo, x_hi = tl.split(tl.permute(tl.reshape(xv, [1, BLOCK_W, 2, 4]), (0, 1, 3, 2)))
                x_lo = x_lo * 18446744073709551616.0  # x 2^64: the products v x 2^-62 are normal floats
                x_hi = x_hi * 18446744073709551616.0
                t = _fma4(hi, x_hi, _fma4(lo, x_lo, tl.zeros([BLOCK_N, BLOCK_W], tl.float32)))[:, :, None]
                acc += (t * 4611686018427387904.0) * _e8m0(s_raw.to(tl.int32))  # 2^62 first: no underflow
            wp += BLOCK_W
            xp += BLOCK_W * 8
            if GROUP_STEPS:
                sp += (BLOCK_W * 8) // GROUP
                zp += (BLOCK_W * 8) // GROUP
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


def w4_gemv1_launch(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, z: torch.Tensor,
                    bias, y: torch.Tensor, fmt_id: int, group: int, cfg: dict, common: dict) -> None:
    """Runs `_w4_gemv1_kernel` into y [1, N]: `words` int32 [N, K/8] (MXFP4's bytes viewed as
    int32), `z` the zero points or any tensor, cfg: BLOCK_N, BLOCK_W, num_warps, num_stages."""
    cfg = dict(cfg)
    N, n_words = words.shape
    if cfg["BLOCK_W"] != 32 * cfg["num_warps"]:
        raise ValueError(f"w4_linear: the one-row GEMV needs BLOCK_W={cfg['BLOCK_W']} = 32 x num_warps "
                         f"({cfg['num_warps']})")
    even = N % cfg["BLOCK_N"] == 0 and n_words % cfg["BLOCK_W"] == 0 and n_words > 0
    if not even:
        cfg.pop("AHEAD", None)  # the masked loop loads one step at a time
    pdl = {k_: v for k_, v in common.items() if k_ in ("PDL", "launch_pdl")}
    b = bias if bias is not None else y
    grid = (triton.cdiv(N, cfg["BLOCK_N"]),)
    _w4_gemv1_kernel[grid](x, words, scales, z, b, y, N, n_words, words.stride(0), scales.stride(0), z.stride(0),
                           FMT=fmt_id, GROUP=group, HAS_ZP=common["HAS_ZP"], HAS_BIAS=bias is not None,
                           EVEN=even, **pdl, **cfg)
