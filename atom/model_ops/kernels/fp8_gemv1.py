"""The one-row (batch-1 decode) ptpc FP8 product on the CUDA cores, in fp16 pair arithmetic.

y[1, N] = (xq . w[n]) * xs * ws[n]: xq the e4m3 row quantized per token (one fp32 scale xs),
w [N, K] e4m3 with one fp32 scale a row (ws), as the swap-AB kernel (`quant_gemv_dot`) takes
them; bf16 (or the asked dtype) out, an optional bias added after the scales.

At one row the product reads the weight once and does 2 flops a byte, so it is bound by how
fast the GPU can issue the instructions that turn each fp8 byte into a product. Here a 4-byte
word costs 4 instructions of inline PTX (sm_89+): two `cvt.rn.f16x2.e4m3x2` (each half-word's
two e4m3 bytes to an exact fp16 pair, the low byte in the low half) and two `fma.rn.f16x2`
against fp16 pairs of the row, into one short fp16 chain (the DW words of one load), whose two
halves are added in fp16 and widened to fp32 once a chain; the fp32 sums of a row are reduced
at the end and scaled by ws[n] xs 2^8. The row's pairs are decoded by the same cvt once a step
and shared by the program's BLOCK_N rows.

Range: the row is scaled by 2^-8 (exact, subnormals included) so that no fp16 sum can
overflow: |w| <= 448 and |xq 2^-8| <= 1.75 keep a chain of 8 products <= 6272. The fp16
chain's rounding is modelled in torch by `h2_ref`; against the exact product it stays within
1e-3 of the largest output (tests), under bf16's own step.

Timings at Llama-3.1-8B's four shapes against the swap-AB kernel (its split K and reduction
included) are in docs/perf (`scripts/fp8_h2_probe.py`): faster at q/k/v, o_proj and gate-up,
level or faster at down; `DEFAULT_TILE` / `TILES` its best tiles. `takes` says where the
engine's one-row route (`quant.common`) runs it.

Rows quantized on load (`fp8_gemv1_pending_launch`, a `pending_quant.PendingQuant`: the kernel
plan's "quant_on_load"): x comes as the 16-bit row the kernel in front stored, with partial
amaxes; each program takes the row's scale from the partials as `act_quant` does (xs =
max(amax, 1e-12) / 448, a correctly rounded division) and quantizes each load of x itself, so
that no quantizer runs in between. x / xs is computed as `act_quant.div_by` computes it: q0 =
x r, rem = x - q0 xs (exact with an FMA), q0 + rem r (r = 1 / xs correctly rounded, once a
program), Markstein's correction, which gives the correctly rounded quotient where it lies in
the normal range; then the hardware's e4m3 rounding (`cvt.rn.satfinite.e4m3x2.f32`: to
nearest, ties to even, saturated at 448, as `act_quant` clamps then rounds in software).
Quotients below the normal range round to e4m3's zero either way (xs >= 1e-12 / 448). 5.5
instructions a value of x (`qx_ptx`, shared by a program's BLOCK_N rows), the same bits as the
quantizer then the kernel (`qx_ref` models it in torch).
"""
from __future__ import annotations

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton
from atom.utils.pow2 import is_pow2

X_SHIFT = 8  # the row is scaled by 2^-X_SHIFT into fp16, y by 2^X_SHIFT back
#: (BLOCK_N rows a program, BLOCK_W loads a row a step, num_warps, DW words a load, AHEAD) by
#: (N, K); DEFAULT_TILE elsewhere, SHORT_K_TILE where K is not a multiple of DEFAULT_TILE's 2048
#: bytes a step. AHEAD: the next step's loads issued before this step's are used. DEFAULT_TILE is
#: `scripts/fp8_h2_probe.py`'s best (or level) tile at Llama-3.1-8B's four shapes, confirmed by
#: batch-1 decode; the figures are in docs/perf
DEFAULT_TILE = (4, 256, 8, 2, True)
SHORT_K_TILE = (4, 128, 4, 2, True)
TILES: dict = {}
MIN_CAPABILITY = (8, 9)  # cvt.rn.f16x2.e4m3x2
#: the weight loads' cache modifier: "" the default; ".cg" L2 only, so that the weight stream (read
#: once) does not evict the row x, which every step loads again, from L1 (opt-in until timed:
#: `scripts/fp8_h2_probe.py` times both)
WORD_CACHE = ""
#: load each program's weight scales (and bias) before the PDL wait and x's scale right after it,
#: instead of after the loop's sums, where the compiled kernel issues them and each program then
#: waits a memory round trip at its end (opt-in until timed: variant `scripts/variants/fp8/scales_first.sh`)
SCALES_FIRST = False


