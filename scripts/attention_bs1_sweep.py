"""The batch-1 decode attention step as the engine runs it at the Llama-3.1-8B shape (32 q heads,
8 KV heads, head dim 128, bf16 cache of 16-token blocks): one sequence, q unrotated and this
step's k / v written by the kernel (`DecodeRope`), the split segments merged in the kernel
("merge_in_attention"), timed in CUDA-graph replays over enough cache copies to miss L2 (a
layer's cache was last read a whole step of weights ago). For each context: the engine's own
choice (`pick_attention_config`), the same with the opt-in "skip_empty" (segments without keys
storing nothing: `triton_unified.SKIP_EMPTY_SEGMENTS`) and a grid of KV splits x TILE_N x warps, beside the time
the KV read takes at the H200's copy rate. A diagnosis tool, not a benchmark: where the ~6-8 us a layer
of batch-1 attention (docs/perf, "Where a batch-1 decode step goes") can come from.

    python3 scripts/attention_bs1_sweep.py --out attn_bs1.json
    python3 scripts/attention_bs1_sweep.py --out attn_bs1.json --contexts 256 1024 --splits 4 16 --tiles 16 64
    python3 scripts/attention_bs1_sweep.py --out attn_bs1_long.json --contexts 2048 4096 8192 --splits 16 32 64 \
        --tiles 32 64 --warps 4    # more segments than the engine's 16 at long contexts
    python3 scripts/attention_bs1_sweep.py --out attn_bs1_ahead.json --ahead --stages 3 --splits 4 8 16 32 \
        --tiles 32 64 --warps 4    # a program's tiles pipelined (compiled for sm90, the default keeps one K / V buffer)

Each configuration's output is checked once against the engine's choice (which the GPU tests
check against the reference); a configuration that fails to build or differs is reported.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from atom.benchmarks.provenance import git_commit
from atom.benchmarks.roofline import H200_BANDWIDTH
from atom.model_ops.rotary import RotaryEmbedding

HQ, HKV, D, BS = 32, 8, 128, 16
L2_MISS_BYTES = 160 << 20


def step_copies(ctx: int, dev, dtype=torch.bfloat16) -> tuple[list, dict]:
    """Distinct caches (each with its own block table) for one decode step at context `ctx`,
    enough of them to miss L2, and the step's shared inputs (q, this step's k / v, cos / sin,
    cu_seqlens, seq_lens, the `DecodeRope` type and one copy's bytes)."""
    from atom.model_ops.attention.triton_unified import DecodeRope
    nblk = -(-ctx // BS)
    one = 2 * nblk * BS * HKV * D * torch.finfo(dtype).bits // 8
    n = max(2, -(-L2_MISS_BYTES // one))
    g = torch.Generator(device=dev).manual_seed(ctx)
    steps = []
    for _ in range(n):
        kc = torch.randn(nblk + 1, BS, HKV, D, device=dev, generator=g).to(dtype)
        vc = torch.randn(nblk + 1, BS, HKV, D, device=dev, generator=g).to(dtype)
        bt = (torch.randperm(nblk + 1, device=dev, generator=g)[:nblk]).int()[None, :]
        slot = (bt[0, (ctx - 1) // BS].long() * BS + (ctx - 1) % BS).reshape(1)
        steps.append((kc, vc, bt, slot))
    qkv = torch.randn(1, (HQ + 2 * HKV) * D, device=dev, generator=g).to(dtype)
    q, k, v = (t.view(1, -1, D) for t in qkv.split([HQ * D, HKV * D, HKV * D], dim=-1))
    cs = RotaryEmbedding(D, ctx + 1, dict(rope_theta=10000.0, rope_type="default")).cos_sin_cache
    shared = dict(q=q, k=k, v=v, cs=cs.to(dev), cu=torch.tensor([0, 1], dtype=torch.int32, device=dev),
                  sl=torch.tensor([ctx], dtype=torch.int32, device=dev), rope=DecodeRope, bytes=one)
    return steps, shared


def engine_call(s: dict, st: tuple, out: torch.Tensor, ws, cfg, splits) -> None:
    """The engine's batch-1 decode attention on one copy `st` (`step_copies`): q unrotated,
    k / v rotated and written by the kernel, segments merged in it; `cfg` / `splits` None: the
    engine's choice."""
    from atom.model_ops.attention.triton_unified import unified_attention
    kc, vc, bt, slot = st
    unified_attention(s["q"], kc, vc, out, s["cu"], s["sl"], bt, D ** -0.5, 1, ws, num_kv_splits=splits,
                      config=cfg, rope=s["rope"](s["cs"], s["k"], s["v"], slot), merge_in_kernel=True)


def time_config(steps, s, cfg, splits, iters):
    """(us a call, output of the first copy) for one configuration (None: the engine's choice)."""
    from atom.model_ops.attention.triton_unified import AttentionWorkspace
    from atom.utils.cuda_timing import graph_time
    # room for the configuration's segments (the engine's workspace holds 16: more would run unsplit)
    ws = AttentionWorkspace(1, HQ, D, max_splits=max(16, splits or 1), device=s["q"].device)
    out = torch.empty_like(s["q"])

    def call(st):
        engine_call(s, st, out, ws, cfg, splits)
    call(steps[0])
    first = out.clone()
    t = graph_time([lambda st=st: call(st) for st in steps], iters=iters)
    return t * 1e6, first


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--tiles", type=int, nargs="+", default=[16, 32, 64], help="TILE_N values")
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--stages", type=int, default=None, help="the grid's num_stages (default: the engine's, 2)")
    ap.add_argument("--ahead", action="store_true",
                    help="the grid's tiles with `rows_ahead` (each tile's block-table entries loaded a tile ahead: "
                         "with 3 stages the K / V tiles get two buffers, so a program's tiles overlap)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{sys.argv[0]}: no CUDA GPU here; nothing was timed", file=sys.stderr)
        return 2
    from atom.model_ops.attention.triton_unified import pick_attention_config
    dev = torch.device("cuda")
    rows = []
    for ctx in args.contexts:
        steps, s = step_copies(ctx, dev)
        floor_us = s["bytes"] / H200_BANDWIDTH * 1e6  # at the H200's copy rate, as docs/perf's floors
        pick = pick_attention_config(1, 1, HQ, HKV, D, 1, dev)
        t0, ref = time_config(steps, s, None, None, args.iters)
        print(f"context {ctx:5d}: KV {s['bytes'] / 2 ** 20:6.2f} MiB, {floor_us:5.2f} us at "
              f"{H200_BANDWIDTH / 1e12} TB/s; "
              f"the engine's choice (splits {pick['num_splits']}, TILE_N {pick['TILE_N']}, "
              f"{pick['num_warps']} warps) {t0:6.2f} us", flush=True)
        rows.append(dict(context=ctx, config="engine", splits=pick["num_splits"], TILE_N=pick["TILE_N"],
                         num_warps=pick["num_warps"], us=t0, floor_us=floor_us))
        # the same choice with the segments that have no keys storing nothing (opt-in "skip_empty")
        t_skip, out = time_config(steps, s, dict(skip_empty=True), None, args.iters)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        print(f"   the engine's choice with skip_empty: {t_skip:6.2f} us{'' if err == 0 else f'  DIFFERS ({err:.1e})'}",
              flush=True)
        rows.append(dict(context=ctx, config="engine+skip_empty", splits=pick["num_splits"], TILE_N=pick["TILE_N"],
                         num_warps=pick["num_warps"], us=t_skip, floor_us=floor_us, rel_diff=err, ok=err == 0))
        for splits, tile_n, warps in itertools.product(args.splits, args.tiles, args.warps):
            cfg = dict(TILE_N=tile_n, num_warps=warps, rows_ahead=args.ahead)
            if args.stages:
                cfg["num_stages"] = args.stages
            row = dict(context=ctx, config="grid", splits=splits, TILE_N=tile_n, num_warps=warps, floor_us=floor_us,
                       num_stages=args.stages or pick["num_stages"], rows_ahead=args.ahead)
            try:
                t, out = time_config(steps, s, cfg, splits, args.iters)
            except Exception as e:  # noqa: BLE001 - a sweep reports a configuration that does not build or run
                rows.append(dict(row, error=f"{type(e).__name__}: {str(e)[:200]}"))
                print(f"   splits {splits:2d} TILE_N {tile_n:3d} warps {warps}: FAILED {type(e).__name__}", flush=True)
                continue
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            rows.append(dict(row, us=t, rel_diff=err, ok=err < 2e-2))
            print(f"   splits {splits:2d} TILE_N {tile_n:3d} warps {warps}: {t:6.2f} us"
                  f"{'' if err < 2e-2 else f'  DIFFERS ({err:.1e})'}", flush=True)
        del steps
    with open(args.out, "w") as f:
        json.dump(dict(commit=git_commit() or "unknown", device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print("\ncontext  engine us  best us  (splits, TILE_N, warps)  KV floor us")
    for ctx in args.contexts:
        at = [r for r in rows if r["context"] == ctx and r.get("us") is not None and r.get("ok", True)]
        eng = next(r for r in at if r["config"] == "engine")
        best = min(at, key=lambda r: r["us"])
        print(f"{ctx:7d} {eng['us']:10.2f} {best['us']:8.2f}  ({best['splits']}, {best['TILE_N']}, {best['num_warps']})"
              f"{'':10s}{eng['floor_us']:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
