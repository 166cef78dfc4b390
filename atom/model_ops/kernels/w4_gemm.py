"""y = x W^T (+ b) for 4-bit weights, dequantized in registers: W4A16 int4 groups and MXFP4.

The weights stay in the bytes the checkpoint packs them in (only MXFP4 pair words, below, the
MXFP4 layers' layout under the default fusion "fp4_pair_words", repack them, in place); from
`W4_DEQUANT_MIN_M` rows a product writes a 16-bit copy of the weight out for the library GEMM
(`kernels.w4_dequant`), a temporary of the call:
- int4 (`fmt="int4"`): `packed` int32 [N, ceil(K/8)], nibble i of word j holding column
  8j + i as u = q + 8 (0..15); `scales` [N, K/g] (any float dtype); `zeros` None (symmetric:
  w = (u - 8) * s) or int8 [N, K/g] of the stored zero points u_z = z + 8 (w = (u - u_z) * s).
  Any group size g that divides K works (the tile loops index the group of every column,
  so g need not divide a tile).
- MXFP4 (`fmt="mxfp4"`): `packed` uint8 [N, K/2], the low nibble the even column, e2m1
  codes (bit 3 the sign); `scales` uint8 E8M0 [N, K/32]; w = e2m1(code) * 2^(s - 127).
  The 16 code values are built as float32 bits (`_e2m1`: the code's exponent and mantissa
  bits placed in a float32's, bit 3 its sign, then one multiply by 2^126), the scale by
  writing s into a float32's exponent field (s = 0, 2^-127, as the subnormal with bit 22
  set): exact, and no conversion instruction per weight. In the GEMM int4 nibbles become floats by the magic-number trick
  (float(0x4B000000 | u) = 2^23 + u, minus the group's 2^23 + zero point).
- MXFP4 pair words (`fmt="mxfp4_pairs"`): the same codes as int32 [N, K/8] words whose bits
  `kernels.fp4_pairs` places for the one-row GEMV's fp16 pair decode (the layout the MXFP4
  method takes under the plan's "fp4_pair_words"); the scales as MXFP4's. The one-row GEMV
  decodes them in fp16 pairs (HALF2, `h2_ptx`), the M = 2-4 GEMV and w4_dot each code from its
  own places (`_e2m1_pairs_at`); the fp32 GEMM and the one-row GEMV's float32 path put each
  loaded word back in the checkpoint's layout first (`_pair_word_std`: seven masks and shifts).

For bf16 / fp16 activations and groups with a power-of-two factor >= 16 (every checkpoint
format: g32 / g64 / g128, channel-wise, MXFP4's 32) `w4_config` picks `w4_dot` above
M = 4 up to M = 64 and the written-out weight from `W4_DEQUANT_MIN_M` (65; MXFP4 in fp16 keeps
w4_dot past 64, int4 in fp32 the GEMM below; the table `DOT_TILES` below says why): the
tensor-core swap-AB kernel of `kernels/w4_dot.py` (the weight tile is tl.dot's first
operand, unpacked to exact small integers / e2m1 values, the group scales multiply the fp32
partials, split-K for layers with few row blocks). The two kernels below run the rest (every
M <= 4, int4 above 64, fp32 activations, groups such as 20 or 8) and stay selectable by
`config` for comparison (`scripts/w4_sweep.py` times them beside w4_dot). By the number of rows M:
- M <= 4, `_w4_gemv_kernel` (batch-1 decode): weight streaming. A program owns BLOCK_N
  output rows and walks K, one int32 word (8 nibbles; MXFP4's bytes read 4 at a time) per
  thread per row and step, so a warp's loads are whole 128-byte lines, the thread's 8 x
  values one 16-byte load; every row of x (up to 4, unrolled) is multiplied with the
  unpacked word, so the weight is read once. Scales (and int4 zero points) apply once per
  word: int4 as 1 + u/16 (float bits 0x3F800000 | u << 19) with sum (u - z) x / 16 =
  sum f x - (1 + z/16) sum x. The sm90 PTX of the loop has no shared-memory layout
  conversion (checked with `triton.compile` for sm90; the test suite's compile harness
  style). At the Llama-3.1-8B shapes N / BLOCK_N >= 1024 programs fill 132 SMs without
  split-K.
- M > 4, `_w4_gemm_kernel`: a tiled tl.dot GEMM. The W^T tile is loaded as packed words
  [BLOCK_K / per-word, BLOCK_N] (coalesced along K), split into nibbles, dequantized in fp32,
  reshaped to [BLOCK_K, BLOCK_N], cast to the activations' dtype and fed to tl.dot with fp32
  accumulation. For 4 < M <= 16 one
  BLOCK_M=16 row tile covers every row, so this too streams the weight once with the
  tensor cores doing the multiplies (the FMA path would be compute-bound there: 16 FMAs
  per half byte). Programs run the M tiles of one weight tile next to each other, so a
  weight tile is fetched from HBM about once.

`w4_linear` (the torch custom op `atom::w4_linear`) launches them (and w4_dot); `w4_linear_ref` is the
torch reference on the same tensors.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, pdl_args, tl, triton

FORMATS = ("int4", "mxfp4", "mxfp4_pairs")
MX_GROUP = 32
#: values per packed element: int4 words hold 8 nibbles, MXFP4 bytes 2
PER_ELEMENT = {"int4": 8, "mxfp4": 2, "mxfp4_pairs": 8}
#: the largest M that runs the weight-streaming FMA kernel
GEMV_MAX_M = 4

# Tile table per regime (fixed; no autotune at import). Columns: the largest M of the
# regime, then the tiles. Chosen from the byte and FLOP budget, not measured here:
# - GEMV (M <= 4): 4 rows x 128 words (1024 columns) per step, one word per thread per row
#   (BLOCK_W must be 32 x num_warps: the layout the kernel docstring describes), 2 KB of
#   int4 / MXFP4 per step per program, N / 4 programs;
# - M <= 16: one 16-row tile, K in chunks of 256 (the weight streams, the tensor cores do
#   the products), 32 output columns, 16 below N = 8192 so that N = 4096 still gives 256
#   programs (two per SM on the H200's 132) without split-K;
# - M <= 64: 64 x 64 tiles, K 64; larger M: 128 x 128 x 64 with 8 warps (compute bound:
#   the dequantization is spread over 128 rows of x).
GEMV_TILES = dict(BLOCK_N=4, BLOCK_W=128, num_warps=4, num_stages=3)
# layers of at most 4096 outputs (few programs of 4 rows): 256 words a step with 8 warps and
# the next words loaded ahead, so each program keeps more bytes in flight (the sweep behind
# both GEMV tables: scripts/quant_gemv_sweep.py, figures in docs/perf/raw/history.md)
GEMV_TILES_NARROW = dict(BLOCK_N=4, BLOCK_W=256, num_warps=8, num_stages=3, AHEAD=True)
NARROW_N = 4096
GEMM_TILES = (
    (16, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3)),
    (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)),
    (None, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)),
)


# The tensor-core kernel (`w4_dot._w4_dot_kernel`, swap-AB: the weight is tl.dot's first
# operand, scales after the dot) for 16-bit activations and groups with a power-of-two factor
# >= 16 (fp32 activations and other groups keep the tables above). The regimes follow the
# H200 sweep (`scripts/w4_sweep.py --quick`, Llama-3.1-8B shapes; figures in docs/perf/raw/history.md):
# - M <= GEMV_MAX_M: the FMA GEMV above stays faster (a single row leaves the tensor cores'
#   padding rows idle while w4_dot's per-chunk unpack and scale work remain);
# - 5 <= M <= 64: w4_dot, well ahead of the FMA kernels; up to M = 32 one 16 / 32-row tile,
#   64 weight rows, K 256, int4 tiles put back in natural column order in registers so that x
#   loads contiguously (ORDER 1: faster than loading x permuted); at M = 64 128 weight rows,
#   K 128, 8 warps;
# - above M = 64 (where the weight is not written out, `W4_DEQUANT_MIN_M`): int4 keeps the tl.dot
#   GEMM above (faster there than w4_dot), MXFP4 runs w4_dot (its e2m1 decode, per weight,
#   costs the GEMM more than w4_dot's chunked one).
# SPLIT_K: layers whose row blocks give fewer than DOT_TARGET_PROGRAMS programs (N = 4096 at
# BLOCK_N = 64: 64) split K in two, four or eight, keeping >= 2 K steps per split (M <= 64).
DOT_MIN_M = GEMV_MAX_M + 1
DOT_TARGET_PROGRAMS = 256
DOT_TILES = (
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3)),
    (32, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3)),
    (64, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)),
    (256, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)),
    (None, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)),
)
DOT_MAX_M = {"int4": 64, "mxfp4": None, "mxfp4_pairs": None}  # None: every M
# From this M (None: never) the format's weight is written out in the activations' dtype and the
# library GEMM runs the product (`kernels.w4_dequant`: "w4_dequant"), for 16-bit activations
# (`written_out_dtypes`: MXFP4 in bf16 only). From
# 65 rows (the tiles' M > 64 regimes, compute bound) in both formats: the Llama-3.1-8B workload
# ran 2.2x (MXFP4) and 1.5x (int4) faster than on w4_dot / the tl.dot GEMM there, and MXFP4's
# prompt steps as fast as bf16's (docs/perf); below 65 rows the in-kernel decode is faster. The
# copy is a temporary of the call (the largest layer's [N, K]: Llama-3.1-8B's gate-up 235 MB in
# bf16), inside the start-up profile's peak and, for graphs of 65 rows or more, in their pool
W4_DEQUANT_MIN_M = {"int4": 65, "mxfp4": 65, "mxfp4_pairs": 65}


def dot_split_k(M: int, N: int, K: int, cfg: dict) -> int:
    """SPLIT_K for the w4_dot tiles `cfg`: the smallest of 1, 2, 4, 8 (4 above M = 32, where
    the sweep found no gain beyond it) that reaches DOT_TARGET_PROGRAMS programs while every split keeps
    at least two K steps; 1 above M = 64 (compute bound: the fp32 partials would be extra
    traffic for no gain in overlap)."""
    if M > 64:
        return 1
    progs = -(-M // cfg["BLOCK_M"]) * -(-N // cfg["BLOCK_N"])
    steps = -(-K // cfg["BLOCK_K"])
    cap = 4 if M > 32 else 8
    split = 1
    while split < cap and progs * split < DOT_TARGET_PROGRAMS and steps // (2 * split) >= 2:
        split *= 2
    return split


def written_out_dtypes(fmt: str) -> tuple[torch.dtype, ...]:
    """The activation dtypes whose products may run on the weight written out in that dtype:
    bf16 for every format; fp16 for int4 only, since an MXFP4 weight times its E8M0 scale
    (2^-127..2^127) can leave fp16's range, where the in-kernel routes apply the scale in fp32."""
    return (torch.bfloat16, torch.float16) if fmt == "int4" else (torch.bfloat16,)


