"""Times DeepSeek-V2-Lite's MoE block (64 routed experts top-6 + 2 shared, bf16) with the
shared experts on the plan's second stream ("shared_overlap") against one stream, CUDA-graph
replays, at the given token counts; also the routed and the shared parts alone. Writes JSON.

    python scripts/moe_shared_overlap.py --tokens 1 64 200 2048 --out overlap.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 200, 2048])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_shared_overlap needs a CUDA GPU")
    from test_moe_shared_stack import Block
    from atom.tuning.moe_tune import gpu_time_us
    from atom.tuning.plan import KernelPlan
    E, H, I, S, k = 64, 2048, 1408, 2, 6
    b = Block(E, H, I, S, k, device="cuda", dtype=torch.bfloat16)
    one = KernelPlan(backend="triton", fusions=())
    two = KernelPlan(backend="triton", fusions=("shared_overlap",))
    rows = []
    for T in args.tokens:
        x = torch.randn(T, H, device="cuda").bfloat16()
        logits = torch.randn(T, E, device="cuda")

        def block(plan):
            b.experts.plan = plan
            return lambda: b.experts(x, logits)
        row = {"tokens": T, "one_stream_us": gpu_time_us(block(one)), "two_streams_us": gpu_time_us(block(two))}
        b.experts.plan = one
        w, ids = b.experts.route(logits)
        row["routed_only_us"] = gpu_time_us(lambda: b.experts.method.apply(b.experts, x, w, ids))
        row["shared_only_us"] = gpu_time_us(lambda: b.shared(x))
        row["speedup"] = row["one_stream_us"] / row["two_streams_us"]
        print(json.dumps({key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
        rows.append(row)
    from atom.benchmarks.provenance import provenance
    Path(args.out).write_text(json.dumps({"shape": dict(E=E, H=H, I=I, S=S, top_k=k), "rows": rows,
                                          "device": torch.cuda.get_device_name(), **provenance()}, indent=1))


if __name__ == "__main__":
    main()
