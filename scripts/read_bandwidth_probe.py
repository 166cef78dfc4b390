"""How fast can this GPU read HBM? Decode attention is judged against it (it reads the KV
cache once and writes little): a copy (read + write), `torch.sum` and a Triton kernel that
only reads (each program sums its contiguous chunk, several tile shapes and warp counts),
each in CUDA-graph replays over a buffer far larger than L2. A diagnosis tool, not a benchmark.

    python3 scripts/read_bandwidth_probe.py --gib 4 --out read_bw.json
"""
from __future__ import annotations

import argparse
import functools
import json

import torch
import triton
import triton.language as tl

from atom.utils.cuda_timing import graph_time


@triton.jit
def _read_kernel(x_ptr, out_ptr, n_per_prog, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * n_per_prog
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_per_prog, BLOCK):
        acc += tl.load(base + start + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def triton_read(x: torch.Tensor, out: torch.Tensor, programs: int, block: int, warps: int) -> None:
    _read_kernel[(programs,)](x, out, x.numel() // programs, BLOCK=block, num_warps=warps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--out", default="read_bw.json")
    args = ap.parse_args()
    n = int(args.gib * (1 << 30)) // 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    nbytes = x.numel() * 2
    rows = [dict(what="copy (read + write bytes)", tb_s=2 * nbytes / graph_time([functools.partial(y.copy_, x)]) / 1e12),
            dict(what="torch.sum", tb_s=nbytes / graph_time([functools.partial(torch.sum, x)]) / 1e12)]
    for programs in (sms, 2 * sms, 4 * sms, 8 * sms, 16 * sms, 64 * sms):
        for block, warps in ((1024, 4), (2048, 4), (4096, 8), (8192, 8), (8192, 16)):
            per = n // programs // block * block
            xs = x[:per * programs]
            out = torch.empty(programs, device="cuda", dtype=torch.float32)
            t = graph_time([functools.partial(triton_read, xs, out, programs, block, warps)])
            rows.append(dict(what=f"triton read programs={programs} block={block} warps={warps}",
                             tb_s=xs.numel() * 2 / t / 1e12))
    for r in rows:
        print(f"{r['what']}: {r['tb_s']:.3f} TB/s", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(gib=args.gib, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
