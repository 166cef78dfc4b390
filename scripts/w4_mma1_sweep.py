"""Times the one-row int4 product on the tensor cores (`kernels.w4_mma1`) over its tiles at the
Llama-3.1-8B linear shapes (symmetric int4, groups of 128), beside the CUDA-core one-row GEMV
the engine ran before it (`w4_gemv1`, its table's tile) and bf16 `F.linear`; each with its
largest error over the largest output of the float64 reference. A probe: JSON to --out.

    python3 scripts/w4_mma1_sweep.py --out w4_mma1_sweep.json
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from w4_sweep import HBM_TBS, SHAPES, copies, nbytes, packed_weights, probe_args, write_rows  # noqa: E402

TILES = [dict(ROWS=r, NW=nw, REP=rep, AHEAD=a, num_warps=nw) for r in (16, 32) for nw in (2, 4, 8)
         for rep, a in ((1, True), (1, False), (2, True), (4, True))]


def main(argv=None) -> int:
    args = probe_args(__doc__, argv)
    if args is None:
        return 2
    from atom.model_ops.kernels.w4_gemm import FORMATS, dequantize_w4
    from atom.model_ops.kernels.w4_gemv1 import tiles as gemv1_tiles
    from atom.model_ops.kernels.w4_gemv1 import w4_gemv1_launch
    from atom.model_ops.kernels.w4_mma1 import w4_mma1_launch
    from atom.model_ops.kernels.triton_import import pdl_args
    from atom.utils.cuda_timing import graph_time
    rows = []
    for N, K in SHAPES:
        packed, scales, _ = packed_weights("int4", N, K, 128, False)
        sets = [(packed, scales)] + [(packed.clone(), scales.clone()) for _ in range(copies(nbytes(packed, scales)) - 1)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ dequantize_w4(packed, scales, None, "int4", 128, K).double().T
        mb = nbytes(packed, scales) / 1e6

        def err(y):
            return ((y.double() - ref).abs().max() / ref.abs().max()).item()

        def timed(name, cfg, call):
            try:
                e = err(call(packed, scales))
                t = graph_time([lambda p=p, s=s: call(p, s) for p, s in sets], iters=args.iters)
            except Exception as ex:  # noqa: BLE001 - a tile that does not compile or does not tile the shape
                print(f"    {name} {cfg}: {type(ex).__name__}: {str(ex)[:160]}", flush=True)
                return None
            rows.append(dict(N=N, K=K, kernel=name, cfg=cfg, us=t * 1e6, tbs=mb / t / 1e6, rel_err=e))
            print(f"    {name} {cfg}: {t * 1e6:.1f} us, {mb / t / 1e6:.2f} TB/s, error {e:.1e}", flush=True)
            return t * 1e6

        w16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        t16 = graph_time([lambda: F.linear(x, w16)] * 4, iters=args.iters) * 1e6
        g1 = gemv1_tiles(N, "int4", K)
        common = dict(HAS_ZP=False, **pdl_args(x))

        def gemv1(p, s, cfg=g1):
            y = torch.empty(1, N, dtype=x.dtype, device=x.device)
            w4_gemv1_launch(x, p, s, s, None, y, FORMATS.index("int4"), 128, cfg, common)
            return y
        t_old = timed("w4_gemv1", g1, gemv1)
        best = None
        for cfg in TILES:
            def mma(p, s, cfg=cfg):
                y = torch.empty(1, N, dtype=x.dtype, device=x.device)
                return w4_mma1_launch(x, p, s, None, y, 128, cfg)
            t = timed("w4_mma1", cfg, mma)
            if t is not None and (best is None or t < best[0]):
                best = (t, cfg)
        print(f"N={N} K={K} ({mb:.1f} MB, {mb / HBM_TBS:.1f} us at {HBM_TBS} TB/s): bf16 {t16:.1f} us, w4_gemv1 "
              f"{t_old:.1f} us, best w4_mma1 {best[0]:.1f} us {best[1]}", flush=True)
        del sets, w16
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
