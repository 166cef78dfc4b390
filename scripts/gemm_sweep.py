"""Can a Triton GEMM beat cuBLAS on decode-batch products (M = 16-256 rows against an 8B
model's weights)? A sweep over tile sizes, warps and pipeline stages at several M, each
timed in a CUDA graph cycling through enough weight copies to miss L2, next to cuBLAS and
to the bandwidth and FLOP floors. A diagnosis tool, not a benchmark.

    python3 scripts/gemm_sweep.py --out gemm.json --deadline 200
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from atom.utils.cuda_timing import graph_time

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # Llama-3.1-8B qkv, o, gate_up, down
ROWS = (32, 64, 128, 192, 256)


@triton.jit
def _mm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y = x w^T; the M tiles of one weight tile are neighbouring programs (L2 reuse)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % num_m, pid // num_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    xp = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    wp = w_ptr + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(xp, mask=rm[:, None] < M, other=0.0)
        b = tl.load(wp, mask=rn[None, :] < N, other=0.0)
        acc = tl.dot(a, b, acc)
        xp += BLOCK_K
        wp += BLOCK_K
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def make_call(x, w, cfg):
    M, K = x.shape
    N = w.shape[0]
    assert K % cfg["BLOCK_K"] == 0, "the kernel has no K mask: K must be a multiple of BLOCK_K"
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)

    def call():
        _mm_kernel[grid](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), BLOCK_M=cfg["BLOCK_M"],
                         BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
                         num_stages=cfg["num_stages"])
        return y
    return call


def configs():
    out = []
    for bm, bn, bk, warps, stages in itertools.product((64, 128), (64, 128, 256), (64, 128), (4, 8), (3, 4)):
        if stages * (bm + bn) * bk * 2 > 200 * 1024 or (bm == 128 and bn == 256 and warps == 4):
            continue
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages))
    random.Random(0).shuffle(out)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline", type=float, default=200.0, help="seconds; later tilings are left out")
    args = ap.parse_args()
    t0 = time.time()
    cases = []
    for N, K in SHAPES:
        nbytes = N * K * 2
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
              for _ in range(max(2, -(-400 * 2**20 // nbytes)))]
        for M in ROWS:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            cub = graph_time([lambda w=w, x=x: F.linear(x, w) for w in ws], iters=10) * 1e6
            cases.append(dict(N=N, K=K, M=M, x=x, ws=ws, ref=F.linear(x, ws[0]).float(), cublas_us=round(cub, 2),
                              floor_bw_us=round(nbytes / 4.8e6, 2), floor_flop_us=round(2 * M * N * K / 989e6, 2),
                              triton=[]))
    tried = 0
    for cfg in configs():
        if time.time() - t0 > args.deadline:
            break
        tried += 1
        for c in cases:
            x, ws, ref = c["x"], c["ws"], c["ref"]
            if cfg["BLOCK_M"] > max(64, triton.next_power_of_2(c["M"])):
                continue
            try:
                got = make_call(x, ws[0], cfg)().float()
            except Exception as e:  # out of resources for this tiling
                c["triton"].append(dict(cfg, us=None, error=type(e).__name__))
                continue
            if not torch.allclose(got, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max())):
                c["triton"].append(dict(cfg, us=None, error="mismatch"))
                continue
            c["triton"].append(dict(cfg, us=round(graph_time([make_call(x, w, cfg) for w in ws], iters=10) * 1e6, 2)))
    print(f"{tried} tilings in {time.time() - t0:.0f} s", flush=True)
    out = []
    for c in cases:
        c["triton"].sort(key=lambda r: r["us"] if r["us"] is not None else 1e9)
        b = c["triton"][0] if c["triton"] else {}
        print(f"{c['N']}x{c['K']} M={c['M']}: cuBLAS {c['cublas_us']} us, best Triton {b.get('us')} "
              f"({ {k: v for k, v in b.items() if k != 'us'} }); floors bw {c['floor_bw_us']} flop {c['floor_flop_us']}")
        out.append({k: v for k, v in c.items() if k not in ("x", "ws", "ref")})
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "cases": out}, f, indent=1)


if __name__ == "__main__":
    main()
