"""The one-row 4-bit GEMV (batch-1 decode): y = x W^T (+ b) for x [1, K], int4 groups or MXFP4,
the weight bytes as the checkpoint packs them (layouts in `w4_gemm`'s module docstring).

At one row the product is a weight stream with one multiply-add per weight on the CUDA
cores, and the H200's issue rate (~33 T thread-instructions/s against ~8.6 T packed
weights/s at 4.3 TB/s) leaves ~4 instructions a weight: the loop has to stay under it, and
below it the kernels' speed is set by how many words are in flight (the tiles, the words
loaded ahead) more than by the count. This kernel is
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
  Llama / Qwen shape), and pointers that advance by a constant;
- the scale and zero-point tiles are loaded on transposed pointers (`_load_t`), so that they
  come laid out as the word tile is, without a shared-memory conversion and its two barriers
  a step.
Rounding: fp32 products and sums; the int4 zero point comes out of each word's partial sum
(cancellation of a few bits of fp32, far below bf16's 2^-9). The powers of two keep x 2^85
below fp32's range for |x| < 2^43 (activations are far smaller).

HALF2 (the table's choice for bf16 / fp16 activations on NVIDIA GPUs; `half2_applies`) halves
the work a weight again with fp16 pair arithmetic in inline PTX: a word's nibbles i and i + 4
land in the two halves of one int32 (int4: masked in place as fp16 subnormals, 16 u 2^-24 for
odd i; MXFP4: e2m1 2^-14, its bits moved to fp16's), one fp16 FMA for both against a pair of x
scaled per word column into [2^14, 2^15), four FMAs a half-word, the halves added in fp16 and
widened once. Its rounding (`half2_ref`, the same arithmetic in torch) costs about 1e-3 of the largest
output, what rounding the dequantized weights to bf16 costs the tensor-core kernels and below
bf16's output rounding; fp32 activations keep the float32 path. The PTX is generated
(`h2_ptx`). Two options of the tile, off in the tables until a GPU times them:
- CHAIN (DW = 2): a thread's word pair in one fp16 chain, x scaled per 16 columns, so that the
  widening, unscaling and scale multiply come once per 16 weights instead of once per 8; its
  rounding is `half2_ref(chain=2)`;
- fmt "mxfp4_pairs": MXFP4 pair words (`fp4_pairs`, the layout the plan's "fp4_pair_words"
  gives MXFP4 layers), 11 decode instructions a word instead of 15; their scale bytes lie in
  `fp4_pairs.FOLD_SCALES`, so with `FOLD_PAIR_SCALES` (the default) a chain's unscaling and its
  E8M0 scale are one float built by one multiply-add of the byte (no shift, max and second multiply).
The compiled loops' instruction counts, with and without each (`scripts/w4_gemv_sass.py`), are
in docs/perf/raw/history.md.
"""
from __future__ import annotations

import os

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton

#: tiles: BLOCK_N rows a program, BLOCK_W loads a step (DW words each, 8 columns a word), one
#: load per thread per row (BLOCK_W = 32 x num_warps). From the H200 sweep
#: (`scripts/w4_gemv1_sweep.py`, Llama-3.1-8B shapes), kept where batch-1 decode agreed: layers
#: of up to WIDE_N outputs (4096 x 4096, 6144 x 4096) over 8 warps with the next words loaded a
#: step ahead; wider ones (28672 x 4096) int4 16 rows over 4 warps, MXFP4 8 rows over 2 warps
#: ahead; MXFP4 from more than DEEP_K inputs (4096 x 14336) 8 rows over 4 warps ahead. MXFP4
#: reads word pairs (DW = 2) everywhere, int4 single words: its sweep gains from pairs (at
#: 28672 x 4096) did not carry into decode (docs/perf has both). Every tile asks L2 for its
#: program's scale (and zero-point) rows before the PDL wait (SPF; faster decode in both formats),
#: and MXFP4's tiles pass Triton's maxnreg = 64 (ptxas then allocates 64 registers instead of
#: 60-62, the same programs an SM and no spills, and schedules the loop otherwise: faster decode),
#: except the deep tile's 128 (`DEEP_MAXNREG`)
TILES = {"int4": dict(BLOCK_N=8, BLOCK_W=256, num_warps=8, num_stages=3, AHEAD=True, HALF2=True, SPF=True),
         "mxfp4": dict(BLOCK_N=8, BLOCK_W=256, num_warps=8, num_stages=3, AHEAD=True, HALF2=True, DW=2, SPF=True)}
TILES_WIDE = {"int4": dict(BLOCK_N=16, BLOCK_W=128, num_warps=4, num_stages=3, HALF2=True, SPF=True),
              "mxfp4": dict(BLOCK_N=8, BLOCK_W=64, num_warps=2, num_stages=3, AHEAD=True, HALF2=True, DW=2,
                            SPF=True)}
#: layers of up to WIDE_N outputs from more than DEEP_K inputs (Llama's down product, 4096 x 14336)
TILES_DEEP = {"int4": dict(TILES["int4"]),
              "mxfp4": dict(BLOCK_N=8, BLOCK_W=128, num_warps=4, num_stages=3, AHEAD=True, HALF2=True, DW=2,
                            SPF=True)}
for _table in (TILES, TILES_WIDE, TILES_DEEP):
    _table["mxfp4"]["maxnreg"] = 64
#: MXFP4's deep tile (Llama's down product: 512 programs of 4 warps, under 4 an SM, which fit the
#: registers at 128 as at 64) with room for 128 registers: ptxas then issues the next step's
#: words early in the step instead of sinking them to its end (`scripts/w4_gemv_sass.py --tables
#: 128` shows the cover). The other tiles, and int4's, lose programs an SM or time with more
#: registers; the timings are in docs/perf.
DEEP_MAXNREG = 128
TILES_DEEP["mxfp4"]["maxnreg"] = DEEP_MAXNREG
# MXFP4 pair words (`fp4_pairs`: the same weights, bits placed for fewer decode instructions)
# take MXFP4's tiles until a sweep of their own
for _table in (TILES, TILES_WIDE, TILES_DEEP):
    _table["mxfp4_pairs"] = dict(_table["mxfp4"])
#: formats whose even loop with the words ahead compiles the row strides in (the kernel's SW,
#: SS, SZ): faster batch-1 decode for MXFP4, slower for int4 with the same tiles (its loop has
#: fewer instructions to save); the figures are in docs/perf
FIXED_STRIDES = {"int4": False, "mxfp4": True, "mxfp4_pairs": True}
#: formats whose even loops compile in only the scale and zero-point rows' strides (the kernel's
#: SS, SZ with SW = 0) where `FIXED_STRIDES` does not apply: each row's scale load at an immediate
#: offset from one pointer instead of a 64-bit address sum a row and step, the words' strides
#: left at runtime. int4's sm90 loops (`scripts/w4_gemv_sass.py --tables`): o_proj and down 229
#: -> 221 instructions a step, q/k/v with the norm inside 274 -> 264, gate-up with SiLU inside
#: (`GATED_TILES`) 534 -> 517. On for int4: batch-1 decode was timed with it and `GATED_TILES`
#: together (alone, with the halved gated tile, it measured slower: docs/perf, variant
#: `runtime_scale_strides`). MXFP4's tiles carry their words ahead, so `FIXED_STRIDES` covers them.
FIXED_SCALE_STRIDES = {"int4": True, "mxfp4": False, "mxfp4_pairs": False}
WIDE_N = 8192
DEEP_K = 8192


def stride_constants(fmt: str, ahead: bool, sw: int, ss: int, sz: int) -> dict:
    """The row strides an even tile's loop compiles in (the kernel's SW, SS, SZ; the words' in
    words, the scales' and zero points' in elements): all three for the `FIXED_STRIDES` formats
    with the words ahead (one compile per weight shape), the scale and zero-point ones for the
    `FIXED_SCALE_STRIDES` formats (one compile per K / group), else none (runtime strides)."""
    if ahead and FIXED_STRIDES[fmt]:
        return dict(SW=sw, SS=ss, SZ=sz)
    if FIXED_SCALE_STRIDES[fmt]:
        return dict(SS=ss, SZ=sz)
    return {}


#: the kernel's EARLY for the add + norm split around products (`w4_gemv1_add_row`'s EPI_ROW,
#: `w4_gemv1_rsq`'s RSQ): the epilogue's and the 1 / rms's operands read before the loop, where
#: their latency hides behind it, instead of after it. Off: batch-1 decode with it was level for
#: W4A16 and ~4% slower for MXFP4, whose gate-up then issues its scale loads later in the step
#: (docs/perf; variants `early_epilogue` in scripts/variants/int4 and scripts/variants/mxfp4)
EARLY_EPILOGUE = False

#: MXFP4 pair words' scale multiply folded: the HALF2 loop multiplies a chain's sum by
#: 2^(e + s - 254) as one float built from the bits e + s - 127 (one multiply-add of the scale byte
#: s; e: x's column exponent) instead of 2^(e - 127) and the E8M0 scale as two floats (a shift, a
#: max for s = 0 and a second multiply a chain): the kernel's FOLD, which `w4_gemv1_launch` sets for
#: pair words from this flag. Exact for every pair-word layer: "fp4_pair_words" repacks only layers
#: whose E8M0 bytes lie in `fp4_pairs.FOLD_SCALES` (all-zero blocks' bytes set to 127,
#: `fp4_pairs.fold_scales`; a layer with other bytes keeps the checkpoint's layout and its loop),
#: whatever the flag says, so it may change at any time and engines loaded under either value
#: both run under the other. Fewer loop instructions a step and Llama-3.1-8B's MXFP4 batch-1
#: decode ~2% faster; with CHAIN on top it was not (docs/perf; variants `no_fold` and `chain_mx`
#: in scripts/variants/mxfp4).
FOLD_PAIR_SCALES = True


