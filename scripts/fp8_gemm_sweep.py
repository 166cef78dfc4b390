"""Times ptpc FP8 products at decode batch sizes above the swap-AB table (M = 80-256) on the
Llama-3.1-8B linear shapes: torch._scaled_mm with row / column scales (the engine's route
there: cuBLASLt's heuristic tile), the Triton tl.dot GEMM (`kernels.quant_gemm`) and the
tensor-core swap-AB kernel (`kernels.quant_gemv_dot`, split K and its reduction included)
for a few tiles each, beside bf16 `F.linear` and the activation quantizer alone. A probe for
the fp8 route above 64 rows, not a benchmark: JSON of every timing to --out.

    python3 scripts/fp8_gemm_sweep.py --out fp8_gemm_sweep.json [--ms 80 128 192 256]

Each timing replays a CUDA graph over enough weight copies to miss L2 (`w4_sweep`'s helpers).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from w4_sweep import SHAPES, copies, probe_args, write_rows  # noqa: E402

# the Triton GEMM: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
GEMM_TILES = [(64, 128, 128, 4, 4), (64, 64, 128, 4, 4), (128, 128, 128, 8, 3), (128, 64, 128, 4, 4),
              (64, 256, 128, 8, 3), (128, 256, 128, 8, 3)]
# the swap-AB kernel: (BLOCK_N weight rows, num_warps, num_stages, SPLIT_K); BLOCK_K 128
DOT_TILES = [(64, 4, 4, 1), (64, 4, 4, 2), (64, 4, 4, 4), (128, 8, 3, 1), (128, 8, 3, 2), (128, 8, 3, 4)]


def main(argv=None) -> int:
    args = probe_args(__doc__, argv, ms=dict(type=int, nargs="*", default=[80, 128, 192, 256]))
    if args is None:
        return 2
    from atom.model_ops.kernels.act_quant import act_quant
    from atom.model_ops.kernels.quant_gemm import quant_gemm_launch
    from atom.model_ops.kernels.quant_gemv_dot import quant_gemv_dot_launch
    from atom.model_ops.quant.common import _scaled_mm
    from atom.utils.cuda_timing import graph_time
    rows = []
    print(f"{'N':>6}{'K':>6}{'M':>5} {'bf16':>7}{'quant':>7}{'scaled':>8}{'gemm':>7}{'dot':>7}  best tiles")
    for N, K in SHAPES:
        w16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        ws = (w16.float().abs().amax(dim=1) / 448.0)
        w8 = (w16.float() / ws[:, None]).to(torch.float8_e4m3fn)
        w16s = [w16] + [w16.clone() for _ in range(copies(w16.numel() * 2) - 1)]
        sets = [w8] + [w8.clone() for _ in range(copies(w8.numel()) - 1)]
        for M in args.ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            t16 = graph_time([lambda w=w: F.linear(x, w) for w in w16s], iters=args.iters)
            t_q = graph_time([lambda: act_quant(x, "fp8", K, 448.0)] * len(sets), iters=args.iters)
            xq, xs = act_quant(x, "fp8", K, 448.0)
            xs = xs.reshape(-1)
            ref = (xq.float() @ w8.float().T) * xs[:, None] * ws[None, :]

            def err(y):
                return ((y.float() - ref).abs().max() / ref.abs().max()).item()
            t_mm = graph_time([lambda w=w: _scaled_mm(xq, xs, w, ws, None, torch.bfloat16, None) for w in sets],
                              iters=args.iters)
            base = dict(N=N, K=K, M=M, bf16_us=t16 * 1e6, quant_us=t_q * 1e6, scaled_mm_us=t_mm * 1e6,
                        scaled_mm_err=err(_scaled_mm(xq, xs, w8, ws, None, torch.bfloat16, None)))
            best = {}
            for name, tiles in (("gemm", GEMM_TILES), ("dot", DOT_TILES)):
                for tile in tiles:
                    if name == "gemm":
                        bm, bn, bk, warps, stages = tile
                        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)

                        def call(w, cfg=cfg):
                            return quant_gemm_launch(xq, xs, w, ws, None, torch.bfloat16, config=cfg)
                    else:
                        bn, warps, stages, split = tile
                        cfg = dict(M_PAD=max(16, 1 << (M - 1).bit_length()), BLOCK_N=bn, BLOCK_K=128,
                                   SPLIT_K=split, num_warps=warps, num_stages=stages)

                        def call(w, cfg=cfg):
                            return quant_gemv_dot_launch(xq, xs, w, ws, None, torch.bfloat16, config=cfg)
                    try:
                        e = err(call(w8))
                        t = graph_time([lambda w=w, c=call: c(w) for w in sets], iters=args.iters)
                    except Exception as ex:  # noqa: BLE001 - a tile that does not compile (shared memory)
                        print(f"    {name} {cfg}: {type(ex).__name__}: {str(ex)[:120]}", flush=True)
                        continue
                    rows.append(dict(base, kernel=name, cfg=cfg, us=t * 1e6, rel_err=e))
                    if name not in best or t < best[name][0]:
                        best[name] = (t, cfg)
            g, d = best.get("gemm", (float("nan"), {})), best.get("dot", (float("nan"), {}))
            print(f"{N:>6}{K:>6}{M:>5} {t16 * 1e6:>7.1f}{t_q * 1e6:>7.1f}{t_mm * 1e6:>8.1f}{g[0] * 1e6:>7.1f}"
                  f"{d[0] * 1e6:>7.1f}  gemm {g[1]}  dot {d[1]}", flush=True)
        del sets, w16s, w8, w16
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
