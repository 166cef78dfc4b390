"""Probes a tensor-core one-row int4 GEMV (batch-1 decode) against the engine's CUDA-core one
(`w4_gemv1`, its table tiles) on the Llama-3.1-8B shapes: correctness against the dequantized
product, then the time of each, TB/s of the stored weight. A probe, not a benchmark, and not
an engine path: JSON of every timing to --out.

    python3 scripts/w4_mma_probe.py --out w4_mma_probe.json

Why: the CUDA-core GEMV spends ~3 instructions a weight (decode, fp16 pair FMAs, scaling)
and runs the 4-bit shapes at 1.9-2.9 TB/s where the bf16 GEMV reaches 3.9-4.4 (docs/perf).
Here each weight costs ~0.75: `mma.sync.m16n8k16` (fp16, fp32 sums) does the products with
the weight as A (16 rows) and x as column 0 of B (the other 7 columns zero). The fragment
comes from the checkpoint's own layout (no repacking): lane (g, t) of a warp loads 16 bytes
(4 words, 32 codes) of rows g and g + 8 at words 4t.. of a 128-column group; each word gives
two mmas' A registers, nibbles (0, 4) and (1, 5) masked in place as fp16 subnormals u 2^-24
(16 u 2^-24 for the odd ones), then (2, 6), (3, 7) after a shift by 8: for a word of each of
the two rows (16 codes), 8 masks, 2 shifts and 2 mmas. The mma's k order is the lanes' own (k slots 2t, 2t + 1, 2t +
8, 2t + 9 hold the word's nibbles), so B carries x in that order: `_prep_kernel` writes x once
per product as fp16 pairs in the fragment order (x scaled by a power of two into fp16's range,
the odd nibbles' x / 16) with 8 x the group sums of x in the mma's units (the symmetric zero
point), which lanes 0-3 (column 0) load; the others load nothing (zeros). A group's mma sum
less that term, times the group's scale, adds into each lane's row; warps that split K are
summed at the end. (In an engine the kernel in front would write the pairs, as the prepared
rows of `h2_xpack` do.) Its timings against `w4_gemv1` are in docs/perf.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from w4_sweep import HBM_TBS, SHAPES, copies, nbytes, probe_args, write_rows  # noqa: E402

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton  # noqa: E402

#: (WM m-tiles of 16 rows a program, WK warps splitting K, D groups loaded ahead)
CONFIGS = [(1, 4, 0), (1, 8, 0), (1, 4, 1), (1, 8, 1), (2, 4, 1), (1, 16, 1), (1, 4, 2), (1, 8, 2), (2, 4, 2),
           (2, 8, 2), (1, 16, 2), (4, 4, 2), (2, 2, 2), (1, 2, 2)]

MMA2 = """{
.reg .b32 a0, a1, a2, a3, sa, sb;
and.b32 a0, $4, 0x000F000F;
and.b32 a1, $5, 0x000F000F;
and.b32 a2, $4, 0x00F000F0;
and.b32 a3, $5, 0x00F000F0;
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {a0, a1, a2, a3}, {$6, $7}, {$10, $11, $12, $13};
shr.u32 sa, $4, 8;
shr.u32 sb, $5, 8;
and.b32 a0, sa, 0x000F000F;
and.b32 a1, sb, 0x000F000F;
and.b32 a2, sa, 0x00F000F0;
and.b32 a3, sb, 0x00F000F0;
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {a0, a1, a2, a3}, {$8, $9}, {$0, $1, $2, $3};
}"""

if HAS_TRITON:
    MMA2_C = tl.constexpr(MMA2)

    @triton.jit
    def _four(v, NT: tl.constexpr):
        """The 4 columns of v [NT, 4] as 4 [NT] tensors (each thread keeps its own)."""
        a, b = tl.split(tl.reshape(v, [NT, 2, 2]))
        v0, v2 = tl.split(a)
        v1, v3 = tl.split(b)
        return v0, v1, v2, v3

    @triton.jit
    def _prep_kernel(x_ptr, f_ptr, sx_ptr, us_ptr, K, BLOCK: tl.constexpr):
        """x [K] -> f [K / 8, 4] int32: per word column, fp16 pairs (x0, x4), (x1, x5) / 16,
        (x2, x6), (x3, x7) / 16 of x 2^s (s puts max |x| in [2^14, 2^15)); sx [K / 128]:
        8 sum(x) a group times 2^(s - 24) (the mma sums' units); us: 2^(24 - s)."""
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 0)
        e = tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 14)
        scale = ((268 - e) << 23).to(tl.float32, bitcast=True)  # 2^(141 - e)
        fac = tl.where(tl.arange(0, 8) % 2 == 1, 0.0625, 1.0)
        xs = tl.reshape(x * scale, [BLOCK // 8, 8]) * fac[None, :]
        xs = tl.permute(tl.reshape(xs, [BLOCK // 8, 2, 2, 2]), (0, 2, 3, 1))  # [col, b, c, a]: nibble 4a + 2b + c
        lo, hi = tl.split(xs)
        pairs = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                          is_pure=True, pack=1)
        cols = tl.arange(0, BLOCK // 8)
        regs = tl.reshape(pairs, [BLOCK // 8, 4])  # register 2 b + c of the column
        tl.store(f_ptr + cols[:, None] * 4 + tl.arange(0, 4)[None, :], regs, mask=(cols < K // 8)[:, None])
        grp = tl.arange(0, BLOCK // 128)
        sums = tl.sum(tl.reshape(x, [BLOCK // 128, 128]), axis=1) * (8.0 * scale * 5.9604644775390625e-08)
        tl.store(sx_ptr + grp, sums, mask=grp < K // 128)
        tl.store(us_ptr, 16777216.0 / scale)

    @triton.jit
    def _loads(wa_p, wb_p, f_p, bmask, sx_ptr, s_ptr, ra, rb, stride_s, grp):
        """Every load of one 128-column group: the lanes' words of rows ra, rb [NT, 4], the four
        x fragments [NT, 4] (zeros off lanes 0-3), the zero-point term and the two scales."""
        wa = tl.load(wa_p + (grp * 16)[:, None])
        wb = tl.load(wb_p + (grp * 16)[:, None])
        f0 = tl.load(f_p + (grp * 64)[:, None], mask=bmask, other=0)
        f1 = tl.load(f_p + (grp * 64 + 4)[:, None], mask=bmask, other=0)
        f2 = tl.load(f_p + (grp * 64 + 8)[:, None], mask=bmask, other=0)
        f3 = tl.load(f_p + (grp * 64 + 12)[:, None], mask=bmask, other=0)
        sx = tl.load(sx_ptr + grp)
        sa = tl.load(s_ptr + ra.to(tl.int64) * stride_s + grp).to(tl.float32)
        sb = tl.load(s_ptr + rb.to(tl.int64) * stride_s + grp).to(tl.float32)
        return wa, wb, f0, f1, f2, f3, sx, sa, sb

    @triton.jit
    def _mma_word(wa, wb, f, c0, c1, c2, c3, NT: tl.constexpr):
        x0, x1, x2, x3 = _four(f, NT)
        return tl.inline_asm_elementwise(MMA2_C, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
                                         [wa, wb, x0, x1, x2, x3, c0, c1, c2, c3],
                                         dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)

    @triton.jit
    def _group(wa, wb, f0, f1, f2, f3, sx, sa, sb, NT: tl.constexpr):
        """One group's 8 mmas (its loads made), less the zero-point term, times the scales:
        the two rows' parts [NT]."""
        a0, a1, a2, a3 = _four(wa, NT)
        b0, b1, b2, b3 = _four(wb, NT)
        z = tl.zeros([NT], tl.float32)
        c0, c1, c2, c3 = _mma_word(a0, b0, f0, z, z, z, z, NT)
        c0, c1, c2, c3 = _mma_word(a1, b1, f1, c0, c1, c2, c3, NT)
        c0, c1, c2, c3 = _mma_word(a2, b2, f2, c0, c1, c2, c3, NT)
        c0, c1, c2, c3 = _mma_word(a3, b3, f3, c0, c1, c2, c3, NT)
        return (c0 - sx) * sa, (c2 - sx) * sb

    @triton.jit
    def _w4_mma_kernel(f_ptr, sx_ptr, us_ptr, w_ptr, s_ptr, y_ptr, stride_w, stride_s, n_groups,
                       WM: tl.constexpr, WK: tl.constexpr, D: tl.constexpr):
        """Program p: rows p 16 WM.. of y; warp w: m-tile w % WM, groups w // WM + j WK. D > 0:
        the loads of group j + D (words, x fragments, scales) are issued, carried through the
        loop, while group j is computed (D = 1 or 2); D = 0: each group's loads, then its mmas."""
        NT: tl.constexpr = 32 * WM * WK
        tid = tl.arange(0, NT)
        lane = tid % 32
        warp = tid // 32
        g = lane // 4
        t = lane % 4
        kp = warp // WM
        ra = tl.program_id(0) * (16 * WM) + (warp % WM) * 16 + g
        rb = ra + 8
        q4 = tl.arange(0, 4)[None, :]
        wa_p = w_ptr + ra.to(tl.int64)[:, None] * stride_w + (4 * t)[:, None] + q4
        wb_p = w_ptr + rb.to(tl.int64)[:, None] * stride_w + (4 * t)[:, None] + q4
        f_p = f_ptr + (16 * t)[:, None] + q4
        bmask = (g == 0)[:, None] & (q4 < 4)
        acc_a = tl.zeros([NT], tl.float32)
        acc_b = tl.zeros([NT], tl.float32)
        n_it = n_groups // WK
        last = kp + (n_it - 1) * WK
        if D >= 1:
            a_wa, a_wb, a_f0, a_f1, a_f2, a_f3, a_sx, a_sa, a_sb = _loads(
                wa_p, wb_p, f_p, bmask, sx_ptr, s_ptr, ra, rb, stride_s, kp)
        if D >= 2:
            b_wa, b_wb, b_f0, b_f1, b_f2, b_f3, b_sx, b_sa, b_sb = _loads(
                wa_p, wb_p, f_p, bmask, sx_ptr, s_ptr, ra, rb, stride_s, tl.minimum(kp + WK, last))
        for it in range(0, n_it):
            if D == 0:
                da, db = _group(*_loads(wa_p, wb_p, f_p, bmask, sx_ptr, s_ptr, ra, rb, stride_s, kp + it * WK), NT)
            elif D == 1:
                c_wa, c_wb, c_f0, c_f1, c_f2, c_f3, c_sx, c_sa, c_sb = \
                    a_wa, a_wb, a_f0, a_f1, a_f2, a_f3, a_sx, a_sa, a_sb
                a_wa, a_wb, a_f0, a_f1, a_f2, a_f3, a_sx, a_sa, a_sb = _loads(
                    wa_p, wb_p, f_p, bmask, sx_ptr, s_ptr, ra, rb, stride_s, tl.minimum(kp + (it + 1) * WK, last))
                da, db = _group(c_wa, c_wb, c_f0, c_f1, c_f2, c_f3, c_sx, c_sa, c_sb, NT)
            else:
                c_wa, c_wb, c_f0, c_f1, c_f2, c_f3, c_sx, c_sa, c_sb = \
                    a_wa, a_wb, a_f0, a_f1, a_f2, a_f3, a_sx, a_sa, a_sb
                a_wa, a_wb, a_f0, a_f1, a_f2, a_f3, a_sx, a_sa, a_sb = \
                    b_wa, b_wb, b_f0, b_f1, b_f2, b_f3, b_sx, b_sa, b_sb
                b_wa, b_wb, b_f0, b_f1, b_f2, b_f3, b_sx, b_sa, b_sb = _loads(
                    wa_p, wb_p, f_p, bmask, sx_ptr, s_ptr, ra, rb, stride_s, tl.minimum(kp + (it + 2) * WK, last))
                da, db = _group(c_wa, c_wb, c_f0, c_f1, c_f2, c_f3, c_sx, c_sa, c_sb, NT)
            acc_a += da
            acc_b += db
        us = tl.load(us_ptr)
        ya = tl.sum(tl.reshape(acc_a, [WK, WM * 32]), axis=0) * us
        yb = tl.sum(tl.reshape(acc_b, [WK, WM * 32]), axis=0) * us
        idx = tl.arange(0, WM * 32)
        rows = tl.program_id(0) * (16 * WM) + (idx // 32) * 16 + (idx % 32) // 4
        first = idx % 4 == 0  # lanes t = 0 hold column 0
        tl.store(y_ptr + rows, ya.to(y_ptr.dtype.element_ty), mask=first)
        tl.store(y_ptr + rows + 8, yb.to(y_ptr.dtype.element_ty), mask=first)


def prep(x: torch.Tensor):
    """(f, sx, us) of one row x [1, K] (K % 128 == 0) for `w4_mma`."""
    K = x.shape[1]
    f = torch.empty(K // 8, 4, dtype=torch.int32, device=x.device)
    sx = torch.empty(K // 128, dtype=torch.float32, device=x.device)
    us = torch.empty(1, dtype=torch.float32, device=x.device)
    _prep_kernel[(1,)](x, f, sx, us, K, BLOCK=triton.next_power_of_2(K), num_warps=8)
    return f, sx, us


def w4_mma(prepped, packed: torch.Tensor, scales: torch.Tensor, y: torch.Tensor, cfg: tuple) -> torch.Tensor:
    """y [1, N] = x W^T for int4 g128 symmetric `packed` int32 [N, K / 8], `scales` [N, K / 128]."""
    wm, wk, d = cfg
    f, sx, us = prepped
    N = packed.shape[0]
    _w4_mma_kernel[(N // (16 * wm),)](f, sx, us, packed, scales, y, packed.stride(0), scales.stride(0),
                                      scales.shape[1], WM=wm, WK=wk, D=d, num_warps=wm * wk)
    return y


def main(argv=None) -> None:
    args = probe_args(__doc__, argv)
    if args is None:
        return
    from atom.model_ops.kernels.w4_gemm import dequantize_w4, w4_linear_launch
    from atom.utils.cuda_timing import graph_time
    rows = []
    for N, K in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(N + K)
        packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (N, K // 8), dtype=torch.int32, device="cuda", generator=g)
        scales = (torch.rand(N, K // 128, device="cuda", generator=g) / K ** 0.5).bfloat16()
        x = torch.randn(1, K, device="cuda", generator=g).bfloat16()
        ref = x.double() @ dequantize_w4(packed, scales, None, "int4", 128, K).double().t()
        sets = [(packed, scales)] + [(packed.clone(), scales.clone())
                                     for _ in range(copies(nbytes(packed, scales)) - 1)]
        wbytes = nbytes(packed, scales)
        y = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
        base = dict(N=N, K=K, weight_bytes=wbytes)
        t_now = graph_time([lambda p=p, s=s: w4_linear_launch(x, p, s, None, None, "int4", 128, K) for p, s in sets],
                           iters=args.iters)
        err_now = ((w4_linear_launch(x, packed, scales, None, None, "int4", 128, K).double() - ref).abs().max()
                   / ref.abs().max()).item()
        rows.append(dict(base, kernel="w4_gemv1 (engine)", us=t_now * 1e6, tbs=wbytes / t_now / 1e12, err=err_now))
        print(f"{N}x{K}: w4_gemv1 {t_now * 1e6:.2f} us ({wbytes / t_now / 1e12:.2f} TB/s, limit {HBM_TBS}) "
              f"err {err_now:.1e}", flush=True)
        t_prep = graph_time([lambda: prep(x)] * 8, iters=args.iters)
        rows.append(dict(base, kernel="prep", us=t_prep * 1e6))
        pre = prep(x)
        for cfg in CONFIGS:
            if N % (16 * cfg[0]) or (K // 128) % cfg[1] or (K // 128) // cfg[1] < 2:
                continue
            try:
                w4_mma(pre, packed, scales, y, cfg)
                torch.cuda.synchronize()
                err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                t = graph_time([lambda p=p, s=s: w4_mma(pre, p, s, y, cfg) for p, s in sets], iters=args.iters)
            except Exception as e:  # noqa: BLE001 - a probe reports a config that does not build or run
                rows.append(dict(base, kernel="w4_mma", cfg=list(cfg), error=f"{type(e).__name__}: {str(e)[:300]}"))
                print(f"   mma {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            rows.append(dict(base, kernel="w4_mma", cfg=list(cfg), us=t * 1e6, tbs=wbytes / t / 1e12, err=err))
            print(f"   mma {cfg}: {t * 1e6:.2f} us ({wbytes / t / 1e12:.2f} TB/s) err {err:.1e}; prep {t_prep * 1e6:.2f} us",
                  flush=True)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