def fold_default(fmt: str) -> bool:
    """The kernel's FOLD where a launch's tile does not set it: `FOLD_PAIR_SCALES`, read now,
    for MXFP4 pair words."""
    return FOLD_PAIR_SCALES and fmt == "mxfp4_pairs"


def tiles(n: int, fmt: str = "int4", k: int = 0) -> dict:
    """The tile config for a layer of n outputs from k inputs of format `fmt`."""
    table = TILES_WIDE if n > WIDE_N else TILES_DEEP if k > DEEP_K else TILES
    return dict(table[fmt])


#: the gated one-row product's own tiles over more than WIDE_N rows (Llama's gate-up with SiLU-and-mul
#: inside, "w4_gate_up_silu"): int4 8 gate + 8 up rows over 2 warps, each thread's word pair in one
#: fp16 chain (DW = 2, CHAIN), no words ahead. sm90 (`scripts/w4_gemv_sass.py --tables`): 2.02 loop
#: instructions a weight against 2.59 for `tiles`' tile with half its rows, 68 registers, 14 programs
#: an SM, Llama's 1,792 programs in 0.97 waves against 1.70: faster batch-1 decode (docs/perf; the
#: variant `gated_table` times the halved tile). MXFP4's same tile measured slower.
GATED_TILES = {"int4": dict(BLOCK_N=8, BLOCK_W=64, num_warps=2, num_stages=3, HALF2=True, DW=2, CHAIN=True, SPF=True)}


