"""Can a Hopper Triton GEMM with TMA loads (persistent or not, split-K, SiLU-and-mul in the
epilogue) beat cuBLAS on decode-batch products (M = 64-256 rows against Llama-3.1-8B's
weights)? The fourth session's pointer-load sweep (`gemm_sweep.py`, in git at 147d07c) lost
by 8-45% at M >= 128.
Each tiling is timed in a CUDA graph cycling through enough weight copies to miss L2, next to
cuBLAS (and cuBLASLt, torch's other BLAS back end) and the bandwidth / FLOP floors.
A diagnosis tool, not a benchmark.

    python3 scripts/gemm_tma_probe.py --out tma.json --deadline 240
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from atom.model_ops.kernels import silu_and_mul
from atom.utils.cuda_timing import graph_time

# Llama-3.1-8B: (name, N, K, gated); gated: [gate | up] weights of 2 x 14336 rows
SHAPES = [("qkv", 6144, 4096, False), ("o", 4096, 4096, False), ("gate_up", 28672, 4096, False),
          ("gate_up_silu", 28672, 4096, True), ("down", 4096, 14336, False)]
ROWS = (64, 128, 192, 256)
HBM, PEAK = 4.3e12, 790e12  # REFERENCE.md: copy bandwidth, 8192^3 bf16 GEMM


@triton.jit
def _tma_mm_kernel(x_desc, w_desc, y_ptr, M, N_OUT, K, split_k, num_progs,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GATED: tl.constexpr):
    """y[s] = x W[:, s-th K slice]^T over tiles (m, n, s), program p taking tiles p, p +
    num_progs, ... (persistent when num_progs < tiles). GATED: W = [gate | up], y = silu(x
    gate^T) * (x up^T). split_k > 1: y is an fp32 workspace [split_k, M, N_OUT]."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    tiles = num_m * tl.cdiv(N_OUT, BLOCK_N) * split_k
    k_len = K // split_k
    for tile in tl.range(pid, tiles, num_progs, flatten=True):
        s = tile % split_k
        t = tile // split_k
        off_m = (t % num_m) * BLOCK_M
        off_n = (t // num_m) * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in tl.range(s * k_len, (s + 1) * k_len, BLOCK_K):
            a = x_desc.load([off_m, k])
            acc = tl.dot(a, w_desc.load([off_n, k]).T, acc)
            if GATED:
                acc2 = tl.dot(a, w_desc.load([N_OUT + off_n, k]).T, acc2)
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc2
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        ptr = y_ptr + s.to(tl.int64) * M * N_OUT + rm[:, None] * N_OUT + rn[None, :]
        tl.store(ptr, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N_OUT))


@triton.jit
def _sum_kernel(w_ptr, y_ptr, n, split_k, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(split_k):
        acc += tl.load(w_ptr + s * n + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=offs < n)


def make_call(x, w, cfg, gated, sms):
    M, K = x.shape
    n_out = w.shape[0] // 2 if gated else w.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    split = cfg["split_k"]
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    wd = TensorDescriptor.from_tensor(w, [bn, bk])
    y = torch.empty(M, n_out, device=x.device, dtype=x.dtype)
    ws = torch.empty(split, M, n_out, device=x.device, dtype=torch.float32) if split > 1 else y
    tiles = triton.cdiv(M, bm) * triton.cdiv(n_out, bn) * split
    progs = min(tiles, sms) if cfg["persistent"] else tiles

    def call():
        _tma_mm_kernel[(progs,)](xd, wd, ws, M, n_out, K, split, progs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                 GATED=gated, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        if split > 1:
            _sum_kernel[(triton.cdiv(M * n_out, 2048),)](ws, y, M * n_out, split, BLOCK=2048)
        return y
    return call


def configs():
    out = []
    for bm, bn, bk, warps, stages in itertools.product((64, 128), (64, 128, 256), (64, 128), (4, 8), (3, 4, 5)):
        if (bm * bn) // (warps * 32) > 128:  # fp32 accumulator registers per thread
            continue
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages))
    random.Random(0).shuffle(out)
    return out


def smem_ok(cfg, gated):
    return cfg["num_stages"] * (cfg["BLOCK_M"] + (2 if gated else 1) * cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2 <= 220 * 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline", type=float, default=240.0, help="seconds; later tilings are left out")
    args = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    t0 = time.time()
    cases = []
    for name, N, K, gated in SHAPES:
        nbytes = N * K * 2
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
              for _ in range(max(2, -(-400 * 2**20 // nbytes)))]
        for M in ROWS:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)

            def ref_call(w, x=x, gated=gated):
                return silu_and_mul(F.linear(x, w)) if gated else F.linear(x, w)
            cub = graph_time([lambda w=w: ref_call(w) for w in ws], iters=10) * 1e6
            torch.backends.cuda.preferred_blas_library("cublaslt")
            lt = graph_time([lambda w=w: ref_call(w) for w in ws], iters=10) * 1e6
            torch.backends.cuda.preferred_blas_library("cublas")
            cases.append(dict(name=name, N=N, K=K, M=M, gated=gated, x=x, ws=ws, ref=ref_call(ws[0]).float(),
                              cublas_us=round(cub, 2), cublaslt_us=round(lt, 2),
                              floor_bw_us=round(nbytes / HBM * 1e6, 2),
                              floor_flop_us=round(2 * M * N * K / PEAK * 1e6, 2), triton=[]))
            print(f"{name} M={M}: cuBLAS {cub:.1f} us, cuBLASLt {lt:.1f} us", flush=True)
    tried = 0
    for cfg in configs():
        if time.time() - t0 > args.deadline:
            break
        tried += 1
        for c in cases:
            if not smem_ok(cfg, c["gated"]) or cfg["BLOCK_M"] > max(64, c["M"]):
                continue
            variants = [dict(cfg, split_k=1, persistent=p) for p in (False, True)]
            if c["N"] <= 6144 and not c["gated"]:
                variants += [dict(cfg, split_k=s, persistent=False) for s in (2, 4)]
            for v in variants:
                try:
                    got = make_call(c["x"], c["ws"][0], v, c["gated"], sms)().float()
                except Exception as e:  # out of resources for this tiling
                    c["triton"].append(dict(v, us=None, error=type(e).__name__))
                    continue
                ref = c["ref"]
                if not torch.allclose(got, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max())):
                    c["triton"].append(dict(v, us=None, error="mismatch"))
                    continue
                us = graph_time([make_call(c["x"], w, v, c["gated"], sms) for w in c["ws"]], iters=10) * 1e6
                c["triton"].append(dict(v, us=round(us, 2)))
    print(f"{tried} tilings in {time.time() - t0:.0f} s", flush=True)
    out = []
    for c in cases:
        c["triton"].sort(key=lambda r: r["us"] if r["us"] is not None else 1e9)
        b = c["triton"][0] if c["triton"] else {}
        errs = sum(r["us"] is None for r in c["triton"])
        print(f"{c['name']} M={c['M']}: cuBLAS {c['cublas_us']} Lt {c['cublaslt_us']} best Triton {b.get('us')} "
              f"({ {k: v for k, v in b.items() if k != 'us'} }) errors {errs}/{len(c['triton'])}; "
              f"floors bw {c['floor_bw_us']} flop {c['floor_flop_us']}", flush=True)
        c["triton"] = c["triton"][:12]
        out.append({k: v for k, v in c.items() if k not in ("x", "ws", "ref")})
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "cases": out}, f, indent=1)


if __name__ == "__main__":
    main()
