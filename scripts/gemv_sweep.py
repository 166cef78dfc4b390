"""Which one-row GEMV tiling streams a weight fastest on this GPU: a sweep over rows per
program, K chunk, warps, pipeline stages, split-K and where the row sums are taken, against
cuBLAS, on the linear-layer shapes of the benchmark models. A diagnosis tool, not a
benchmark: it decides the candidates `atom.model_ops.kernels.gemv` offers the start-up choice.

    python3 scripts/gemv_sweep.py --model llama-3.1-8b --out sweep.json --deadline 150

Each timing replays a CUDA graph that cycles through enough copies of the weight to miss L2.
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

SHAPES = {  # (N, K) of qkv, o, gate_up, down, lm_head
    "llama-3.1-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)],
    "qwen3-0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],
}


@triton.jit
def _sweep_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_wn, k_per_split,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, REDUCE_EACH: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    k_lo = pid_k * k_per_split
    if REDUCE_EACH:
        acc = tl.zeros([BLOCK_N], tl.float32)
    else:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if REDUCE_EACH:
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        else:
            acc2 += w.to(tl.float32) * x[None, :]
    if not REDUCE_EACH:
        acc = tl.sum(acc2, axis=1)
    tl.store(out_ptr + pid_k * N + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _sum_splits(part_ptr, y_ptr, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * N + cols, mask=ok, other=0.0)
    tl.store(y_ptr + cols, acc.to(y_ptr.dtype.element_ty), mask=ok)


def make_call(x, w, cfg):
    N, K = w.shape
    split = cfg["split"]
    kps = triton.cdiv(triton.cdiv(K, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    y = torch.empty(N, device=w.device, dtype=w.dtype)
    part = torch.empty(split, N, device=w.device, dtype=torch.float32) if split > 1 else y
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), split)
    kw = dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], REDUCE_EACH=cfg["reduce_each"],
              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    def call():
        _sweep_kernel[grid](x, w, part, N, K, w.stride(0), kps, **kw)
        if split > 1:
            _sum_splits[(triton.cdiv(N, 1024),)](part, y, N, SPLIT=split, BLOCK=1024)
        return y
    return call


def configs(N, K):
    """The valid tilings in a fixed shuffled order, so that a sweep cut by its deadline samples all."""
    out = []
    for bn, bk, warps, stages, red, split in itertools.product(
            (1, 2, 4, 8, 16, 32), (256, 512, 1024), (4, 8), (1, 3), (False, True), (1, 2, 4, 8)):
        if bn * bk < warps * 32 * 8 or bn * bk > 16384 or K // split < bk or bn > N // 256:
            continue
        out.append(dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, reduce_each=red, split=split))
    random.Random(0).shuffle(out)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline", type=float, default=150.0, help="seconds in all, shared by the shapes")
    args = ap.parse_args()
    results = []
    shapes = SHAPES[args.model]
    for N, K in shapes:
        t0, budget = time.time(), args.deadline / len(shapes)
        nbytes = N * K * 2
        copies = max(2, -(-400 * 2**20 // nbytes))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(K, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x[None], ws[0])[0].float()
        cub = graph_time([lambda w=w: F.linear(x[None], w) for w in ws], iters=10) * 1e6
        row = {"N": N, "K": K, "MB": nbytes / 2**20, "cublas_us": cub, "cublas_TBps": nbytes / cub / 1e6, "triton": []}
        for cfg in configs(N, K):
            if time.time() - t0 > budget:
                break
            got = make_call(x, ws[0], cfg)().float()
            if not torch.allclose(got, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max())):
                row["triton"].append(dict(cfg, us=None, error="mismatch"))
                continue
            t = graph_time([make_call(x, w, cfg) for w in ws], iters=10) * 1e6
            row["triton"].append(dict(cfg, us=round(t, 2), TBps=round(nbytes / t / 1e6, 3)))
        row["triton"].sort(key=lambda r: r["us"] if r["us"] is not None else 1e9)
        results.append(row)
        best = row["triton"][:3]
        print(f"{N}x{K} ({row['MB']:.0f} MB): cuBLAS {cub:.2f} us ({row['cublas_TBps']:.2f} TB/s); "
              f"{len(row['triton'])} configs; best {best}", flush=True)
        del ws
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "model": args.model, "shapes": results}, f, indent=1)


if __name__ == "__main__":
    main()
