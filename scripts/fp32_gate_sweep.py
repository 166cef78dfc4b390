"""DeepSeek's fp32 router logits two ways (`atom.model_ops.moe.gate.Fp32Gate`): the reference
(cast the bf16 activations to fp32, fp32 GEMM) against one bf16 GEMM with fp32 accumulation
and output (`torch.mm(..., out_dtype=torch.float32)`) over the exact bf16 copy of the weight.
Each timed in CUDA-graph replays at decode and prefill sizes, with the largest difference of
the two outputs (only the order of fp32 sums differs). GPU only.

    python3 scripts/fp32_gate_sweep.py [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

SHAPES = [(64, 2048), (160, 5120), (256, 7168)]  # (experts, hidden): V2-Lite, V2, V3
TOKENS = [1, 8, 64, 200, 2048, 16384]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp32_gate_sweep.py times GEMMs in CUDA graphs: it needs a CUDA GPU (none found)")
    from atom.utils.cuda_timing import graph_time
    rows = []
    for E, H in SHAPES:
        w16 = (torch.randn(E, H, device="cuda") * H ** -0.5).bfloat16()
        w32 = w16.float()
        for T in TOKENS:
            x = torch.randn(T, H, device="cuda").bfloat16()
            ref = torch.nn.functional.linear(x.float(), w32)
            low = torch.mm(x, w16.t(), out_dtype=torch.float32)
            t_ref = graph_time([lambda: torch.nn.functional.linear(x.float(), w32)] * 20)
            t_low = graph_time([lambda: torch.mm(x, w16.t(), out_dtype=torch.float32)] * 20)
            rows.append(dict(experts=E, hidden=H, tokens=T, fp32_us=round(t_ref * 1e6, 2),
                             bf16_fp32out_us=round(t_low * 1e6, 2), speedup=round(t_ref / t_low, 2),
                             max_abs_diff=float((ref - low).abs().max()), max_abs=float(ref.abs().max())))
            print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rows=rows, device=torch.cuda.get_device_name()), f, indent=1)


if __name__ == "__main__":
    main()