def gated_tiles(rows: int, fmt: str = "int4", k: int = 0) -> dict:
    """The tile of a gated one-row product over a [gate | up] weight of `rows` rows from k inputs
    (y = silu(gate) up, the programs' gate and up rows side by side): the format's `GATED_TILES`
    entry over more than WIDE_N rows; else `tiles`' tile for the plain product of all `rows` with
    half its BLOCK_N, so that a program reads as many rows and words a step as there, and the
    grid is the same."""
    if fmt in GATED_TILES and rows > WIDE_N:
        return dict(GATED_TILES[fmt])
    cfg = tiles(rows, fmt, k)
    cfg["BLOCK_N"] = max(1, cfg["BLOCK_N"] // 2)
    return cfg


FUSED_TILES = {False: dict(BLOCK_N=8, BLOCK_W=128, num_warps=4, num_stages=3, AHEAD=True, HALF2=True, SPF=True),
               True: dict(BLOCK_N=8, BLOCK_W=128, num_warps=4, num_stages=3, HALF2=True, SPF=True)}


def fused_tiles(gated: bool) -> dict:
    """The tile of `w4_gemv1_fused` (`scripts/w4_fused_sweep.py`'s best at Llama-3.1-8B's q/k/v
    and gate-up products, both formats): 8 rows (a gated product: 8 gate and 8 up rows) of
    128 words a step, the next step's words loaded ahead where not gated, the scale rows asked of
    L2 before the PDL wait (SPF) as in `tiles`."""
    return dict(FUSED_TILES[gated])


def _sm90(x: torch.Tensor) -> bool:
    """The kernel's sm90 PTX runs for x (Hopper and later, compiled): the bulk prefetch of L2N."""
    from atom.model_ops.kernels.triton_import import compiled_for_sm90
    return ptx_applies(x) and compiled_for_sm90(x.device.index if x.device.index is not None else 0)


def ptx_applies(x: torch.Tensor) -> bool:
    """The kernel's inline PTX runs for x: on an NVIDIA GPU, compiled (not the interpreter)."""
    return x.is_cuda and torch.version.hip is None and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def half2_applies(x: torch.Tensor, fmt_id: int) -> bool:
    """The HALF2 path (fp16 products, inline PTX) runs 16-bit activations (fp16 rounding
    would cost fp32 activations bits they have) on NVIDIA GPUs, not under the interpreter."""
    return fmt_id in (0, 1, 2) and x.dtype in (torch.bfloat16, torch.float16) and ptx_applies(x)


def supports(fmt: str, group: int, k: int) -> bool:
    """Whether `_w4_gemv1_kernel` runs this format: whole words (K % 8 == 0) and int4 groups of
    whole words (a word's 8 nibbles share one scale)."""
    return k % 8 == 0 and (fmt != "int4" or group % 8 == 0)


def require_supported(name: str, fmt: str, group: int, k: int) -> None:
    """Raise a ValueError naming `name` where `_w4_gemv1_kernel` does not run the format (`supports`)."""
    if not supports(fmt, group, k):
        raise ValueError(f"{name}: the one-row GEMV runs K % 8 == 0 and int4 groups of whole words, "
                         f"got K={k}, group={group}")


def half2_ref(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros, bias, group: int,
              fmt: str = "int4", chain: int = 1) -> torch.Tensor:
    """The HALF2 path's arithmetic in torch (CPU or GPU), rounding where the kernel rounds:
    the x of each run of `chain` word columns (8 chain columns; CHAIN = 2: a thread's word pair)
    scaled by 2^(141 - e) (e: the biased exponent of its largest |x|, at least 40; int4's odd
    nibbles' x also / 16), rounded to fp16; per half of a run 4 chain fp16 FMAs in the kernel's
    order (word by word; a product and a sum exact in float64, then one rounding to fp16), the
    two halves added in fp16; the rest in float64 (the kernel's float32 sums differ from it by
    float32 rounding only). x [1, K] of any float dtype, `words` int32 [N, K / 8] (MXFP4's
    bytes viewed as int32; fmt "mxfp4_pairs": `fp4_pairs` words); returns float32 [1, N]."""
    from atom.model_ops.kernels.h2_xpack import scaled_halves
    from atom.model_ops.quant.mxfp4 import FP4_VALUES
    if fmt == "mxfp4_pairs":  # the same values, decoded by other shifts
        from atom.model_ops.kernels.fp4_pairs import standard_words
        words, fmt = standard_words(words), "mxfp4"
    n, n_words = words.shape
    if n_words % chain or (fmt == "int4" and group % (8 * chain)):
        raise ValueError(f"half2_ref: {n_words} words (int4 groups of {group}) do not split into runs of "
                         f"chain={chain} words")
    runs = n_words // chain
    dev = x.device
    xf = x.reshape(-1).float().reshape(runs, chain, 8)
    e, xs = scaled_halves(xf, fmt == "int4")  # e [runs], xs [runs, chain, 8]
    xs = xs.double()
    codes = (words[:, :, None] >> torch.arange(0, 32, 4, device=dev, dtype=torch.int32)) & 0xF  # [N, n_words, 8]
    if fmt == "int4":  # the fp16 subnormals u 2^-24 (16 u 2^-24 for odd nibbles)
        v = codes.double() * torch.tensor([1.0, 16.0] * 4, device=dev, dtype=torch.float64) * 2.0 ** -24
    else:  # e2m1 2^-14
        v = FP4_VALUES.to(dev, torch.float64)[codes.long()] * 2.0 ** -14
    v = v.reshape(n, runs, chain, 8)
    halves = []
    for part in (range(0, 4), range(4, 8)):  # nibbles 0-3 in the low half, 4-7 in the high half
        a = torch.zeros(n, runs, dtype=torch.float64, device=dev)
        for w in range(chain):
            for i in part:
                a = (v[:, :, w, i] * xs[:, w, i] + a).to(torch.float16).double()
        halves.append(a)
    t = (halves[0] + halves[1]).to(torch.float16).double()  # [N, runs]
    if fmt == "int4":  # t = sum u x 2^(117 - e)
        unscale = ((e + 10) << 23).view(torch.float32).double()
        per = group // (8 * chain)  # runs a group
        z = zeros.double().repeat_interleave(per, dim=1)[:, :runs] if zeros is not None else 8.0
        s = scales.double().repeat_interleave(per, dim=1)[:, :runs]
        y = ((t * unscale - z * xf.double().sum(dim=(1, 2))) * s).sum(dim=1)
    else:  # t = sum v x 2^(127 - e), scales E8M0 per 32 columns
        unscale = (e << 23).view(torch.float32).double()
        s = torch.exp2(scales.double() - 127).repeat_interleave(4 // chain, dim=1)[:, :runs]
        y = (t * unscale * s).sum(dim=1)
    if bias is not None:
        y = y + bias.double()
    return y.float()[None, :]


if HAS_TRITON:
    from atom.model_ops.kernels.h2_ptx import constraints as h2_constraints
    from atom.model_ops.kernels.h2_ptx import h2_ptx
    from atom.model_ops.kernels.h2_xpack import _h2_column_e, _h2_pairs, store_added_prepared, unpack_cols
    from atom.model_ops.kernels.rmsnorm import add_norm_cols, store_added_row
    from atom.model_ops.kernels.triton_import import pdl_start
    from atom.model_ops.kernels.w4_gemm import _e8m0, _pair_word_std

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

    @triton.jit
    def _load_t(ptr, mask=None, other=None):
        """tl.load of a [BLOCK_N, BLOCK_W] scale or zero-point tile, issued on the transposed
        pointers: a pointer tile with no contiguous dimension is laid out along its first one
        (rows) by the coalescing pass, unlike the word tile (along the words), and converting
        it costs shared memory and two barriers a step; transposed, its first dimension is
        the words', and the two transposes are free relabellings."""
        if mask is None:
            t = tl.load(tl.trans(ptr))
        else:
            t = tl.load(tl.trans(ptr), mask=tl.trans(mask), other=other)
        return tl.trans(t)

    H2_INT4 = tl.constexpr(h2_ptx("int4"))
    H2_MXFP4 = tl.constexpr(h2_ptx("mxfp4"))
    H2_PAIRS = tl.constexpr(h2_ptx("mxfp4_pairs"))
    H2_INT4_2 = tl.constexpr(h2_ptx("int4", 2))
    H2_MXFP4_2 = tl.constexpr(h2_ptx("mxfp4", 2))
    H2_PAIRS_2 = tl.constexpr(h2_ptx("mxfp4_pairs", 2))
    H2_ONE = tl.constexpr(h2_constraints(1))
    H2_TWO = tl.constexpr(h2_constraints(2))

    @triton.jit
    def _h2_word(word, x0, x1, x2, x3, FMT: tl.constexpr):
        """One word's 8 products in fp16 pairs (`HALF2` below; the PTX of `h2_ptx`): codes
        (i, i + 4) as the two fp16 halves of one int32 each, multiplied by the fp16 pair xi and
        summed in fp16 (4 products a half, one rounding an FMA; fp16 subnormals are exact on
        the FMA pipe), the halves added in fp16 and the sum widened to float32. Returns the
        float32 bits as int32."""
        if FMT == 0:
            t = tl.inline_asm_elementwise(H2_INT4, H2_ONE, [word, x0, x1, x2, x3], dtype=tl.int32, is_pure=True,
                                          pack=1)
        elif FMT == 2:
            t = tl.inline_asm_elementwise(H2_PAIRS, H2_ONE, [word, x0, x1, x2, x3], dtype=tl.int32, is_pure=True,
                                          pack=1)
        else:
            t = tl.inline_asm_elementwise(H2_MXFP4, H2_ONE, [word, x0, x1, x2, x3], dtype=tl.int32, is_pure=True,
                                          pack=1)
        return t

    @triton.jit
    def _h2_words2(w0, w1, x0, x1, x2, x3, x4, x5, x6, x7, FMT: tl.constexpr):
        """`_h2_word` over two words (CHAIN) in one fp16 chain: w0's four pair FMAs with x0..x3,
        then w1's with x4..x7, the halves added once."""
        args = [w0, w1, x0, x1, x2, x3, x4, x5, x6, x7]
        if FMT == 0:
            t = tl.inline_asm_elementwise(H2_INT4_2, H2_TWO, args, dtype=tl.int32, is_pure=True, pack=1)
        elif FMT == 2:
            t = tl.inline_asm_elementwise(H2_PAIRS_2, H2_TWO, args, dtype=tl.int32, is_pure=True, pack=1)
        else:
            t = tl.inline_asm_elementwise(H2_MXFP4_2, H2_TWO, args, dtype=tl.int32, is_pure=True, pack=1)
        return t

    @triton.jit
    def _h2_column_x(xv, es, ODD16: tl.constexpr, BLOCK_W: tl.constexpr):
        """`_h2_pairs` of each word column with its own exponent; returns the four pairs and
        e [1, BLOCK_W, 1]."""
        e = _h2_column_e(xv)
        x0, x1, x2, x3 = _h2_pairs(xv, e, es, ODD16, BLOCK_W)
        return x0, x1, x2, x3, e

    @triton.jit
    def _h2_dot(word, xv, es, FMT: tl.constexpr, BLOCK_W: tl.constexpr):
        """Each word's products in fp16 pairs (words [BLOCK_N, BLOCK_W], x [1, BLOCK_W, 8]):
        float32 [BLOCK_N, BLOCK_W, 1] and the columns' e [1, BLOCK_W, 1] (`_h2_column_x`)."""
        x0, x1, x2, x3, e = _h2_column_x(xv, es, FMT == 0, BLOCK_W)
        x0 = tl.broadcast_to(x0, word.shape)
        x1 = tl.broadcast_to(x1, word.shape)
        x2 = tl.broadcast_to(x2, word.shape)
        x3 = tl.broadcast_to(x3, word.shape)
        t = _h2_word(word, x0, x1, x2, x3, FMT)
        return t.to(tl.float32, bitcast=True)[:, :, None], e

    @triton.jit
    def _zero_term(sx, zp, ok, HAS_ZP: tl.constexpr, EVEN: tl.constexpr):
        """sum x times each word's zero point (`zp`'s tile; 8, the symmetric one, without)."""
        if HAS_ZP:
            if EVEN:
                z_raw = _load_t(zp)[:, :, None]
            else:
                z_raw = _load_t(zp, ok, 8)[:, :, None]
            c = sx * z_raw.to(tl.float32)
        else:
            c = sx * 8.0
        return c

    @triton.jit
    def _h2_part(t, e, sx, s_raw, zp, ok, FMT: tl.constexpr, HAS_ZP: tl.constexpr, EVEN: tl.constexpr,
                 FOLD: tl.constexpr = False):
        """A HALF2 chain's sum t (float32) unscaled and scaled: int4 t = sum u x 2^(117 - e), less
        the zero point times sx (the chain's sum of x), times the group scale; MXFP4 t = sum v x
        2^(127 - e), times the E8M0 scale (sx unused); FOLD (the kernel's), pair words (FMT 2, whose
        scale bytes s then lie in `fp4_pairs.FOLD_SCALES`) times 2^(e + s - 254) as one float, its
        exponent field e + s - 127 one multiply-add of the scale byte (a normal float: exact)."""
        if FMT == 0:
            c = _zero_term(sx, zp, ok, HAS_ZP, EVEN)
            part = (t * ((e + 10) << 23).to(tl.float32, bitcast=True) - c) * s_raw.to(tl.float32)
        elif FMT == 2 and FOLD:
            part = t * (s_raw.to(tl.int32) * 8388608 + ((e - 127) << 23)).to(tl.float32, bitcast=True)
        else:
            part = (t * (e << 23).to(tl.float32, bitcast=True)) * _e8m0(s_raw.to(tl.int32))
        return part

    @triton.jit
    def _word_sums(word, s_raw, zp, ok, xv, es, FMT: tl.constexpr, HALF2: tl.constexpr, HAS_ZP: tl.constexpr,
                   EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, FOLD: tl.constexpr = False):
        """One step's dot-product parts of a [BLOCK_N, BLOCK_W, 1] word tile with x [1, BLOCK_W, 8]
        (its scale tile s_raw, zero points at zp): float32 [BLOCK_N, BLOCK_W, 1]."""
        if FMT == 2 and not HALF2:  # MXFP4 pair words on the float32 path: the checkpoint's layout first
            word = _pair_word_std(word)
        wu = word.to(tl.uint32, bitcast=True)
        shape: tl.constexpr = [BLOCK_N, BLOCK_W]
        if HALF2:
            t, e = _h2_dot(tl.reshape(word, shape), xv, es, FMT, BLOCK_W)
            part = _h2_part(t, e, tl.sum(xv, axis=2, keep_dims=True), s_raw, zp, ok, FMT, HAS_ZP, EVEN, FOLD)
        elif FMT == 0:
            # nibble i kept at bit 4i (i <= 5) or 4i - 8 (i = 6, 7: one shift by 8 for both)
            right = tl.where(es >= 6, 8, 0)
            pos = 4 * es - right
            # x 2^(85 - pos): the float of bits u << pos is u 2^(pos - 149), so every product is u x 2^-64
            xmul = ((127 + 85 - pos) << 23).to(tl.float32, bitcast=True)
            f = ((wu >> right) & (0xF << pos)).to(tl.float32, bitcast=True)  # u 2^(pos - 149), exact
            t = _fma8(f, xv * xmul, tl.zeros(shape, tl.float32))[:, :, None]  # sum u x 2^-64
            sx = tl.sum(xv, axis=2, keep_dims=True) * 5.421010862427522e-20  # sum x 2^-64
            c = _zero_term(sx, zp, ok, HAS_ZP, EVEN)
            part = ((t - c) * 18446744073709551616.0) * s_raw.to(tl.float32)  # 2^64 first: no underflow
        else:
            # codes i and i + 4 as the two halves of one int32 (bf16 bits): signs to bits 15 / 31
            # (left by 12 - 4i), exponent and mantissa bits to 6-8 / 22-24
            i4 = tl.arange(0, 4)[None, None, :]
            mag = ((wu << tl.maximum(6 - 4 * i4, 0)) >> tl.maximum(4 * i4 - 6, 0)) & 0x01C001C0
            h = ((wu << (12 - 4 * i4)) & 0x80008000) | mag  # [BLOCK_N, BLOCK_W, 4]: two bf16 e2m1 x 2^-126
            lo = (h << 16).to(tl.float32, bitcast=True)  # columns 0-3 of the word, as float32
            hi = (h & 0xFFFF0000).to(tl.float32, bitcast=True)  # columns 4-7
            x_lo, x_hi = tl.split(tl.permute(tl.reshape(xv, [1, BLOCK_W, 2, 4]), (0, 1, 3, 2)))
            x_lo = x_lo * 18446744073709551616.0  # x 2^64: the products v x 2^-62 are normal floats
            x_hi = x_hi * 18446744073709551616.0
            t = _fma4(hi, x_hi, _fma4(lo, x_lo, tl.zeros(shape, tl.float32)))[:, :, None]
            part = (t * 4611686018427387904.0) * _e8m0(s_raw.to(tl.int32))  # 2^62 first: no underflow
        return part

    @triton.jit
    def _word_sums2(word, s_raw, zp, ok, xa, xb, es, FMT: tl.constexpr, HAS_ZP: tl.constexpr, EVEN: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, FOLD: tl.constexpr = False):
        """`_word_sums` (HALF2) of a thread's word pair (DW = 2: `word` the int64 of both, xa / xb
        the x of the low / high word) in one fp16 chain (CHAIN): both words' x scaled by one
        power of two (the exponent of the 16 columns' largest |x|), eight pair FMAs, then one
        widening, unscaling and scale multiply for 16 weights instead of two."""
        shape: tl.constexpr = [BLOCK_N, BLOCK_W]
        e = tl.maximum(_h2_column_e(xa), _h2_column_e(xb))
        a0, a1, a2, a3 = _h2_pairs(xa, e, es, FMT == 0, BLOCK_W)
        b0, b1, b2, b3 = _h2_pairs(xb, e, es, FMT == 0, BLOCK_W)
        t = _h2_words2(tl.reshape(_half(word, 0, 2), shape), tl.reshape(_half(word, 1, 2), shape),
                       tl.broadcast_to(a0, shape), tl.broadcast_to(a1, shape), tl.broadcast_to(a2, shape),
                       tl.broadcast_to(a3, shape), tl.broadcast_to(b0, shape), tl.broadcast_to(b1, shape),
                       tl.broadcast_to(b2, shape), tl.broadcast_to(b3, shape), FMT)
        t = t.to(tl.float32, bitcast=True)[:, :, None]
        sx = tl.sum(xa, axis=2, keep_dims=True) + tl.sum(xb, axis=2, keep_dims=True)
        return _h2_part(t, e, sx, s_raw, zp, ok, FMT, HAS_ZP, EVEN, FOLD)

    @triton.jit
    def _word_sums_packed(word, s_raw, zp, ok, pairs, e, sx, FMT: tl.constexpr, HAS_ZP: tl.constexpr,
                          EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                          FOLD: tl.constexpr = False):
        """`_word_sums` (HALF2) with x's word columns prepared once by the kernel in front
        (XPACK: `h2_xpack`'s columns: the four fp16 pairs [1, BLOCK_W, 4], e and the bits of
        sum x [1, BLOCK_W]): the same products without each program scaling and packing x."""
        shape: tl.constexpr = [BLOCK_N, BLOCK_W]
        xa, xb = tl.split(tl.reshape(pairs, [1, BLOCK_W, 2, 2]))
        x0, x2 = tl.split(xa)
        x1, x3 = tl.split(xb)
        t = _h2_word(tl.reshape(word, shape), tl.broadcast_to(x0, shape), tl.broadcast_to(x1, shape),
                     tl.broadcast_to(x2, shape), tl.broadcast_to(x3, shape), FMT)
        return _h2_part(t.to(tl.float32, bitcast=True)[:, :, None], e[:, :, None],
                        sx.to(tl.float32, bitcast=True)[:, :, None], s_raw, zp, ok, FMT, HAS_ZP, EVEN, FOLD)

    @triton.jit
    def _half(word, h: tl.constexpr, DW: tl.constexpr):
        """Word h of each thread's load: the load itself (DW = 1), or the low (h = 0: the
        earlier word in memory) or high int32 of an int64 (DW = 2)."""
        if DW == 1:
            return word
        elif h == 0:
            return word.to(tl.int32)
        else:
            return (word >> 32).to(tl.int32)

    # prefetch [$1 + $2 $3 + $4] where $5 != 0: a row's base, the row, its bytes, a byte in it. The
    # address is formed in the PTX, out of the compiler's sight: formed in Triton, the row
    # arithmetic it shares with the loop changed how the compiled loop forms its own addresses,
    # with more instructions a step (the counts: docs/perf/raw/history.md, 2026-12-06d)
    _PF_AT = ("{{ .reg .pred p; .reg .b64 a, o; setp.ne.b32 p, $5, 0; mad.wide.s32 a, $2, $3, $1; "
              "cvt.s64.s32 o, $4; add.s64 a, a, o; @p prefetch.global.{} [a]; mov.b32 $0, 0; }}")
    PF_AT_L1 = tl.constexpr(_PF_AT.format("L1"))
    PF_AT_L2 = tl.constexpr(_PF_AT.format("L2"))

    @triton.jit
    def _prefetch_at(base, row, row_bytes, byte, mask, L1: tl.constexpr):
        """Asks L2 (L1: and L1) for the line of byte `byte` of row `row` (rows `row_bytes` apart
        from `base`) where mask holds; NVIDIA only (inline PTX)."""
        args = [base, row, row_bytes, byte, mask.to(tl.int32)]
        if L1:
            tl.inline_asm_elementwise(PF_AT_L1, "=r,l,r,r,r,r", args, dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(PF_AT_L2, "=r,l,r,r,r,r", args, dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _prefetch_step(w_ptr, s_ptr, z_ptr, row0, w_at, n_words, stride_wn, stride_sn, stride_zn, GROUP: tl.constexpr,
                       HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, DW: tl.constexpr,
                       L1: tl.constexpr):
        """L2 prefetches of the step whose words start at w_at (nothing past the row's end), one
        line a lane: a warp's columns of a row are DW 128-byte word lines, and lane l < BLOCK_N DW
        asks for one of them; lanes BLOCK_N DW + r ask for row r's scale line at the warp's first
        column, and (zero points, where 32 lanes hold them) the lanes after those for its
        zero-point line. A thread's element of [BLOCK_W] is its lane's (32 threads a warp). L1:
        the scale and zero-point lines into L1 as well (the words are read once a program)."""
        t = tl.arange(0, BLOCK_W)
        lane = t % 32
        LINES: tl.constexpr = BLOCK_N * DW
        col = w_at + (t // 32) * (32 * DW)  # the warp's first word of the step
        live = w_at < n_words
        q = tl.where(lane < LINES, lane, 0)
        _prefetch_at(w_ptr, row0 + q // DW, stride_wn * 4, (col + (q % DW) * 32) * 4, live & (lane < LINES), False)
        S: tl.constexpr = s_ptr.dtype.element_ty.primitive_bitwidth // 8
        r = tl.where((lane >= LINES) & (lane < LINES + BLOCK_N), lane - LINES, 0)
        _prefetch_at(s_ptr, row0 + r, stride_sn * S, (col * 8) // GROUP * S,
                     live & (lane >= LINES) & (lane < LINES + BLOCK_N), L1)
        if HAS_ZP and LINES + 2 * BLOCK_N <= 32:
            Z: tl.constexpr = z_ptr.dtype.element_ty.primitive_bitwidth // 8
            rz = tl.where((lane >= LINES + BLOCK_N) & (lane < LINES + 2 * BLOCK_N), lane - LINES - BLOCK_N, 0)
            _prefetch_at(z_ptr, row0 + rz, stride_zn * Z, (col * 8) // GROUP * Z,
                         live & (lane >= LINES + BLOCK_N) & (lane < LINES + 2 * BLOCK_N), L1)

    @triton.jit
    def _prefetch_rows(ptr, row0, n_rows, stride, n_elems, BLOCK_W: tl.constexpr, L1: tl.constexpr):
        """L2 prefetches of the 128-byte lines that hold the first n_elems elements of rows
        row0 .. row0 + n_rows - 1 from ptr, a row every `stride` elements: BLOCK_W // 16 lines a
        row from its start (the last clamped to its last element), a line a thread: 16 rows of up
        to 1 KB with 128 threads (a hint: lines past those are left to the loads). L1: into L1
        as well."""
        S: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
        LPR: tl.constexpr = BLOCK_W // 16  # lines a row
        t = tl.arange(0, BLOCK_W)
        _prefetch_at(ptr, row0 + t // LPR, stride * S, tl.minimum((t % LPR) * (128 // S), n_elems - 1) * S,
                     t // LPR < n_rows, L1)

    @triton.jit
    def _bulk_prefetch_l2(ptr, count, chunk, NT: tl.constexpr):
        """L2 bulk prefetches (`cp.async.bulk.prefetch.L2`, sm90) of elements [0, count) of ptr,
        `chunk` elements a warp of the NT threads: lane 0 of warp w of program p asks for the
        chunk from (p NT / 32 + w) chunk, so the grid covers the span once (`l2_next_args` makes
        every chunk a multiple of 16 bytes from a 16-byte aligned start). One lane a warp: sm90
        issues the prefetch from uniform registers, once per distinct address among a warp's
        lanes. Nothing waits on it (a hint: L2 is coherent, and no kernel in the stream writes
        weights)."""
        S: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
        t = tl.arange(0, NT)
        start = (tl.program_id(0).to(tl.int64) * (NT // 32) + t // 32) * chunk
        size = tl.where(t % 32 == 0, tl.minimum(tl.maximum(count - start, 0), chunk) * S, 0)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r", [ptr + start, size.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _rsq_parts(rsq_ptr, rsq_count, RSQ_N: tl.constexpr):
        """RSQ's `rsq_count` partial sums of h^2 (float32), zero-padded to RSQ_N."""
        parts = tl.arange(0, RSQ_N)
        return tl.load(rsq_ptr + parts, mask=parts < rsq_count, other=0.0)

    @triton.jit(do_not_specialize=["stride_wn", "stride_sn", "stride_zn", "up_rows"],
                do_not_specialize_on_alignment=["w_ptr", "s_ptr", "z_ptr"])
    def _w4_gemv1_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, N, n_words, stride_wn, stride_sn, stride_zn,
                         FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
                         PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, EVEN: tl.constexpr,
                         AHEAD: tl.constexpr = False, HALF2: tl.constexpr = False,
                         r_ptr=None, nw_ptr=None, rout_ptr=None, up_rows=0, eps=0.0, NORM: tl.constexpr = False,
                         HAS_RES: tl.constexpr = False, GATED: tl.constexpr = False, SW: tl.constexpr = 0,
                         SS: tl.constexpr = 0, SZ: tl.constexpr = 0, DW: tl.constexpr = 1,
                         CHAIN: tl.constexpr = False, xk_ptr=None, XPACK: tl.constexpr = False,
                         PNORM: tl.constexpr = False, er_ptr=None, erout_ptr=None, enw_ptr=None, ek_ptr=None,
                         EPI: tl.constexpr = False, EODD16: tl.constexpr = False, esq_ptr=None,
                         EPI_ROW: tl.constexpr = False, rsq_ptr=None, rsq_count=0, RSQ: tl.constexpr = False,
                         RSQ_N: tl.constexpr = 1, L2D: tl.constexpr = 0, STAGES: tl.constexpr = None,
                         WCACHE: tl.constexpr = "", SPF: tl.constexpr = False, PF1: tl.constexpr = False,
                         EARLY: tl.constexpr = False, L2N: tl.constexpr = 0, l2a_ptr=None, l2a_count=0, l2a_chunk=0,
                         l2b_ptr=None, l2b_count=0, l2b_chunk=0, FOLD: tl.constexpr = False):
        """Program p owns rows p BLOCK_N.. of y; a [BLOCK_N, BLOCK_W, 8] tile a step, one word
        per thread per row, its 8 x values one 16-byte load shared by the rows. The weight,
        scale and zero-point pointers and the row strides are not specialized on alignment,
        which keeps the word loads one word per thread along the row, the layout x's tile has:
        aligned, they would be vectorized and converted through shared memory every step.
        SW, SS, SZ (> 0: the row strides of the words, scales and zero points as compile-time
        constants, for the even loop with the words ahead of the `FIXED_STRIDES` formats):
        each row's load is one instruction at an immediate offset from one pointer, where
        runtime strides cost a 64-bit address sum a row and step (~0.4 instructions a weight).
        Without the words ahead the compiler then spreads the word loads through the step,
        each waited for in turn (slower on the H200), hence runtime strides there. SS, SZ
        alone (SW = 0; even tiles of the `FIXED_SCALE_STRIDES` formats): the scale and
        zero-point loads at immediate offsets, the words' strides at runtime. AHEAD
        (tiles that fit evenly only): the next step's words are loaded before this step's are
        used, two word tiles in flight per thread, and the first before waiting for the kernel
        in front (PDL: the weights do not depend on it).
        HALF2 (NVIDIA only: inline PTX): a word's products in fp16 pairs (`_h2_dot`), x of each
        word column scaled by a power of two that puts its largest |x| in [2^14, 2^15) so that
        the fp16 products keep 11 bits.
        NORM: x is the RMSNorm of x (+ the residual at r_ptr, rounded to x's dtype as the
        unfused add is; program 0 writes the sum to rout_ptr) with the weight at nw_ptr: each
        program sums the squares of the x it reads anyway and scales its dot products by the
        row's 1 / rms at the end. GATED: rows n and up_rows + n of a [gate | up] weight, and
        y = silu(gate) up (each rounded to x's dtype first, as the unfused product writes them).
        DW = 2 (even tiles only; the launcher checks that the words pair up): each thread reads
        two adjacent words of a row as one 8-byte load (an int64 split into its two int32
        halves), so a load and a row's address sum and scale load serve 16 weights instead
        of 8; x's 16 columns are two 16-byte loads. CHAIN (HALF2, DW = 2): both words of a
        load in one fp16 chain (`_word_sums2`). FMT 2: MXFP4 pair words (`fp4_pairs`), their
        own PTX with HALF2, put back in the checkpoint's layout (`w4_gemm._pair_word_std`) without.
        XPACK (not CHAIN, NORM or GATED): x's word columns come prepared at xk_ptr (`h2_xpack`:
        what each HALF2 program would compute from x, computed once), x_ptr unread; without
        HALF2 (the interpreter) the float32 loop runs on the values they stand for;
        PNORM: those columns are of h w for an RMSNorm (weight w) and carry their sum of h^2
        (`h2_xpack.store_added_prepared`): y is scaled by the row's 1 / rms at the end, as NORM.
        EPI (BLOCK_N a multiple of 8): instead of y, h = y + the residual at er_ptr (rounded as the
        unfused product and add round them) is stored to erout_ptr and prepared at ek_ptr for a
        PNORM loop with the next RMSNorm's weight at enw_ptr (EODD16: for int4); y_ptr is unread.
        EPI_ROW: the same h stored to erout_ptr, and h w (w at enw_ptr) in x's dtype to ek_ptr, a
        plain row for the next product, with the program's sum of h^2 at esq_ptr[program]; RSQ:
        x is such a row, and y (GATED: the gate and up rows' products) is scaled by the row's
        1 / rms from the `rsq_count` sums at rsq_ptr (RSQ_N: a power of two at least rsq_count),
        as NORM scales it.
        L2D > 0 (even tiles, not GATED; NVIDIA only: inline PTX): each step first asks L2 for
        the word, scale (and, where lanes are left, zero-point) lines of the step L2D ahead
        (`_prefetch_step`), so that more of the weight stream is in flight than the registers
        hold and the step's own loads find L2. STAGES (not AHEAD): the loop pipelined by
        Triton into that many stages, its loads as asynchronous copies into shared memory.
        WCACHE: the word loads' cache modifier (".cg": L2 only, so that the weight stream, read
        once, does not evict x and the scales from L1; "": the default). SPF (NVIDIA only): the
        program's whole scale (and zero-point) rows asked of L2 before the PDL wait (a few lines
        a row; `_prefetch_rows`), so that no step waits for them from memory. PF1: L2D's and
        SPF's scale and zero-point lines into L1 as well, where each step's loads of them find
        them (with WCACHE ".cg" the word stream does not evict them). EARLY: what the end of the
        kernel reads, read before the loop instead of after it: RSQ's partial sums of h^2 loaded
        right after the PDL wait (summed at the end), and with EPI_ROW and SPF the epilogue's norm
        weight line asked of L2 before the wait and its residual line after it. L2N (1 or 2; NVIDIA
        sm90: inline PTX): after its loop each warp asks L2 for its share of the next products'
        weights, elements [0, l2a_count) from l2a_ptr (and from l2b_ptr), `_bulk_prefetch_l2`'s
        chunks, so that they stream while the epilogue and the kernels after this one run. None of
        these changes the arithmetic. FOLD (FMT 2, HALF2; the launcher's `FOLD_PAIR_SCALES`): each
        chain's unscaling and E8M0 scale as one float (`_h2_part`), exact for scale bytes in
        `fp4_pairs.FOLD_SCALES` only."""
        act = x_ptr.dtype.element_ty
        tl.static_assert(not XPACK or (not CHAIN and not NORM and not GATED),
                         "prepared x (XPACK) feeds the products of a plain one-row GEMV")
        tl.static_assert(not PNORM or XPACK, "PNORM reads prepared columns (XPACK)")
        tl.static_assert(not EPI or (BLOCK_N % 8 == 0 and not GATED), "EPI prepares whole word columns of y")
        tl.static_assert(not (EPI_ROW or RSQ) or (not (EPI or NORM or PNORM) and not (EPI_ROW and GATED)),
                         "EPI_ROW / RSQ: the add and norm split around one-row products (RSQ's may be gated)")
        tl.static_assert(DW == 1 or EVEN, "two words a thread (DW = 2) run even tiles only")
        tl.static_assert(not CHAIN or (DW == 2 and HALF2), "CHAIN chains a word pair's HALF2 products (DW = 2)")
        tl.static_assert(L2D == 0 or (EVEN and not GATED and BLOCK_N * (DW + 1) <= 32),
                         "L2D prefetches even tiles' word and scale lines, a lane each")
        tl.static_assert(STAGES is None or not AHEAD, "STAGES pipelines the loads that AHEAD would carry")
        # each row stride a compile-time constant where the launcher gave one (`w4_gemv1_launch`),
        # else the runtime argument; the words' in loads (DW words)
        if SW > 0:
            stride_w = SW // DW
        else:
            stride_w = stride_wn // DW
        if SS > 0:
            stride_s = SS
            stride_z = SZ
        else:
            stride_s = stride_sn
            stride_z = stride_zn
        STEP: tl.constexpr = BLOCK_W * DW  # words a row a step
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        j2 = tl.arange(0, BLOCK_W)[None, :]
        js = j2[:, :, None]
        es = tl.arange(0, 8)[None, None, :]
        if DW == 2:
            w_base = w_ptr.to(tl.pointer_type(tl.int64))
        else:
            w_base = w_ptr
        wp = w_base + rows.to(tl.int64)[:, None] * stride_w + j2  # [BLOCK_N, BLOCK_W]
        s_row = s_ptr + rows.to(tl.int64)[:, None] * stride_s
        z_row = z_ptr + rows.to(tl.int64)[:, None] * stride_z
        sp = s_row + (j2 * 8 * DW) // GROUP
        zp = z_row + (j2 * 8 * DW) // GROUP
        # GATED: the up rows' words, scales and zero points are these pointers plus a row offset
        w_up = up_rows.to(tl.int64) * stride_w
        s_up = up_rows.to(tl.int64) * stride_s
        z_up = up_rows.to(tl.int64) * stride_z
        wpu = wp + w_up  # GATED: the up rows' pointers, advanced with the gate rows' (no sum a step)
        spu = sp + s_up
        zpu = zp + z_up
        # groups that tile a step advance the scale pointers by a constant; others (e.g. 96, or
        # channel-wise groups wider than a step) index each word's group
        GROUP_STEPS: tl.constexpr = (STEP * 8) % GROUP == 0
        xp = x_ptr + js * (8 * DW) + es
        if XPACK:  # 8 int32 a word column, as x has 8 values: 4 pairs, e, sum x (, sum h^2 with PNORM)
            NM: tl.constexpr = 4 if PNORM else 2
            xkp = xk_ptr + js * (8 * DW) + tl.arange(0, 4)[None, None, :]
            xkm = xk_ptr + js * (8 * DW) + 4 + tl.arange(0, NM)[None, None, :]
            psq = tl.zeros([1, BLOCK_W], tl.float32)
        acc = tl.zeros([BLOCK_N, BLOCK_W, 1], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_W, 1], tl.float32)
        sq = tl.zeros([1, BLOCK_W, 8], tl.float32)
        if AHEAD:
            word_next = tl.load(wp, cache_modifier=WCACHE)
            if GATED:
                up_next = tl.load(wpu, cache_modifier=WCACHE)
        if SPF:  # the scale rows are weights: no kernel in the stream writes them
            row0 = tl.program_id(0) * BLOCK_N
            n_rows = tl.minimum(N - row0, BLOCK_N)
            n_groups = (n_words * 8 + GROUP - 1) // GROUP
            _prefetch_rows(s_ptr, row0, n_rows, stride_s, n_groups, BLOCK_W, PF1)
            if HAS_ZP:
                _prefetch_rows(z_ptr, row0, n_rows, stride_z, n_groups, BLOCK_W, PF1)
            if GATED:
                _prefetch_rows(s_ptr, row0 + up_rows, n_rows, stride_s, n_groups, BLOCK_W, PF1)
                if HAS_ZP:
                    _prefetch_rows(z_ptr, row0 + up_rows, n_rows, stride_z, n_groups, BLOCK_W, PF1)
        if EARLY and EPI_ROW and SPF:  # the norm weight's line (a weight: no kernel in the stream writes it)
            first = tl.arange(0, BLOCK_W) == 0  # one thread: a program's BLOCK_N weights share a line
            _prefetch_at(enw_ptr, tl.program_id(0) * BLOCK_N, enw_ptr.dtype.element_ty.primitive_bitwidth // 8, 0,
                         first, False)
        pdl_start(PDL)
        if EARLY and EPI_ROW and SPF:  # the residual's line, written by a kernel before this one
            _prefetch_at(er_ptr, tl.program_id(0) * BLOCK_N, er_ptr.dtype.element_ty.primitive_bitwidth // 8, 0,
                         first, False)
        if EARLY and RSQ:  # the product in front wrote them: after the wait, held through the loop
            rsq_parts = _rsq_parts(rsq_ptr, rsq_count, RSQ_N)
        if L2D > 0:  # the steps before the loop's first prefetch reaches
            for d in tl.static_range(1, L2D):
                _prefetch_step(w_ptr, s_ptr, z_ptr, tl.program_id(0) * BLOCK_N, d * STEP, n_words, stride_w * DW,
                               stride_s, stride_z, GROUP, HAS_ZP, BLOCK_N, BLOCK_W, DW, PF1)
        for w0 in tl.range(0, n_words, STEP, num_stages=STAGES):
            if L2D > 0:
                _prefetch_step(w_ptr, s_ptr, z_ptr, tl.program_id(0) * BLOCK_N, w0 + L2D * STEP, n_words,
                               stride_w * DW, stride_s, stride_z, GROUP, HAS_ZP, BLOCK_N, BLOCK_W, DW, PF1)
            if not GROUP_STEPS:
                sp = s_row + ((w0 + j2 * DW) * 8) // GROUP
                zp = z_row + ((w0 + j2 * DW) * 8) // GROUP
                spu = sp + s_up
                zpu = zp + z_up
            ok = (rows < N)[:, None] & (w0 + j2 < n_words)  # [BLOCK_N, BLOCK_W] (unused when EVEN)
            x_ok = (w0 + js * DW < n_words) & (es < 8)
            if XPACK:
                x_ok4 = (w0 + js * DW < n_words) & (tl.arange(0, 4)[None, None, :] < 4)
                x_okm = (w0 + js * DW < n_words) & (tl.arange(0, NM)[None, None, :] < NM)
            if EVEN:
                if AHEAD:
                    word = word_next[:, :, None]
                    if GATED:
                        word_up = up_next[:, :, None]
                    if SW == STEP:
                        pass  # rows of one step (an even tile whose row stride is the step): none ahead
                    elif SW > 0:
                        # the next step's words; the last step reloads the first step's (in bounds,
                        # unused): a scalar select in place of a mask a thread (with runtime strides
                        # the moved pointer costs an address sum a row, slower than the mask)
                        nxt = tl.where(w0 + STEP < n_words, BLOCK_W, -(w0 // DW))
                        word_next = tl.load(wp + nxt, cache_modifier=WCACHE)
                        if GATED:
                            up_next = tl.load(wpu + nxt, cache_modifier=WCACHE)
                    else:
                        more = w0 + STEP + j2 * DW < n_words
                        word_next = tl.load(wp + BLOCK_W, mask=more, other=0, cache_modifier=WCACHE)
                        if GATED:
                            up_next = tl.load(wpu + BLOCK_W, mask=more, other=0, cache_modifier=WCACHE)
                else:
                    word = tl.load(wp, cache_modifier=WCACHE)[:, :, None]
                    if GATED:
                        word_up = tl.load(wpu, cache_modifier=WCACHE)[:, :, None]
                s_raw = _load_t(sp)[:, :, None]
                if GATED:
                    s_raw_up = _load_t(spu)[:, :, None]
            else:
                word = tl.load(wp, mask=ok, other=0, cache_modifier=WCACHE)[:, :, None]
                s_raw = _load_t(sp, ok, 0)[:, :, None]
                if GATED:
                    word_up = tl.load(wpu, mask=ok, other=0, cache_modifier=WCACHE)[:, :, None]
                    s_raw_up = _load_t(spu, ok, 0)[:, :, None]
            if CHAIN:  # both words of the load in one fp16 chain (EVEN: DW = 2 runs even tiles only)
                xa = tl.load(xp).to(tl.float32)
                xb = tl.load(xp + 8).to(tl.float32)
                if NORM:
                    xo = w0 * 8 + js * 16 + es
                    xa, sq = add_norm_cols(xa, xo, None, r_ptr, nw_ptr, rout_ptr, sq, act, HAS_RES)  # CHAIN: EVEN
                    xb, sq = add_norm_cols(xb, xo + 8, None, r_ptr, nw_ptr, rout_ptr, sq, act, HAS_RES)
                acc += _word_sums2(word, s_raw, zp, ok, xa, xb, es, FMT, HAS_ZP, EVEN, BLOCK_N, BLOCK_W, FOLD)
                if GATED:
                    acc_up += _word_sums2(word_up, s_raw_up, zpu, ok, xa, xb, es, FMT, HAS_ZP, EVEN, BLOCK_N,
                                          BLOCK_W, FOLD)
            else:
                for h in tl.static_range(DW):  # the words of a load: columns h 8 .. h 8 + 7 of each thread's 8 DW
                    if XPACK:  # the pairs [1, BLOCK_W, 4] and (e, sum x[, sum h^2, unused]) of each column
                        if EVEN:
                            pairs = tl.load(xkp + h * 8)
                            meta = tl.load(xkm + h * 8)
                        else:
                            pairs = tl.load(xkp + h * 8, mask=x_ok4, other=0)
                            meta = tl.load(xkm + h * 8, mask=x_okm, other=0)
                        if PNORM:
                            ma, mb = tl.split(tl.reshape(meta, [1, BLOCK_W, 2, 2]))  # (e, sum h^2), (sum x, -)
                            e, hsq = tl.split(ma)
                            sx, _ = tl.split(mb)
                            psq += hsq.to(tl.float32, bitcast=True)
                        else:
                            e, sx = tl.split(meta)
                        if HALF2:
                            acc += _word_sums_packed(_half(word, h, DW), s_raw, zp, ok, pairs, e, sx, FMT, HAS_ZP,
                                                     EVEN, BLOCK_N, BLOCK_W, FOLD)
                        else:  # the float32 loop on the values the columns stand for
                            acc += _word_sums(_half(word, h, DW), s_raw, zp, ok, unpack_cols(pairs, e, FMT == 0, BLOCK_W),
                                              es, FMT, False, HAS_ZP, EVEN, BLOCK_N, BLOCK_W)
                    else:
                        if EVEN:
                            xv = tl.load(xp + h * 8).to(tl.float32)
                        else:
                            xv = tl.load(xp, mask=x_ok, other=0.0).to(tl.float32)
                        if NORM:
                            xo = w0 * 8 + js * (8 * DW) + h * 8 + es  # x's columns, for the residual and the norm weight
                            if EVEN:  # every column in the row: loads without a mask (no compare and predicate a step)
                                xv, sq = add_norm_cols(xv, xo, None, r_ptr, nw_ptr, rout_ptr, sq, act, HAS_RES)
                            else:
                                xv, sq = add_norm_cols(xv, xo, x_ok, r_ptr, nw_ptr, rout_ptr, sq, act, HAS_RES)
                        acc += _word_sums(_half(word, h, DW), s_raw, zp, ok, xv, es, FMT, HALF2, HAS_ZP, EVEN, BLOCK_N,
                                          BLOCK_W, FOLD)
                        if GATED:
                            acc_up += _word_sums(_half(word_up, h, DW), s_raw_up, zpu, ok, xv, es, FMT, HALF2, HAS_ZP,
                                                 EVEN, BLOCK_N, BLOCK_W, FOLD)
            wp += BLOCK_W
            if GATED:
                wpu += BLOCK_W
            xp += STEP * 8
            if XPACK:
                xkp += STEP * 8
                xkm += STEP * 8
            if GROUP_STEPS:
                sp += (STEP * 8) // GROUP
                zp += (STEP * 8) // GROUP
                if GATED:
                    spu += (STEP * 8) // GROUP
                    zpu += (STEP * 8) // GROUP
        if L2N > 0:  # the next products' weights into L2 while this program's epilogue and the kernels after run
            _bulk_prefetch_l2(l2a_ptr, l2a_count, l2a_chunk, BLOCK_W)
            if L2N > 1:
                _bulk_prefetch_l2(l2b_ptr, l2b_count, l2b_chunk, BLOCK_W)
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
        if NORM or PNORM or RSQ:  # the row's 1 / rms scales every dot product
            if NORM:  # from the sums of h^2 the loop made
                ssq = tl.sum(tl.sum(tl.sum(sq, axis=2), axis=1), axis=0)
            elif PNORM:  # from the prepared columns' sums of h^2
                ssq = tl.sum(tl.sum(psq, axis=1), axis=0)
            else:  # from the sums of h^2 of the product in front (EPI_ROW), loaded here or before the loop
                if not EARLY:
                    rsq_parts = _rsq_parts(rsq_ptr, rsq_count, RSQ_N)
                ssq = tl.sum(rsq_parts, axis=0)
            rstd = 1.0 / tl.sqrt(ssq / (n_words * 8) + eps)
            y = y * rstd
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        if GATED:
            y_up = tl.sum(tl.sum(acc_up, axis=2), axis=1)
            if NORM or RSQ:
                y_up = y_up * rstd
            g = y.to(act).to(tl.float32)
            y = g / (1.0 + tl.exp(-g)) * y_up.to(act).to(tl.float32)
        if EPI:  # y itself is not read: only h = y + residual and h's prepared columns are stored
            store_added_prepared(y, rows, N, er_ptr, erout_ptr, enw_ptr, ek_ptr, act, EODD16, BLOCK_N, HALF2)
        elif EPI_ROW:
            store_added_row(y, rows, N, er_ptr, erout_ptr, enw_ptr, ek_ptr, esq_ptr, act)
        else:
            tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


def pairs_words(words: torch.Tensor, block_n: int, block_w: int, group: int) -> bool:
    """Whether the kernel's two-words-a-thread loads (DW = 2) apply: even tiles of 2 BLOCK_W
    words a step, 8-byte aligned rows (an even row stride and an aligned start), and groups of
    whole word pairs (16 columns)."""
    n, n_words = words.shape
    return (n % block_n == 0 and n_words > 0 and n_words % (2 * block_w) == 0 and words.stride(0) % 2 == 0
            and words.stride(1) == 1 and words.data_ptr() % 8 == 0 and group % 16 == 0)


def w4_gemv1_launch(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, z: torch.Tensor,
                    bias, y: torch.Tensor, fmt_id: int, group: int, cfg: dict, common: dict,
                    norm: dict | None = None, gated: bool = False, l2_next=()) -> None:
    """Runs `_w4_gemv1_kernel` into y [1, N]: `words` int32 [N, K/8] (MXFP4's bytes viewed as
    int32), `z` the zero points or any tensor, cfg: BLOCK_N, BLOCK_W, num_warps, num_stages and
    the kernel's tile options (AHEAD, HALF2, DW, CHAIN, L2D, STAGES, WCACHE, SPF, PF1; FOLD, by
    default `FOLD_PAIR_SCALES` for pair words) and launch options (maxnreg).
    `norm`: the kernel's NORM arguments (r_ptr, nw_ptr, rout_ptr, eps, HAS_RES); `gated`: words
    of a [gate | up] weight of 2N rows, y = silu(gate) up. `l2_next`: up to two (tensor, bytes)
    regions of the next products' weights the warps ask L2 for after their loop (L2N,
    `l2_next_args`; sm90 only)."""
    from atom.model_ops.kernels.w4_gemm import FORMATS
    cfg = dict(cfg)
    if gated:
        cfg.update(GATED=True, up_rows=words.shape[0] // 2)
        words = words[:words.shape[0] // 2]  # the gate rows: the grid and the masks; up rows at up_rows
    if norm is not None:
        cfg.update(NORM=True, **norm)
    if cfg.get("FOLD") and FORMATS[fmt_id] != "mxfp4_pairs":
        raise ValueError(f"w4_linear: FOLD folds MXFP4 pair words' E8M0 scales (fmt 'mxfp4_pairs'), "
                         f"not fmt {FORMATS[fmt_id]!r}: {cfg}")
    cfg.setdefault("FOLD", fold_default(FORMATS[fmt_id]))
    if cfg.get("HALF2") and not half2_applies(x, fmt_id):
        cfg["HALF2"] = False  # the float32 products: fp32 activations, or not an NVIDIA GPU (the interpreter)
    N, n_words = words.shape
    if cfg["BLOCK_W"] != 32 * cfg["num_warps"]:
        raise ValueError(f"w4_linear: the one-row GEMV needs BLOCK_W={cfg['BLOCK_W']} = 32 x num_warps "
                         f"({cfg['num_warps']})")
    if cfg.get("DW", 1) == 2 and not pairs_words(words, cfg["BLOCK_N"], cfg["BLOCK_W"], group):
        cfg["DW"] = 1  # words that do not pair into aligned 8-byte loads over even tiles
    if cfg.get("CHAIN") and not (cfg.get("HALF2") and cfg.get("DW", 1) == 2):
        cfg["CHAIN"] = False  # the chain is of a word pair's fp16 products
    if cfg.get("FOLD") and not cfg.get("HALF2"):
        cfg["FOLD"] = False  # the fold is of the fp16 chains' scale multiply
    if cfg.get("STAGES") and cfg.get("AHEAD"):
        raise ValueError("w4_linear: a one-row GEMV tile pipelines its loads (STAGES) or carries them (AHEAD), "
                         f"not both: {cfg}")
    if cfg.get("PF1") and not (cfg.get("SPF") or cfg.get("L2D")):
        raise ValueError(f"w4_linear: PF1 sends SPF's and L2D's scale prefetches into L1 too; neither is on: {cfg}")
    if cfg.get("L2D") and cfg["BLOCK_N"] * (cfg.get("DW", 1) + 1) > 32:
        raise ValueError(f"w4_linear: L2D prefetches a line a lane, BLOCK_N x (DW + 1) <= 32 of them: {cfg}")
    even = N % cfg["BLOCK_N"] == 0 and n_words % (cfg["BLOCK_W"] * cfg.get("DW", 1)) == 0 and n_words > 0
    if cfg.get("L2D") and not (even and not gated and ptx_applies(x)):
        cfg["L2D"] = 0  # the prefetch is inline PTX (NVIDIA, compiled) for even, plain tiles
    if cfg.get("SPF") and not ptx_applies(x):
        cfg["SPF"] = False  # inline PTX too
    if l2_next:  # the regions checked wherever it runs; the bulk prefetch is sm90 PTX, without it the same product
        l2 = l2_next_args(l2_next, triton.cdiv(N, cfg["BLOCK_N"]), cfg["num_warps"])
        if _sm90(x):
            cfg.update(l2)
    if torch.version.hip is not None:
        cfg.pop("maxnreg", None)  # an option of Triton's NVIDIA backend only
    if not even:
        cfg.pop("AHEAD", None)  # the masked loop loads one step at a time
    else:
        cfg.update(stride_constants(FORMATS[fmt_id], bool(cfg.get("AHEAD")), words.stride(0), scales.stride(0),
                                    z.stride(0)))
    pdl = {k_: v for k_, v in common.items() if k_ in ("PDL", "launch_pdl")}
    b = bias if bias is not None else y
    grid = (triton.cdiv(N, cfg["BLOCK_N"]),)
    _w4_gemv1_kernel[grid](x, words, scales, z, b, y, N, n_words, words.stride(0), scales.stride(0), z.stride(0),
                           FMT=fmt_id, GROUP=group, HAS_ZP=common["HAS_ZP"], HAS_BIAS=bias is not None,
                           EVEN=even, **pdl, **cfg)


def l2_next_args(regions, programs: int, warps: int) -> dict:
    """The kernel's L2N arguments for up to two regions, each (tensor, bytes): the tensor's
    first `bytes` bytes (at most all of it, down to a multiple of 16) asked of L2 by a grid of
    `programs` x `warps`, each warp one 16-byte-multiple chunk (`_bulk_prefetch_l2`). Regions
    that are empty, strided or not 16-byte aligned are left out; {} when none is left."""
    out, names = {}, ("l2a", "l2b")
    if len(regions) > len(names):
        raise ValueError(f"l2_next_args: at most {len(names)} regions, got {len(regions)}")
    regions = [(t, n) for t, n in regions if t.numel() and t.data_ptr() % 16 == 0 and t.is_contiguous()]
    for name, (t, nbytes) in zip(names, regions):
        size = t.element_size()
        count = (min(int(nbytes), t.numel() * size) // 16 * 16) // size
        if count == 0:
            continue
        per = 16 // size  # elements of 16 bytes
        chunk = -(-count // (programs * warps * per)) * per
        if chunk * size >= 2 ** 31:  # the kernel's size operand is an int32
            raise ValueError(f"l2_next_args: {chunk * size} bytes a warp ({count * size} over {programs} x {warps} "
                             "warps) do not fit the prefetch's 32-bit size: more programs or warps")
        out.update({f"{name}_ptr": t, f"{name}_count": count, f"{name}_chunk": chunk})
    n = sum(1 for name in names if f"{name}_ptr" in out)
    if n == 1 and "l2a_ptr" not in out:  # the one region left goes first
        out = {k.replace("l2b", "l2a"): v for k, v in out.items()}
    return dict(out, L2N=n) if n else {}


def _layer_args(packed: torch.Tensor, scales: torch.Tensor, zeros, fmt: str) -> tuple:
    """(words, the zero-point argument, format id) of a 4-bit layer, as `w4_gemv1_launch` takes them."""
    from atom.model_ops.kernels.w4_gemm import FORMATS
    return (packed if fmt == "int4" else packed.view(torch.int32), zeros if zeros is not None else scales,
            FORMATS.index(fmt))


def w4_gemv1_fused(x: torch.Tensor, residual, norm_weight: torch.Tensor, eps: float, packed: torch.Tensor,
                   scales: torch.Tensor, zeros, fmt: str, group: int, k: int, gated: bool = False,
                   cfg: dict | None = None, l2_next=()):
    """One row: `h, res = rmsnorm(x + residual)` (no add when `residual` is None: `res` is x),
    then `y = h W^T` for a 4-bit weight (`w4_gemm`'s layouts), or `silu(y[:I]) * y[I:]` for a
    [gate | up] weight of 2I rows when `gated`, in one launch of the one-row GEMV. h is not
    rounded to x's dtype before the product (the unfused layers round it). `cfg`: the tile
    (`tiles`' keys; default `fused_tiles`). `l2_next`: weight regions asked of L2 after the loop
    (`w4_gemv1_launch`). Returns (y [1, N or I], res [1, K])."""
    from atom.model_ops.kernels.triton_import import pdl_args
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != k:
        raise ValueError(f"w4_gemv1_fused: x must be one row of {k} values, got {tuple(x.shape)}")
    if norm_weight.shape != (k,):
        raise ValueError(f"w4_gemv1_fused: norm weight shape {tuple(norm_weight.shape)} != ({k},)")
    require_supported("w4_gemv1_fused", fmt, group, k)
    if gated and packed.shape[0] % 2:
        raise ValueError(f"w4_gemv1_fused: a gated product needs an even number of rows, got {packed.shape[0]}")
    x = x.contiguous()
    if residual is None:
        r, rout = x, x
    else:
        if residual.numel() != k:
            raise ValueError(f"w4_gemv1_fused: residual has {residual.numel()} values, x has {k}")
        r, rout = residual.reshape(1, k).contiguous(), torch.empty_like(x)
    n = packed.shape[0] // 2 if gated else packed.shape[0]
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    words, z, fmt_id = _layer_args(packed, scales, zeros, fmt)
    common = dict(HAS_ZP=zeros is not None, **pdl_args(x))
    norm = dict(r_ptr=r, nw_ptr=norm_weight, rout_ptr=rout, eps=float(eps), HAS_RES=residual is not None)
    w4_gemv1_launch(x, words, scales, z, None, y, fmt_id, group, cfg if cfg is not None else fused_tiles(gated),
                    common, norm=norm, gated=gated, l2_next=l2_next)
    return y, rout.view(1, k)


def w4_gemv1_prepared(prep, packed: torch.Tensor, scales: torch.Tensor, zeros, fmt: str, group: int, k: int,
                      cfg: dict | None = None) -> torch.Tensor:
    """y = x W^T [1, N] in x's dtype for a row x prepared by the kernel in front (`h2_xpack`:
    `PreparedRow`), a 4-bit weight (`w4_gemm`'s layouts): the HALF2 loop reading the prepared
    columns (XPACK) instead of scaling and packing x in every program (16-bit rows on NVIDIA
    GPUs; elsewhere, under the interpreter, the float32 loop on the values the columns stand
    for, x at fp16's 11 bits). `cfg`: the tile (`tiles`' keys; default `tiles`' for the shape,
    CHAIN off)."""
    from atom.model_ops.kernels.triton_import import pdl_args
    if prep.k != k or prep.odd16 != (fmt == "int4"):
        raise ValueError(f"w4_gemv1_prepared: a row of {prep.k} values prepared with odd16={prep.odd16} for a "
                         f"{fmt} product of K={k} (odd16 is int4's)")
    require_supported("w4_gemv1_prepared", fmt, group, k)
    n = packed.shape[0]
    y = torch.empty(1, n, dtype=prep.dtype, device=prep.cols.device)
    words, z, fmt_id = _layer_args(packed, scales, zeros, fmt)
    cfg = dict(cfg if cfg is not None else tiles(n, fmt, k), HALF2=True, CHAIN=False, XPACK=True, xk_ptr=prep.cols)
    if prep.eps is not None:  # columns of h w with their sums of h^2: the loop applies 1 / rms
        cfg.update(PNORM=True, eps=float(prep.eps))
    w4_gemv1_launch(y, words, scales, z, None, y, fmt_id, group, cfg, dict(HAS_ZP=zeros is not None, **pdl_args(y)))
    return y


def w4_gemv1_add_prepared(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros, fmt: str, group: int,
                          k: int, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, odd16: bool,
                          cfg: dict | None = None):
    """One row: y = x W^T for a 4-bit weight, then h = y + residual (rounded as the unfused
    product and add round them) and the next RMSNorm's input prepared from h in the product's
    epilogue (EPI, `h2_xpack.store_added_prepared`) instead of a norm kernel: returns
    (PreparedRow of h w with eps, for `w4_gemv1_prepared`; h [1, N], the new residual). The
    tile's BLOCK_N must be a multiple of 8 that divides N (`add_prepared_applies`)."""
    from atom.model_ops.kernels.h2_xpack import PreparedRow
    n = packed.shape[0]
    cfg = dict(cfg if cfg is not None else tiles(n, fmt, k))
    if x.dim() != 2 or x.shape != (1, k) or not add_prepared_applies(n, cfg) or residual.numel() != n \
            or norm_weight.shape != (n,):
        raise ValueError(f"w4_gemv1_add_prepared: one row of {k}, a residual and norm weight of {n} and a tile of "
                         f"whole word columns (BLOCK_N a multiple of 8 dividing N), got x {tuple(x.shape)}, residual "
                         f"{residual.numel()}, norm weight {tuple(norm_weight.shape)}, BLOCK_N {cfg['BLOCK_N']}")
    require_supported("w4_gemv1_add_prepared", fmt, group, k)
    cols = torch.empty(n // 8, 8, dtype=torch.int32, device=x.device)
    rout = _launch_added(x, packed, scales, zeros, fmt, group, residual, norm_weight, cfg,
                         EPI=True, EODD16=odd16, ek_ptr=cols)
    return PreparedRow(cols, n, odd16, x.dtype, eps), rout


def add_prepared_applies(n: int, cfg: dict) -> bool:
    """Whether a tile's programs own whole word columns of an n-row output (EPI)."""
    return cfg["BLOCK_N"] % 8 == 0 and n % cfg["BLOCK_N"] == 0


def w4_gemv1_add_row(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros, fmt: str, group: int,
                     k: int, residual: torch.Tensor, norm_weight: torch.Tensor, cfg: dict | None = None, l2_next=()):
    """One row: y = x W^T for a 4-bit weight, then h = y + residual (rounded as the unfused
    product and add round them) and the next RMSNorm's input h w in x's dtype written in the
    product's epilogue (EPI_ROW, `rmsnorm.store_added_row`) with each program's sum of h^2,
    instead of an add + RMSNorm kernel. `l2_next`: weight regions asked of L2 after the loop
    (`w4_gemv1_launch`). Returns (h w [1, N] and the sums, for `w4_gemv1_rsq`; h [1, N], the
    new residual)."""
    n = packed.shape[0]
    cfg = dict(cfg if cfg is not None else tiles(n, fmt, k))
    if x.dim() != 2 or x.shape != (1, k) or residual.numel() != n or norm_weight.shape != (n,):
        raise ValueError(f"w4_gemv1_add_row: one row of {k}, a residual and norm weight of {n}, got x "
                         f"{tuple(x.shape)}, residual {residual.numel()}, norm weight {tuple(norm_weight.shape)}")
    require_supported("w4_gemv1_add_row", fmt, group, k)
    hw = torch.empty(1, n, dtype=x.dtype, device=x.device)
    sums = torch.empty(triton.cdiv(n, cfg["BLOCK_N"]), dtype=torch.float32, device=x.device)  # one a program
    rout = _launch_added(x, packed, scales, zeros, fmt, group, residual, norm_weight, cfg, l2_next,
                         EPI_ROW=True, ek_ptr=hw, esq_ptr=sums)
    return hw, sums, rout


def _launch_added(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros, fmt: str, group: int,
                  residual: torch.Tensor, norm_weight: torch.Tensor, cfg: dict, l2_next=(), **epilogue) -> torch.Tensor:
    """The one-row GEMV of x with an epilogue that adds the residual (`epilogue`: EPI or EPI_ROW
    and its outputs) for `w4_gemv1_add_prepared` / `w4_gemv1_add_row`, the inputs checked
    there. Returns h = y + residual [1, N], the new residual; y itself is not stored."""
    from atom.model_ops.kernels.triton_import import pdl_args
    n = packed.shape[0]
    x = x.contiguous()
    rout = torch.empty(1, n, dtype=x.dtype, device=x.device)
    words, z, fmt_id = _layer_args(packed, scales, zeros, fmt)
    cfg = dict(cfg, er_ptr=residual.reshape(1, n).contiguous(), erout_ptr=rout, enw_ptr=norm_weight, **epilogue)
    cfg.setdefault("EARLY", EARLY_EPILOGUE)
    w4_gemv1_launch(x, words, scales, z, None, rout, fmt_id, group, cfg,  # y_ptr: only its dtype is read
                    dict(HAS_ZP=zeros is not None, **pdl_args(x)), l2_next=l2_next)
    return rout


def w4_gemv1_rsq(hw: torch.Tensor, sums: torch.Tensor, eps: float, packed: torch.Tensor, scales: torch.Tensor,
                 zeros, fmt: str, group: int, k: int, cfg: dict | None = None, gated: bool = False,
                 l2_next=()) -> torch.Tensor:
    """y = RMSNorm(h) W^T [1, N] for the row h w and the sums of h^2 that `w4_gemv1_add_row`
    wrote (RSQ): the plain one-row GEMV on h w, its products scaled by 1 / rms at the end (h w
    rounded to x's dtype once, where the unfused norm rounds h / rms). `gated`: W is [gate | up]
    of 2I rows and y = silu(gate) up [1, I], each product rounded to x's dtype first as the
    unfused product writes them (SiLU-and-mul's arithmetic after); default tile `gated_tiles`.
    `l2_next`: weight regions asked of L2 after the loop (`w4_gemv1_launch`)."""
    from atom.model_ops.kernels.triton_import import pdl_args
    if hw.dim() != 2 or hw.shape != (1, k) or sums.dim() != 1 or sums.dtype != torch.float32:
        raise ValueError(f"w4_gemv1_rsq: a row of {k} and float32 sums, got {tuple(hw.shape)}, "
                         f"{tuple(sums.shape)} {sums.dtype}")
    require_supported("w4_gemv1_rsq", fmt, group, k)
    rows = packed.shape[0]
    if gated and rows % 2:
        raise ValueError(f"w4_gemv1_rsq: a gated product needs an even number of rows, got {rows}")
    n = rows // 2 if gated else rows
    y = torch.empty(1, n, dtype=hw.dtype, device=hw.device)
    words, z, fmt_id = _layer_args(packed, scales, zeros, fmt)
    if cfg is None:
        cfg = gated_tiles(rows, fmt, k) if gated else tiles(n, fmt, k)
    cfg = dict(cfg, RSQ=True, rsq_ptr=sums, rsq_count=sums.numel(), RSQ_N=triton.next_power_of_2(sums.numel()),
               eps=float(eps))
    cfg.setdefault("EARLY", EARLY_EPILOGUE)
    w4_gemv1_launch(hw, words, scales, z, None, y, fmt_id, group, cfg, dict(HAS_ZP=zeros is not None, **pdl_args(hw)),
                    gated=gated, l2_next=l2_next)
    return y
