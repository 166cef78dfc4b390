"""Times the 4-bit weight-only kernels (`atom::w4_linear`: W4A16 int4 g128 sym / asym and
MXFP4) against bf16 `F.linear` on the Llama-3.1-8B linear shapes, for M in 1, 8, 64, 512, and
prints the bytes each streams per second next to the H200's ~4.3 TB/s limit.

    python3 scripts/quant_kernel_bench_4bit.py --out quant_kernels.json

Each timing replays a CUDA graph that cycles through enough copies of the weights to miss
L2 (`atom.utils.cuda_timing.graph_time`). Bytes counted: the weight as stored (packed values,
scales, zero points) plus x and y. The speed-up column is bf16 time / 4-bit time (the batch-1
target: >= 2.2x). Needs a CUDA GPU; on CPU it says so and exits.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
MS = [1, 8, 64, 512]
FORMATS = [("int4", 128, False), ("int4", 128, True), ("mxfp4", 32, False)]
HBM_TBS = 4.3
L2_MISS_BYTES = 256 << 20  # cycle through copies adding up to more than this


def packed_weights(fmt: str, N: int, K: int, g: int, zp: bool):
    if fmt == "int4":
        packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (N, K // 8), dtype=torch.int32, device="cuda")
        scales = (torch.rand(N, K // g, device="cuda") / K ** 0.5).bfloat16()
        zeros = torch.randint(0, 16, (N, K // g), dtype=torch.int8, device="cuda") if zp else None
    else:
        packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda")
        scales = torch.randint(118, 126, (N, K // 32), dtype=torch.uint8, device="cuda")
        zeros = None
    return packed, scales, zeros


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="quant_kernel_bench.json", help="JSON file for the results")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("quant_kernel_bench: no CUDA GPU here; run it on the GPU machine (nothing was timed)")
        return 1
    from atom.model_ops.kernels import w4_gemm  # noqa: F401  (registers atom::w4_linear)
    from atom.model_ops.kernels.w4_gemm import kernel_name
    from atom.utils.cuda_timing import graph_time

    rows = []
    print(f"{'format':<12}{'N':>7}{'K':>7}{'M':>5}  {'kernel':<8}{'us':>9}{'GB/s':>8}{'bf16 us':>9}"
          f"{'bf16 GB/s':>10}{'speed-up':>9}   (HBM limit {HBM_TBS} TB/s)")
    for N, K in SHAPES:
        w_bf16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        n_bf16 = max(1, -(-L2_MISS_BYTES // nbytes(w_bf16)))
        ws_bf16 = [w_bf16] + [w_bf16.clone() for _ in range(n_bf16 - 1)]
        for M in MS:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            io = nbytes(x) + M * N * 2
            t_bf16 = graph_time([lambda w=w: F.linear(x, w) for w in ws_bf16], iters=args.iters)
            for fmt, g, zp in FORMATS:
                one = packed_weights(fmt, N, K, g, zp)
                copies = max(1, -(-L2_MISS_BYTES // nbytes(*one)))
                sets = [one] + [tuple(t.clone() if t is not None else None for t in one) for _ in range(copies - 1)]
                calls = [lambda s=s: torch.ops.atom.w4_linear(x, s[0], s[1], s[2], None, fmt, g, K) for s in sets]
                t = graph_time(calls, iters=args.iters)
                b = nbytes(*one) + io
                name = f"{fmt} g{g}{' asym' if zp else ''}" if fmt == "int4" else fmt
                row = dict(format=name, N=N, K=K, M=M, kernel=kernel_name(M), us=t * 1e6, gbs=b / t / 1e9,
                           bf16_us=t_bf16 * 1e6, bf16_gbs=(nbytes(w_bf16) + io) / t_bf16 / 1e9,
                           speedup=t_bf16 / t, hbm_limit_gbs=HBM_TBS * 1e3)
                rows.append(row)
                print(f"{name:<12}{N:>7}{K:>7}{M:>5}  {row['kernel']:<8}{row['us']:>9.1f}{row['gbs']:>8.0f}"
                      f"{row['bf16_us']:>9.1f}{row['bf16_gbs']:>10.0f}{row['speedup']:>8.2f}x")
                del sets, calls
            torch.cuda.empty_cache()
        del ws_bf16
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), hbm_limit_tbs=HBM_TBS, rows=rows), f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
