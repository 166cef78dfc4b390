"""Times the 8-bit swap-AB product (`kernels.quant_gemv_dot`, ptpc fp8, pre-quantized x) with
its weight tiles through TMA (tensor descriptors) against masked pointer loads, at the
Llama-3.1-8B linear shapes: at each row count the dispatch table's tile both ways, and at one
row a few TMA tiles around it (more stages, wider tiles, another split of K). TB/s of the fp8
weight next to the ~4.3 TB/s HBM limit; every output checked against the pointer kernel's
(bit for bit with the table's tile: the same sums in the same order). A probe, not a
benchmark: JSON of every timing to --out.

    python3 scripts/qdot_tma_sweep.py --out qdot_tma.json [--rows 1 16 64 128] [--deadline 240]

Each timing replays a CUDA graph over enough weight copies to miss L2 (`w4_sweep`'s helpers).
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from w4_sweep import HBM_TBS, SHAPES, copies, probe_args, write_rows  # noqa: E402


def variants(table: dict) -> list[dict]:
    """The table's tile both ways, then TMA tiles around it (one-row sizes)."""
    out = [dict(table, TMA=False), dict(table, TMA=True)]
    for change in (dict(num_stages=table["num_stages"] + 2), dict(num_stages=max(2, table["num_stages"] - 1)),
                   dict(BLOCK_N=128, num_warps=4), dict(BLOCK_N=128, num_warps=8), dict(BLOCK_N=32),
                   dict(SPLIT_K=table["SPLIT_K"] * 2), dict(BLOCK_K=128, num_stages=8)):
        cfg = dict(table, TMA=True, **change)
        if cfg not in out:
            out.append(cfg)
    return out


def main(argv=None) -> int:
    args = probe_args(__doc__, argv, rows=dict(type=int, nargs="+", default=[1, 16, 64, 128]),
                      deadline=dict(type=float, default=240.0))
    if args is None:
        return 2
    from atom.model_ops.kernels.act_quant import act_quant
    from atom.model_ops.kernels.quant_gemv_dot import quant_gemv_dot_launch, small_m_config
    from atom.utils.cuda_timing import graph_time
    t0, rows = time.time(), []
    print(f"{'N':>6}{'K':>6}{'M':>4} {'ptr us':>7}{'TB/s':>6} {'tma us':>7}{'TB/s':>6}  best TMA tile (us, TB/s)")
    for N, K in SHAPES:
        g = torch.Generator("cuda").manual_seed(0)
        w16 = torch.randn(N, K, device="cuda", generator=g) * 0.02
        ws = (w16.abs().amax(dim=1) / 448.0).clamp_min(1e-12)
        w8 = (w16 / ws[:, None]).to(torch.float8_e4m3fn)
        del w16
        sets = [w8] + [w8.clone() for _ in range(copies(w8.numel()) - 1)]
        for M in args.rows:
            table = small_m_config(M, N, K)
            if table is None or time.time() - t0 > args.deadline:
                continue
            table = {k: v for k, v in table.items() if k != "FUSE"}
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            xq, xs = act_quant(x, "fp8", K, 448.0)
            xs = xs.reshape(-1)
            want = quant_gemv_dot_launch(xq, xs, w8, ws, None, torch.bfloat16, config=dict(table, TMA=False))
            timed = []
            for cfg in (variants(table) if M == 1 else variants(table)[:2]):
                if time.time() - t0 > args.deadline:
                    break
                try:
                    got = quant_gemv_dot_launch(xq, xs, w8, ws, None, torch.bfloat16, config=cfg)
                    same = bool(torch.equal(got, want))
                    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                    t = graph_time([lambda w=w, cfg=cfg: quant_gemv_dot_launch(xq, xs, w, ws, None, torch.bfloat16,
                                                                               config=cfg) for w in sets],
                                   iters=args.iters)
                except Exception as e:  # a tile that does not compile or fit: recorded, not fatal
                    rows.append(dict(N=N, K=K, M=M, **cfg, error=f"{type(e).__name__}: {e}"[:300]))
                    continue
                timed.append((t, cfg))
                rows.append(dict(N=N, K=K, M=M, **cfg, us=t * 1e6, tbs=w8.numel() / t / 1e12, same_bits=same,
                                 rel_err=err))
                if err > 1e-2 or (not same and cfg == dict(table, TMA=True)):
                    print(f"  {N}x{K} M={M} {cfg}: output differs from the pointer kernel's (rel {err:.1e})",
                          flush=True)
            if len(timed) < 2:
                continue
            ptr = timed[0][0]
            best_t, best = min(timed[1:], key=lambda r: r[0])
            tile = " ".join(f"{k}={v}" for k, v in best.items() if k != "TMA")
            print(f"{N:>6}{K:>6}{M:>4} {ptr * 1e6:>7.1f}{w8.numel() / ptr / 1e12:>6.2f} {timed[1][0] * 1e6:>7.1f}"
                  f"{w8.numel() / timed[1][0] / 1e12:>6.2f}  {tile} ({best_t * 1e6:.1f}, "
                  f"{w8.numel() / best_t / 1e12:.2f}; HBM {HBM_TBS} TB/s)", flush=True)
        del sets, w8
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
