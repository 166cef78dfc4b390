"""Times the 4-bit weight's write-out (`atom.model_ops.kernels.w4_dequant`, the route 4-bit
products of `W4_DEQUANT_MIN_M` rows or more take) for a grid of tiles at the Llama-3.1-8B
linear shapes, int4 g128 and MXFP4 pair words; GB/s moved (the 4-bit bytes and scales read,
2 bytes a weight written) next to the HBM limit. At 128 rows it also times the whole route
(write-out + bf16 GEMM) against bf16 `F.linear` and the in-kernel decode (`w4_dot`), so the
write-out's share of a large decode step shows. A probe, not a benchmark: JSON to --out.

    python3 scripts/w4_dequant_probe.py --out w4_dequant_probe.json

Each timing replays a CUDA graph over enough weight copies to miss L2 (`w4_sweep.copies`);
every tile's output is checked against the module's tile (the same values, bit for bit).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from w4_sweep import HBM_TBS, SHAPES, copies, nbytes, packed_weights, probe_args, write_rows  # noqa: E402

#: (BLOCK_N rows, BLOCK_W words, num_warps); the module's tile is timed first (32 rows a program or more
#: ran 3-5x slower on an H100: docs/perf)
TILES = [(4, 128, 4), (16, 32, 4), (8, 32, 4), (16, 64, 4), (16, 128, 8), (8, 64, 4), (8, 128, 4), (2, 256, 4),
         (4, 256, 8), (32, 32, 4)]
ROWS = 128  # the whole route's rows (a decode step of 65-128 sequences)


def main(argv=None) -> int:
    args = probe_args(__doc__, argv)
    if args is None:
        return 2
    from atom.model_ops.kernels import fp4_pairs, w4_dequant as wd
    from atom.model_ops.kernels.w4_gemm import FORMATS, w4_linear_launch
    from atom.utils.cuda_timing import graph_time
    default = (wd.BLOCK_N, wd.BLOCK_W, wd.NUM_WARPS)
    tiles = [default] + [t for t in TILES if t != default]
    rows = []
    print(f"{'format':<13}{'N':>6}{'K':>6}  {'tile':<14}{'us':>8}{'GB/s':>7}{'%HBM':>6}")
    for N, K in SHAPES:
        w16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(ROWS, K, device="cuda", dtype=torch.bfloat16)
        t16 = graph_time([lambda w=w: F.linear(x, w) for w in [w16] + [w16.clone() for _ in range(
            copies(nbytes(w16)) - 1)]], iters=args.iters)
        for fmt, g in (("int4", 128), ("mxfp4_pairs", 32)):
            packed, scales, zeros = packed_weights("int4" if fmt == "int4" else "mxfp4", N, K, g, False)
            words = packed if fmt == "int4" else fp4_pairs.pair_words(packed.view(torch.int32))
            sets = [(words, scales)] + [(words.clone(), scales.clone()) for _ in range(copies(nbytes(words)) - 1)]
            moved = nbytes(words, scales) + N * K * 2
            fi = FORMATS.index(fmt)
            ref = wd.w4_dequant(words, scales, None, fi, g, K, torch.bfloat16)
            for tile in tiles:
                row = dict(format=fmt, N=N, K=K, BLOCK_N=tile[0], BLOCK_W=tile[1], num_warps=tile[2],
                           is_default=tile == default)
                try:
                    same = torch.equal(wd.w4_dequant(words, scales, None, fi, g, K, torch.bfloat16, tile=tile), ref)
                    t = graph_time([lambda s=s, tile=tile: wd.w4_dequant(s[0], s[1], None, fi, g, K, torch.bfloat16,
                                                                        tile=tile) for s in sets], iters=args.iters)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit
                    print(f"  {fmt} {N}x{K} {tile}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                row.update(us=t * 1e6, gbs=moved / t / 1e9, same_bits=same)
                rows.append(row)
                print(f"{fmt:<13}{N:>6}{K:>6}  {str(tile):<14}{t * 1e6:8.1f}{moved / t / 1e9:7.0f}"
                      f"{moved / t / 1e9 / HBM_TBS / 10:6.0f}{'' if same else '  DIFFERS'}", flush=True)
            routes = {}
            for name, cfg in (("written out", dict(kernel="w4_dequant")),
                              ("w4_dot", dict(kernel="w4_dot", BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4,
                                              num_stages=3, SPLIT_K=1))):
                routes[name] = graph_time([lambda s=s, cfg=cfg: w4_linear_launch(x, s[0], s[1], None, None, fmt, g, K,
                                                                                 config=cfg) for s in sets],
                                          iters=args.iters) * 1e6
            rows.append(dict(format=fmt, N=N, K=K, M=ROWS, bf16_us=t16 * 1e6, **{f"{k}_us": v for k, v in routes.items()}))
            print(f"  M={ROWS}: bf16 {t16 * 1e6:.1f} us, written out {routes['written out']:.1f}, "
                  f"w4_dot {routes['w4_dot']:.1f}", flush=True)
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
