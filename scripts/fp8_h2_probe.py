"""Times a CUDA-core one-row (batch-1 decode) ptpc FP8 product in fp16 pair arithmetic against
the tensor-core swap-AB kernel the engine runs at M = 1 (`quant_gemv_dot`, its split K and
reduction included), on the Llama-3.1-8B linear shapes, beside bf16 `F.linear`; TB/s of the
fp8 weight next to the ~4.3 TB/s HBM limit. A probe, not a benchmark: JSON of every timing to
--out.

    python3 scripts/fp8_h2_probe.py --out fp8_h2_probe.json

Why: `fp8_gemv_sweep.py` found the bf16 GEMV widening each fp8 weight to fp32 slower than the
swap-AB kernel at every shape (instruction-bound: ~3 instructions a weight byte). Here, as
in the 4-bit GEMV's HALF2 path (`w4_gemv1`, `h2_ptx`), a word of 4 fp8 weights costs 4
instructions of inline PTX: two `cvt.rn.f16x2.e4m3x2` (sm_89+; each half-word's two e4m3
bytes to an exact fp16 pair, the low byte in the low half) and two `fma.rn.f16x2` against
fp16 pairs of the row, into one short fp16 chain (one word, or the two words of an 8-byte
load: DW = 2), whose two halves are added in fp16 and widened to fp32 once a chain (two
more, and one fp32 add); the per-row scale ws[n] xs 2^8 once at the end; bf16 out. The x
pairs are made once a step and shared by the program's BLOCK_N rows.
The row: ptpc semantics (the quantized row xq, e4m3, one scale xs a token, as the engine
feeds the swap-AB kernel) decoded by the same cvt and scaled by 2^-8 (exact, subnormals
included), so that no fp16 sum can overflow (|w| <= 448, |x 2^-8| <= 1.75: a chain of 8
products <= 6272). "w8a16" rows read the bf16 row instead (x 2^-8 rounded to fp16; no
activation quantization, so NOT ptpc semantics: an upper bound for the CUDA-core route,
safe for |x| up to ~4000). Errors: max |y - ref| / max |ref| against the exact product
(float64) of the same operands; `h2_ref` is the kernel's rounding in torch ("vs model").
Each timing replays a CUDA graph over enough weight copies to miss L2 (`w4_sweep`'s helpers);
a tile that fails to compile or errs by more than 2e-2 is reported, not fatal.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_gemv_sweep import fp8_operands  # noqa: E402
from w4_sweep import HBM_TBS, SHAPES, copies, probe_args, write_rows  # noqa: E402

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton  # noqa: E402

#: (BLOCK_N rows a program, BLOCK_W loads a row a step, num_warps, DW words a load, AHEAD)
TILES = [(4, 128, 4, 1, True), (8, 128, 4, 1, True), (16, 128, 4, 1, False), (8, 256, 8, 1, True),
         (8, 256, 8, 1, False), (16, 64, 4, 1, True), (8, 128, 4, 2, True), (4, 128, 4, 2, True),
         (16, 128, 4, 2, False)]
A16_TILES = [(8, 128, 4, 1, True), (8, 256, 8, 1, True), (8, 128, 4, 2, True)]  # the w8a16 variant
X_SHIFT = 8  # x is scaled by 2^-8 into fp16, y by 2^8 back
BAD = 2e-2


def h2_ptx(words: int) -> str:
    """The inline asm of one chain: $0 its float32 sum (int32 bits), $1..$W the fp8 words,
    then two fp16 x pairs a word (bytes 0, 1 and bytes 2, 3). Per word: each half-word's
    two e4m3 bytes to an f16x2 (low byte -> low half), one pair FMA each into acc; then
    the halves added in fp16 and widened."""
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
    """The kernel's arithmetic in torch (CPU or GPU): x [1, K] (e4m3 xq, or bf16 for w8a16)
    times 2^-8 rounded to fp16; per chain of `chain` words and per half (lane 0: bytes 0, 2
    of each word, lane 1: bytes 1, 3) the products added in the kernel's order, each sum
    rounded to fp16 (a product of two e4m3, or e4m3 and bf16, is exact in float32, and a
    float32 sum then rounded to fp16 is the FMA's single rounding but for ties); the lanes
    added in fp16; the rest float64. Returns float32 [1, N]: x . w (scales not applied)."""
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

    @triton.jit
    def _bf16_pair(xw):
        """An int32 of two bf16 (k, k + 1) -> their fp16 pair, times 2^-8 (rounded)."""
        lo = (xw << 16).to(tl.float32, bitcast=True) * 0.00390625
        hi = (xw & -65536).to(tl.float32, bitcast=True) * 0.00390625
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [hi, lo], dtype=tl.int32,
                                         is_pure=True, pack=1)

    @triton.jit
    def _bf16_pairs(v):
        """An int64 of 4 bf16 of the row -> the fp16 pairs (0, 1), (2, 3), times 2^-8."""
        return _bf16_pair(v.to(tl.int32)), _bf16_pair((v >> 32).to(tl.int32))

    @triton.jit(do_not_specialize_on_alignment=["w_ptr", "x_ptr"])
    def _fp8_h2_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, n_loads, stride_w, A16: tl.constexpr,
                       DW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, AHEAD: tl.constexpr,
                       PDL: tl.constexpr):
        """Program p: rows p BLOCK_N.. of y, a [BLOCK_N, BLOCK_W] tile of loads (int32: one word,
        int64: DW = 2 words) a step, one fp16 chain a load; even tiles only (the launcher checks).
        x: the e4m3 row as the same loads (A16: the bf16 row, one int64 a word). AHEAD: the next
        step's loads issued before this step's are used (the first before the PDL wait)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        j = tl.arange(0, BLOCK_W)[None, :]
        wp = w_ptr + rows.to(tl.int64)[:, None] * stride_w + j
        XSTEP: tl.constexpr = DW if A16 else 1  # x elements a load column
        xp = x_ptr + j * XSTEP
        shape: tl.constexpr = [BLOCK_N, BLOCK_W]
        acc = tl.zeros(shape, tl.float32)
        if AHEAD:
            nxt = tl.load(wp)
        pdl_start(PDL)
        for w0 in range(0, n_loads, BLOCK_W):
            if AHEAD:
                word = nxt
                nxt = tl.load(wp + tl.where(w0 + BLOCK_W < n_loads, BLOCK_W, 0))  # last step: reload, unused
            else:
                word = tl.load(wp)
            if A16:  # the x pairs of each load column's word 0 (and 1), shared by the rows
                a0, a1 = _bf16_pairs(tl.load(xp))
                if DW == 2:
                    b0, b1 = _bf16_pairs(tl.load(xp + 1))
            else:
                xv = tl.load(xp)
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
            xp += BLOCK_W * XSTEP
        if A16:
            scale = tl.load(ws_ptr + rows) * 256.0
        else:
            scale = tl.load(ws_ptr + rows) * (tl.load(xs_ptr) * 256.0)
        tl.store(y_ptr + rows, (tl.sum(acc, axis=1) * scale).to(y_ptr.dtype.element_ty))


def fp8_h2_launch(x, xs, w8, ws, y, tile, a16=False):
    """y [1, N] bf16 = (x . w8[n]) xs ws[n] (a16: x the bf16 row, xs unused). `tile`: TILES'
    tuple; x, w8 of K % (4 DW) == 0 and an even tile, else ValueError."""
    from atom.model_ops.kernels.triton_import import pdl_args
    bn, bw, warps, dw, ahead = tile
    n, k = w8.shape
    if n % bn or k % (4 * dw * bw):
        raise ValueError(f"uneven tile {tile} for N={n}, K={k}")
    words = w8.view(torch.int32 if dw == 1 else torch.int64)
    xv = x.view(torch.int64) if a16 else x.view(torch.int32 if dw == 1 else torch.int64)
    _fp8_h2_kernel[(n // bn,)](xv, xs, words, ws, y, words.shape[1], words.stride(0), A16=a16, DW=dw, BLOCK_N=bn,
                               BLOCK_W=bw, AHEAD=ahead, num_warps=warps, num_stages=3, **pdl_args(x))


def rel(y, ref) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def tile_rows(kind, tiles, x, xs, sets, ws, ref, N, K, iters, base) -> list:
    """Each tile: checked once (errors against the exact product and `h2_ref`), then timed."""
    from atom.utils.cuda_timing import graph_time
    out, models = [], {}
    for tile in tiles:
        bn, bw, warps, dw, ahead = tile
        row = dict(base, kind=kind, BLOCK_N=bn, BLOCK_W=bw, num_warps=warps, DW=dw, AHEAD=ahead,
                   words_a_step=bw * dw)
        y = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
        try:
            fp8_h2_launch(x, xs, sets[0], ws, y, tile, kind == "w8a16")
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a probe reports a tile that does not build or run
            out.append(dict(row, error=f"{type(e).__name__}: {str(e)[:300]}"))
            print(f"   {kind:>6} {tile}: FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        if dw not in models:
            scale = ws if kind == "w8a16" else ws * xs
            models[dw] = h2_ref(x, sets[0], dw) * scale
        err, err_model = rel(y, ref), rel(y, models[dw])
        t = graph_time([lambda w=w: fp8_h2_launch(x, xs, w, ws, y, tile, kind == "w8a16") for w in sets], iters)
        out.append(dict(row, us=t * 1e6, tbs=N * K / t / 1e12, rel_err=err, model_err=err_model, ok=err <= BAD))
        print(f"   {kind:>6} {tile}: {t * 1e6:8.1f} us {N * K / t / 1e12:5.2f} TB/s"
              f"  x dot {base['dot_us'] / t / 1e6:5.2f}  err {err:.1e} (vs model {err_model:.1e})"
              f"{'' if err <= BAD else '  WRONG'}", flush=True)
    return out


def main(argv=None) -> int:
    args = probe_args(__doc__, argv)
    if args is None:
        return 2
    if not HAS_TRITON or torch.cuda.get_device_capability() < (8, 9):
        print(f"{sys.argv[0]}: needs Triton and an sm_89+ GPU (cvt.rn.f16x2.e4m3x2); nothing was timed",
              file=sys.stderr)
        return 2
    from atom.model_ops.kernels.quant_gemv_dot import quant_gemv_dot_launch
    from atom.utils.cuda_timing import graph_time
    rows = []
    torch.manual_seed(0)
    print(f"HBM ~{HBM_TBS} TB/s; 'x dot': the swap-AB kernel's time over the tile's (> 1: faster)")
    for N, K in SHAPES:
        x, t16, w8, ws, xq, xs = fp8_operands(N, K, args.iters)
        ref = (xq.double() @ w8.double().T).float() * xs * ws  # exact products and sums, then the scales
        ref16 = (x.double() @ w8.double().T).float() * ws  # w8a16: the bf16 row, no activation scale
        sets = [w8] + [w8.clone() for _ in range(copies(w8.numel()) - 1)]
        t_dot = graph_time([lambda w=w: quant_gemv_dot_launch(xq, xs, w, ws, None, torch.bfloat16) for w in sets],
                           iters=args.iters)
        err_dot = rel(quant_gemv_dot_launch(xq, xs, w8, ws, None, torch.bfloat16), ref)
        base = dict(N=N, K=K, dot_us=t_dot * 1e6, dot_tbs=N * K / t_dot / 1e12, dot_rel_err=err_dot,
                    bf16_us=t16 * 1e6, hbm_tbs=HBM_TBS)
        print(f"{N:>6} x {K:<6} swap-AB {t_dot * 1e6:8.1f} us {N * K / t_dot / 1e12:5.2f} TB/s (err {err_dot:.1e})"
              f"   bf16 F.linear {t16 * 1e6:8.1f} us", flush=True)
        rows.append(dict(base, kind="swap_ab", us=t_dot * 1e6, tbs=N * K / t_dot / 1e12, rel_err=err_dot))
        rows += tile_rows("ptpc", TILES, xq, xs, sets, ws, ref, N, K, args.iters, base)
        rows += tile_rows("w8a16", A16_TILES, x, xs, sets, ws, ref16, N, K, args.iters, base)
        del sets, w8
    write_rows(args.out, rows)
    summary(rows)
    return 0


def summary(rows) -> None:
    """One line a shape: the swap-AB kernel, the best correct tile of each kind, bf16."""
    print(f"\n{'N':>6}{'K':>6} {'swap-AB us':>10}{'TB/s':>6} {'ptpc us':>8}{'TB/s':>6}{'x dot':>6} "
          f"{'w8a16 us':>9}{'TB/s':>6}{'x dot':>6} {'bf16 us':>8}  best ptpc tile (BLOCK_N, BLOCK_W, warps, DW, AHEAD)")
    for N, K in SHAPES:
        at = [r for r in rows if (r["N"], r["K"]) == (N, K)]
        if not at:
            continue
        b0, line, tile = at[0], "", "none correct"
        for kind in ("ptpc", "w8a16"):
            good = [r for r in at if r["kind"] == kind and r.get("ok")]
            if not good:
                line += f"{'-':>{9 if kind == 'w8a16' else 8}}{'-':>6}{'-':>6} "
                continue
            b = min(good, key=lambda r: r["us"])
            line += f"{b['us']:>{9 if kind == 'w8a16' else 8}.1f}{b['tbs']:>6.2f}{b0['dot_us'] / b['us']:>6.2f} "
            if kind == "ptpc":
                tile = f"({b['BLOCK_N']}, {b['BLOCK_W']}, {b['num_warps']}, {b['DW']}, {b['AHEAD']})"
        print(f"{N:>6}{K:>6} {b0['dot_us']:>10.1f}{b0['dot_tbs']:>6.2f} {line}{b0['bf16_us']:>8.1f}  {tile}")


if __name__ == "__main__":
    sys.exit(main())
