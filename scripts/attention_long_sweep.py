"""Decode attention at long contexts, bf16 and FP8 KV caches: the unified attention kernel on
decode batches of the long-context workload (64 requests, prompts of 4-8k tokens; the
contexts of the requests still running at a few decode steps), Llama-3.1-8B's attention shape,
the engine's choice (`pick_attention_config`, the in-kernel merge where it splits) against
other splits, tiles, stages and `rows_ahead`. Each figure is a CUDA-graph replay beside the
time the batch's KV bytes take at `--hbm-tbs` (the roofline of one layer's read). Outputs are
checked against the engine's choice on the same cache. A diagnosis tool, not a benchmark.

    python3 scripts/attention_long_sweep.py --out attn_long.json
    python3 scripts/attention_long_sweep.py --out attn_long.json --kv fp8 --steps 0 300 \
        --configs 128/2/4 64/3/4/ra s2 s4

A config is "default", "s<N>" (the engine's tile, N segments) or
TILE_N/num_stages/num_warps[/ra] (ra: `rows_ahead`, block-table entries a tile ahead).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_sweep import HKV, HQ, D, paged_batch  # noqa: E402

from atom.benchmarks.workloads import long_context_workload  # noqa: E402
from atom.model_ops.attention.options import AttentionOptions  # noqa: E402
from atom.model_ops.attention.triton_unified import AttentionWorkspace, unified_attention  # noqa: E402
from atom.utils.cuda_timing import checked_graph_time  # noqa: E402

DEFAULT_CONFIGS = ["s2", "s4", "s8", "64/3/4/ra", "64/4/4/ra", "32/4/4/ra", "128/2/4", "128/2/8", "128/3/8/ra",
                   "128/3/4/ra"]


def parse_config(spec: str) -> dict | None:
    """'default' -> None; 's4' -> 4 segments; '64/3/4/ra' -> TILE_N 64, 3 stages, 4 warps, rows_ahead."""
    if spec == "default":
        return None
    if spec.startswith("s") and spec[1:].isdigit():
        n = int(spec[1:])
        if n < 1 or n > 16 or n & (n - 1):
            raise ValueError(f"config {spec!r}: splits must be a power of two from 1 to 16")
        return dict(num_splits=n)
    parts = spec.split("/")
    ahead = parts[-1] == "ra"
    nums = parts[:-1] if ahead else parts
    if len(nums) != 3 or not all(p.isdigit() for p in nums):
        raise ValueError(f"config {spec!r}: expected 'default', 's<N>' or TILE_N/num_stages/num_warps[/ra]")
    tile, stages, warps = map(int, nums)
    return dict(TILE_N=tile, num_stages=stages, num_warps=warps, rows_ahead=ahead)


def decode_batch(step: int, n_seqs: int) -> list[int]:
    """Contexts (longest first) of the long workload's requests still running at decode step
    `step`, their whole prompts in the cache."""
    reqs = long_context_workload(n_seqs)
    return sorted((len(r.prompt_token_ids) + step for r in reqs if r.max_tokens > step), reverse=True)


def time_batch(ctx: list[int], kv: str, specs: list[str], hbm_tbs: float) -> list[dict]:
    q, kc, vc, cu, sl, bt = paged_batch(ctx, [1] * len(ctx), "cuda")
    opts = None
    if kv == "fp8":
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        one = torch.ones((), dtype=torch.float32, device="cuda")
        opts = AttentionOptions(k_scale=one, v_scale=one)
    kv_bytes = sum(ctx) * HKV * D * 2 * kc.element_size()
    out = torch.empty_like(q)
    ws = AttentionWorkspace(q.shape[0], HQ, D, device=q.device)
    ref, rows = None, []
    for spec in ["default"] + specs:
        cfg = parse_config(spec)
        splits = cfg.pop("num_splits") if cfg and "num_splits" in cfg else None

        def call(cfg=cfg, splits=splits):
            unified_attention(q, kc, vc, out, cu, sl, bt, D ** -0.5, 1, ws, num_kv_splits=splits, config=cfg,
                              options=opts, merge_in_kernel=True)
        t, ref = checked_graph_time(call, out, ref, repeat=2, iters=10)
        if isinstance(t, str):
            rows.append(dict(config=spec, error=t))
            continue
        rows.append(dict(config=spec, us=round(t * 1e6, 1), tbs=round(kv_bytes / t / 1e12, 2),
                         of_roofline=round(kv_bytes / (hbm_tbs * 1e12) / t, 3)))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--steps", type=int, nargs="+", default=[0, 250, 450],
                    help="decode steps of the workload (requests still running, whole prompts cached)")
    ap.add_argument("--seqs", type=int, default=64, help="requests in the workload")
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    ap.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth for the roofline, TB/s")
    args = ap.parse_args()
    for spec in args.configs:
        parse_config(spec)  # bad specs fail before any GPU work
    res = []
    for step in args.steps:
        ctx = decode_batch(step, args.seqs)
        if not ctx:
            continue
        for kv in args.kv:
            rows = time_batch(ctx, kv, args.configs, args.hbm_tbs)
            key = dict(step=step, seqs=len(ctx), mean_ctx=round(sum(ctx) / len(ctx)), kv=kv)
            res.append(dict(key, rows=rows))
            print(f"step {step}, {len(ctx)} seqs (mean context {key['mean_ctx']}), KV {kv}:", flush=True)
            for r in rows:
                print("   ", r, flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("ATOM_BENCH_COMMIT", "unknown"),
                   "hbm_tbs": args.hbm_tbs, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