def w4_config(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16, group: int = 128,
              fmt: str = "int4") -> tuple[str, dict]:
    """(kernel name, tile config) for an [M, K] x [N, K]^T product of format `fmt` with
    activations of `dtype` and weight groups of `group` columns (the tables above)."""
    from atom.model_ops.kernels.w4_dot import supports
    from atom.model_ops.kernels.w4_gemv1 import supports as gemv1_supports
    from atom.model_ops.kernels.w4_gemv1 import tiles as gemv1_tiles
    top = DOT_MAX_M.get(fmt, 64)
    low = W4_DEQUANT_MIN_M.get(fmt)
    if low is not None and M >= low and dtype in written_out_dtypes(fmt):
        return "w4_dequant", {}
    if M >= DOT_MIN_M and (top is None or M <= top) and supports(dtype, group):
        for max_m, cfg in DOT_TILES:
            if max_m is None or M <= max_m:
                cfg = dict(cfg)
                cfg["SPLIT_K"] = dot_split_k(M, N, K, cfg)
                if fmt == "int4" and M <= 32:
                    cfg["ORDER"] = 1
                return "w4_dot", cfg
    if M == 1 and gemv1_supports(fmt, group, K):
        return "w4_gemv1", gemv1_tiles(N, fmt, K)
    if M <= GEMV_MAX_M:
        tiles = GEMV_TILES_NARROW if N <= NARROW_N else GEMV_TILES
        return "w4_gemv", dict(tiles, BLOCK_M=max(1, triton.next_power_of_2(M)) if HAS_TRITON else 1)
    for max_m, cfg in GEMM_TILES:
        if max_m is None or M <= max_m:
            cfg = dict(cfg)
            if max_m == 16 and N < 8192:
                cfg["BLOCK_N"] = 16
            return "w4_gemm", cfg
    raise AssertionError("unreachable")


