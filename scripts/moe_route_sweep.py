"""Times the routing kernel of a MoE layer (`route_triton.fused_topk`) on a GPU over rows per
program and warps (CUDA-graph replays, so launch overhead is left out), at decode and prefill
token counts; `route_config`'s choice is marked. Prints each row as it is measured, writes JSON.

    python scripts/moe_route_sweep.py --out sweep.json [--tokens 1 130 1024 16384]
"""
from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 130, 256, 1024, 4096, 16384])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_route_sweep needs a CUDA GPU")
    from atom.model_ops.kernels.triton_import import triton
    from atom.model_ops.moe.route_triton import fused_topk, route_config
    from atom.model_ops.moe.router import TopK
    from atom.tuning.moe_tune import gpu_time_us  # graph replays, the inputs finished first
    rows = []
    shapes = {"deepseek-v2-lite": (64, 6, "softmax"), "qwen3-30b-a3b": (128, 8, "softmax"),
              "deepseek-v3": (256, 8, "sigmoid")}
    for model, (E, k, scoring) in shapes.items():
        topk = TopK(E, k, renormalize=scoring == "sigmoid", scoring=scoring)
        for T in args.tokens:
            logits = torch.randn(T, E, device="cuda")
            base = route_config(T, E)
            grid = [(1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (4, 2), (1, 4), (4, 4)]
            for r, w in [(r, w) for r, w in grid if r * triton.next_power_of_2(E) <= 2048]:  # the tiles the rule may pick
                us = gpu_time_us(lambda: fused_topk(logits, topk, config=dict(ROWS=r, num_warps=w)))
                emit(rows, dict(kernel="route", model=model, tokens=T, ROWS=r, num_warps=w, us=us,
                                default=base == dict(ROWS=r, num_warps=w)))
            with open(args.out, "w") as f:  # after every shape: a run cut short keeps what it measured
                json.dump(rows, f, indent=1)


def emit(rows: list, row: dict) -> None:
    rows.append(row)
    print(row, flush=True)


if __name__ == "__main__":
    main()
