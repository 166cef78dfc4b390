"""Decode attention at ragged contexts: does the order the programs start in matter? (GPU)

Four workload-like decode batches (Qwen3-0.6B attention shape, bf16, block 16, contexts
uniform in a range) are timed in CUDA-graph replays in batch order (random lengths) and
longest-first, with the current kernel (kv head the grid's fastest axis) and with the
kernel of commit 2284a78 (query block fastest), taken from git. Prints us per launch and
the KV-read bandwidth; the H200's copy rate is 4.3 TB/s.

    python3 scripts/attention_order.py out.json   # from the repository root, on the GPU

The figures in docs/perf/raw/2026-11-30-h200-s3-attention-order.json came from this
measurement (run from a scratch copy that loaded the two kernels from files; the current
kernel's code was the same as now).
"""
import importlib.util
import json
import random
import subprocess
import sys
import tempfile

import torch

from atom.model_ops.attention.triton_unified import AttentionWorkspace, unified_attention
from atom.utils.cuda_timing import graph_time


def earlier_kernel():
    src = subprocess.run(["git", "show", "2284a78:atom/model_ops/attention/triton_unified.py"],
                         check=True, capture_output=True, text=True).stdout
    f = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    f.write(src)
    f.close()
    spec = importlib.util.spec_from_file_location("unified_2284a78", f.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.unified_attention


def main(out_path: str) -> None:
    old = earlier_kernel()
    dev, dt = "cuda", torch.bfloat16
    Hq, Hkv, D, bs = 16, 8, 128, 16
    res = {}
    for B, lo, hi in ((192, 400, 2048), (128, 600, 2048), (64, 900, 2048), (256, 100, 1200)):
        rng = random.Random(B)
        lens = [rng.randint(lo, hi) for _ in range(B)]
        nblk = [-(-L // bs) for L in lens]
        pool = sum(nblk) + 8
        kc = torch.randn(pool, bs, Hkv, D, device=dev, dtype=dt)
        vc = torch.randn_like(kc)
        perm = torch.randperm(pool, device=dev).int()
        bt = torch.zeros(B, max(nblk), dtype=torch.int32, device=dev)
        o = 0
        for i, n in enumerate(nblk):
            bt[i, :n] = perm[o:o + n]
            o += n
        q = torch.randn(B, Hq, D, device=dev, dtype=dt)
        out = torch.empty_like(q)
        cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
        ws = AttentionWorkspace(B, Hq, D, device=dev)
        kv_bytes = sum(lens) * Hkv * D * 2 * 2
        order = sorted(range(B), key=lambda i: -lens[i])
        batch = {"batch order": (torch.tensor(lens, dtype=torch.int32, device=dev), bt),
                 "longest first": (torch.tensor([lens[i] for i in order], dtype=torch.int32, device=dev),
                                   bt[order].contiguous())}
        r = {}
        for kname, fn in (("kernel 2284a78", old), ("current kernel", unified_attention)):
            for oname, (sl, tables) in batch.items():
                def call(fn=fn, sl=sl, tables=tables):
                    fn(q, kc, vc, out, cu, sl, tables, D ** -0.5, 1, ws)
                t = graph_time([call] * 8, iters=30)
                r[f"{kname}, {oname}"] = {"us": round(t * 1e6, 1), "TB/s": round(kv_bytes / t / 1e12, 2)}
        res[f"B={B} ctx {lo}-{hi}"] = r
        print(B, lo, hi, json.dumps(r), flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
