"""Decode-batch products inside a decoder layer's chain of kernels: cuBLAS against the Triton
GEMM, each with and without programmatic dependent launch (PDL) on the Triton kernels of the
chain (RMSNorm, SiLU-and-mul; the Triton GEMM took PDL too when this probe was first run,
see docs/perf, eighth session). At M rows (a decode batch) the
Llama-3.1-8B MLP and projection products of 32 layers (distinct weights, so each comes from
HBM) run in one CUDA graph as the engine runs them: add + RMSNorm, qkv, o, add + RMSNorm,
gate-up, SiLU-and-mul, down (attention left out; o reads q's columns of the qkv output).
Variants: cuBLAS (`F.linear`); the Triton GEMM (each shape's tiling picked first from a few
candidates, timed the same way); each with PDL switched on and off
(`triton_import.USE_PDL`). The eighth session's JSON in docs/perf names the Triton rows
`triton_pdl_*` (its GEMM took PDL then). A diagnosis tool, not a benchmark.

    python3 scripts/layer_chain_probe.py --rows 16 64 128 192 --out chain.json
"""
from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F

from atom.model_ops.kernels import fused_add_rms_norm, silu_and_mul, triton_import
from atom.model_ops.kernels.gemm import gemm
from atom.utils.cuda_timing import graph_time

H, I, QKV, LAYERS = 4096, 14336, 6144, 32
HBM = 4.3e12
TILINGS = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
           for bm, bn, bk, w, s in [(64, 64, 128, 4, 5), (64, 128, 128, 4, 4), (64, 256, 64, 4, 5),
                                    (64, 256, 64, 8, 4), (128, 128, 64, 4, 4), (128, 256, 64, 8, 4)]]


def pick_tiling(x, ws):
    """The fastest tiling for x against these weights, in a graph cycling through them."""
    ref = F.linear(x, ws[0]).float()
    best = None
    for cfg in TILINGS:
        if cfg["BLOCK_M"] > 64 and x.shape[0] <= 64:
            continue
        y = gemm(x, ws[0], config=cfg).float()
        if (y - ref).abs().max() > 1e-2 * ref.abs().max():
            continue
        t = graph_time([functools.partial(gemm, x, w, config=cfg) for w in ws], 10) * 1e6
        if best is None or t < best[0]:
            best = (t, cfg)
    if best is None:
        raise RuntimeError(f"no tiling gave F.linear's product for x {tuple(x.shape)}, W {tuple(ws[0].shape)}")
    base = graph_time([functools.partial(F.linear, x, w) for w in ws], 10) * 1e6
    return best, base


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 192])
    ap.add_argument("--out", default="layer_chain.json")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def weight(n, k):
        return (torch.randn(n, k, device=dev, dtype=dt, generator=g) * 0.02)

    layers = [dict(qkv=weight(QKV, H), o=weight(H, H), gu=weight(2 * I, H), d=weight(H, I)) for _ in range(LAYERS)]
    nw = torch.rand(H, device=dev, dtype=dt) + 0.5
    results = []
    for m in args.rows:
        x0 = torch.randn(m, H, device=dev, dtype=dt)
        acts = dict(qkv=x0, o=x0, gu=x0, d=torch.randn(m, I, device=dev, dtype=dt))
        tilings, isolated = {}, {}
        for name in ("qkv", "o", "gu", "d"):
            best, base = pick_tiling(acts[name], [layer[name] for layer in layers[:8]])
            tilings[name] = best[1]
            isolated[name] = dict(cublas_us=round(base, 2), triton_us=round(best[0], 2), tiling=best[1])

        def chain(product):
            def run():
                h, res = x0, torch.zeros_like(x0)
                for layer in layers:
                    h, res = fused_add_rms_norm(h, res, nw)
                    qkv = product(h, layer["qkv"], "qkv")
                    o = product(qkv[:, :H], layer["o"], "o")
                    h, res = fused_add_rms_norm(o, res, nw)
                    a = silu_and_mul(product(h, layer["gu"], "gu"))
                    h = product(a, layer["d"], "d")
            return run

        cublas = chain(lambda x, w, name: F.linear(x, w))
        triton = chain(lambda x, w, name: gemm(x, w, config=tilings[name]))
        row = dict(M=m, isolated=isolated)
        for label, fn, pdl in (("cublas", cublas, True), ("cublas_no_pdl", cublas, False),
                               ("triton", triton, True), ("triton_no_pdl", triton, False)):
            triton_import.USE_PDL = pdl
            row[label + "_us_per_layer"] = round(graph_time([fn], 10) * 1e6 / LAYERS, 2)
        triton_import.USE_PDL = True
        weights_bytes = (QKV * H + H * H + 2 * I * H + H * I) * 2
        row["weights_floor_us_per_layer"] = round(weights_bytes / HBM * 1e6, 2)
        results.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
