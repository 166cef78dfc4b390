"""Does another of cuBLASLt's candidate algorithms (`LtProduct.candidates`) beat torch's cuBLAS pick on decode-batch
products (Llama-3.1-8B's weights, 32-256 rows)? Each candidate is timed in a CUDA graph
cycling through enough weight copies to miss L2, checked against `F.linear` (kept within the
start-up choice's 1e-2 of the largest output), and set next to
cuBLAS and the bandwidth / FLOP floors. A diagnosis tool, not a benchmark.

    python3 scripts/cublaslt_probe.py --out lt.json --deadline 240

With `--dtype fp8` the products are the row-wise (ptpc) FP8 ones: e4m3 operands with a scale a
row each side, torch._scaled_mm (the engine's route from 65 rows) against cuBLASLt's candidates
with the same outer-vector scales (the start-up choice's, `atom.tuning.gemm_choice`).

With `--enumerate`, every configuration `LtProduct.configurations` builds from cuBLASLt's
algorithm ids is screened too (three graph replays each), and the fastest eight are timed
like the heuristic's candidates.
"""
from __future__ import annotations

import argparse
import functools
import json
import random
import time

import torch

from atom.model_ops.cublaslt import CLUSTER_IDS, LtProduct, describe
from atom.tuning.gemm_choice import timing_case
from atom.utils.cuda_timing import graph_time

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096)]
ROWS = (32, 64, 96, 128, 160, 192, 224, 256)
HBM, PEAK = 4.3e12, 790e12  # REFERENCE.md: copy bandwidth, 8192^3 bf16 GEMM (fp8: twice the rate)
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
TOL = 1e-2  # of the largest output: what the start-up choice keeps (`gemm_choice._agree`)


def _time(prod, case, ws, algo, out, ref, iters):
    """(us in CUDA-graph replays cycling the weights, relative error against `ref`), or
    (None, the error message) where cuBLASLt refuses to run it. `case`: the inputs
    (`gemm_choice.timing_case`)."""
    try:
        y = case.lt(prod, ws[0], algo, out)().float()
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        return graph_time([case.lt(prod, w, algo, out) for w in ws], iters=iters) * 1e6, err
    except RuntimeError as e:
        return None, str(e)


def enumerated(prod, case, ws, out, ref, keep=8, budget=90.0):
    """Screen (three graph replays each, in random order) every tiling x stages x custom
    option x cluster shape of every algorithm id (those cuBLASLt lists and the heuristic's),
    then every split-K / swizzle variant of the 12 fastest, then time the `keep` fastest of
    all properly: wider and slower than the engine's start-up search
    (`atom.tuning.gemm_choice._wide_candidates`). Screening stops after 60% of `budget` seconds for the first
    set and after `budget` for the variants."""
    t0 = time.time()

    def screen(algos, until):
        found = []
        for algo in algos:
            if time.time() - t0 > until:
                break
            us, err = _time(prod, case, ws, algo, out, ref, iters=3)
            if us is not None and err < TOL:  # (err is a message where us is None)
                found.append((us, algo))
        return sorted(found, key=lambda p: p[0])

    ids = {describe(a)["id"] for a in prod.algos()}  # the heuristic's ids (Hopper kernels) too
    base = prod.configurations(split_ks=(1,), max_custom=7, swizzle=False, clusters=CLUSTER_IDS, ids=ids,
                               limit=200000)
    random.Random(0).shuffle(base)
    screened = screen(base, 0.6 * budget)
    variants = []
    for _, algo in screened[:12]:
        d = describe(algo)
        variants += prod.configurations(split_ks=(2, 3, 4, 6, 8), max_custom=7, clusters=CLUSTER_IDS, ids=ids,
                                        only={f: d[f] for f in ("id", "tile", "stages", "custom", "cluster")})
    screened = sorted(screened + screen(variants, budget), key=lambda p: p[0])
    best = []
    for _, algo in screened[:keep]:
        us, err = _time(prod, case, ws, algo, out, ref, iters=25)
        if us is not None:
            best.append(dict(us=round(us, 2), rel_err=err, **describe(algo)))
    best.sort(key=lambda r: r["us"])
    return dict(enumerated=len(base) + len(variants), ran=len(screened), seconds=round(time.time() - t0, 1),
                best=best)


def probe(name, n, k, m, dtype=torch.bfloat16, enumerate_all=False, budget=90.0):
    size = torch.finfo(dtype).bits // 8
    copies = max(1, -(-200_000_000 // (n * k * size)))
    ws = [(torch.randn(n, k, device="cuda") * (32 if size == 1 else 0.02)).to(dtype) for _ in range(copies)]
    case = timing_case(m, ws[0])  # the input and the engine's product (F.linear / torch._scaled_mm / swap-AB)
    cub = graph_time([functools.partial(case.library, w) for w in ws]) * 1e6
    ref = case.library(ws[0]).float()
    prod = LtProduct(m, n, k, dtype)
    out = torch.empty(m, n, device="cuda", dtype=prod.out_dtype)
    rows = []
    for i, algo in enumerate(prod.candidates()):
        us, err = _time(prod, case, ws, algo, out, ref, iters=25)
        rows.append(dict(index=i, error=err) if us is None else dict(index=i, us=round(us, 2), rel_err=err, **describe(algo)))
    ok = [r for r in rows if "us" in r and r["rel_err"] < TOL]
    best = min(ok, key=lambda r: r["us"]) if ok else {}
    floor = max(n * k * size / HBM, 2 * m * n * k / (PEAK * (2 if size == 1 else 1))) * 1e6
    found = enumerated(prod, case, ws, out, ref, budget=budget) if enumerate_all else {}
    return dict(name=name, dtype=str(dtype), M=m, N=n, K=k, cublas_us=round(cub, 2), floor_us=round(floor, 2),
                lt_first_us=rows[0].get("us") if rows else None, lt_best=best, candidates=rows, enumeration=found)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="cublaslt_probe.json")
    ap.add_argument("--deadline", type=float, default=300.0)
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    ap.add_argument("--shapes", nargs="*", default=[s[0] for s in SHAPES])
    ap.add_argument("--enumerate", action="store_true", help="also screen every configuration cuBLASLt accepts")
    ap.add_argument("--budget", type=float, default=90.0, help="seconds of screening per shape with --enumerate")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                    help="bf16 products, or row-wise fp8 ones against torch._scaled_mm (the 'cuBLAS' column)")
    args = ap.parse_args()
    t0, results = time.time(), []
    for m in args.rows:
        for name, n, k in SHAPES:
            if name not in args.shapes or time.time() - t0 > args.deadline:
                continue
            r = probe(name, n, k, m, DTYPES[args.dtype], enumerate_all=args.enumerate, budget=args.budget)
            results.append(r)
            b = r["lt_best"]
            print(f"{name} M={m}: cuBLAS {r['cublas_us']} Lt first {r['lt_first_us']} best {b.get('us')} "
                  f"(#{b.get('index')} of {len(r['candidates'])}) floor {r['floor_us']} us", flush=True)
            e = r["enumeration"]
            if e:
                top = e["best"][0] if e["best"] else {}
                print(f"   enumerated {e['enumerated']} ran {e['ran']} in {e['seconds']} s: best {top}", flush=True)
            with open(args.out, "w") as f:  # after each shape: a crash keeps what was measured
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
