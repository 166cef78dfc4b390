"""Launch configurations of the absorbed MLA decode kernel (`mla_decode`) at DeepSeek-V2-Lite's
decode shape: 16 heads, kv_lora_rank 512, rope 64, a bf16 latent cache in pages of the engine's
KV block size (16 tokens: `kv_cache_block_size`, which the Triton MLA backend uses as is), pages
in random order. Cases: batches of 1, 8, 32, 64, 128, 256 sequences at uniform contexts of
512, 1024 and 4096 tokens, and per batch one mixed case (contexts uniform in [100, 4096],
longest first as the scheduler orders decode batches). Each configuration is timed in CUDA-graph
replays (`atom.utils.cuda_timing.graph_time`) and checked against the default's output; a case
prints the default's and the best configuration's time and the latent-cache read rate
(B x ctx x (R + P) x 2 bytes per call) beside the H200's 4.3 TB/s. A diagnosis tool for the
table in `pick_mla_config`, not a benchmark. GPU only.

    python3 scripts/mla_decode_sweep.py --out mla_sweep.json            # ~28 configs a case
    python3 scripts/mla_decode_sweep.py --out mla_sweep.json --quick    # fewer cases and configs
    python3 scripts/mla_decode_sweep.py --out mla_sweep.json --batches 128 136 --contexts 900
    python3 scripts/mla_decode_sweep.py --out mla_sweep.json --token-rows   # page_loads False grid

The summary at the end gives, per batch, the configuration with the least total time over that
batch's cases: the row of `pick_mla_config`'s tables to edit.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import sys

import torch

H, R, P = 16, 512, 64
PEAK_TBS = 4.3


def latent_batch(ctx: list[int], dev, block_size: int, seed: int = 0):
    """q_lat, q_pe, a random bf16 latent cache, block tables (pages shuffled) and seq_lens."""
    g = torch.Generator(device=dev).manual_seed(seed)
    pages = [-(-c // block_size) for c in ctx]
    pool = sum(pages) + 8
    cache = torch.randn(pool, block_size, R + P, device=dev, generator=g, dtype=torch.bfloat16)
    perm = torch.randperm(pool, device=dev, generator=g).int()
    bt = torch.zeros(len(ctx), max(pages), dtype=torch.int32, device=dev)
    at = 0
    for i, n in enumerate(pages):
        bt[i, :n] = perm[at:at + n]
        at += n
    ql = torch.randn(len(ctx), H, R, device=dev, generator=g, dtype=torch.bfloat16)
    qp = torch.randn(len(ctx), H, P, device=dev, generator=g, dtype=torch.bfloat16)
    return ql, qp, cache, bt, torch.tensor(ctx, dtype=torch.int32, device=dev)


def configs(default: dict, quick: bool, token_rows: bool = False) -> list[dict]:
    """Overrides of the default: tilings at its split count, then split choices at its tiling;
    `token_rows`: instead, tilings (stages up to 4), 32-token tiles with 3 stages at every split
    count, and split counts with one block-table entry per token (page_loads False) against
    the default."""
    if token_rows:
        out = [dict(page_loads=False, TILE_N=t, num_warps=w, num_stages=s)
               for t, w, s in itertools.product((16, 32, 64), (4, 8), (2, 3, 4))]
        # the pipelined tiling at every split count (a deeper pipeline moves the best split)
        out += [dict(page_loads=False, TILE_N=32, num_warps=4, num_stages=3, num_splits=n) for n in (1, 2, 4, 8)]
        out += [dict(page_loads=False, num_splits=n) for n in (1, 2, 8)]
        out += [dict(page_loads=False, min_split_tokens=n) for n in (128, 512)]
        out += [dict(page_loads=False, lazy_rescale=True, TILE_N=t, num_warps=w, num_stages=s)
                for t, w, s in ((32, 4, 3), (64, 8, 2))]
        return [c for c in out if any(default.get(k) != v for k, v in c.items())]
    tiles = (itertools.product((32, 64), (4, 8), (2, 3)) if quick else
             itertools.product((16, 32, 64), (4, 8), (1, 2, 3)))
    out = [dict(TILE_N=t, num_warps=w, num_stages=s) for t, w, s in tiles]
    splits = (1, default["num_splits"] * 2, max(1, default["num_splits"] // 2)) if quick else (1, 2, 4, 8, 16, 32)
    out += [dict(num_splits=n) for n in sorted(set(splits)) if n <= 32]
    if not quick:
        out += [dict(min_split_tokens=n) for n in (64, 1024)]
        out += [dict(page_loads=not default["page_loads"]), dict(splits_first=False)]
    return [c for c in out if any(default.get(k) != v for k, v in c.items())]


def sweep(batch, cfgs, workspace, latent_bytes: int, iters: int):
    from atom.model_ops.kernels.mla_decode import mla_decode
    from atom.utils.cuda_timing import checked_graph_time
    ql, qp, cache, bt, sl = batch
    out = torch.empty_like(ql)
    ref, rows = None, []
    for cfg in [None] + cfgs:
        def call(cfg=cfg):
            mla_decode(ql, qp, cache, bt, sl, R, 0.1147, out, workspace, config=cfg)
        t, ref = checked_graph_time(call, out, ref, iters=iters)
        if isinstance(t, str):
            rows.append(dict(config=cfg, error=t))
            continue
        rows.append(dict(config=cfg or "default", us=round(t * 1e6, 2), TBs=round(latent_bytes / t / 1e12, 3)))
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    return dict(default=next(r for r in rows if r["config"] == "default"), best=ok[:5], all=rows,
                errors=[r for r in rows if "error" in r])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file of every case's timings")
    ap.add_argument("--quick", action="store_true", help="3 batches, 1 context + mixed, 11 configs")
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--contexts", type=int, nargs="+")
    ap.add_argument("--no-mixed", action="store_true", help="uniform contexts only")
    ap.add_argument("--block-size", type=int, default=16, help="KV-cache block size (the engine's default: 16)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--token-rows", action="store_true",
                    help="tilings and splits with one block-table entry per token (page_loads False)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("mla_decode_sweep.py times Triton kernels in CUDA graphs: it needs a CUDA GPU (none found)")
    for name in ("batches", "contexts"):
        if any(v < 1 for v in getattr(args, name) or []):
            ap.error(f"--{name} takes positive integers, got {getattr(args, name)}")
    from atom.model_ops.kernels.mla_decode import MLAWorkspace, num_sms, pick_mla_config, workspace_slots
    dev = torch.device("cuda", torch.cuda.current_device())
    sms = num_sms(dev)
    batches = args.batches or ([1, 32, 128] if args.quick else [1, 8, 32, 64, 128, 256])
    contexts = args.contexts or ([1024] if args.quick else [512, 1024, 4096])
    ws = MLAWorkspace(max(batches), H, R, max_splits=32, device=dev,
                      slots=max(workspace_slots(max(batches), H, R, sms), max(batches) * 32))
    rng = random.Random(0)
    res, totals = {}, {}
    for b in batches:
        cases = [(f"ctx {c}", [c] * b) for c in contexts]
        if not args.no_mixed:
            cases.append(("mixed 100-4096", sorted((rng.randint(100, 4096) for _ in range(b)), reverse=True)))
        default = pick_mla_config(b, H, R, sms, 32)
        cfgs = configs(default, args.quick, args.token_rows)
        for name, ctx in cases:
            latent_bytes = sum(ctx) * (R + P) * 2
            r = sweep(latent_batch(ctx, dev, args.block_size), cfgs, ws, latent_bytes, args.iters)
            key = f"B={b}, {name}"
            r["default_config"] = default
            res[key] = r
            d, best = r["default"], r["best"][0]
            print(f"{key:24s} default {d.get('us')} us {d.get('TBs')} TB/s | best {best['config']} "
                  f"{best['us']} us {best['TBs']} TB/s | peak {PEAK_TBS} TB/s"
                  + (f" | {len(r['errors'])} errors" if r["errors"] else ""), flush=True)
            for row in r["all"]:
                if "us" in row:
                    k = json.dumps(row["config"], sort_keys=True)
                    totals.setdefault(b, {}).setdefault(k, [0.0, 0])
                    totals[b][k][0] += row["us"]
                    totals[b][k][1] += 1
    summary = {}
    print("\nper batch, least total time over its cases (configs timed in every case):")
    for b, per in totals.items():
        n = max(c for _, c in per.values())
        full = {k: t for k, (t, c) in per.items() if c == n}
        best = min(full, key=full.get)
        summary[b] = dict(best=json.loads(best), total_us=round(full[best], 1),
                          default_total_us=round(full.get('"default"', float("nan")), 1))
        print(f"  B={b:4d}: best {best} ({full[best]:.1f} us) vs default ({summary[b]['default_total_us']} us)")
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), sms=sms, block_size=args.block_size,
                       shape=dict(heads=H, kv_lora_rank=R, rope=P), peak_TBs=PEAK_TBS,
                       results=res, summary=summary), f, indent=1)


if __name__ == "__main__":
    main()
