"""Does another of cuBLASLt's candidate algorithms (`LtProduct.candidates`) beat torch's cuBLAS pick on decode-batch
products (Llama-3.1-8B's weights, 32-256 rows)? Each candidate is timed in a CUDA graph
cycling through enough weight copies to miss L2, checked against `F.linear`, and set next to
cuBLAS and the bandwidth / FLOP floors. A diagnosis tool, not a benchmark.

    python3 scripts/cublaslt_probe.py --out lt.json --deadline 240
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import torch
import torch.nn.functional as F

from atom.model_ops.cublaslt import LtProduct
from atom.utils.cuda_timing import graph_time

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096)]
ROWS = (32, 64, 96, 128, 160, 192, 224, 256)
HBM, PEAK = 4.3e12, 790e12  # REFERENCE.md: copy bandwidth, 8192^3 bf16 GEMM


def probe(name, n, k, m, dtype=torch.bfloat16):
    copies = max(1, -(-200_000_000 // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    cub = graph_time([functools.partial(F.linear, x, w) for w in ws]) * 1e6
    ref = F.linear(x, ws[0]).float()
    prod = LtProduct(m, n, k, dtype)
    rows = []
    for i, algo in enumerate(prod.candidates()):
        try:
            y = prod(x, ws[0], algo, out).float()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            us = graph_time([functools.partial(prod, x, w, algo, out) for w in ws]) * 1e6
        except RuntimeError as e:
            rows.append(dict(index=i, error=str(e)))
            continue
        rows.append(dict(index=i, us=round(us, 2), rel_err=err))
    ok = [r for r in rows if "us" in r and r["rel_err"] < 2e-2]
    best = min(ok, key=lambda r: r["us"]) if ok else {}
    floor = max(n * k * 2 / HBM, 2 * m * n * k / PEAK) * 1e6
    return dict(name=name, M=m, N=n, K=k, cublas_us=round(cub, 2), floor_us=round(floor, 2),
                lt_first_us=rows[0].get("us") if rows else None, lt_best=best, candidates=rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="cublaslt_probe.json")
    ap.add_argument("--deadline", type=float, default=300.0)
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    args = ap.parse_args()
    t0, results = time.time(), []
    for m in args.rows:
        for name, n, k in SHAPES:
            if time.time() - t0 > args.deadline:
                break
            r = probe(name, n, k, m)
            results.append(r)
            b = r["lt_best"]
            print(f"{name} M={m}: cuBLAS {r['cublas_us']} Lt first {r['lt_first_us']} best {b.get('us')} "
                  f"(#{b.get('index')} of {len(r['candidates'])}) floor {r['floor_us']} us", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
