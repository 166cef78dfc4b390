"""Tile sizes, warps and pipeline stages of the unified attention kernel at the Llama-3.1-8B
attention shape (32 q heads, 8 KV heads, head dim 128, bf16, KV blocks of 16 tokens or those
of `--block-sizes`), on batches taken
from the nano-vllm workload: decode batches at three points of the run (contexts of the
requests still running, longest first as the scheduler orders them) and a prefill step
(the first 16,384 prompt tokens). Each configuration is timed in CUDA-graph replays next to
the default choice; decode figures come with the KV-read bandwidth (the H200 copies at
4.3 TB/s). A diagnosis tool, not a benchmark.

    python3 scripts/attention_sweep.py --out attn.json
    python3 scripts/attention_sweep.py --out attn.json --block-sizes 16 32 64 --decode-only --few
    python3 scripts/attention_sweep.py --out attn.json --decode-only --steps 800 900 1000 --splits 1 2 4 8
    python3 scripts/attention_sweep.py --out attn.json --decode-only --few --layouts nhd hnd --placement sequential
    python3 scripts/attention_sweep.py --out attn.json --decode-only --rows-ahead \
        --decode-tilings 64/2/4 64/3/4 64/4/4 32/3/4 32/4/4 128/3/8
    python3 scripts/attention_sweep.py --out attn.json --baseline old_triton_unified.py \
        --decode-tilings 64/2/4 32/4/4 --prefill-tilings 64/64/2/4 64/32/3/4

`--baseline FILE` times an earlier copy of `triton_unified.py` (its default choice) on the same
batches, as the row "baseline"; `--decode-tilings` (TILE_N/num_stages/num_warps[/maxnreg]) and
`--prefill-tilings` (BLOCK_M/TILE_N/num_stages/num_warps[/maxnreg]) replace the built-in lists
(maxnreg: a cap on registers per thread, e.g. 64/2/4/96 for a fifth program per SM).
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json

import torch

from atom.benchmarks.workloads import nano_vllm_workload
from atom.model_ops.attention.triton_unified import AttentionWorkspace, unified_attention
from atom.utils.cuda_timing import checked_graph_time

HQ, HKV, D = 32, 8, 128


def paged_batch(ctx, q_lens, dev, block_size=16, layout="nhd", placement="random"):
    """q, caches, cu_seqlens, seq_lens and block tables of a batch. `layout`: "nhd" caches
    [blocks, block_size, Hkv, D]; "hnd" the same shape as a view of [blocks, Hkv, block_size, D]
    (each KV head's rows of a block contiguous). `placement`: blocks in random order, or each
    sequence's blocks consecutive ("sequential", as a fresh engine hands them out)."""
    nblk = [-(-c // block_size) for c in ctx]
    pool = sum(nblk) + 8
    if layout == "hnd":
        kc = torch.randn(pool, HKV, block_size, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        vc = torch.randn(pool, HKV, block_size, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    else:
        kc = torch.randn(pool, block_size, HKV, D, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
    perm = (torch.randperm(pool, device=dev) if placement == "random" else torch.arange(pool, device=dev)).int()
    bt = torch.zeros(len(ctx), max(nblk), dtype=torch.int32, device=dev)
    o = 0
    for i, n in enumerate(nblk):
        bt[i, :n] = perm[o:o + n]
        o += n
    cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device=dev)
    q = torch.randn(int(cu[-1]), HQ, D, device=dev, dtype=torch.bfloat16)
    sl = torch.tensor(ctx, dtype=torch.int32, device=dev)
    return q, kc, vc, cu, sl, bt


def load_baseline(path):
    """An earlier copy of triton_unified.py, as a module."""
    spec = importlib.util.spec_from_file_location("attention_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sweep(batch, max_q, configs, kv_bytes=None, baseline=None):
    q, kc, vc, cu, sl, bt = batch
    out = torch.empty_like(q)
    ws = AttentionWorkspace(q.shape[0], HQ, D, device=q.device)
    base_ws = baseline.AttentionWorkspace(q.shape[0], HQ, D, device=q.device) if baseline else None
    ref = None
    rows = []
    for cfg in [None] + configs + (["baseline"] if baseline else []):
        def call(cfg=cfg):
            if cfg == "baseline":
                baseline.unified_attention(q, kc, vc, out, cu, sl, bt, D ** -0.5, max_q, base_ws)
            else:
                unified_attention(q, kc, vc, out, cu, sl, bt, D ** -0.5, max_q, ws, config=cfg)
        t, ref = checked_graph_time(call, out, ref, iters=20)
        if isinstance(t, str):
            rows.append(dict(config=cfg, error=t))
            continue
        r = dict(config=cfg or "default", us=round(t * 1e6, 1))
        if kv_bytes:
            r["TB/s"] = round(kv_bytes / t / 1e12, 2)
        rows.append(r)
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    res = dict(default=next(r for r in rows if r["config"] == "default"), best=ok[:8],
               errors=sum("error" in r for r in rows))
    if baseline:
        res["baseline"] = next(r for r in rows if r["config"] == "baseline")
    return res


def tilings(specs, keys):
    """'64/2/4' -> dict(TILE_N=64, num_stages=2, num_warps=4) for keys of that order."""
    return [dict(zip(keys, map(int, spec.split("/")))) for spec in specs]


def main():
    global HQ
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16])
    ap.add_argument("--layouts", nargs="+", default=["nhd"], choices=["nhd", "hnd"],
                    help="KV-cache layouts to time (hnd: each KV head's rows of a block contiguous); "
                         "the prefill sweep takes the last layout and the first block size")
    ap.add_argument("--placement", default="random", choices=["random", "sequential"])
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--few", action="store_true", help="a handful of decode tilings, not all 27")
    ap.add_argument("--steps", type=int, nargs="+", default=[100, 300, 600], help="decode steps of the workload")
    ap.add_argument("--splits", type=int, nargs="*", default=[],
                    help="instead of the tilings (and of --few), the default tiling with these numbers of "
                         "KV splits (powers of two up to 16)")
    ap.add_argument("--q-heads", type=int, default=HQ,
                    help="query heads over the 8 KV heads (32: Llama-3.1-8B; 16: Qwen3-0.6B)")
    ap.add_argument("--baseline", help="an earlier triton_unified.py to time on the same batches")
    ap.add_argument("--decode-tilings", nargs="+",
                    help="TILE_N/num_stages/num_warps[/maxnreg], instead of the built-in list")
    ap.add_argument("--rows-ahead", action="store_true",
                    help="time every tiling also with `rows_ahead` (block-table entries a tile ahead, so that "
                         "3+ stages keep several K / V tiles in flight)")
    ap.add_argument("--prefill-tilings", nargs="+",
                    help="BLOCK_M/TILE_N/num_stages/num_warps[/maxnreg], instead of the built-in list")
    args = ap.parse_args()
    HQ = args.q_heads
    if any(n < 1 or n > 16 or n & (n - 1) for n in args.splits):
        ap.error(f"--splits takes powers of two from 1 to 16 (the workspace's limit), got {args.splits}")
    dev = "cuda"
    reqs = nano_vllm_workload(256)
    res = {}
    dec_cfgs = [dict(TILE_N=t, num_warps=w, num_stages=s)
                for t, w, s in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))]
    if args.few:
        dec_cfgs = [dict(TILE_N=t, num_warps=4, num_stages=s) for t, s in itertools.product((32, 64, 128), (2, 3))]
    if args.splits:
        dec_cfgs = [dict(num_splits=n) for n in args.splits]
    if args.decode_tilings:
        dec_cfgs = tilings(args.decode_tilings, ("TILE_N", "num_stages", "num_warps", "maxnreg"))
    if args.rows_ahead:
        dec_cfgs += [dict(c, rows_ahead=True) for c in dec_cfgs]
    baseline = load_baseline(args.baseline) if args.baseline else None
    for layout, bs in itertools.product(args.layouts, args.block_sizes):
        for step in args.steps:
            live = sorted((len(r.prompt_token_ids) + step for r in reqs if r.max_tokens > step), reverse=True)
            kv = sum(live) * HKV * D * 2 * 2
            r = sweep(paged_batch(live, [1] * len(live), dev, bs, layout, args.placement), 1, dec_cfgs, kv, baseline)
            key = f"{layout}, block {bs}, decode step {step}, {len(live)} seqs"
            res[key] = r
            print(f"{key}: default {r['default']}; best {r['best'][:3]}; baseline {r.get('baseline')}", flush=True)
    if args.decode_only:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": res}, f, indent=1)
        return
    lens, total = [], 0
    for r in reqs:
        if total + len(r.prompt_token_ids) > 16384:
            break
        lens.append(len(r.prompt_token_ids))
        total += lens[-1]
    pre_cfgs = [dict(BLOCK_M=m, TILE_N=t, num_warps=w, num_stages=s)
                for m, t, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))]
    if args.prefill_tilings:
        pre_cfgs = tilings(args.prefill_tilings, ("BLOCK_M", "TILE_N", "num_stages", "num_warps", "maxnreg"))
    if args.rows_ahead:
        pre_cfgs += [dict(c, rows_ahead=True) for c in pre_cfgs]
    r = sweep(paged_batch(lens, lens, dev, args.block_sizes[0], args.layouts[-1], args.placement), max(lens), pre_cfgs,
              baseline=baseline)
    flops = sum(2 * 2 * L * L / 2 * HQ * D for L in lens)
    for row in [r["default"]] + r["best"] + ([r["baseline"]] if "baseline" in r else []):
        row["TFLOP/s"] = round(flops / row["us"] / 1e6, 1)
    key = f"{args.layouts[-1]}, block {args.block_sizes[0]}, prefill {len(lens)} prompts, {total} tokens"
    res[key] = r
    print(f"{key}: default {r['default']}; best {r['best'][:3]}; baseline {r.get('baseline')}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
