"""Times the engine's CUDA-core one-row (batch-1 decode) ptpc FP8 product in fp16 pair
arithmetic (`atom.model_ops.kernels.fp8_gemv1`, every tile of a grid) against the tensor-core
swap-AB kernel (`quant_gemv_dot`, its split K and reduction included), on the Llama-3.1-8B
linear shapes, beside bf16 `F.linear`; TB/s of the fp8 weight next to the HBM limit. A probe,
not a benchmark: JSON of every timing to --out. Its best tiles are `fp8_gemv1.TILES`.

    python3 scripts/fp8_h2_probe.py --out fp8_h2_probe.json

Why: `fp8_gemv_sweep.py` found the bf16 GEMV widening each fp8 weight to fp32 slower than the
swap-AB kernel at every shape (instruction-bound: ~3 instructions a weight byte); the fp16
pair kernel spends 4 instructions a word of 4 weights (its docstring). Errors: max |y - ref| /
max |ref| against the exact product (float64) of the same operands; `fp8_gemv1.h2_ref` is the
kernel's rounding in torch ("vs model"). Each timing replays a CUDA graph over enough weight
copies to miss L2 (`w4_sweep`'s helpers); a tile that fails to compile or errs by more than
2e-2 is reported, not fatal. The table's tile is timed again with its weight loads cached in L2
only (`fp8_gemv1.WORD_CACHE` ".cg") and with its scales loaded before the loop
(`fp8_gemv1.SCALES_FIRST`).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_gemv_sweep import fp8_operands  # noqa: E402
from w4_sweep import HBM_TBS, SHAPES, copies, probe_args, write_rows  # noqa: E402

from atom.model_ops.kernels.fp8_gemv1 import MIN_CAPABILITY, fp8_gemv1_launch, h2_ref, tile_for  # noqa: E402
from atom.model_ops.kernels.triton_import import HAS_TRITON  # noqa: E402

#: (BLOCK_N rows a program, BLOCK_W loads a row a step, num_warps, DW words a load, AHEAD)
#: (the single-word, 16-row and 64-load 4-warp tiles of an earlier grid were slower at every Llama
#: shape, docs/perf; this grid explores fewer rows a program and other warps around the double-word
#: tiles that won)
TILES = [(4, 128, 4, 1, True), (8, 128, 4, 2, True), (4, 128, 4, 2, True), (4, 128, 4, 2, False),
         (2, 128, 4, 2, True), (1, 128, 4, 2, True), (4, 256, 8, 2, True), (2, 256, 8, 2, True),
         (4, 64, 2, 2, True), (8, 64, 2, 2, True), (2, 64, 2, 2, True)]
BAD = 2e-2


def rel(y, ref) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def tile_rows(tiles, x, xs, sets, ws, ref, N, K, iters, base, word_cache: str = "", scales_first: bool = False) -> list:
    """Each tile: checked once (errors against the exact product and `h2_ref`), then timed;
    `word_cache`: the weight loads' cache modifier (`fp8_gemv1.WORD_CACHE`); `scales_first`:
    `fp8_gemv1.SCALES_FIRST`."""
    from atom.utils.cuda_timing import graph_time
    out, models = [], {}
    for tile in tiles:
        bn, bw, warps, dw, ahead = tile
        row = dict(base, kind="ptpc", BLOCK_N=bn, BLOCK_W=bw, num_warps=warps, DW=dw, AHEAD=ahead,
                   words_a_step=bw * dw, word_cache=word_cache, scales_first=scales_first)
        name = f"{tile}{' ' + word_cache if word_cache else ''}{' scales first' if scales_first else ''}"
        opts = dict(word_cache=word_cache, scales_first=scales_first)
        y = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
        try:
            fp8_gemv1_launch(x, xs, sets[0], ws, out=y, tile=tile, **opts)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a probe reports a tile that does not build or run
            out.append(dict(row, error=f"{type(e).__name__}: {str(e)[:300]}"))
            print(f"   {name}: FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        if dw not in models:
            models[dw] = h2_ref(x, sets[0], dw) * ws * xs
        err, err_model = rel(y, ref), rel(y, models[dw])
        t = graph_time([lambda w=w: fp8_gemv1_launch(x, xs, w, ws, out=y, tile=tile, **opts)
                        for w in sets], iters)
        out.append(dict(row, us=t * 1e6, tbs=N * K / t / 1e12, rel_err=err, model_err=err_model, ok=err <= BAD))
        print(f"   {name}: {t * 1e6:8.1f} us {N * K / t / 1e12:5.2f} TB/s"
              f"  x dot {base['dot_us'] / t / 1e6:5.2f}  err {err:.1e} (vs model {err_model:.1e})"
              f"{'' if err <= BAD else '  WRONG'}", flush=True)
    return out


def main(argv=None) -> int:
    args = probe_args(__doc__, argv)
    if args is None:
        return 2
    if not HAS_TRITON or torch.cuda.get_device_capability() < MIN_CAPABILITY:
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
        sets = [w8] + [w8.clone() for _ in range(copies(w8.numel()) - 1)]
        t_dot = graph_time([lambda w=w: quant_gemv_dot_launch(xq, xs, w, ws, None, torch.bfloat16) for w in sets],
                           iters=args.iters)
        err_dot = rel(quant_gemv_dot_launch(xq, xs, w8, ws, None, torch.bfloat16), ref)
        base = dict(N=N, K=K, dot_us=t_dot * 1e6, dot_tbs=N * K / t_dot / 1e12, dot_rel_err=err_dot,
                    bf16_us=t16 * 1e6, hbm_tbs=HBM_TBS)
        print(f"{N:>6} x {K:<6} swap-AB {t_dot * 1e6:8.1f} us {N * K / t_dot / 1e12:5.2f} TB/s (err {err_dot:.1e})"
              f"   bf16 F.linear {t16 * 1e6:8.1f} us", flush=True)
        rows.append(dict(base, kind="swap_ab", us=t_dot * 1e6, tbs=N * K / t_dot / 1e12, rel_err=err_dot))
        rows += tile_rows(TILES, xq, xs, sets, ws, ref, N, K, args.iters, base)
        rows += tile_rows([tile_for(N, K)], xq, xs, sets, ws, ref, N, K, args.iters, base, word_cache=".cg")
        rows += tile_rows([tile_for(N, K)], xq, xs, sets, ws, ref, N, K, args.iters, base, scales_first=True)
        del sets, w8
    write_rows(args.out, rows)
    summary(rows)
    return 0


def summary(rows) -> None:
    """One line a shape: the swap-AB kernel, the best correct tile, bf16."""
    print(f"\n{'N':>6}{'K':>6} {'swap-AB us':>10}{'TB/s':>6} {'ptpc us':>8}{'TB/s':>6}{'x dot':>6} "
          f"{'bf16 us':>8}  best tile (BLOCK_N, BLOCK_W, warps, DW, AHEAD), cache modifier, scales first")
    for N, K in SHAPES:
        at = [r for r in rows if (r["N"], r["K"]) == (N, K)]
        if not at:
            continue
        b0 = at[0]
        good = [r for r in at if r["kind"] == "ptpc" and r.get("ok")]
        if not good:
            print(f"{N:>6}{K:>6} {b0['dot_us']:>10.1f}{b0['dot_tbs']:>6.2f}  no correct tile")
            continue
        b = min(good, key=lambda r: r["us"])
        tile = (f"({b['BLOCK_N']}, {b['BLOCK_W']}, {b['num_warps']}, {b['DW']}, {b['AHEAD']}) {b['word_cache']}"
                f"{' scales first' if b.get('scales_first') else ''}")
        print(f"{N:>6}{K:>6} {b0['dot_us']:>10.1f}{b0['dot_tbs']:>6.2f} {b['us']:>8.1f}{b['tbs']:>6.2f}"
              f"{b0['dot_us'] / b['us']:>6.2f} {b0['bf16_us']:>8.1f}  {tile}")


if __name__ == "__main__":
    sys.exit(main())
