"""Times one MoE shape's experts layer (`fused_experts`, the path each table's rule picks)
under two tile files at the given token counts, CUDA-graph replays on a GPU, beside the
weight-read floor at 4.8 TB/s. Prints each row as it is measured, writes JSON.
`--old-unfused` runs the "old" column with SiLU-and-mul as its own kernel (the same file
twice then compares the activation inside the first product against it).

    python scripts/moe_tiles_compare.py --old A.json --new B.json --top-k 6 --out cmp.json \
        [--tokens 1 16 64 128 200 256 512 2048 16384] [--old-unfused]
"""
from __future__ import annotations

import argparse
import json

import torch

HBM_BYTES_PER_S = 4.8e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="a tile file (atom/model_ops/moe/configs/...)")
    ap.add_argument("--new", required=True, help="a tile file of the same shape")
    ap.add_argument("--top-k", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 200, 256, 512, 2048, 16384])
    ap.add_argument("--old-unfused", action="store_true", help="the old column without the fused activation")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_tiles_compare needs a CUDA GPU")
    from atom.model_ops.activation import silu_and_mul
    from atom.model_ops.moe.experts_triton import fused_experts, skips_sorting
    from atom.model_ops.moe.tile_configs import TileTable
    from atom.tuning.moe_tune import gpu_time_us, make_case
    old, new = TileTable.from_file(args.old), TileTable.from_file(args.new)
    E, I, H = old.experts, old.width, old.hidden
    if (new.experts, new.width, new.hidden, new.dtype) != (E, I, H, old.dtype):
        raise SystemExit(f"--new is for E={new.experts} I={new.width} H={new.hidden} {new.dtype}, "
                         f"--old for E={E} I={I} H={H} {old.dtype}")
    dtype = getattr(torch, old.dtype)
    rows = []
    for T in args.tokens:
        x, w13, w2, weights, ids = make_case(E, I, H, args.top_k, T, dtype, "cuda")
        touched = int(ids.unique().numel())
        floor_us = touched * 3 * I * H * x.element_size() / HBM_BYTES_PER_S * 1e6
        row = dict(tokens=T, experts_touched=touched, floor_us=round(floor_us, 1))
        for name, table in (("old", old), ("new", new)):
            fuse = False if name == "old" and args.old_unfused else None
            us = gpu_time_us(lambda: fused_experts(x, w13, w2, weights, ids, silu_and_mul, tiles=table,
                                                   fuse_activation=fuse))
            row[name] = dict(us=round(us, 1), config=table.config_for(T, args.top_k),
                             sorted=not skips_sorting(T, args.top_k, E, table))
        row["speedup"] = round(row["old"]["us"] / row["new"]["us"], 3)
        print(f"T={T:6d} old {row['old']['us']:9.1f} us  new {row['new']['us']:9.1f} us  "
              f"x{row['speedup']:.2f}  floor {floor_us:8.1f} us", flush=True)
        rows.append(row)
        with open(args.out, "w") as f:
            json.dump(dict(shape=dict(experts=E, width=I, hidden=H, top_k=args.top_k),
                           old=args.old, new=args.new, old_unfused=args.old_unfused, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
