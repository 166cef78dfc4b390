"""The MoE grouping (`experts_triton.moe_align`) at decode sizes, both ways: the one-program
kernel against the fill and three kernels, each timed in CUDA-graph replays (50 calls a
graph, as a decode step's layers would run them) and checked against `moe_align_ref`. The
timings per case are what `ONE_PROGRAM_MAX` is set from:
the largest padded pairs x experts at which the one program is still the faster. GPU only.

    python3 scripts/moe_align_sweep.py [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

CASES = [(1, 64, 6, 16), (4, 64, 6, 16), (16, 64, 6, 16), (21, 64, 6, 16), (42, 64, 6, 16), (250, 64, 6, 16),
         (250, 128, 8, 16), (4096, 128, 8, 64),
         (1, 128, 8, 16), (4, 128, 8, 16), (8, 128, 8, 16), (16, 128, 8, 16),
         (1, 256, 8, 16), (4, 256, 8, 16), (1, 32, 4, 16), (16, 32, 4, 16)]  # tokens, experts, top-k, BLOCK_M


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_align_sweep.py times Triton kernels in CUDA graphs: it needs a CUDA GPU (none found)")
    import triton

    from atom.model_ops.moe.experts_triton import ONE_PROGRAM_SIZE, moe_align, moe_align_ref
    from atom.utils.cuda_timing import graph_time
    rows = []
    for T, E, k, bm in CASES:
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).cuda()
        want, want_be = moe_align_ref(ids.cpu(), E, bm)
        row = dict(tokens=T, experts=E, top_k=k, block_m=bm,
                   fits_one_program=triton.next_power_of_2(T * k) * triton.next_power_of_2(E) <= ONE_PROGRAM_SIZE)
        def blocks(t):  # each expert's pairs as a set: the atomics order them inside its group
            rows = t.view(-1, bm).tolist()
            return sorted((e, sorted(p for b, r in enumerate(rows) if want_be[b] == e for p in r))
                          for e in set(want_be.tolist()))
        for one in ((True, False) if row["fits_one_program"] else (False,)):  # past it: the three kernels
            got, be = moe_align(ids, E, bm, one_program=one)
            same = torch.equal(be.cpu(), want_be) and blocks(got.cpu()) == blocks(want) and (
                not one or torch.equal(got.cpu(), want))
            us = graph_time([lambda o=one: moe_align(ids, E, bm, one_program=o)] * 50) * 1e6  # per call
            row["one_program_us" if one else "three_kernels_us"] = round(us, 2)
            row["one_program_ok" if one else "three_kernels_ok"] = same
        print(row, flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
