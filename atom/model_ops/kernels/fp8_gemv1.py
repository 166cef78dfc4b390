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
"""
from __future__ import annotations

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton

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


def takes(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> bool:
    """Whether the kernel runs this product: one e4m3 row and one scale for it, an e4m3 weight
    with one scale a row, both contiguous and 16-byte aligned, a tile that covers the shape,
    Triton on an NVIDIA GPU of sm_89 or later."""
    if not (HAS_TRITON and xq.is_cuda and torch.version.hip is None):
        return False
    if xq.dim() != 2 or xq.shape[0] != 1 or xq.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        return False
    N, K = w.shape
    if xq.shape[1] != K or xs.numel() != 1 or ws.numel() != N or not even(N, K, tile_for(N, K)):
        return False
    if not (xq.is_contiguous() and w.is_contiguous()) or xq.data_ptr() % 16 or w.data_ptr() % 16:
        return False
    return torch.cuda.get_device_capability(xq.device) >= MIN_CAPABILITY


if HAS_TRITON:
    from atom.model_ops.kernels.triton_import import pdl_start
    from atom.model_ops.kernels.w4_gemv1 import _half  # word h of a load (DW = 2: an int64's halves)

    H2_1 = tl.constexpr(h2_ptx(1))
    H2_2 = tl.constexpr(h2_ptx(2))
    XQ_LO_C = tl.constexpr(XQ_LO)
    XQ_HI_C = tl.constexpr(XQ_HI)

    @triton.jit
    def _xq_pairs(xw):
        """A word of the e4m3 row -> its fp16 pairs (bytes 0, 1), (2, 3), times 2^-8."""
        lo = tl.inline_asm_elementwise(XQ_LO_C, "=r,r", [xw], dtype=tl.int32, is_pure=True, pack=1)
        hi = tl.inline_asm_elementwise(XQ_HI_C, "=r,r", [xw], dtype=tl.int32, is_pure=True, pack=1)
        return lo, hi

    @triton.jit(do_not_specialize_on_alignment=["w_ptr", "x_ptr"])
    def _fp8_gemv1_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, n_loads, stride_w, HAS_BIAS: tl.constexpr,
                          DW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, AHEAD: tl.constexpr,
                          PDL: tl.constexpr, WCACHE: tl.constexpr = "", SFIRST: tl.constexpr = False):
        """Program p: rows p BLOCK_N.. of y, a [BLOCK_N, BLOCK_W] tile of loads (int32: one word,
        int64: DW = 2 words) a step, one fp16 chain a load; even tiles only (`even`). x: the
        e4m3 row as the same loads. AHEAD: the next step's loads issued before this step's are
        used (the first before the PDL wait: the weights do not depend on the kernel before).
        WCACHE: the weight loads' cache modifier (`WORD_CACHE`). SFIRST (`SCALES_FIRST`): the
        rows' weight scales and bias loaded before the PDL wait (weights: no kernel in the stream
        writes them) and x's scale right after it, held through the loop, instead of loaded
        after it; the same arithmetic."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        j = tl.arange(0, BLOCK_W)[None, :]
        wp = w_ptr + rows.to(tl.int64)[:, None] * stride_w + j
        xp = x_ptr + j
        shape: tl.constexpr = [BLOCK_N, BLOCK_W]
        acc = tl.zeros(shape, tl.float32)
        if AHEAD:
            nxt = tl.load(wp, cache_modifier=WCACHE)
        if SFIRST:  # weights: no kernel in the stream writes them
            w_scale = tl.load(ws_ptr + rows).to(tl.float32)
            if HAS_BIAS:
                bias = tl.load(b_ptr + rows).to(tl.float32)
        pdl_start(PDL)
        if SFIRST:  # written by the quantizer in front: after the wait
            x_scale = tl.load(xs_ptr).to(tl.float32)
        for w0 in range(0, n_loads, BLOCK_W):
            if AHEAD:
                word = nxt
                nxt = tl.load(wp + tl.where(w0 + BLOCK_W < n_loads, BLOCK_W, 0),  # last step: reload, unused
                              cache_modifier=WCACHE)
            else:
                word = tl.load(wp, cache_modifier=WCACHE)
            xv = tl.load(xp)  # the row's pairs for each load column, shared by the rows
            a0, a1 = _xq_pairs(_half(xv, 0, DW))
            if DW == 1:
                t = tl.inline_asm_elementwise(H2_1, "=r,r,r,r", [word, tl.broadcast_to(a0, shape),
                                              tl.broadcast_to(a1, shape)], dtype=tl.int32, is_pure=True, pack=1)
            else:
                b0, b1 = _xq_pairs(_half(xv, 1, DW))
                t = tl.inline_asm_elementwise(H2_2, "=r,r,r,r,r,r,r", [
                    _half(word, 0, DW), _half(word, 1, DW), tl.broadcast_to(a0, shape), tl.broadcast_to(a1, shape),
                    tl.broadcast_to(b0, shape), tl.broadcast_to(b1, shape)], dtype=tl.int32, is_pure=True, pack=1)
            acc += t.to(tl.float32, bitcast=True)
            wp += BLOCK_W
            xp += BLOCK_W
        dot = tl.sum(acc, axis=1)
        if not SFIRST:  # loaded after the sums, the bias after the scaling
            w_scale = tl.load(ws_ptr + rows).to(tl.float32)
            x_scale = tl.load(xs_ptr).to(tl.float32)
        y = dot * (w_scale * (x_scale * 256.0))
        if HAS_BIAS:
            if not SFIRST:
                bias = tl.load(b_ptr + rows).to(tl.float32)
            y += bias
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))


def fp8_gemv1_launch(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                     bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.bfloat16, tile: tuple | None = None,
                     word_cache: str | None = None, scales_first: bool | None = None) -> torch.Tensor:
    """y [1, N] = (xq . w[n]) xs ws[n] (+ bias[n]) in `out_dtype` (into `out` when given) with
    `tile` (`tile_for(N, K)` by default) and the weight loads' cache modifier `word_cache`
    (`WORD_CACHE` by default), the scales loaded first or not (`scales_first`, `SCALES_FIRST` by
    default); ValueError where the tile does not cover the shape."""
    from atom.model_ops.kernels.triton_import import pdl_args
    N, K = w.shape
    tile = tile or tile_for(N, K)
    if not even(N, K, tile):
        raise ValueError(f"fp8_gemv1: tile {tile} does not cover N={N}, K={K}")
    if xq.shape != (1, K):
        raise ValueError(f"fp8_gemv1: x must be [1, K={K}], got {tuple(xq.shape)}")
    bn, bw, warps, dw, ahead = tile
    view = torch.int32 if dw == 1 else torch.int64
    words = w.view(view)
    if out is None:
        out = torch.empty(1, N, device=xq.device, dtype=out_dtype)
    _fp8_gemv1_kernel[(N // bn,)](xq.view(view), xs, words, ws, bias if bias is not None else ws, out,
                                  words.shape[1], words.stride(0), HAS_BIAS=bias is not None, DW=dw, BLOCK_N=bn,
                                  BLOCK_W=bw, AHEAD=ahead, num_warps=warps, num_stages=3,
                                  WCACHE=WORD_CACHE if word_cache is None else word_cache,
                                  SFIRST=SCALES_FIRST if scales_first is None else scales_first, **pdl_args(xq))
    return out
