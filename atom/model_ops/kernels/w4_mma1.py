"""The one-row int4 product on the tensor cores (batch-1 decode): y = x W^T (+ b) for one row x
[1, K] in bf16 and a symmetric int4 weight with groups of 128 columns or a multiple (W4A16 as
compressed-tensors' `pack-quantized` stores it: int32 words of 8 nibbles along K, nibble i at
bits 4i, value (u - 8) times the group's scale).

Why: the CUDA-core GEMV (`w4_gemv1`) spends ~3-3.6 instructions a weight (unpack, convert,
multiply-add) against the ~4 the H200 can issue per weight at its HBM rate, and stays near
2-2.7 TB/s. Here a weight costs its share of one `lop3` (two nibbles masked into the two bf16
halves of a register over 0x4300: 128 + u exactly), one `sub.bf16x2` (u - 8, exact) and a shift
every other pair, ~1.4 instructions, and the multiply-adds go to `mma.m16n8k16` (bf16 in, fp32
sums: every product exact): the weight rows are the MMA's 16 rows, x its first column.

Written in Gluon (Triton's layout-explicit dialect), because the trick is the layout: each lane
loads 4 adjacent words of each of its rows (16-byte loads; lane 4r + c owns rows r and r + 8,
and r + 16, r + 24 at 32 rows, words 4c..4c+3 of the warp's 16), dequantizes them in registers
into 8 bf16 values a word, and the MMA reads them where they are: the order of K inside a
warp's 128 columns is chosen (a permutation of its bits: the pair half, then the lane, then the
pair, then the word) so that the registers a lane holds are exactly its `mma` A fragment
(`convert_layout(..., assert_trivial=True)` checks it at compile time). x's 128 values go
through the same permutation into the B fragment: each lane loads the 32 contiguous x values
of its 4 words (x broadcast over the MMA's 8 columns; the output keeps one). Every warp of a
program owns its own 128 columns of K a step (a batched MMA, warps along the batch), the
partial sums of the warps are added once at the end.

Each warp's 128 columns lie in one scale group (GROUP % 128 == 0), so a step's MMA starts
from zero and its [rows] result is multiplied by the group's scales and added in fp32.
Rounding: exact products, fp32 sums (the MMA's, then the per-step and per-warp adds), the
output rounded to bf16: the torch reference's arithmetic up to the order of the fp32 sums.
NVIDIA sm80+ only (inline PTX, mma.sync); `supports` says which layers it runs.
"""
from __future__ import annotations

import os

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    HAS_GLUON = HAS_TRITON
except ImportError:  # pragma: no cover - Triton without Gluon
    gluon = gl = mma_v2 = None
    HAS_GLUON = False

#: K a warp covers a step: 4 lanes x 4 words x 8 nibbles
WARP_K = 128
#: the tile per layer shape (None: `w4_gemv1` stays faster there): ROWS weight rows a program
#: (16: one MMA tile; 32: two, sharing x's fragment), NW warps splitting K, REP 16-byte loads a
#: row and lane a step (each its own MMA), AHEAD: the next step's words loaded before this
#: one's are used. Layers of up to WIDE_N outputs from up to DEEP_K inputs ("narrow": Llama's
#: q/k/v and o), wider ("wide": gate-up), deeper ("deep": down)
TILES = {"narrow": dict(ROWS=16, NW=4, REP=4, AHEAD=True, num_warps=4),
         "wide": dict(ROWS=16, NW=4, REP=4, AHEAD=True, num_warps=4),
         "deep": dict(ROWS=16, NW=8, REP=2, AHEAD=True, num_warps=8)}
WIDE_N = 8192
DEEP_K = 8192
#: switch for A/B measurements: False keeps every layer on `w4_gemv1`
ENABLED = True


def tiles(n: int, k: int) -> dict | None:
    """The tile for a layer of n outputs from k inputs (None: not this kernel)."""
    cfg = TILES["wide" if n > WIDE_N else "deep" if k > DEEP_K else "narrow"]
    return dict(cfg) if cfg is not None else None


def supports(fmt: str, group: int, n: int, k: int, has_zeros: bool, x: torch.Tensor) -> bool:
    """Whether `_w4_mma1_kernel` runs this product of one bf16 row on this GPU: symmetric int4,
    groups of whole warp steps (128 columns or a multiple), rows that tile (16) and a K that
    tiles the table's warps, an NVIDIA GPU of sm80+ (mma.sync, bf16), not the interpreter."""
    if not (ENABLED and HAS_GLUON and fmt == "int4" and not has_zeros and x.dtype == torch.bfloat16
            and x.is_cuda and torch.version.hip is None):
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or torch.cuda.get_device_capability(x.device)[0] < 8:
        return False
    cfg = tiles(n, k)
    return cfg is not None and group % WARP_K == 0 and n % cfg["ROWS"] == 0 \
        and k % (WARP_K * cfg["NW"] * cfg.get("REP", 1)) == 0


