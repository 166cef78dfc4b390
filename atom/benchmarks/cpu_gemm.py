"""CPU matmul route of the linear layers: `F.linear` (BLAS; what transformers calls) against
oneDNN's matmul (what ATOM's `dense` calls for fp32 on a CPU), on the embedded model's
layer shapes (SmolLM2-135M: 30 layers of qkv 960x576, o 576x576, gate-up 3072x576, down
576x1536, and the 49152x576 LM head), every layer's own weight so that they stream from
memory as in a forward. Printed next to the limit: the weight bytes over the memory
bandwidth measured by a plain sum over the same weights (rows <= 8), or the best GEMM
FLOP rate seen (more rows).

    python -m atom.benchmarks.cpu_gemm [--rows 1 8 32 256] [--out gemm.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from atom.benchmarks.provenance import provenance

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
NUM_LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def _best_s(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) for _ in range(NUM_LAYERS) for n, k in LAYER_SHAPES]
    weights.append(torch.randn(VOCAB, HIDDEN, generator=g))
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    stream_s = _best_s(lambda: [w.sum() for w in weights], args.reps)
    routes = {"F.linear (BLAS)": lambda x, w: F.linear(x, w),
              "oneDNN (ATOM)": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")}
    rows = []
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g) for k in {w.shape[1] for w in weights}}
        flops = sum(2 * m * w.numel() for w in weights)
        times = {name: _best_s(lambda: [op(xs[w.shape[1]], w) for w in weights], args.reps)
                 for name, op in routes.items()}
        rows.append({"rows": m, "gflop": flops / 1e9, **{f"{k} s": v for k, v in times.items()}})
    peak_gflops = max(r["gflop"] / min(r[f"{k} s"] for k in routes) for r in rows)
    t = Table(title=f"CPU linear layers, {nbytes / 1e6:.0f} MB of fp32 weights, {torch.get_num_threads()} threads")
    for c in ("rows", *routes, "oneDNN / BLAS", "limit ms"):
        t.add_column(c)
    for r in rows:
        limit = stream_s if r["rows"] <= 8 else r["gflop"] / peak_gflops
        r["limit_s"] = limit
        t.add_row(str(r["rows"]), *(f"{r[f'{k} s'] * 1e3:.1f} ms" for k in routes),
                  f"{r['F.linear (BLAS) s'] / r['oneDNN (ATOM) s']:.2f}x", f"{limit * 1e3:.1f}")
    Console().print(t)
    Console().print(f"memory: a sum over the weights streams {nbytes / stream_s / 1e9:.1f} GB/s; "
                    f"best GEMM rate seen {peak_gflops:.0f} GFLOP/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(),
                       "weight_bytes": nbytes, "stream_gb_s": nbytes / stream_s / 1e9,
                       "peak_gflops": peak_gflops, "results": rows, **provenance()}, f, indent=1)


if __name__ == "__main__":
    main()
