"""What the fp8 tensor-core accumulation costs at workload batch sizes: ptpc FP8 products on
the Llama-3.1-8B linear shapes at M rows, torch._scaled_mm with and without cuBLASLt's fast
accumulation, and the Triton tl.dot GEMM (`kernels.quant_gemm`) with its partial sums added
into fp32 every 128 of K (the engine's) or never (IMPRECISE -1: the tensor cores' accumulator
over all of K, as Triton does by default on sm90), beside bf16
`F.linear`. Each timing's error is the largest |y - ref| over the largest |ref| (ref: the
dequantized operands' product in float64). A probe, not a benchmark: JSON to --out.

    python3 scripts/fp8_accum_probe.py --out fp8_accum_probe.json [--ms 128 256 1024]
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from w4_sweep import SHAPES, copies, probe_args, write_rows  # noqa: E402

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
TILES = [(64, 128, 128, 4, 4), (128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (128, 128, 64, 4, 4)]
PROMOTE = [0, -1]  # 0: the kernel's default (every 128 of K, or BLOCK_K if smaller); -1: never


def main(argv=None) -> int:
    args = probe_args(__doc__, argv, ms=dict(type=int, nargs="*", default=[128, 256, 1024]))
    if args is None:
        return 2
    from atom.model_ops.kernels.act_quant import act_quant
    from atom.model_ops.kernels.quant_gemm import quant_gemm_launch
    from atom.utils.cuda_timing import graph_time
    rows = []
    for N, K in SHAPES:
        w16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        ws = w16.float().abs().amax(dim=1) / 448.0
        w8 = (w16.float() / ws[:, None]).to(torch.float8_e4m3fn)
        w16s = [w16] + [w16.clone() for _ in range(copies(w16.numel() * 2) - 1)]
        sets = [w8] + [w8.clone() for _ in range(copies(w8.numel()) - 1)]
        for M in args.ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            xq, xs = act_quant(x, "fp8", K, 448.0)
            ref = (xq.double() @ w8.double().T) * xs.double() * ws.double()[None, :]

            def err(y):
                return ((y.double() - ref).abs().max() / ref.abs().max()).item()
            out = dict(N=N, K=K, M=M, bf16_us=graph_time([lambda w=w: F.linear(x, w) for w in w16s],
                                                         iters=args.iters) * 1e6)
            sx, sw = xs.float().reshape(M, 1).contiguous(), ws.float().reshape(1, N).contiguous()
            for fast in (False, True):
                def mm(w, fast=fast):
                    return torch._scaled_mm(xq, w.t(), sx, sw, out_dtype=torch.bfloat16, use_fast_accum=fast)
                t = graph_time([lambda w=w: mm(w) for w in sets], iters=args.iters)
                rows.append(dict(out, kernel="scaled_mm", fast_accum=fast, us=t * 1e6, rel_err=err(mm(w8))))
            for bm, bn, bk, warps, stages in TILES:
                for imp in PROMOTE:
                    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, IMPRECISE=imp)

                    def call(w, cfg=cfg):
                        return quant_gemm_launch(xq, xs, w, ws, None, torch.bfloat16, config=cfg)
                    try:
                        e = err(call(w8))
                        t = graph_time([lambda w=w: call(w) for w in sets], iters=args.iters)
                    except Exception as ex:  # noqa: BLE001 - a tile that does not compile (shared memory)
                        print(f"    {cfg}: {type(ex).__name__}: {str(ex)[:120]}", flush=True)
                        continue
                    rows.append(dict(out, kernel="gemm", cfg=cfg, us=t * 1e6, rel_err=e))
            mine = [r for r in rows if r["N"] == N and r["M"] == M]
            line = " ".join(f"{r['kernel'][:4]}{'F' if r.get('fast_accum') else ''}"
                            f"{'/' + str(r['cfg']['BLOCK_M']) + 'x' + str(r['cfg']['BLOCK_N']) + 'x' + str(r['cfg']['BLOCK_K']) + ':' + str(r['cfg']['IMPRECISE']) if 'cfg' in r else ''}"
                            f" {r['us']:.1f}({r['rel_err']:.1e})" for r in mine)
            print(f"N={N} K={K} M={M} bf16 {out['bf16_us']:.1f} | {line}", flush=True)
        del sets, w16s, w8, w16
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