if HAS_GLUON:
    #: one int32 word of 8 nibbles -> 8 bf16 values u - 8, as 4 registers of bf16 pairs:
    #: register p holds nibbles p (low half) and p + 4 (high half), each masked over 0x4300
    #: (128 + u, exact: bf16 steps by 1 in [128, 256)) and less 136 (0x4308), exact
    DEQUANT_PTX = gl.constexpr("""{
    .reg .b32 s, k;
    mov.b32 k, 0x43084308;
    lop3.b32 $0, $4, 0x000F000F, 0x43004300, 0xea;
    shr.u32 s, $4, 4;
    lop3.b32 $1, s, 0x000F000F, 0x43004300, 0xea;
    shr.u32 s, $4, 8;
    lop3.b32 $2, s, 0x000F000F, 0x43004300, 0xea;
    shr.u32 s, $4, 12;
    lop3.b32 $3, s, 0x000F000F, 0x43004300, 0xea;
    sub.rn.bf16x2 $0, $0, k;
    sub.rn.bf16x2 $1, $1, k;
    sub.rn.bf16x2 $2, $2, k;
    sub.rn.bf16x2 $3, $3, k;
    }""")

    @gluon.jit
    def _gdc_wait():
        """griddepcontrol.wait (PDL): every kernel before this one has finished."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)

    @gluon.jit
    def _gdc_launch():
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _a_operand(words, NW: gl.constexpr, ROWS: gl.constexpr, AL: gl.constexpr):
        """words [NW, ROWS, 16] int32 (lane c's 4 words at 4c..4c+3) -> the MMA's A [NW, ROWS, 128]
        bf16: each word broadcast over 8 values in registers (joins), dequantized (element
        2p + h: nibble p + 4h), and K reordered by its bits (lsb first: h, c0, c1, p0, p1, u0,
        u1 for word u of lane c) into the A fragment, a relabelling of registers."""
        w2 = gl.join(words, words)
        w4 = gl.join(w2, w2)
        # the 8 copies of a word in 8 consecutive registers: what the asm's pack of 8 takes
        W8L: gl.constexpr = gl.BlockedLayout([1, 1, 4, 8], [1, 8, 4, 1], [NW, 1, 1, 1], [3, 2, 1, 0])
        w8 = gl.convert_layout(gl.join(w4, w4).reshape([NW, ROWS, 16, 8]), W8L, assert_trivial=True)
        d = gl.inline_asm_elementwise(DEQUANT_PTX, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [w8], dtype=gl.bfloat16,
                                      is_pure=True, pack=8)
        d = d.reshape([NW, ROWS, 2, 2, 2, 2, 2, 2, 2])  # c1 c0 u1 u0 p1 p0 h
        d = d.permute([0, 1, 4, 5, 6, 7, 2, 3, 8])  # u1 u0 p1 p0 c1 c0 h
        return gl.convert_layout(d.reshape([NW, ROWS, 128]), AL, assert_trivial=True)

    @gluon.jit
    def _b_operand(xv, NW: gl.constexpr, BL: gl.constexpr):
        """x [NW, 8, 4, 32] (lane (n, c)'s 32 contiguous values: word u, nibble e = p + 4h) ->
        the MMA's B [NW, 128, 8] with `_a_operand`'s order of K."""
        xr = xv.reshape([NW, 8, 2, 2, 2, 2, 2, 2, 2])  # n c1 c0 u1 u0 h p1 p0
        xr = xr.permute([0, 4, 5, 7, 8, 2, 3, 6, 1])  # u1 u0 p1 p0 c1 c0 h n
        return gl.convert_layout(xr.reshape([NW, 128, 8]), BL, assert_trivial=True)

    @gluon.jit
    def _load_parts(p, STRIDE: gl.constexpr, REP: gl.constexpr):
        """REP loads of the pointer tile p, STRIDE elements apart (a tuple)."""
        if REP == 1:
            return (gl.load(p),)
        elif REP == 2:
            return (gl.load(p), gl.load(p + STRIDE))
        else:
            return (gl.load(p), gl.load(p + STRIDE), gl.load(p + 2 * STRIDE), gl.load(p + 3 * STRIDE))

    @gluon.jit
    def _w4_mma1_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, n_words, stride_wn, stride_sn,
                        ROWS: gl.constexpr, NW: gl.constexpr, GROUP: gl.constexpr, HAS_BIAS: gl.constexpr,
                        AHEAD: gl.constexpr, PDL: gl.constexpr, REP: gl.constexpr = 1):
        """Program p: rows p ROWS.. of y. A step is NW 16 REP words of each row: warp b takes
        words b 16 REP.., as REP sub-steps of 16 (lane c: words 4c..4c+3 of each, a 16-byte
        load a row), each its own MMA (independent chains) and scale."""
        STEP: gl.constexpr = NW * 16 * REP  # words a row a step
        WL: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 8, 4], [NW, 1, 1], [2, 1, 0])
        XL: gl.constexpr = gl.BlockedLayout([1, 1, 1, 32], [1, 8, 4, 1], [NW, 1, 1, 1], [3, 2, 1, 0])
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1],
                                                      instr_shape=[1, 16, 8])
        AL: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
        BL: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
        SL: gl.constexpr = gl.SliceLayout(2, mma)
        pid = gl.program_id(0)
        # the words of sub-step 0: [NW, ROWS, 16]
        wb = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, WL)))
        wr = gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, WL)))
        wc = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, WL)))
        wp = w_ptr + ((pid * ROWS + wr).to(gl.int64) * stride_wn)[None, :, None] + (wb * (16 * REP))[:, None, None] \
            + wc[None, None, :]
        # x of sub-step 0: [NW, 8, 4, 32], the 8 MMA columns read the same x
        xb = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, XL))))
        xn = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, XL))))
        xc = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, XL))))
        xe = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, XL))))
        xp = x_ptr + (xb * (128 * REP))[:, None, None, None] + (xn * 0)[None, :, None, None] \
            + (xc * 32)[None, None, :, None] + xe[None, None, None, :]
        # scales: [NW, ROWS] in the accumulator's row layout
        sb = gl.arange(0, NW, layout=gl.SliceLayout(1, SL))
        sr = gl.arange(0, ROWS, layout=gl.SliceLayout(0, SL))
        s_row = s_ptr + ((pid * ROWS + sr).to(gl.int64) * stride_sn)[None, :]
        acc = gl.zeros([NW, ROWS, 8], gl.float32, layout=mma)
        zero = gl.zeros([NW, ROWS, 8], gl.float32, layout=mma)
        words = _load_parts(wp, 16, REP)  # the weights do not depend on the kernel in front
        if PDL:
            _gdc_launch()
            _gdc_wait()
        for w0 in range(0, n_words, STEP):
            if not AHEAD and w0 > 0:
                words = _load_parts(wp, 16, REP)
            if AHEAD:  # the next step's words (the last step reloads the first: in bounds, unused)
                nxt = gl.where(w0 + STEP < n_words, STEP, -w0)
                words_next = _load_parts(wp + nxt, 16, REP)
            for r in gl.static_range(REP):
                # x where it is used (L1 after the first program): few registers live across the step
                xv = gl.load(xp + r * 128)
                s = gl.load(s_row + ((w0 + sb * (16 * REP) + r * 16) * 8 // GROUP)[:, None]).to(gl.float32)
                part = mma_v2(_a_operand(words[r], NW, ROWS, AL), _b_operand(xv, NW, BL), zero)
                acc += part * s[:, :, None]
            wp += STEP
            xp += STEP * 8
            if AHEAD:
                words = words_next
        y = gl.max(gl.sum(acc, axis=0), axis=1)  # the 8 columns are equal: their max is that value
        OL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(0, mma))
        rows = pid * ROWS + gl.arange(0, ROWS, layout=OL)
        if HAS_BIAS:
            y += gl.load(b_ptr + rows).to(gl.float32)
        gl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))


def w4_mma1_launch(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, bias, y: torch.Tensor, group: int,
                   cfg: dict | None = None) -> torch.Tensor:
    """y [1, N] = x [1, K] W^T (+ bias) with `words` int32 [N, K / 8] and bf16 / fp16 / fp32
    `scales` [N, K / group]; the caller checked `supports`. `cfg`: `tiles`' keys."""
    from atom.model_ops.kernels.triton_import import pdl_args
    n, n_words = words.shape
    cfg = dict(cfg or tiles(n, n_words * 8) or {})
    if not cfg:
        raise ValueError(f"w4_mma1: no tile for N={n}, K={n_words * 8}")
    if words.stride(1) != 1 or scales.stride(1) != 1 or x.stride(-1) != 1:
        raise ValueError("w4_mma1: words, scales and x must be contiguous along K")
    step = 16 * cfg["NW"] * cfg.get("REP", 1)
    if n % cfg["ROWS"] or n_words % step or group % WARP_K:
        raise ValueError(f"w4_mma1: N={n} must tile by ROWS={cfg['ROWS']}, K={n_words * 8} by {step * 8} "
                         f"and the group {group} by {WARP_K}")
    pdl = pdl_args(x)
    _w4_mma1_kernel[(n // cfg["ROWS"],)](x, words, scales, bias if bias is not None else y, y, n_words,
                                         words.stride(0), scales.stride(0), GROUP=group, HAS_BIAS=bias is not None,
                                         **pdl, **cfg)
    return y
