"""Sweeps the tiles of the 4-bit tensor-core kernel (`w4_dot._w4_dot_kernel`, swap-AB) on the
Llama-3.1-8B linear shapes for M in 1 .. 2048, beside bf16 `F.linear` and the kernel the
table picked before it (`w4_gemv` / `w4_gemm`), and prints the best tile per (format, shape,
M) with GB/s next to the ~4.3 TB/s HBM limit (TFLOP/s from M = 512). A tuning probe for
`w4_gemm.DOT_TILES` / `DOT_TARGET_PROGRAMS` / `DOT_MIN_M`, not a benchmark: JSON of every
timing to --out.

    python3 scripts/w4_sweep.py --out w4_sweep.json [--quick] [--formats int4 int4_asym mxfp4] [--ms 1 8 64]

Formats: int4 g128 symmetric, int4 g128 with zero points, MXFP4. The asymmetric int4 times
only the best few tiles of the symmetric one at the same (shape, M) (same unpacking; the zero
point is a per-chunk outer product), which keeps the compile count and the run under 3
minutes on an H200. Each timing replays a CUDA graph over enough weight copies to miss L2
(`atom.utils.cuda_timing.graph_time`). Bytes: the stored weight (packed values, scales, zero
points) plus x and y. "table" in the output is the config `w4_config` picks today.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
MS = [1, 2, 4, 8, 16, 64, 512, 2048]
FORMATS = {"int4": ("int4", 128, False), "int4_asym": ("int4", 128, True), "mxfp4": ("mxfp4", 32, False)}
HBM_TBS = 4.3
L2_MISS_BYTES = 256 << 20
ASYM_TOP = 5  # tiles of the symmetric int4 sweep the asymmetric one re-times
DEVICE = "cuda"  # the tests run the loop on the CPU (interpreter, a stand-in timer)

# candidate tiles per regime: (BLOCK_N, BLOCK_K, num_warps, num_stages, ORDER), each with split-K counts
SMALL = [(32, 256, 4, 3, 0), (64, 256, 4, 3, 0), (64, 512, 4, 3, 0), (128, 256, 4, 3, 0), (128, 256, 8, 3, 0),
         (64, 128, 4, 3, 0), (64, 256, 4, 3, 1), (64, 256, 8, 4, 0)]
SMALL_QUICK = [(64, 256, 4, 3, 0), (128, 256, 8, 3, 0), (64, 256, 4, 3, 1)]
MID = [(64, 128, 4, 3, 0), (64, 256, 4, 3, 0), (128, 128, 8, 3, 0), (128, 64, 4, 3, 0), (32, 256, 4, 3, 0)]
MID_QUICK = [(64, 128, 4, 3, 0), (128, 128, 8, 3, 0)]
# large M: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, ORDER)
LARGE = [(64, 128, 64, 4, 3, 0), (128, 128, 64, 8, 3, 0), (128, 128, 128, 8, 3, 0), (128, 64, 64, 4, 4, 0),
         (128, 256, 64, 8, 3, 0), (64, 64, 128, 4, 3, 0), (128, 128, 64, 8, 4, 0)]
LARGE_QUICK = [(128, 128, 64, 8, 3, 0), (64, 128, 64, 4, 3, 0)]


def candidates(M: int, quick: bool) -> list[dict]:
    """The w4_dot configs tried at M rows (<= ~40)."""
    out = []
    if M <= 64:
        bm = max(16, 1 << (M - 1).bit_length())
        tiles, splits = (SMALL_QUICK if quick else SMALL, (1, 2, 4, 8)) if M <= 16 else \
            (MID_QUICK if quick else MID, (1, 2, 4))
        for bn, bk, w, st, order in tiles:
            for sk in splits:
                out.append(dict(kernel="w4_dot", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, ORDER=order,
                                num_warps=w, num_stages=st))
    else:
        for bm, bn, bk, w, st, order in (LARGE_QUICK if quick else LARGE):
            out.append(dict(kernel="w4_dot", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, ORDER=order,
                            num_warps=w, num_stages=st))
    return out


def packed_weights(fmt: str, N: int, K: int, g: int, zp: bool):
    if fmt == "int4":
        packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (N, K // 8), dtype=torch.int32, device=DEVICE)
        scales = (torch.rand(N, K // g, device=DEVICE) / K ** 0.5).bfloat16()
        zeros = torch.randint(0, 16, (N, K // g), dtype=torch.int8, device=DEVICE) if zp else None
    else:
        packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=DEVICE)
        scales = torch.randint(118, 126, (N, K // 32), dtype=torch.uint8, device=DEVICE)
        zeros = None
    return packed, scales, zeros


def probe_args(doc: str, argv, **extra) -> argparse.Namespace | None:
    """The probes' command line (--out, --iters, and `extra`: option name -> add_argument
    keywords); None, after saying so, where there is no CUDA GPU to time on."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", required=True)
    for name, kw in extra.items():
        ap.add_argument(f"--{name}", **kw)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{sys.argv[0]}: no CUDA GPU here; nothing was timed", file=sys.stderr)
        return None
    return args