def kernel_name(M: int, dtype: torch.dtype = torch.bfloat16, group: int = 128, fmt: str = "int4") -> str:
    """Which kernel runs M rows (for the per-layer tables)."""
    return w4_config(M, 1, 1 << 12, dtype, group, fmt)[0]


if HAS_TRITON:
    from atom.model_ops.kernels.triton_import import pdl_start

    @triton.jit
    def _e2m1(u):
        """fp32 values of e2m1 codes u (int32, the code in bits 0-3; higher bits ignored):
        `_e2m1_at` of the code at bit 0."""
        return _e2m1_at(u, 0)

    @triton.jit
    def _e2m1_at(word, offset):
        """fp32 values of the e2m1 codes at bit `offset` (a multiple of 4, 0..28) of int32
        words, without a conversion instruction: shifted left so that the code's sign is on
        bit 31, its exponent and mantissa bits (then on 28-30) go to bits 22-24 by a logical
        shift of 6. The float32's exponent field then holds the code's exponent e and its top
        fraction bit the mantissa m: 2^(e - 127) (1 + m/2) for e >= 1 and the subnormal
        m 2^-127 for e = 0, each the e2m1 value times 2^-126, and one exact multiplication by
        2^126 gives the value (GPU float multiplies keep subnormal inputs: Triton emits no
        flush-to-zero). Two shifts, two masks and the multiply a code, no compare or select
        (`scripts/w4_gemv_sass.py` counts them in the GEMV's loop)."""
        y = word.to(tl.uint32, bitcast=True) << (28 - offset)
        bits = (y & 0x80000000) | ((y >> 6) & 0x01C00000)
        return bits.to(tl.float32, bitcast=True) * 8.507059173023462e+37  # 2^126

    @triton.jit
    def _pair_word_std(word):
        """`fp4_pairs` pair words (int32) back in the checkpoint's layout (code i at bits
        4i..4i+3): the runs of `fp4_pairs.MOVES` grouped by their shift, one mask and shift a
        group."""
        wu = word.to(tl.uint32, bitcast=True)
        std = (((wu & 0x80008000) >> 12) | ((wu & 0x0E000E00) >> 9) | ((wu & 0x10001000) >> 5)
               | ((wu & 0x21C021C0) >> 2) | ((wu & 0x40004000) << 1) | ((wu & 0x00380038) << 5)
               | ((wu & 0x00070007) << 12))
        return std.to(tl.int32, bitcast=True)

    @triton.jit
    def _e2m1_pairs_at(word, es):
        """`_e2m1_at` for pair words (`fp4_pairs`): the fp32 values of columns es (0..7) of
        int32 pair words, each code's sign (at 15 - SIGN_SHIFT[i] + 16 h for column i + 4 h)
        shifted to bit 31 and its exponent-mantissa bits (at 9 - EM_SHIFT[i] + 16 h) to
        22-24: a shift and a mask each (EM_SHIFT[i] = 3 i, SIGN_SHIFT[i] = (4 - i) % 4), then
        the multiply by 2^126. One shift a code more than the checkpoint's layout, against
        seven masks and shifts a word to put it back (`_pair_word_std`)."""
        i = es % 4
        h = es // 4
        em_pos = 9 - 3 * i + 16 * h
        sign_pos = 15 - (4 - i) % 4 + 16 * h
        wu = word.to(tl.uint32, bitcast=True)
        bits = ((wu << (31 - sign_pos)) & 0x80000000) | (((wu >> em_pos) & 7) << 22)
        return bits.to(tl.float32, bitcast=True) * 8.507059173023462e+37  # 2^126

    @triton.jit
    def _e8m0(s):
        """fp32 2^(s - 127) of E8M0 exponents s (int32 0..255), exactly: s in a float32's exponent
        field, and for s = 0 (whose field reads 0) the subnormal 2^-127, taken by a max rather
        than a compare and select."""
        tiny = (s * 0 + 0x00400000).to(tl.float32, bitcast=True)  # 2^-127
        return tl.maximum((s << 23).to(tl.float32, bitcast=True), tiny)

    @triton.jit
    def _group_terms(s_raw, z_raw, FMT: tl.constexpr, HAS_ZP: tl.constexpr):
        """Per group (computed at the scales' shape, before broadcasting to the nibbles):
        int4 (offset, scale) with w = (float(0x4B000000 | u) - offset) * scale, offset =
        2^23 + zero point (the magic-number conversion: no int-to-float instruction per
        weight, exact for 0 <= u < 16); MXFP4 (unused, 2^(s - 127))."""
        if FMT == 0:
            if HAS_ZP:
                off = z_raw.to(tl.float32) + 8388608.0
            else:
                off = tl.zeros_like(s_raw.to(tl.float32)) + 8388616.0  # 2^23 + 8
            return off, s_raw.to(tl.float32)
        else:
            scale = _e8m0(s_raw.to(tl.int32))
            return scale, scale

    @triton.jit
    def _dequant(u, off, scale, FMT: tl.constexpr):
        """fp32 weights of nibbles u (int32 0..15) given their group's `_group_terms`."""
        if FMT == 0:
            return ((u | 0x4B000000).to(tl.float32, bitcast=True) - off) * scale
        else:
            return _e2m1(u) * scale

    @triton.jit
    def _dequant_each(u, grp, r64, s_ptr, z_ptr, stride_sn, stride_zn, mask, FMT: tl.constexpr,
                      HAS_ZP: tl.constexpr):
        """fp32 weights of codes u [BLOCK_N, BLOCK_W, 8] of rows r64, each code's group scale
        (and int4 zero point) loaded by its group index grp (masked lanes: 0 / 8)."""
        s3 = tl.load(s_ptr + r64[:, None, None] * stride_sn + grp, mask=mask, other=0)
        z3 = s3
        if HAS_ZP:
            z3 = tl.load(z_ptr + r64[:, None, None] * stride_zn + grp, mask=mask, other=8)
        off, scale = _group_terms(s3, z3, FMT, HAS_ZP)
        return _dequant(u, off, scale, FMT)

    @triton.jit
    def _row_acc(acc, f, off, scale, x_ptr, m: tl.constexpr, M, ks, k_ok, stride_xm, OFF: tl.constexpr):
        """acc [BLOCK_N, BLOCK_W, 1] + the products of row m of x (columns ks [1, BLOCK_W, 8])
        with the unscaled weights f summed per word, minus off x the word's sum of x when OFF,
        times the word's scale."""
        xm = tl.load(x_ptr + m * stride_xm + ks, mask=k_ok & (ks * 0 + m < M), other=0.0).to(tl.float32)
        t = tl.sum(f * xm, axis=2, keep_dims=True)
        if OFF:
            t = t - off * tl.sum(xm, axis=2, keep_dims=True)
        return acc + t * scale

    @triton.jit
    def _row_store(acc, b_ptr, y_ptr, rows, row_ok, m: tl.constexpr, M, stride_ym, HAS_BIAS: tl.constexpr):
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok & (rows * 0 + m < M))

    @triton.jit
    def _w4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, n_words,
                        stride_xm, stride_wn, stride_sn, stride_zn, stride_ym,
                        FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr,
                        HAS_BIAS: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, AHEAD: tl.constexpr = False):
        """Programs own BLOCK_N rows of y for all M (<= BLOCK_M <= 4) rows of x. `w_ptr`:
        int32 words of 8 nibbles, column 8j + i in nibble i of word j (int4 as stored; MXFP4's
        bytes viewed as int32, which is the same order).

        Layout (checked in the sm90 PTX: no shared-memory layout conversion in the loop): a
        [BLOCK_N, BLOCK_W, 8] tile with one word per thread per row along K (BLOCK_W = 32 x
        warps; a warp's word loads are one 128-byte line), the thread's 8 x values one
        16-byte load. The word index goes through a `where` so that the compiler does not
        vectorize the word loads into a layout x does not share. With groups that are a
        multiple of 8 the scale multiplies once per word (after the 8 products are summed)."""
        pdl_start(PDL)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        r64 = rows.to(tl.int64)
        js = tl.arange(0, BLOCK_W)
        es = tl.arange(0, 8)
        shifts = (es * 4)[None, None, :]
        OFF: tl.constexpr = FMT == 0 and GROUP % 8 == 0
        acc0 = tl.zeros([BLOCK_N, BLOCK_W, 1], tl.float32)
        acc1 = tl.zeros([BLOCK_N, BLOCK_W, 1], tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_W, 1], tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_W, 1], tl.float32)
        if AHEAD:  # the next words are loaded before the current ones are used: two tiles in flight
            j0 = tl.where(js < n_words, js, 0)
            word_next = tl.load(w_ptr + (r64[:, None] * stride_wn + j0[None, :])[:, :, None],
                                mask=(row_ok[:, None] & (js < n_words)[None, :])[:, :, None], other=0)
        for w0 in range(0, n_words, BLOCK_W):
            jw = w0 + js
            w_ok = jw < n_words
            jl = tl.where(w_ok, jw, 0)
            m3 = (row_ok[:, None] & w_ok[None, :])[:, :, None]
            if AHEAD:
                word = word_next
                jn = jw + BLOCK_W
                jnl = tl.where(jn < n_words, jn, 0)
                word_next = tl.load(w_ptr + (r64[:, None] * stride_wn + jnl[None, :])[:, :, None],
                                    mask=(row_ok[:, None] & (jn < n_words)[None, :])[:, :, None], other=0)
            else:
                word = tl.load(w_ptr + (r64[:, None] * stride_wn + jl[None, :])[:, :, None], mask=m3, other=0)
            u = (word >> shifts) & 0xF  # [BLOCK_N, BLOCK_W, 8] (int4, MXFP4 in the checkpoint's layout)
            ks = (jw[:, None] * 8 + es[None, :])[None, :, :]  # [1, BLOCK_W, 8]: the column of every nibble
            k_ok = ks < K
            if GROUP % 8 == 0:  # a word's nibbles share a group: its scale multiplies their sum
                grp = (jl * 8) // GROUP
                s3 = tl.load(s_ptr + (r64[:, None] * stride_sn + grp[None, :])[:, :, None], mask=m3, other=0)
                z3 = s3
                if HAS_ZP:
                    z3 = tl.load(z_ptr + (r64[:, None] * stride_zn + grp[None, :])[:, :, None], mask=m3, other=8)
                if FMT == 0:
                    # f = 1 + u/16 (float bits 0x3F800000 | u << 19, exact), and per word
                    # sum (u - z) x / 16 = sum f x - (1 + z/16) sum x: one FMA a weight
                    f = (0x3F800000 | (u << 19)).to(tl.float32, bitcast=True)
                    zq = z3.to(tl.float32) if HAS_ZP else 8.0
                    off = 1.0 + zq * 0.0625
                    scale = s3.to(tl.float32) * 16.0
                else:
                    if FMT == 2:  # MXFP4 pair words: each code from its own places
                        f = _e2m1_pairs_at(word, es[None, None, :])
                    else:
                        f = _e2m1_at(word, shifts)
                    off = 0.0
                    scale = _e8m0(s3.to(tl.int32))
            else:  # groups that split a word (int4 only): every nibble its own scale
                f = _dequant_each(u, ks // GROUP, r64, s_ptr, z_ptr, stride_sn, stride_zn,
                                  row_ok[:, None, None] & k_ok, FMT, HAS_ZP)
                off = 0.0
                scale = 1.0
            acc0 = _row_acc(acc0, f, off, scale, x_ptr, 0, M, ks, k_ok, stride_xm, OFF)
            if BLOCK_M > 1:
                acc1 = _row_acc(acc1, f, off, scale, x_ptr, 1, M, ks, k_ok, stride_xm, OFF)
            if BLOCK_M > 2:
                acc2 = _row_acc(acc2, f, off, scale, x_ptr, 2, M, ks, k_ok, stride_xm, OFF)
                acc3 = _row_acc(acc3, f, off, scale, x_ptr, 3, M, ks, k_ok, stride_xm, OFF)
        _row_store(acc0, b_ptr, y_ptr, rows, row_ok, 0, M, stride_ym, HAS_BIAS)
        if BLOCK_M > 1:
            _row_store(acc1, b_ptr, y_ptr, rows, row_ok, 1, M, stride_ym, HAS_BIAS)
        if BLOCK_M > 2:
            _row_store(acc2, b_ptr, y_ptr, rows, row_ok, 2, M, stride_ym, HAS_BIAS)
            _row_store(acc3, b_ptr, y_ptr, rows, row_ok, 3, M, stride_ym, HAS_BIAS)

    @triton.jit
    def _w4_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, n_words,
                        stride_xm, stride_wn, stride_sn, stride_zn, stride_ym,
                        FMT: tl.constexpr, PER: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr,
                        HAS_BIAS: tl.constexpr, PDL: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """A BLOCK_M x BLOCK_N tile of y; the M tiles of one weight tile are neighbours."""
        pdl_start(PDL)
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        pid_m = pid % num_m
        pid_n = pid // num_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        rn64 = rn.to(tl.int64)
        BLOCK_W: tl.constexpr = BLOCK_K // PER
        es = tl.arange(0, PER)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + ks[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            # W^T as packed words [BLOCK_W, BLOCK_N] (coalesced along K: a row's words are
            # contiguous), split into [BLOCK_W, PER, BLOCK_N] nibbles, dequantized, then viewed
            # as [BLOCK_K, BLOCK_N] (column k = word * PER + nibble)
            jw = k0 // PER + tl.arange(0, BLOCK_W)
            wk = (jw < n_words)[:, None] & n_ok[None, :]
            word = tl.load(w_ptr + rn64[None, :] * stride_wn + jw[:, None], mask=wk, other=0).to(tl.int32)
            if FMT == 2:  # MXFP4 pair words: the checkpoint's layout first
                word = _pair_word_std(word)
            u = (word[:, None, :] >> (es * 4)[None, :, None]) & 0xF
            ks3 = jw[:, None] * PER + es[None, :]  # [BLOCK_W, PER]
            k3_ok = (ks3 < K)[:, :, None] & n_ok[None, None, :]
            if GROUP % PER == 0:  # one scale per word
                grp = (jw * PER) // GROUP
                s_raw = tl.load(s_ptr + rn64[None, :] * stride_sn + grp[:, None], mask=wk, other=0)[:, None, :]
                z_raw = s_raw
                if HAS_ZP:
                    z_raw = tl.load(z_ptr + rn64[None, :] * stride_zn + grp[:, None], mask=wk, other=8)[:, None, :]
            else:
                grp = (ks3 // GROUP)[:, :, None]
                s_raw = tl.load(s_ptr + rn64[None, None, :] * stride_sn + grp, mask=k3_ok, other=0)
                z_raw = s_raw
                if HAS_ZP:
                    z_raw = tl.load(z_ptr + rn64[None, None, :] * stride_zn + grp, mask=k3_ok, other=8)
            off, scale = _group_terms(s_raw, z_raw, FMT, HAS_ZP)
            w3 = tl.where(k3_ok, _dequant(u, off, scale, FMT), 0.0)  # columns past K (padding nibbles): 0
            w = tl.reshape(w3, [BLOCK_K, BLOCK_N])
            w = w.to(a.dtype)
            if DOT_F32:  # the interpreter: same rounding of W, the product in fp32 (see _dot_f32)
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def _dot_f32(x: torch.Tensor) -> bool:
    """Whether the GEMM multiplies in fp32: only under the interpreter (TRITON_INTERPRET=1,
    CPU tensors), whose tl.dot mishandles bf16 (numpy has no bf16). The weight tile is still
    rounded to the activation dtype first, so the result is what the tensor cores compute."""
    return not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check(x, packed, scales, zeros, bias, fmt: str, group: int, k: int) -> None:
    """Shapes and dtypes of a 4-bit product; raises ValueError naming the argument."""
    if fmt not in FORMATS:
        raise ValueError(f"w4_linear: fmt={fmt!r}, allowed {FORMATS}")
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"w4_linear: x must be [M, {k}] with a contiguous last dim, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"w4_linear: x dtype {x.dtype}, allowed bfloat16, float16, float32")
    per = PER_ELEMENT[fmt]
    N = packed.shape[0]
    want_dtype = torch.uint8 if fmt == "mxfp4" else torch.int32
    if packed.dtype != want_dtype or packed.shape[1] != -(-k // per) or packed.stride(1) != 1:
        raise ValueError(f"w4_linear: packed must be {want_dtype} [N, {-(-k // per)}] row-major for "
                         f"{fmt} with K={k}, got {packed.dtype} {tuple(packed.shape)}")
    if fmt != "int4" and group != MX_GROUP:
        raise ValueError(f"w4_linear: mxfp4 has group {MX_GROUP}, got group={group}")
    if group <= 0 or k % group:
        raise ValueError(f"w4_linear: group={group} must divide K={k}")
    if tuple(scales.shape) != (N, k // group) or scales.stride(1) != 1:
        raise ValueError(f"w4_linear: scales must be [{N}, {k // group}], got {tuple(scales.shape)}")
    if zeros is not None and (fmt != "int4" or tuple(zeros.shape) != (N, k // group) or zeros.stride(1) != 1):
        raise ValueError(f"w4_linear: zeros (int4 only) must be [{N}, {k // group}], got {tuple(zeros.shape)}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"w4_linear: bias must be [{N}], got {tuple(bias.shape)}")


def w4_linear_launch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor], fmt: str, group: int, k: int,
                     config: Optional[dict] = None, l2_next=()) -> torch.Tensor:
    """Launches the kernel `w4_config` picks for x [M, K] -> y [M, N] in x's dtype; `config`
    overrides it (tiles as in the tables, plus "kernel": "w4_gemv" or "w4_gemm"). `l2_next`:
    weight regions the one-row GEMV asks L2 for after its loop (`w4_gemv1_launch`; the other
    kernels take none)."""
    if not HAS_TRITON:
        raise RuntimeError("w4_linear needs triton; use w4_linear_ref without it")
    _check(x, packed, scales, zeros, bias, fmt, group, k)
    M, N = x.shape[0], packed.shape[0]
    if M == 0:
        return torch.empty(M, N, dtype=x.dtype, device=x.device)
    name, cfg = w4_config(M, N, k, x.dtype, group, fmt)
    if config is not None:
        cfg = dict(config)
        name = cfg.pop("kernel", name)
    words = packed if fmt == "int4" else packed.view(torch.int32)  # MXFP4: 4 bytes = 8 nibbles in order
    if name == "w4_dequant":
        from atom.model_ops.kernels.w4_dequant import w4_dequant
        w = w4_dequant(words, scales, zeros, FORMATS.index(fmt), group, k, x.dtype)
        return torch.nn.functional.linear(x, w, bias.to(x.dtype) if bias is not None else None)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    z = zeros if zeros is not None else scales
    b = bias if bias is not None else y
    common = dict(FMT=FORMATS.index(fmt), PER=PER_ELEMENT[fmt], GROUP=group, HAS_ZP=zeros is not None,
                  HAS_BIAS=bias is not None, **pdl_args(x))
    if name == "w4_dot":
        from atom.model_ops.kernels.w4_dot import w4_dot_launch
        w4_dot_launch(x, words, scales, z, bias, y, FORMATS.index(fmt), group, k, cfg, common, _dot_f32(x))
    elif name == "w4_gemv1":
        from atom.model_ops.kernels.w4_gemv1 import supports as gemv1_supports
        from atom.model_ops.kernels.w4_gemv1 import w4_gemv1_launch
        if M != 1 or not gemv1_supports(fmt, group, k):
            raise ValueError(f"w4_linear: the one-row GEMV runs M=1 with K % 8 == 0 and int4 groups of whole words, "
                             f"got M={M}, K={k}, group={group}")
        w4_gemv1_launch(x, words, scales, z, bias, y, FORMATS.index(fmt), group, cfg, common, l2_next=l2_next)
    elif name == "w4_gemv":
        if cfg["BLOCK_M"] < M:
            raise ValueError(f"w4_linear: the GEMV's BLOCK_M={cfg['BLOCK_M']} must cover M={M}")
        if cfg["BLOCK_M"] > 4:
            raise ValueError(f"w4_linear: the GEMV runs at most 4 rows, got BLOCK_M={cfg['BLOCK_M']}")
        grid = (triton.cdiv(N, cfg["BLOCK_N"]),)
        common.pop("PER")
        _w4_gemv_kernel[grid](x, words, scales, z, b, y, M, N, k, words.shape[1], x.stride(0),
                              words.stride(0), scales.stride(0), z.stride(0), y.stride(0), **common, **cfg)
    else:
        grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
        _w4_gemm_kernel[grid](x, packed, scales, z, b, y, M, N, k, packed.shape[1], x.stride(0), packed.stride(0),
                              scales.stride(0), z.stride(0), y.stride(0),
                              DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
                              DOT_F32=_dot_f32(x), **common, **cfg)
    return y


@torch.library.custom_op("atom::w4_linear", mutates_args=())
def w4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
              bias: Optional[torch.Tensor], fmt: str, group: int, k: int) -> torch.Tensor:
    """x [M, K] W^T (+ b) -> [M, N] in x's dtype, W the 4-bit weight described in the module
    docstring; opaque to torch.compile (only its output shape is traced)."""
    return w4_linear_launch(x, packed, scales, zeros, bias, fmt, group, k)


@w4_linear.register_fake
def _(x, packed, scales, zeros, bias, fmt, group, k):
    return x.new_empty((x.shape[0], packed.shape[0]))


def dequantize_w4(packed: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], fmt: str,
                  group: int, k: int) -> torch.Tensor:
    """fp32 [N, K] of the kernels' weight tensors (torch, any device)."""
    if fmt == "mxfp4_pairs":
        from atom.model_ops.kernels.fp4_pairs import standard_words
        packed = standard_words(packed)
    per = PER_ELEMENT[fmt]
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * 4
    u = ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF).flatten(-2)[:, :k]
    s = scales.repeat_interleave(group, 1)
    if fmt == "int4":
        z = zeros.to(torch.int32).repeat_interleave(group, 1) if zeros is not None else 8
        return (u - z).float() * s.float()
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=packed.device)
    vals = e2m1[(u & 7).long()] * torch.where((u & 8) != 0, -1.0, 1.0)
    return vals * torch.ldexp(torch.ones_like(s, dtype=torch.float32), s.to(torch.int32) - 127)


def w4_linear_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                  bias: Optional[torch.Tensor], fmt: str, group: int, k: int) -> torch.Tensor:
    """The torch reference: dequantize to fp32, multiply in fp32, return x's dtype."""
    w = dequantize_w4(packed, scales, zeros, fmt, group, k)
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


