"""Sweeps the tiles of the quantized decode GEMVs (the fp8 / int8 `_qgemv_kernel`, the 4-bit
`_w4_gemv_kernel`) at M = 1 on the Llama-3.1-8B linear shapes, beside bf16 `F.linear`, and
prints the best tile per shape with its GB/s next to the ~4.3 TB/s HBM limit. A tuning probe
for the kernels' fixed tile tables (`quant_gemm.gemv_config`, `w4_gemm.GEMV_TILES`), not a
benchmark: JSON of every timing to --out.

    python3 scripts/quant_gemv_sweep.py --out sweep.json [--kinds fp8 int4 mxfp4]

Each timing replays a CUDA graph over enough weight copies to miss L2
(`atom.utils.cuda_timing.graph_time`); the fp8 figure includes its activation quantizer.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kinds", nargs="*", default=["fp8", "int4", "mxfp4"])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("quant_gemv_sweep: no CUDA GPU here (run it on the H200)", file=sys.stderr)
        return 2
    from atom.utils.cuda_timing import graph_time
    rows = []
    for N, K in SHAPES:
        w16 = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies(2 * N * K))]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        t16 = graph_time([lambda w=w: F.linear(x, w) for w in w16])
        print(f"{N}x{K}: bf16 F.linear {t16 * 1e6:.1f} us ({2 * N * K / t16 / 1e9:.0f} GB/s)", flush=True)
        del w16
        for kind in args.kinds:
            cases = fp8_cases(N, K) if kind == "fp8" else w4_cases(N, K, kind)
            best = None
            for cfg, calls, nbytes in cases:
                try:
                    t = graph_time(calls, iters=10)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit
                    print(f"  {kind} {cfg}: {type(e).__name__}", flush=True)
                    continue
                rows.append(dict(kind=kind, N=N, K=K, cfg=cfg, us=t * 1e6, gbs=nbytes / t / 1e9, bf16_us=t16 * 1e6))
                if best is None or t < best[0]:
                    best = (t, cfg, nbytes)
            if best:
                t, cfg, nbytes = best
                print(f"  {kind:6s} best {t * 1e6:7.1f} us {nbytes / t / 1e9:6.0f} GB/s  {t16 / t:4.2f}x bf16  {cfg}",
                      flush=True)
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