#: the 16-bit rows `fp8_gemv1_pending_launch` quantizes on load, by the kernel's QX code
QX_DTYPES = {torch.bfloat16: 1, torch.float16: 2}
QMAX = 448.0  # e4m3's largest value: the satfinite conversion's clamp


def qx_ptx(dtype: torch.dtype) -> str:
    """The inline asm that quantizes 4 values of a 16-bit row on load: $2 an int64 of four
    bf16 / fp16 values, $3 r = 1 / xs and $4 -xs (float32 bits); $0, $1 their e4m3 values as the
    fp16 pairs (values 0, 1) and (2, 3), times 2^-8, as `XQ_LO` / `XQ_HI` decode a quantized row.
    Per value: widen, q0 = x r, rem = fma(q0, -xs, x), q = fma(rem, r, q0); per pair: one
    satfinite e4m3x2 conversion, one back to f16x2, one multiply by 2^-8."""
    if dtype not in QX_DTYPES:
        raise ValueError(f"qx_ptx: dtype {dtype}, one of {list(QX_DTYPES)}")
    if dtype == torch.bfloat16:  # a bf16's bits are a float32's upper half
        widen = ["mov.b64 {lo, hi}, $2;", "shl.b32 v0, lo, 16;", "and.b32 v1, lo, 0xFFFF0000;",
                 "shl.b32 v2, hi, 16;", "and.b32 v3, hi, 0xFFFF0000;"]
    else:
        widen = ["mov.b64 {x0, x1, x2, x3}, $2;"] + [f"cvt.f32.f16 v{i}, x{i};" for i in range(4)]
    lines = widen + [f"mul.rn.f32 q{i}, v{i}, $3;" for i in range(4)] \
        + [f"fma.rn.f32 r{i}, q{i}, $4, v{i};" for i in range(4)] \
        + [f"fma.rn.f32 q{i}, r{i}, $3, q{i};" for i in range(4)] \
        + ["cvt.rn.satfinite.e4m3x2.f32 e0, q1, q0;", "cvt.rn.satfinite.e4m3x2.f32 e1, q3, q2;",
           "cvt.rn.f16x2.e4m3x2 p0, e0;", "cvt.rn.f16x2.e4m3x2 p1, e1;", "mov.b32 s, 0x1C001C00;",
           "mul.rn.f16x2 $0, p0, s;", "mul.rn.f16x2 $1, p1, s;"]
    return ("{\n.reg .b32 lo, hi, v0, v1, v2, v3, q0, q1, q2, q3, r0, r1, r2, r3, p0, p1, s;\n"
            ".reg .b16 x0, x1, x2, x3, e0, e1;\n" + "\n".join(lines) + "\n}")