def write_rows(path: str, rows: list) -> None:
    """The probes' JSON: the commit (ATOM_BENCH_COMMIT), the device and every timing."""
    with open(path, "w") as f:
        json.dump(dict(commit=os.environ.get("ATOM_BENCH_COMMIT", "unknown"), device=torch.cuda.get_device_name(),
                       rows=rows), f, indent=1)


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def copies(n: int) -> int:
    return max(2, -(-L2_MISS_BYTES // n))


def key(cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items() if k != "kernel")


def _compile_one(task) -> str:
    """Worker process: runs one (format, M, config) on small tensors of the sweep's dtypes and
    16-divisible sizes, so that Triton's on-disk cache holds the kernel the sweep then loads."""
    name, M, cfg = task
    from atom.model_ops.kernels.w4_gemm import w4_linear_launch
    fmt, g, zp = FORMATS[name]
    packed, scales, zeros = packed_weights(fmt, 256, 2048, g, zp)
    x = torch.randn(M, 2048, device=DEVICE, dtype=torch.bfloat16)
    try:
        w4_linear_launch(x, packed, scales, zeros, None, fmt, g, 2048, config=cfg)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported again (and skipped) when timed
        return f"{name} {key(cfg)}: {type(e).__name__}"
    return ""


def precompile(tasks: list, jobs: int) -> None:
    """Compiles the sweep's kernels in `jobs` processes (Triton compiles one at a time per
    process; ~100 kernels would otherwise take most of the sweep's budget)."""
    import concurrent.futures
    import multiprocessing
    seen, todo = set(), []
    for name, M, cfg in tasks:
        dot = cfg["kernel"] == "w4_dot"  # its M and SPLIT_K are not specialized: one compile per tile
        k = (name, 0 if dot else M, key(dict(cfg, SPLIT_K=min(cfg.get("SPLIT_K", 1), 2))))
        if k not in seen:
            seen.add(k)
            todo.append((name, M, cfg))
    t0 = time.time()
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        errors = [e for e in ex.map(_compile_one, todo) if e]
    print(f"compiled {len(todo)} kernels in {time.time() - t0:.0f} s with {jobs} processes"
          + (f"; {len(errors)} failed, e.g. {errors[0]}" if errors else ""), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file of every timing")
    ap.add_argument("--quick", action="store_true", help="a few tiles per regime (about a third of the time)")
    ap.add_argument("--formats", nargs="*", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--ms", nargs="*", type=int, default=MS)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=8, help="processes compiling the kernels first (0: none)")
    args = ap.parse_args(argv)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("w4_sweep: no CUDA GPU here (run it on the H200); nothing was timed", file=sys.stderr)
        return 2
    from atom.model_ops.kernels.w4_gemm import w4_config, w4_linear_launch
    from atom.utils.cuda_timing import graph_time
    t_start = time.time()
    if args.jobs > 0:
        tasks = []
        for name in args.formats:
            g = FORMATS[name][1]
            for M in args.ms:
                for N, K in SHAPES:
                    for dt in (torch.bfloat16, torch.float32):  # the table's pick, the one before w4_dot
                        kname, cfg = w4_config(M, N, K, dt, g)
                        tasks.append((name, M, dict(cfg, kernel=kname)))
                tasks += [(name, M, cfg) for cfg in candidates(M, args.quick)]
        precompile(tasks, args.jobs)
    rows, best_rows = [], []
    print(f"{'format':<10}{'N':>6}{'K':>6}{'M':>5} {'best us':>8}{'GB/s':>6}{'%HBM':>5}{'TFLOP/s':>8}"
          f"{'bf16 us':>8}{'x bf16':>7}{'old us':>8}{'x old':>6}  best config (table: w4_config's pick)")
    for N, K in SHAPES:
        w16 = torch.randn(N, K, device=DEVICE, dtype=torch.bfloat16)
        ws16 = [w16] + [w16.clone() for _ in range(copies(nbytes(w16)) - 1)]
        weights = {}
        for name in args.formats:
            fmt, g, zp = FORMATS[name]
            one = packed_weights(fmt, N, K, g, zp)
            weights[name] = [one] + [tuple(t.clone() if t is not None else None for t in one)
                                     for _ in range(copies(nbytes(*one)) - 1)]
        for M in args.ms:
            x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
            io = nbytes(x) + M * N * 2
            t16 = graph_time([lambda w=w: F.linear(x, w) for w in ws16], iters=args.iters)
            sym_times: list[tuple[float, dict]] = []
            for name in args.formats:
                fmt, g, zp = FORMATS[name]
                sets = weights[name]
                wbytes = nbytes(*sets[0])

                def timed(cfg, sets=sets, fmt=fmt, g=g):
                    calls = [lambda s=s: w4_linear_launch(x, s[0], s[1], s[2], None, fmt, g, K, config=cfg)
                             for s in sets]
                    return graph_time(calls, iters=args.iters)
                table_name, table_cfg = w4_config(M, N, K, torch.bfloat16, g)
                old_name, old_cfg = w4_config(M, N, K, torch.float32, g)  # the table before w4_dot
                t_old = timed(dict(old_cfg, kernel=old_name))
                cands = candidates(M, args.quick)
                if name == "int4_asym" and sym_times:
                    cands = [c for _, c in sorted(sym_times, key=lambda r: r[0])[:ASYM_TOP]]
                table = dict(table_cfg, kernel=table_name)
                if table not in cands:
                    cands.append(table)
                best = None
                for cfg in cands:
                    try:
                        t = timed(cfg)
                    except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit
                        print(f"  {name} N={N} K={K} M={M} {key(cfg)}: {type(e).__name__}: {str(e)[:120]}",
                              flush=True)
                        continue
                    if name == "int4":
                        sym_times.append((t, cfg))
                    rows.append(dict(format=name, N=N, K=K, M=M, cfg=cfg, us=t * 1e6, gbs=(wbytes + io) / t / 1e9,
                                     tflops=2 * M * N * K / t / 1e12, bf16_us=t16 * 1e6, old_us=t_old * 1e6,
                                     is_table=cfg == table))
                    if best is None or t < best[0]:
                        best = (t, cfg)
                if best is None:
                    continue
                t, cfg = best
                gbs = (wbytes + io) / t / 1e9
                tf = f"{2 * M * N * K / t / 1e12:8.0f}" if M >= 512 else f"{'':8}"
                mark = "" if cfg == table else f"  (table: {key(table)})"
                print(f"{name:<10}{N:>6}{K:>6}{M:>5} {t * 1e6:8.1f}{gbs:6.0f}{gbs / HBM_TBS / 10:5.0f}{tf}"
                      f"{t16 * 1e6:8.1f}{t16 / t:6.2f}x{t_old * 1e6:8.1f}{t_old / t:5.2f}x  {key(cfg)}{mark}",
                      flush=True)
                best_rows.append(dict(format=name, N=N, K=K, M=M, cfg=cfg, us=t * 1e6, gbs=gbs, bf16_us=t16 * 1e6,
                                      old_kernel=old_name, old_us=t_old * 1e6, table_cfg=table))
        del ws16, weights
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, hbm_limit_tbs=HBM_TBS,
                       quick=args.quick, seconds=time.time() - t_start, best=best_rows, rows=rows), f, indent=1)
    print(f"wrote {args.out} ({time.time() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
