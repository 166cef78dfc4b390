"""Times the one-row 4-bit GEMV reading a row prepared by the kernel in front (`kernels.h2_xpack`,
`w4_gemv1_prepared`: the plan's "w4_prepared_x") against the GEMV preparing x itself, at
Llama-3.1-8B's shapes and a few tiles (the table's first), then the producers against the
kernels they replace, and a batch-1 MLP of each format both ways (add + RMSNorm, gate-up,
SiLU-and-mul, down, in one CUDA graph). A probe for the fusion, not a benchmark: JSON of every
timing to --out.

    python3 scripts/w4_prepared_sweep.py --out w4_prepared_sweep.json [--formats int4 mxfp4 mxfp4_pairs]

Each timing replays a CUDA graph over enough weight copies to miss L2 (`w4_sweep`'s helpers).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from w4_gemv1_sweep import FORMATS, weights  # noqa: E402
from w4_sweep import HBM_TBS, SHAPES, copies, nbytes, probe_args, write_rows  # noqa: E402

# (BLOCK_N, num_warps, AHEAD, DW) beside the table's tile, HALF2 on, CHAIN off
TILES = [(8, 8, True, 1), (16, 4, False, 1), (8, 4, True, 1), (8, 8, True, 2), (8, 4, True, 2), (8, 2, True, 2)]


def main(argv=None) -> int:
    args = probe_args(__doc__, argv, formats=dict(nargs="*", default=["int4", "mxfp4", "mxfp4_pairs"],
                                                  choices=list(FORMATS)))
    if args is None:
        return 2
    from atom.model_ops.kernels.activation import silu_and_mul
    from atom.model_ops.kernels.h2_xpack import norm_prepare, prepare_row, silu_prepare
    from atom.model_ops.kernels.rmsnorm import fused_add_rms_norm
    from atom.model_ops.kernels.w4_gemm import w4_linear_launch
    from atom.model_ops.kernels.w4_gemv1 import tiles, w4_gemv1_prepared
    from atom.utils.cuda_timing import graph_time
    rows = []
    print(f"{'format':<12}{'N':>6}{'K':>6} {'x us':>7}{'prepared us':>12}{'TB/s':>6}{'%HBM':>5}  tile")
    for name in args.formats:
        fmt, g, zp = FORMATS[name]
        for N, K in SHAPES:
            one = weights(fmt, N, K, g, zp)
            sets = [one] + [tuple(t.clone() if t is not None else None for t in one)
                            for _ in range(copies(nbytes(*one)) - 1)]
            x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
            row = prepare_row(x, fmt == "int4")
            table = tiles(N, fmt, K)
            for cfg in [table] + [dict(BLOCK_N=bn, BLOCK_W=32 * w, num_warps=w, num_stages=3, AHEAD=ahead,
                                       HALF2=True, DW=dw) for bn, w, ahead, dw in TILES]:
                cfg = dict(cfg, CHAIN=False)
                t_x = graph_time([lambda s=s: w4_linear_launch(x, s[0], s[1], s[2], None, fmt, g, K,
                                                               config=dict(cfg, kernel="w4_gemv1")) for s in sets],
                                 iters=args.iters)
                t_p = graph_time([lambda s=s: w4_gemv1_prepared(row, s[0], s[1], s[2], fmt, g, K, cfg=cfg)
                                  for s in sets], iters=args.iters)
                tbs = nbytes(*one) / t_p / 1e12
                rows.append(dict(format=name, N=N, K=K, cfg=cfg, is_table=cfg == dict(table, CHAIN=False),
                                 x_us=t_x * 1e6, prepared_us=t_p * 1e6))
                print(f"{name:<12}{N:>6}{K:>6} {t_x * 1e6:>7.1f}{t_p * 1e6:>12.1f}{tbs:>6.2f}{tbs / HBM_TBS:>5.0%}  "
                      f"{'table ' if cfg == dict(table, CHAIN=False) else ''}BLOCK_N={cfg['BLOCK_N']} "
                      f"warps={cfg['num_warps']} AHEAD={cfg.get('AHEAD', False)} DW={cfg.get('DW', 1)}", flush=True)
            del sets, one
    h, r = (torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    y = torch.randn(1, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    for label, fn in (("add + RMSNorm", lambda: fused_add_rms_norm(h, r, w, 1e-6)),
                      ("add + RMSNorm, prepared", lambda: norm_prepare(h, r, w, 1e-6, True)),
                      ("SiLU-and-mul", lambda: silu_and_mul(y)), ("SiLU-and-mul, prepared", lambda: silu_prepare(y, True))):
        t = graph_time([fn], iters=args.iters)
        rows.append(dict(producer=label, us=t * 1e6))
        print(f"{label:<28}{t * 1e6:>7.1f} us", flush=True)
    for name in args.formats:  # the batch-1 MLP both ways
        fmt, g, zp = FORMATS[name]
        gu, dn = weights(fmt, 28672, 4096, g, zp), weights(fmt, 4096, 14336, g, zp)
        mlps = [(gu, dn)] + [(tuple(t.clone() if t is not None else None for t in gu),
                              tuple(t.clone() if t is not None else None for t in dn))
                             for _ in range(copies(nbytes(*gu, *dn)) - 1)]

        def unprepared(m):
            a, _ = fused_add_rms_norm(h, r, w, 1e-6)
            act = silu_and_mul(w4_linear_launch(a, *m[0], None, fmt, g, 4096))
            return w4_linear_launch(act, *m[1], None, fmt, g, 14336)

        def prepared(m):
            row, _ = norm_prepare(h, r, w, 1e-6, fmt == "int4")
            act = silu_prepare(w4_gemv1_prepared(row, *m[0], fmt, g, 4096), fmt == "int4")
            return w4_gemv1_prepared(act, *m[1], fmt, g, 14336)
        t_u = graph_time([lambda m=m: unprepared(m) for m in mlps], iters=args.iters)
        t_p = graph_time([lambda m=m: prepared(m) for m in mlps], iters=args.iters)
        rows.append(dict(format=name, mlp_us=t_u * 1e6, mlp_prepared_us=t_p * 1e6))
        print(f"{name:<12} batch-1 MLP (norm, gate-up, SiLU, down): {t_u * 1e6:.1f} us, prepared {t_p * 1e6:.1f} us "
              f"({t_u / t_p:.3f}x)", flush=True)
        del mlps, gu, dn
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