def qx_ref(h: torch.Tensor, pmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The on-load quantization in torch (CPU or GPU): h [1, K] (16-bit), pmax fp32 [1, P] ->
    (xq e4m3 [1, K], xs fp32 [1]): the scale as `act_quant`'s, x / xs by the kernel's
    reciprocal and Markstein correction (FMAs exact: a float32 product is exact in float64 and
    the remainder's sum too; the last one rounds in float64 then float32, which can differ from
    one rounding only at a tie of the two, ~2^-29 of values), then e4m3's rounding."""
    xs = (torch.clamp(pmax.float().amax(), min=1e-12) / QMAX).reshape(1)
    r = torch.ones_like(xs) / xs
    x = h.float()
    q0 = x * r
    rem = (x.double() - q0.double() * xs.double()).float()
    q = (rem.double() * r.double() + q0.double()).float()
    return q.clamp(-QMAX, QMAX).to(torch.float8_e4m3fn), xs


def h2_ptx(words: int) -> str:
    """The inline asm of one chain: $0 its float32 sum (int32 bits), $1..$W the fp8 words,
    then two fp16 row pairs a word (bytes 0, 1 and bytes 2, 3). Per word: each half-word's
    two e4m3 bytes to an f16x2 (low byte -> low half), one pair FMA each into acc; then the
    halves added in fp16 and widened."""
    if words < 1:
        raise ValueError(f"h2_ptx: words={words}, at least 1")
    lines = []
    for k in range(words):
        xa, xb = f"${1 + words + 2 * k}", f"${2 + words + 2 * k}"
        lines += [f"mov.b32 {{l, h}}, ${1 + k};", "cvt.rn.f16x2.e4m3x2 p, l;", "cvt.rn.f16x2.e4m3x2 q, h;",
                  f"mul.rn.f16x2 acc, p, {xa};" if k == 0 else f"fma.rn.f16x2 acc, p, {xa}, acc;",
                  f"fma.rn.f16x2 acc, q, {xb}, acc;"]
    return ("{\n.reg .b32 p, q, acc;\n.reg .b16 l, h;\n.reg .f32 fl;\n" + "\n".join(lines)
            + "\nmov.b32 {l, h}, acc;\nadd.rn.f16 l, l, h;\ncvt.f32.f16 fl, l;\nmov.b32 $0, fl;\n}")


#: a word of 4 e4m3 bytes of the row -> the fp16 pair of bytes 0, 1 (XQ_LO) or 2, 3 (XQ_HI), x 2^-8
_XQ = "{{\n.reg .b16 l, h;\n.reg .b32 p, s;\nmov.b32 {{l, h}}, $1;\ncvt.rn.f16x2.e4m3x2 p, {};\n" \
      "mov.b32 s, 0x1C001C00;\nmul.rn.f16x2 $0, p, s;\n}}"
XQ_LO, XQ_HI = _XQ.format("l"), _XQ.format("h")


def h2_ref(x: torch.Tensor, w8: torch.Tensor, chain: int = 1) -> torch.Tensor:
    """The kernel's arithmetic in torch (CPU or GPU): x [1, K] (e4m3 xq, or a 16-bit row)
    times 2^-8 rounded to fp16; per chain of `chain` words and per half (lane 0: bytes 0, 2
    of each word, lane 1: bytes 1, 3) the products added in the kernel's order, each sum
    rounded to fp16 (a product of two e4m3 is exact in float32, and a float32 sum then
    rounded to fp16 is the FMA's single rounding but for ties); the lanes added in fp16; the
    rest float64. Returns float32 [1, N]: x . w (scales not applied)."""
    n, k = w8.shape
    runs = k // (4 * chain)
    xh = (x.reshape(-1).float() * 2.0 ** -X_SHIFT).half().float().reshape(runs, chain, 4)
    v = w8.float().reshape(n, runs, chain, 4)
    lanes = []
    for lane in (0, 1):
        a = None
        for c in range(chain):
            for i in (lane, lane + 2):
                p = v[:, :, c, i] * xh[:, c, i]
                a = p.half().float() if a is None else (a + p).half().float()
        lanes.append(a)
    t = (lanes[0] + lanes[1]).half()
    return (t.double().sum(dim=1) * 2.0 ** X_SHIFT).float()[None, :]


def tile_for(N: int, K: int) -> tuple:
    """The tile of an [N, K] weight: its `TILES` entry, else DEFAULT_TILE where it covers the
    shape, else SHORT_K_TILE (K an odd multiple of 1024 bytes, e.g. Qwen3-0.6B's 1024 and 3072)."""
    if (N, K) in TILES:
        return TILES[(N, K)]
    return DEFAULT_TILE if even(N, K, DEFAULT_TILE) or not even(N, K, SHORT_K_TILE) else SHORT_K_TILE


def even(N: int, K: int, tile: tuple) -> bool:
    """Whether `tile` covers [N, K] without a remainder (the kernel masks nothing)."""
    bn, bw, _, dw, _ = tile
    return N % bn == 0 and K % (4 * dw * bw) == 0


def _takes_row(x: torch.Tensor, is_cuda: bool, w: torch.Tensor, ws: torch.Tensor) -> bool:
    """The conditions both routes share: one contiguous, 16-byte aligned row x [1, K] on an
    NVIDIA GPU of sm_89 or later with Triton, an e4m3 weight [N, K] likewise with one scale a
    row, and a tile that covers the shape."""
    if not (HAS_TRITON and is_cuda and torch.version.hip is None):
        return False
    if x.dim() != 2 or x.shape[0] != 1 or w.dtype != torch.float8_e4m3fn:
        return False
    N, K = w.shape
    if x.shape[1] != K or ws.numel() != N or not even(N, K, tile_for(N, K)):
        return False
    if not (x.is_contiguous() and w.is_contiguous()) or x.data_ptr() % 16 or w.data_ptr() % 16:
        return False
    return torch.cuda.get_device_capability(x.device) >= MIN_CAPABILITY


def takes(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> bool:
    """Whether the kernel runs this product: one e4m3 row and one scale for it, an e4m3 weight
    with one scale a row, both contiguous and 16-byte aligned, a tile that covers the shape,
    Triton on an NVIDIA GPU of sm_89 or later."""
    return xq.dtype == torch.float8_e4m3fn and xs.numel() == 1 and _takes_row(xq, xq.is_cuda, w, ws)


def takes_pending(p, w: torch.Tensor, ws: torch.Tensor) -> bool:
    """Whether `fp8_gemv1_pending_launch` runs this product: `takes`' conditions for the
    weight, and a `PendingQuant` of one contiguous, 16-byte aligned bf16 / fp16 row with fp8
    kind, qmax 448 (the satfinite conversion's clamp) and fp32 partials [1, P]."""
    pm = p.pmax
    if p.kind != "fp8" or p.qmax != QMAX or p.h.dtype not in QX_DTYPES:
        return False
    if pm.dtype != torch.float32 or pm.dim() != 2 or pm.shape[0] != 1 or not pm.is_contiguous():
        return False
    return _takes_row(p.h, p.is_cuda, w, ws)


if HAS_TRITON:
    from atom.model_ops.kernels.triton_import import pdl_start
    from atom.model_ops.kernels.w4_gemv1 import _half  # word h of a load (DW = 2: an int64's halves)

    H2_1 = tl.constexpr(h2_ptx(1))
    H2_2 = tl.constexpr(h2_ptx(2))
    XQ_LO_C = tl.constexpr(XQ_LO)
    XQ_HI_C = tl.constexpr(XQ_HI)

    QX_BF16_C = tl.constexpr(qx_ptx(torch.bfloat16))
    QX_FP16_C = tl.constexpr(qx_ptx(torch.float16))

    @triton.jit
    def _qx_pairs(xw, inv, nxs, QX: tl.constexpr):
        """An int64 of four 16-bit row values (QX 1: bf16, 2: fp16) -> their e4m3 values as the
        fp16 pairs (0, 1), (2, 3), times 2^-8 (`qx_ptx`); inv / nxs: 1 / xs and -xs as int32 bits."""
        asm: tl.constexpr = QX_BF16_C if QX == 1 else QX_FP16_C
        return tl.inline_asm_elementwise(asm, "=r,=r,l,r,r", [xw, inv, nxs], dtype=(tl.int32, tl.int32),
                                         is_pure=True, pack=1)

    @triton.jit
    def _xq_pairs(xw):
        """A word of the e4m3 row -> its fp16 pairs (bytes 0, 1), (2, 3), times 2^-8."""
        lo = tl.inline_asm_elementwise(XQ_LO_C, "=r,r", [xw], dtype=tl.int32, is_pure=True, pack=1)
        hi = tl.inline_asm_elementwise(XQ_HI_C, "=r,r", [xw], dtype=tl.int32, is_pure=True, pack=1)
        return lo, hi

    @triton.jit(do_not_specialize_on_alignment=["w_ptr", "x_ptr"])
    def _fp8_gemv1_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, n_loads, stride_w, HAS_BIAS: tl.constexpr,
                          DW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, AHEAD: tl.constexpr,
                          PDL: tl.constexpr, WCACHE: tl.constexpr = "", SFIRST: tl.constexpr = False,
                          pm_ptr=None, n_parts=0, QX: tl.constexpr = 0, PARTS: tl.constexpr = 1):
        """Program p: rows p BLOCK_N.. of y, a [BLOCK_N, BLOCK_W] tile of loads (int32: one word,
        int64: DW = 2 words) a step, one fp16 chain a load; even tiles only (`even`). x: the
        e4m3 row as the same loads. AHEAD: the next step's loads issued before this step's are
        used (the first before the PDL wait: the weights do not depend on the kernel before).
        WCACHE: the weight loads' cache modifier (`WORD_CACHE`). SFIRST (`SCALES_FIRST`): the
        rows' weight scales and bias loaded before the PDL wait (weights: no kernel in the stream
        writes them) and x's scale right after it, held through the loop, instead of loaded
        after it; the same arithmetic. QX (1: bf16, 2: fp16; `fp8_gemv1_pending_launch`): x_ptr
        is the unquantized row as int64s of four values (DW a load column) and pm_ptr its n_parts
        partial amaxes (PARTS a power of two >= n_parts): each program computes the row's scale
        and quantizes each load of x as it comes (module docstring); xs_ptr is not read."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        j = tl.arange(0, BLOCK_W)[None, :]
        wp = w_ptr + rows.to(tl.int64)[:, None] * stride_w + j
        xp = x_ptr + j * (DW if QX else 1)  # QX: DW int64s of four values a load column
        shape: tl.constexpr = [BLOCK_N, BLOCK_W]
        acc = tl.zeros(shape, tl.float32)
        if AHEAD:
            nxt = tl.load(wp, cache_modifier=WCACHE)
        if SFIRST:  # weights: no kernel in the stream writes them
            w_scale = tl.load(ws_ptr + rows).to(tl.float32)
            if HAS_BIAS:
                bias = tl.load(b_ptr + rows).to(tl.float32)
        pdl_start(PDL)
        if QX:  # the row's scale from the partials of the kernel in front, as act_quant computes it
            parts = tl.arange(0, PARTS)
            pm = tl.load(pm_ptr + parts, mask=parts < n_parts, other=0.0)
            x_scale = tl.math.div_rn(tl.maximum(tl.max(pm, 0), 1e-12), 448.0)
            inv = tl.math.div_rn(tl.full([1, BLOCK_W], 1.0, tl.float32), x_scale).to(tl.int32, bitcast=True)
            nxs = tl.full([1, BLOCK_W], 0.0, tl.float32) - x_scale
            nxs = nxs.to(tl.int32, bitcast=True)
        elif SFIRST:  # written by the quantizer in front: after the wait
            x_scale = tl.load(xs_ptr).to(tl.float32)
        for w0 in range(0, n_loads, BLOCK_W):
            if AHEAD:
                word = nxt
                nxt = tl.load(wp + tl.where(w0 + BLOCK_W < n_loads, BLOCK_W, 0),  # last step: reload, unused
                              cache_modifier=WCACHE)
            else:
                word = tl.load(wp, cache_modifier=WCACHE)
            if QX:  # the row's values quantized here, shared by the rows
                a0, a1 = _qx_pairs(tl.load(xp), inv, nxs, QX)
                if DW == 2:
                    b0, b1 = _qx_pairs(tl.load(xp + 1), inv, nxs, QX)
            else:
                xv = tl.load(xp)  # the row's pairs for each load column, shared by the rows
                a0, a1 = _xq_pairs(_half(xv, 0, DW))
                if DW == 2:
                    b0, b1 = _xq_pairs(_half(xv, 1, DW))
            if DW == 1:
                t = tl.inline_asm_elementwise(H2_1, "=r,r,r,r", [word, tl.broadcast_to(a0, shape),
                                              tl.broadcast_to(a1, shape)], dtype=tl.int32, is_pure=True, pack=1)
            else:
                t = tl.inline_asm_elementwise(H2_2, "=r,r,r,r,r,r,r", [
                    _half(word, 0, DW), _half(word, 1, DW), tl.broadcast_to(a0, shape), tl.broadcast_to(a1, shape),
                    tl.broadcast_to(b0, shape), tl.broadcast_to(b1, shape)], dtype=tl.int32, is_pure=True, pack=1)
            acc += t.to(tl.float32, bitcast=True)
            wp += BLOCK_W
            xp += BLOCK_W * (DW if QX else 1)
        dot = tl.sum(acc, axis=1)
        if not SFIRST:  # loaded after the sums, the bias after the scaling
            w_scale = tl.load(ws_ptr + rows).to(tl.float32)
            if not QX:
                x_scale = tl.load(xs_ptr).to(tl.float32)
        y = dot * (w_scale * (x_scale * 256.0))
        if HAS_BIAS:
            if not SFIRST:
                bias = tl.load(b_ptr + rows).to(tl.float32)
            y += bias
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))


def tile_problem(N: int, K: int, tile) -> str:
    """Why `tile` cannot run an [N, K] weight ('' where it can): five entries (BLOCK_N,
    BLOCK_W, num_warps, DW, AHEAD), the first three powers of two, DW 1 or 2 words a load, and
    a cover of the shape without a remainder (`even`)."""
    if not isinstance(tile, tuple) or len(tile) != 5:
        return f"tile {tile!r}: (BLOCK_N, BLOCK_W, num_warps, DW, AHEAD) expected"
    bn, bw, warps, dw, _ = tile
    if not all(is_pow2(v) for v in (bn, bw, warps)):
        return f"tile {tile}: BLOCK_N, BLOCK_W and num_warps must be powers of two"
    if dw not in (1, 2):
        return f"tile {tile}: DW (words a load) must be 1 or 2"
    if not even(N, K, tile):
        return f"tile {tile} does not cover N={N}, K={K} (BLOCK_N rows must divide N, 4 DW BLOCK_W bytes K)"
    return ""


def _tile(N: int, K: int, tile: tuple | None) -> tuple:
    """`tile`, or `tile_for(N, K)` by default; ValueError where it cannot run the shape."""
    tile = tile or tile_for(N, K)
    problem = tile_problem(N, K, tile)
    if problem:
        raise ValueError(f"fp8_gemv1: {problem}")
    return tile


def _launch(x: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bias, out, out_dtype, tile: tuple,
            word_cache: str | None, scales_first: bool | None, **qx) -> torch.Tensor:
    """The kernel on x as its loads read it (the e4m3 row viewed as the weight's words, or the
    pending row as int64s: `qx` the kernel's QX arguments), into `out` or a new [1, N] tensor."""
    from atom.model_ops.kernels.triton_import import pdl_args
    N = w.shape[0]
    bn, bw, warps, dw, ahead = tile
    words = w.view(torch.int32 if dw == 1 else torch.int64)
    if out is None:
        out = torch.empty(1, N, device=x.device, dtype=out_dtype)
    _fp8_gemv1_kernel[(N // bn,)](x, xs, words, ws, bias if bias is not None else ws, out,
                                  words.shape[1], words.stride(0), HAS_BIAS=bias is not None, DW=dw, BLOCK_N=bn,
                                  BLOCK_W=bw, AHEAD=ahead, num_warps=warps, num_stages=3,
                                  WCACHE=WORD_CACHE if word_cache is None else word_cache,
                                  SFIRST=SCALES_FIRST if scales_first is None else scales_first, **qx, **pdl_args(x))
    return out


def fp8_gemv1_launch(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                     bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.bfloat16, tile: tuple | None = None,
                     word_cache: str | None = None, scales_first: bool | None = None) -> torch.Tensor:
    """y [1, N] = (xq . w[n]) xs ws[n] (+ bias[n]) in `out_dtype` (into `out` when given) with
    `tile` (`tile_for(N, K)` by default) and the weight loads' cache modifier `word_cache`
    (`WORD_CACHE` by default), the scales loaded first or not (`scales_first`, `SCALES_FIRST` by
    default); ValueError where the tile does not cover the shape."""
    N, K = w.shape
    tile = _tile(N, K, tile)
    if xq.shape != (1, K):
        raise ValueError(f"fp8_gemv1: x must be [1, K={K}], got {tuple(xq.shape)}")
    x = xq.view(torch.int32 if tile[3] == 1 else torch.int64)
    return _launch(x, xs, w, ws, bias, out, out_dtype, tile, word_cache, scales_first)


def fp8_gemv1_pending_launch(p, w: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None = None,
                             out_dtype: torch.dtype = torch.bfloat16, tile: tuple | None = None) -> torch.Tensor:
    """`fp8_gemv1_launch` for a `pending_quant.PendingQuant` row (`takes_pending`): the kernel
    quantizes p.h on load with the scale of p.pmax (QX; module docstring), the bits of
    `fp8_gemv1_launch(*p.quantize(), ...)`."""
    N, K = w.shape
    tile = _tile(N, K, tile)
    h, pm = p.h, p.pmax
    if h.shape != (1, K) or h.dtype not in QX_DTYPES:
        raise ValueError(f"fp8_gemv1: the pending row must be [1, K={K}] bf16 / fp16, got {tuple(h.shape)} {h.dtype}")
    if p.kind != "fp8" or p.qmax != QMAX:
        raise ValueError(f"fp8_gemv1: quantizes on load to fp8 with qmax {QMAX}, got {p.kind} {p.qmax}")
    n_parts = pm.shape[-1]
    return _launch(h.view(torch.int64), pm, w, ws, bias, None, out_dtype, tile, None, None, pm_ptr=pm,
                   n_parts=n_parts, QX=QX_DTYPES[h.dtype], PARTS=triton.next_power_of_2(n_parts))
