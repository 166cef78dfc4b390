"""Times one-row (batch-1 decode) ptpc FP8 products on the Llama-3.1-8B linear shapes: the
tensor-core swap-AB kernel the engine runs at M = 1 (`quant_gemv_dot`, its split K and
reduction included) against the bf16 weight-streaming GEMV (`kernels.gemv._gemv_kernel`)
reading the fp8 weight and the fp8-quantized row directly (each fp8 value widened to fp32:
the products exact, the per-row and per-token scales one multiply after the sum), for a few
tiles, beside bf16 `F.linear`; TB/s of the fp8 weight next to the ~4.3 TB/s HBM limit. A
probe for a CUDA-core one-row FP8 route, not a benchmark: JSON of every timing to --out.

    python3 scripts/fp8_gemv_sweep.py --out fp8_gemv_sweep.json

Each timing replays a CUDA graph over enough weight copies to miss L2 (`w4_sweep`'s helpers).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from w4_sweep import HBM_TBS, SHAPES, copies, probe_args, write_rows  # noqa: E402

# (BLOCK_N, BLOCK_K, num_warps, AHEAD) for the CUDA-core GEMV over fp8
TILES = [(2, 1024, 4, True), (2, 2048, 4, True), (4, 1024, 4, True), (4, 2048, 8, True), (1, 2048, 4, True),
         (2, 2048, 4, False), (8, 512, 4, False), (4, 4096, 8, True)]


def fp8_operands(N: int, K: int, iters: int):
    """A random bf16 weight [N, K] and row on the GPU, bf16 `F.linear`'s time over them (weight
    copies that miss L2), and the ptpc FP8 operands: the weight in e4m3 with one scale a row
    (amax / 448), the row quantized by `act_quant`. Returns (x, t16, w8, ws, xq, xs)."""
    from atom.model_ops.kernels.act_quant import act_quant
    from atom.utils.cuda_timing import graph_time
    w16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    ws16 = [w16] + [w16.clone() for _ in range(copies(w16.numel() * 2) - 1)]
    t16 = graph_time([lambda w=w: F.linear(x, w) for w in ws16], iters=iters)
    del ws16
    ws = (w16.float().abs().amax(dim=1) / 448.0).contiguous()
    w8 = (w16.float() / ws[:, None]).to(torch.float8_e4m3fn)
    del w16
    xq, xs = act_quant(x, "fp8", K, 448.0)
    return x, t16, w8, ws, xq, xs.reshape(-1)


def main(argv=None) -> int:
    args = probe_args(__doc__, argv)
    if args is None:
        return 2
    from atom.model_ops.kernels.gemv import _gemv_kernel
    from atom.model_ops.kernels.quant_gemv_dot import quant_gemv_dot_launch
    from atom.utils.cuda_timing import graph_time
    rows = []
    print(f"{'N':>6}{'K':>6} {'dot us':>8}{'TB/s':>6} {'gemv us':>8}{'TB/s':>6}{'x dot':>6}{'bf16 us':>8}  best tile")
    for N, K in SHAPES:
        x, t16, w8, ws, xq, xs = fp8_operands(N, K, args.iters)
        ref = (xq.float() @ w8.float().T) * xs * ws
        sets = [w8] + [w8.clone() for _ in range(copies(w8.numel()) - 1)]
        t_dot = graph_time([lambda w=w: quant_gemv_dot_launch(xq, xs, w, ws, None, torch.bfloat16) for w in sets],
                           iters=args.iters)
        y_dot = quant_gemv_dot_launch(xq, xs, w8, ws, None, torch.bfloat16)
        err_dot = ((y_dot.float() - ref).abs().max() / ref.abs().max()).item()
        best = None
        for bn, bk, warps, ahead in TILES:
            y = torch.empty(1, N, device="cuda", dtype=torch.float32)

            def run(w, y=y, bn=bn, bk=bk, warps=warps, ahead=ahead):
                _gemv_kernel[(triton_cdiv(N, bn),)](xq, xq, xq, w, y, y, N, K, w.stride(0), 0, 0.0, NORM=False,
                                                    HAS_RES=False, GATED=False, PDL=False, BLOCK_N=bn,
                                                    BLOCK_K=min(bk, K), AHEAD=ahead, num_warps=warps, num_stages=3)
            t = graph_time([lambda w=w: run(w) for w in sets], iters=args.iters)
            run(w8)
            err = ((y * xs * ws - ref).abs().max() / ref.abs().max()).item()
            rows.append(dict(N=N, K=K, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, AHEAD=ahead, us=t * 1e6,
                             tbs=w8.numel() / t / 1e12, rel_err=err, dot_us=t_dot * 1e6, dot_rel_err=err_dot,
                             bf16_us=t16 * 1e6))
            if best is None or t < best[0]:
                best = (t, (bn, bk, warps, ahead), err)
        t, cfg, err = best
        print(f"{N:>6}{K:>6} {t_dot * 1e6:>8.1f}{w8.numel() / t_dot / 1e12:>6.2f} {t * 1e6:>8.1f}"
              f"{w8.numel() / t / 1e12:>6.2f}{t_dot / t:>6.2f}{t16 * 1e6:>8.1f}  BLOCK_N={cfg[0]} BLOCK_K={cfg[1]} "
              f"warps={cfg[2]} AHEAD={cfg[3]} (rel err {err:.1e}; dot {err_dot:.1e}; HBM {HBM_TBS} TB/s)", flush=True)
        del sets, w8
    write_rows(args.out, rows)
    return 0


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


if __name__ == "__main__":
    sys.exit(main())
