"""Times the small kernels around a MoE layer's experts on a GPU (CUDA-graph replays, so launch
overhead is left out): the routing kernel (`route_triton.fused_topk`) over rows per program and
warps, the fp32 router logits (`gate_triton`: the Triton kernel over its tiles against the
cast + cuBLAS fp32 GEMM), at decode and prefill token counts. Prints a table, writes JSON.

    python scripts/moe_glue_sweep.py --out sweep.json [--tokens 1 130 1024 16384]
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch


def bench(fn) -> float:
    import triton
    return float(triton.testing.do_bench_cudagraph(fn, rep=30)) * 1e3  # us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 130, 256, 1024, 4096, 16384])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_glue_sweep needs a CUDA GPU")
    from atom.model_ops.moe.gate_triton import router_logits_ref, router_logits_triton
    from atom.model_ops.moe.route_triton import fused_topk, route_config
    from atom.model_ops.moe.router import TopK
    rows = []
    shapes = {"deepseek-v2-lite": (64, 6, 2048, "softmax"), "qwen3-30b-a3b": (128, 8, 2048, "softmax")}
    for model, (E, k, H, scoring) in shapes.items():
        topk = TopK(E, k, renormalize=scoring == "sigmoid", scoring=scoring)
        for T in args.tokens:
            logits = torch.randn(T, E, device="cuda")
            base = route_config(T, E)
            for r, w in [(1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (4, 2)]:
                us = bench(lambda: fused_topk(logits, topk, config=dict(ROWS=r, num_warps=w)))
                emit(rows, dict(kernel="route", model=model, tokens=T, ROWS=r, num_warps=w, us=us,
                                default=base == dict(ROWS=r, num_warps=w)))
            if E > 128:
                continue
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            wt = torch.randn(E, H, device="cuda")
            emit(rows, dict(kernel="gate", model=model, tokens=T, config="cast + cuBLAS fp32",
                            us=bench(lambda: router_logits_ref(x, wt))))
            for be, bk in itertools.product((16, 32, 64), (64, 128)):
                cfg = dict(BLOCK_E=be, BLOCK_K=bk)
                emit(rows, dict(kernel="gate", model=model, tokens=T, config=json.dumps(cfg),
                                us=bench(lambda: router_logits_triton(x, wt, cfg))))
            with open(args.out, "w") as f:  # after every shape: a run cut short keeps what it measured
                json.dump(rows, f, indent=1)


def emit(rows: list, row: dict) -> None:
    rows.append(row)
    print(row, flush=True)


if __name__ == "__main__":
    main()
