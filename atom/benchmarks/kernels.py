"""Micro-benchmark of the unified Triton attention kernel (GPU).

Decode on the Qwen3-0.6B attention shape (16 q heads, 8 kv heads, head dim
128, bf16, block 16) at several batch sizes and contexts.  Kernel time is the
median of CUDA-graph replays (as the engine runs it), each graph holding
several launches over disjoint KV so the data does not sit in the 50 MB L2;
``eager us`` is ``triton.testing.do_bench`` of the Python call (host-bound at
small sizes).  Prints the achieved KV-read bandwidth against the 4.3 TB/s HBM
limit and, in the same run, a peer: torch's ``scaled_dot_product_attention``
over the same K/V laid out contiguously (no paging), timed the same way.
``--tune`` sweeps tile/warp/split choices (decode) and tiles (prefill).

    python -m atom.benchmarks.kernels --out kern.json [--tune]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch

from atom.benchmarks.provenance import provenance
from atom.utils.cuda_timing import graph_time

HBM_BYTES_PER_S = 4.3e12  # measured D2D copy on the H200
BF16_FLOPS = 790e12  # measured dense bf16 GEMM on the H200
L2_FLUSH_BYTES = 160 * 2**20  # > 3x the H200's L2


def _decode_cases(B, ctx, Hq=16, Hkv=8, D=128, bs=16, dtype=torch.bfloat16, dev="cuda"):
    """Replicas of one decode batch over disjoint blocks of one shared KV pool."""
    kv_bytes = 2 * B * ctx * Hkv * D * 2
    R = max(1, min(64, -(-L2_FLUSH_BYTES // kv_bytes)))
    nblk = -(-ctx // bs)
    pool = R * B * nblk
    g = torch.Generator(device=dev).manual_seed(0)
    k_cache = torch.randn(pool, bs, Hkv, D, device=dev, dtype=dtype, generator=g)
    v_cache = torch.randn(pool, bs, Hkv, D, device=dev, dtype=dtype, generator=g)
    perm = torch.randperm(pool, device=dev, generator=g).int().view(R, B, nblk)
    cases = []
    for r in range(R):
        q = torch.randn(B, Hq, D, device=dev, dtype=dtype, generator=g)
        cases.append(dict(q=q, k_cache=k_cache, v_cache=v_cache, out=torch.empty_like(q),
                          cu_seqlens_q=torch.arange(B + 1, device=dev, dtype=torch.int32),
                          seq_lens=torch.full((B,), ctx, device=dev, dtype=torch.int32),
                          block_tables=perm[r].contiguous(), softmax_scale=D ** -0.5,
                          max_query_len=1))
    return cases


def _prefill_case(B, L, Hq=16, Hkv=8, D=128, bs=16, dtype=torch.bfloat16, dev="cuda"):
    c = _decode_cases(B, L, Hq, Hkv, D, bs, dtype, dev)[0]
    c["q"] = torch.randn(B * L, Hq, D, device=dev, dtype=dtype)
    c["out"] = torch.empty_like(c["q"])
    c["cu_seqlens_q"] = torch.arange(0, B * L + 1, L, device=dev, dtype=torch.int32)
    c["max_query_len"] = L
    return c


def _host_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def _bench(fn, rep=60):
    from triton.testing import do_bench

    return do_bench(fn, warmup=15, rep=rep, return_mode="median") * 1e-3  # seconds


def _try(calls):
    try:
        return graph_time(calls, iters=10)
    except Exception as e:  # e.g. out of shared memory for a big tile
        print(f"    config failed: {str(e).splitlines()[0][:100]}")
        return float("inf")


def _sdpa_peer(cases):
    """torch SDPA over the same K/V gathered into contiguous [B, Hkv, ctx, D] tensors."""
    F = torch.nn.functional
    calls = []
    for case in cases:
        B, Hq, D = case["q"].shape
        ctx = int(case["seq_lens"][0])
        Hkv = case["k_cache"].shape[2]
        bt = case["block_tables"].long()
        k = case["k_cache"][bt].reshape(B, -1, Hkv, D)[:, :ctx].transpose(1, 2).contiguous()
        v = case["v_cache"][bt].reshape(B, -1, Hkv, D)[:, :ctx].transpose(1, 2).contiguous()
        q = case["q"].view(B, Hq, 1, D)
        calls.append(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    return graph_time(calls)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write results as JSON here")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--contexts", default="512,1024,2048")
    ap.add_argument("--tune", action="store_true", help="sweep kernel configs too")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 1
    from atom.model_ops.attention.triton_unified import (
        AttentionWorkspace, pick_attention_config, unified_attention)

    dev = torch.device("cuda")
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    ws = AttentionWorkspace(max(batches), 16, 128, max_splits=32, device=dev)
    rows = []
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {__import__('triton').__version__}")
    print(f"{'batch':>5} {'ctx':>5} {'splits':>6} {'us':>8} {'GB/s':>7} {'%HBM':>5} "
          f"{'sdpa us':>8} {'vs sdpa':>7} {'eager us':>8} {'host us':>7}")

    def attn(case, **kw):
        return lambda: unified_attention(**case, workspace=ws, **kw)

    for B, ctx in itertools.product(batches, contexts):
        cases = _decode_cases(B, ctx)
        nbytes = 2 * B * ctx * 8 * 128 * 2 + 2 * cases[0]["q"].numel() * 2
        cfg = pick_attention_config(B, B, 16, 8, 128, 1, dev, max_splits=ws.max_splits)
        t = graph_time([attn(c) for c in cases])
        t_eager = _bench(attn(cases[0]))
        host = _host_us(attn(cases[0]))
        try:
            t_peer = _sdpa_peer(cases)
        except Exception as e:  # pragma: no cover
            print(f"sdpa peer failed: {str(e).splitlines()[0][:100]}")
            t_peer = float("nan")
        bw = nbytes / t
        rows.append(dict(kind="decode", batch=B, ctx=ctx, splits=cfg["num_splits"],
                         time_us=t * 1e6, bytes=nbytes, gbps=bw / 1e9,
                         frac_hbm=bw / HBM_BYTES_PER_S, sdpa_us=t_peer * 1e6,
                         speedup_vs_sdpa=t_peer / t, eager_us=t_eager * 1e6, host_us=host,
                         replicas=len(cases)))
        print(f"{B:>5} {ctx:>5} {cfg['num_splits']:>6} {t * 1e6:>8.1f} {bw / 1e9:>7.0f} "
              f"{100 * bw / HBM_BYTES_PER_S:>5.1f} {t_peer * 1e6:>8.1f} {t_peer / t:>7.2f} "
              f"{t_eager * 1e6:>8.1f} {host:>7.1f}", flush=True)
        del cases

    # prefill: 4 x 2048 causal, FLOPs = 4 * B * Hq * D * L^2 / 2
    pre = _prefill_case(4, 2048)
    flops = 4 * 4 * 16 * 128 * 2048 ** 2 / 2
    t = graph_time([lambda: unified_attention(**pre)])
    rows.append(dict(kind="prefill", batch=4, ctx=2048, time_us=t * 1e6,
                     tflops=flops / t / 1e12, frac_peak=flops / t / BF16_FLOPS))
    print(f"prefill 4x2048: {t * 1e6:.1f} us  {flops / t / 1e12:.1f} TFLOP/s "
          f"({100 * flops / t / BF16_FLOPS:.1f}% of bf16 peak)", flush=True)

    tuned = []

    def dump():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), **provenance(),
                               hbm_bytes_per_s=HBM_BYTES_PER_S, rows=rows, tuning=tuned),
                          f, indent=1)

    dump()
    if args.tune:
        print("\ntuning (graph median us per call; best first)", flush=True)
        for B in [b for b in batches if b <= 64]:
            cases = _decode_cases(B, 1024)
            res = []
            for n, w in itertools.product((32, 64), (2, 4, 8)):
                for sp in ((1, 2, 4, 8, 16, 32) if B <= 8 else (1, 2)):
                    cfg = dict(TILE_N=n, num_warps=w, num_stages=2)
                    res.append((_try([attn(c, config=cfg, num_kv_splits=sp) for c in cases]),
                                dict(cfg, splits=sp)))
            res.sort(key=lambda r: r[0])
            for t, c in res[:4]:
                print(f"  decode B={B:<4} ctx=1024 {t * 1e6:8.1f} us  {c}", flush=True)
            tuned.append(dict(kind="decode", batch=B, ctx=1024,
                              best=[dict(c, time_us=t * 1e6) for t, c in res[:8]]))
            dump()
            del cases
        res = []
        for bm, n, w, st in itertools.product((64, 128), (32, 64), (4, 8), (2, 3)):
            cfg = dict(BLOCK_M=bm, TILE_N=n, num_warps=w, num_stages=st)
            res.append((_try([lambda: unified_attention(**pre, config=cfg)]), cfg))
        res.sort(key=lambda r: r[0])
        for t, c in res[:4]:
            print(f"  prefill 4x2048 {t * 1e6:8.1f} us {flops / t / 1e12:6.1f} TFLOP/s  {c}")
        tuned.append(dict(kind="prefill", batch=4, ctx=2048,
                          best=[dict(c, time_us=t * 1e6) for t, c in res[:6]]))

    dump()
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