#: what the 4-bit methods report as their GPU kernel (`kernel` attribute, `kernel_for(layer)`)
KERNEL_DESCRIPTION = (f"atom::w4_linear (triton w4_gemv1 at M=1, w4_gemv for M<={GEMV_MAX_M}; w4_dot, "
                      f"tensor-core swap-AB, for bf16/fp16 activations above (int4 up to M={DOT_MAX_M['int4']}); else w4_gemm; "
                      f"the weight written out for the library GEMM from W4_DEQUANT_MIN_M rows where set)")
REFERENCE_DESCRIPTION = "torch reference (dequantize to fp32, F.linear)"


def use_w4_kernel(x: torch.Tensor) -> bool:
    """The 4-bit methods run the Triton kernels for NVIDIA CUDA inputs when Triton is there;
    the CPU (and ROCm, where these kernels never ran) keeps the torch reference."""
    return HAS_TRITON and x.is_cuda and torch.version.hip is None


def kernel_for_weight(weight: torch.Tensor) -> str:
    """What runs a 4-bit layer whose packed weight is `weight`: the Triton kernels on CUDA,
    else the torch reference (the per-layer tables' `kernel` column)."""
    return KERNEL_DESCRIPTION if HAS_TRITON and weight.is_cuda else REFERENCE_DESCRIPTION


def w4_product(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
               bias: Optional[torch.Tensor], fmt: str, group: int, k: int) -> torch.Tensor:
    """x [..., K] W^T (+ b) -> [..., N] through `atom::w4_linear` (leading dims flattened)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.ops.atom.w4_linear(x2, packed, scales, zeros, bias, fmt, group, k)
    return y.reshape(*lead, packed.shape[0])
