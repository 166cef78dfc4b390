"""Launch shapes of the MoE grouping's offsets kernel (`experts_triton._moe_offsets_kernel`: one
program, each expert's first padded row, the padding rows and every block's expert): CH (an
expert's blocks a loop step) x num_warps, at decode batches (130 tokens) and prefill chunks (16k tokens) for 32-256
experts. Each launch is timed in CUDA-graph replays and checked against the first one's
output. A diagnosis tool for the launch in `moe_align`, not a benchmark. GPU only.

    python3 scripts/moe_offsets_sweep.py
"""
from __future__ import annotations

import sys

import torch

CASES = [(130, 64, 6, 16), (130, 128, 8, 16), (130, 32, 4, 16), (130, 256, 8, 16), (16384, 64, 6, 64),
         (16384, 128, 8, 64)]  # tokens, experts, top-k, BLOCK_M


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("moe_offsets_sweep.py times a Triton kernel in CUDA graphs: it needs a CUDA GPU (none found)")
    import triton

    from atom.model_ops.moe import experts_triton as et
    from atom.utils.cuda_timing import graph_time
    dev = "cuda"
    for T, E, k, bm in CASES:
        ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)]).int()
        nb = -(-ids.numel() // bm) + E
        counts = torch.bincount(ids.reshape(-1).long(), minlength=E).int()
        starts = torch.empty_like(counts)
        be = torch.empty(nb, dtype=torch.int32, device=dev)
        rows = torch.empty(nb * bm, dtype=torch.int32, device=dev)
        ep = triton.next_power_of_2(E)
        ref, res = None, []
        for bj in (2, 4, 8, 16):
            for nw in (1, 2, 4):
                def offs(bj=bj, nw=nw):
                    et._moe_offsets_kernel[(1,)](counts, starts, rows, be, E, ids.numel(), nb, BLOCK_M=bm, E_PAD=ep,
                                                 CH=bj, PAD_CH=min(bm, 16), num_warps=nw)
                offs()
                ref = be.clone() if ref is None else ref
                assert torch.equal(be, ref), (bj, nw)
                res.append((graph_time([offs] * 8, iters=20) * 1e6, bj, nw))
        res.sort()
        print(f"T={T} E={E} blocks={nb}: best " + ", ".join(f"CH {b} / {n} warps {t:.2f} us" for t, b, n in res[:5]),
              flush=True)


if __name__ == "__main__":
    main()
