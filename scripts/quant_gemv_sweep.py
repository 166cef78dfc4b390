"""Sweeps the tiles of the quantized small-M kernels on the Llama-3.1-8B linear shapes, beside
bf16 `F.linear`, and prints the best tile per (shape, M) with its GB/s next to the ~4.3 TB/s
HBM limit. A tuning probe for the kernels' fixed tile tables (`quant_gemm.gemv_config`,
`w4_gemm.GEMV_TILES`, `quant_gemv_dot.small_m_config`), not a benchmark: JSON of every timing
to --out.

Kinds:
- fp8 (M = 1 only), int4, mxfp4: the CUDA-core GEMVs `_qgemv_kernel` / `_w4_gemv_kernel`;
- fp8dot, int8dot (per-channel weights x per-token activations) and fp8blockdot (128 x 128
  blocks x 1 x 128 activations): the tensor-core swap-AB kernel `quant_gemv_dot` over
  BLOCK_N x BLOCK_K x SPLIT_K x num_warps x num_stages x FUSE (the activation quantizer
  folded in or in front), at every M of --ms; beside it the product the engine runs today
  for that M without it (act_quant + quant_gemv / quant_gemm, or torch._scaled_mm).

    python3 scripts/quant_gemv_sweep.py --out sweep.json --kinds fp8dot int8dot fp8blockdot \
        [--ms 1 2 4 8 16 32 64] [--quick] [--wide] [--shapes 4096x14336]

Each timing replays a CUDA graph over enough weight copies to miss L2
(`atom.utils.cuda_timing.graph_time`); the 8-bit figures include the activation quantizer
(separate or fused) and, with SPLIT_K > 1, the split reduction. GB/s counts weight bytes.
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import sys

import torch
import torch.nn.functional as F

from atom.utils.cuda_timing import graph_time

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
PRE_DOT_SCALED_MM_MIN_M = 17  # where fp8 row / column products went to torch._scaled_mm before the dot kernel
L2_MISS_BYTES = 256 << 20


def copies(nbytes: int) -> int:
    return max(2, -(-L2_MISS_BYTES // nbytes))


def fp8_cases(N, K):
    from atom.model_ops.kernels.act_quant import act_quant_launch
    from atom.model_ops.kernels.quant_gemm import quant_gemv_launch
    ws = [(torch.randn(N, K, device="cuda") * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
          for _ in range(copies(N * K))]
    wsc = torch.rand(N, device="cuda") * 1e-3
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    for bn, bk, nw, ahead in itertools.product((4, 8, 16), (512, 1024), (4, 8), (False, True)):
        cfg = dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=3, AHEAD=ahead)

        def call(w, cfg=cfg):
            xq, xs = act_quant_launch(x, "fp8", K, 448.0)
            return quant_gemv_launch(xq, xs.reshape(-1), w, wsc, None, torch.bfloat16, config=cfg)
        yield cfg, [lambda w=w, c=call: c(w) for w in ws], N * K


DOT_KINDS = {"fp8dot": ("fp8", 0), "int8dot": ("int8", 0), "fp8blockdot": ("fp8", 128)}


def wide_grid(M, N, K, block_k, m_pad):
    """`--wide`: BLOCK_N 16-128 x BLOCK_K 128-512 x SPLIT_K 1-16 (>= 2 K steps a split, 132-1056
    programs: 1-8 a SM), the quantizer in front, as many stages as fit ~128 KiB of weight tiles
    (2-6), 4 warps (8 on 128-row tiles): ~40 tiles a shape, for the decode rows the quick grid
    left out."""
    out = []
    for bn, bk in itertools.product((16, 32, 64, 128), (block_k,) if block_k else (128, 256, 512)):
        stages = max(2, min(6, (128 << 10) // (bn * bk)))
        for split in (1, 2, 4, 8, 16):
            if (K // bk) // split < 2 or not 132 <= -(-N // bn) * split <= 1056:
                continue
            for nw in ((8,) if bn >= 128 else (4,)):
                out.append(dict(M_PAD=m_pad, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=nw,
                                num_stages=stages, FUSE=False))
    return out


def dot_grid(M, N, K, block_k, quick, wide=False):
    """The candidate tiles of the swap-AB kernel for one (shape, M), ~25 (~5 with `quick`):
    the table's own choice and its fused / unfused twin, then BLOCK_N x BLOCK_K x SPLIT_K
    (SPLIT_K around the value that fills ~2 programs per SM) at 4 warps, then warps / stages
    variants of the table's tile. Compiles dominate the sweep's time (Triton specializes M = 1
    and M = 16 apart, and each SPLIT_K / M_PAD is a new kernel)."""
    from atom.model_ops.kernels.quant_gemv_dot import TARGET_PROGRAMS, small_m_config
    m_pad = max(16, 1 << (M - 1).bit_length())
    table = small_m_config(M, N, K, block_k)
    out = []
    if table:
        table = dict(table, M_PAD=m_pad)
        out += [table, dict(table, FUSE=not table["FUSE"])]
    bns = (64, 128) if quick else (32, 64, 128)
    bks = (block_k,) if block_k else ((256,) if quick else (256, 512))
    for bn, bk in itertools.product(bns, bks):
        want = 1
        while -(-N // bn) * want < TARGET_PROGRAMS and (K // bk) // (want * 2) >= 2:
            want *= 2
        for split in ((want,) if quick else sorted({max(1, want // 2), want, want * 2})):
            if (K // bk) // split < 2:
                continue
            stages = 3 if bn * bk >= 128 * 512 else 4  # a 64 KiB weight stage: 3 fit in shared memory
            out.append(dict(M_PAD=m_pad, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=stages,
                            FUSE=M <= 16))
    if table and not quick:
        out += [dict(table, num_warps=nw, num_stages=ns) for nw, ns in ((4, 3), (4, 5), (8, 4))]
    if wide:
        out += wide_grid(M, N, K, block_k, m_pad)
    seen, uniq = set(), []
    for c in out:
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            uniq.append(c)
    return uniq if wide else uniq[:40]


def dot_cases(N, K, M, kind, quick, wide=False):
    """(config, calls, weight bytes) of the swap-AB kernel, then the engine's product without it
    (config {"kernel": route}) as the baseline."""
    from atom.model_ops.kernels.act_quant import act_quant_launch
    from atom.model_ops.kernels.quant_gemm import quant_gemm_launch, quant_gemv_launch, GEMV_MAX_M
    from atom.model_ops.kernels.quant_gemv_dot import quant_gemv_dot_fused_launch, quant_gemv_dot_launch
    from atom.model_ops.quant import common
    q, bk = DOT_KINDS[kind]
    qmax = 448.0 if q == "fp8" else 127.0
    n = copies(N * K)
    if q == "fp8":
        wqs = [(torch.randn(N, K, device="cuda") * 40).clamp(-448, 448).to(torch.float8_e4m3fn) for _ in range(n)]
    else:
        wqs = [torch.randint(-128, 128, (N, K), device="cuda", dtype=torch.int8) for _ in range(n)]
    ws = torch.rand(N, K // bk, device="cuda") * 1e-3 if bk else torch.rand(N, device="cuda") * 1e-3
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    nbytes = N * K + ws.numel() * 4
    for cfg in dot_grid(M, N, K, bk, quick, wide):
        kcfg = {k: v for k, v in cfg.items() if k != "FUSE"}
        if cfg["FUSE"]:
            def call(w, kcfg=kcfg):
                return quant_gemv_dot_fused_launch(x, w, ws, None, q, qmax, bk, config=kcfg)
        else:
            def call(w, kcfg=kcfg):
                xq, xs = act_quant_launch(x, q, bk or K, qmax)
                return quant_gemv_dot_launch(xq, xs if bk else xs.reshape(-1), w, ws, None, torch.bfloat16, bk,
                                             config=kcfg)
        yield dict(cfg, kernel="quant_gemv_dot"), [lambda w=w, c=call: c(w) for w in wqs], nbytes
    # the engine's product before this kernel, for the same M (cuBLASLt's scaled mm from 17 rows then)
    if q == "fp8" and not bk and M >= PRE_DOT_SCALED_MM_MIN_M:
        route = "scaled_mm"

        def old(w):
            xq, xs = act_quant_launch(x, q, K, qmax)
            return common._scaled_mm(xq, xs.reshape(-1), w, ws.reshape(-1, 1), None, torch.bfloat16, None)
    else:
        route = "gemv" if M <= GEMV_MAX_M else "gemm"
        launch = quant_gemv_launch if route == "gemv" else quant_gemm_launch

        def old(w):
            xq, xs = act_quant_launch(x, q, bk or K, qmax)
            return launch(xq, xs if bk else xs.reshape(-1), w, ws, None, torch.bfloat16, bk)
    yield dict(kernel=f"act_quant+{route}"), [lambda w=w: old(w) for w in wqs], nbytes


def w4_cases(N, K, fmt):
    from atom.model_ops.kernels.w4_gemm import w4_linear_launch
    g = 128 if fmt == "int4" else 32
    n = copies(N * K // 2)
    if fmt == "int4":
        packs = [torch.randint(-2 ** 31, 2 ** 31 - 1, (N, K // 8), dtype=torch.int32, device="cuda") for _ in range(n)]
        scales = (torch.rand(N, K // g, device="cuda") / K ** 0.5).bfloat16()
    else:
        packs = [torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda") for _ in range(n)]
        scales = torch.randint(118, 126, (N, K // 32), dtype=torch.uint8, device="cuda")
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    for bn, nw, ahead in itertools.product((4, 8, 16), (2, 4, 8), (False, True)):
        cfg = dict(kernel="w4_gemv", BLOCK_M=1, BLOCK_N=bn, BLOCK_W=32 * nw, num_warps=nw, num_stages=3, AHEAD=ahead)
        yield cfg, [lambda p=p, c=cfg: w4_linear_launch(x, p, scales, None, None, fmt, g, K, config=c)
                    for p in packs], N * K // 2 + scales.numel() * scales.element_size()


def _best(rows, kind, cases, N, K, M, t16):
    """Times every case; prints the best quant_gemv_dot tile and the baseline (if any)."""
    best, base = None, None
    for cfg, calls, nbytes in cases:
        try:
            t = graph_time(calls, iters=10)
        except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit
            print(f"  {kind} M={M} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        rows.append(dict(kind=kind, N=N, K=K, M=M, cfg=cfg, us=t * 1e6, gbs=nbytes / t / 1e9, bf16_us=t16 * 1e6))
        if str(cfg.get("kernel", "")).startswith("act_quant+"):
            base = (t, cfg, nbytes)
        elif best is None or t < best[0]:
            best = (t, cfg, nbytes)
    for label, b in (("best", best), ("now ", base)):
        if b:
            t, cfg, nbytes = b
            print(f"  {kind:11s} M={M:<3d} {label} {t * 1e6:7.1f} us {nbytes / t / 1e9:6.0f} GB/s (HBM ~4300)  "
                  f"{t16 / t:4.2f}x bf16  {cfg}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kinds", nargs="*", default=["fp8", "int4", "mxfp4"],
                    choices=["fp8", "int4", "mxfp4", *DOT_KINDS])
    ap.add_argument("--ms", nargs="*", type=int, default=[1, 2, 4, 8, 16, 32, 64],
                    help="rows for the *dot kinds (the GEMV kinds run M = 1)")
    ap.add_argument("--quick", action="store_true", help="a smaller tile grid for the *dot kinds")
    ap.add_argument("--wide", action="store_true", help="add BLOCK_N 16-128 x BLOCK_K x SPLIT_K 1-16 (see wide_grid)")
    ap.add_argument("--shapes", nargs="*", default=None, help="NxK products (default: the Llama-3.1-8B four)")
    args = ap.parse_args(argv)
    if any(m < 1 or m > 64 for m in args.ms):
        ap.error(f"--ms {args.ms}: each M must be in 1..64 (the swap-AB kernel's range)")
    bad = [s for s in args.shapes or () if not re.fullmatch(r"[1-9]\d*x[1-9]\d*", s)]
    if bad:
        ap.error(f"--shapes {bad}: each must be NxK with positive integers (e.g. 4096x14336)")
    if not torch.cuda.is_available():
        print("quant_gemv_sweep: no CUDA GPU here (run it on the H200)", file=sys.stderr)
        return 2
    rows = []
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    for N, K in shapes:
        w16 = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies(2 * N * K))]
        ms = sorted({1, *args.ms}) if any(k in DOT_KINDS for k in args.kinds) else [1]
        t16s = {}
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            t16s[M] = graph_time([lambda w=w: F.linear(x, w) for w in w16])
            print(f"{N}x{K} M={M}: bf16 F.linear {t16s[M] * 1e6:.1f} us ({2 * N * K / t16s[M] / 1e9:.0f} GB/s)",
                  flush=True)
            rows.append(dict(kind="bf16", N=N, K=K, M=M, cfg={}, us=t16s[M] * 1e6, gbs=2 * N * K / t16s[M] / 1e9))
        del w16
        for kind in args.kinds:
            if kind in DOT_KINDS:
                for M in args.ms:
                    _best(rows, kind, dot_cases(N, K, M, kind, args.quick, args.wide), N, K, M, t16s[M])
                    torch.cuda.empty_cache()
                continue
            cases = fp8_cases(N, K) if kind == "fp8" else w4_cases(N, K, kind)
            _best(rows, kind, cases, N, K, 1, t16s[1])
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
