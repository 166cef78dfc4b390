"""Times the one-row 4-bit GEMV with the RMSNorm inside (`w4_gemv1.w4_gemv1_fused`, the plan's
"w4_norm_gemv") against the kernels it replaces, at Llama-3.1-8B's shapes: the add + RMSNorm
inside the q/k/v (6144 x 4096) and gate-up (28672 x 4096) products, and the gate-up product
with the norm and SiLU-and-mul both inside (`gated`, gate and up rows in one program).
Unfused: the norm kernel, the one-row GEMV with the table's tile (and SiLU-and-mul), as the
engine runs them. Fused: a few tiles. A tuning probe for `w4_gemv1.fused_tiles`, not a
benchmark: JSON of every timing to --out.

    python3 scripts/w4_fused_sweep.py --out w4_fused_sweep.json [--formats int4 mxfp4]

Each timing replays a CUDA graph over enough weight copies to miss L2 (`w4_sweep`'s helpers).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from w4_sweep import FORMATS, copies, nbytes, packed_weights, probe_args, write_rows  # noqa: E402

# (layer, N, K, what runs inside: "norm", or "norm+silu" (gated))
SHAPES = [("qkv", 6144, 4096, "norm"), ("gate_up", 2 * 14336, 4096, "norm"), ("gate_up", 2 * 14336, 4096, "norm+silu")]
# (BLOCK_N, num_warps, AHEAD, DW); HALF2 always, BLOCK_W = 32 x num_warps, DW words a thread's load
TILES = [(8, 8, True, 1), (4, 8, True, 1), (8, 4, True, 1), (4, 4, True, 1), (16, 4, True, 1), (16, 4, False, 1),
         (8, 4, False, 1), (8, 8, False, 1), (8, 8, False, 2), (8, 4, False, 2), (8, 4, True, 2), (8, 2, True, 2),
         (4, 4, True, 2), (16, 4, False, 2), (16, 2, True, 2)]


def main(argv=None) -> int:
    args = probe_args(__doc__, argv, formats=dict(nargs="*", default=["int4", "mxfp4"], choices=list(FORMATS)))
    if args is None:
        return 2
    from atom.model_ops.kernels.activation import silu_and_mul
    from atom.model_ops.kernels.rmsnorm import fused_add_rms_norm
    from atom.model_ops.kernels.w4_gemm import w4_linear_launch
    from atom.model_ops.kernels.w4_gemv1 import fused_tiles, w4_gemv1_fused
    from atom.utils.cuda_timing import graph_time
    rows = []
    print(f"{'format':<7}{'layer':<8}{'inside':<10}{'N':>6}{'K':>6} {'front':>6}{'gemv':>6}{'unfused':>8}{'fused':>7}"
          f"{'x':>6}  best fused tile (table's fused tile us)")
    for name in args.formats:
        fmt, g, zp = FORMATS[name]
        for layer, N, K, inside in SHAPES:
            gated = inside == "norm+silu"
            x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
            nw = torch.rand(K, device="cuda", dtype=torch.bfloat16) + 0.5
            one = packed_weights(fmt, N, K, g, zp)
            sets = [one] + [tuple(t.clone() if t is not None else None for t in one)
                            for _ in range(copies(nbytes(*one)) - 1)]

            def front():
                return fused_add_rms_norm(x, res, nw, 1e-5)[0]

            def unfused(s):
                y = w4_linear_launch(front(), s[0], s[1], s[2], None, fmt, g, K)
                return silu_and_mul(y) if gated else y

            def fused(s, cfg=None):
                return w4_gemv1_fused(x, res, nw, 1e-5, s[0], s[1], s[2], fmt, g, K, gated=gated, cfg=cfg)[0]
            t_norm = graph_time([front for _ in sets], iters=args.iters)
            h = front()
            t_gemv = graph_time([lambda s=s: w4_linear_launch(h, s[0], s[1], s[2], None, fmt, g, K) for s in sets],
                                iters=args.iters)
            t_un = graph_time([lambda s=s: unfused(s) for s in sets], iters=args.iters)
            ref = unfused(one).float()
            table = fused_tiles(gated)
            t_table = graph_time([lambda s=s: fused(s) for s in sets], iters=args.iters)
            best = None
            for bn, warps, ahead, dw in TILES:
                cfg = dict(BLOCK_N=bn, BLOCK_W=32 * warps, num_warps=warps, num_stages=3, AHEAD=ahead, HALF2=True,
                           DW=dw)
                err = ((fused(one, cfg).float() - ref).abs().max() / ref.abs().max()).item()
                t = graph_time([lambda s=s, c=cfg: fused(s, c) for s in sets], iters=args.iters)
                rows.append(dict(format=name, layer=layer, inside=inside, N=N, K=K, cfg=cfg, us=t * 1e6, rel_err=err,
                                 unfused_us=t_un * 1e6, front_us=t_norm * 1e6, gemv_us=t_gemv * 1e6,
                                 table_us=t_table * 1e6, table=table))
                if best is None or t < best[0]:
                    best = (t, cfg, err)
            t, cfg, err = best
            print(f"{name:<7}{layer:<8}{inside:<10}{N:>6}{K:>6} {t_norm * 1e6:>6.1f}{t_gemv * 1e6:>6.1f}{t_un * 1e6:>8.1f}"
                  f"{t * 1e6:>7.1f}{t_un / t:>6.2f}  BLOCK_N={cfg['BLOCK_N']} warps={cfg['num_warps']} "
                  f"AHEAD={cfg['AHEAD']} DW={cfg['DW']} (rel err {err:.1e}; table {t_table * 1e6:.1f})", flush=True)
            del sets, one
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
