"""The experts kernel on a GPU: the Triton grouped GEMM against a per-expert loop of F.linear
and against its roofline, at batch 1, 64 and 2048 tokens (model shapes from `workloads`).

    python -m atom.benchmarks.moe_experts --model qwen3-30b-a3b [--tokens 1,64,2048] [--out f.json]

Triton: `fused_experts` with the tiles of `atom/model_ops/moe/configs/` (defaults where no
file was tuned), timed as CUDA-graph replays (`graph_time`). The peer: the per-expert
`F.linear` loop (`experts_reference`, which syncs once for the counts, so it is timed eagerly
with CUDA events). The roofline: the bytes a step must move, the weights of the experts its
tokens activate (counted from the routing) plus the activations in and out, over 4.3 TB/s;
and, where larger, the FLOPs over the bf16 peak.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from atom.benchmarks.roofline import H200_BANDWIDTH, H200_BF16_FLOPS
from atom.benchmarks.workloads import MODEL_CONFIGS


def _num_experts(cfg: dict) -> int | None:
    """Routed experts of a config: Qwen3-MoE's num_experts, Mixtral / GPT-OSS's
    num_local_experts, DeepSeek's n_routed_experts."""
    return cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")


def moe_shape(name: str) -> tuple[int, int, int, int]:
    """(experts, width, hidden, top_k) of a MoE entry of MODEL_CONFIGS."""
    c = MODEL_CONFIGS[name]
    E = _num_experts(c)
    if not E:
        raise ValueError(f"model={name!r} has no experts: choose a MoE model "
                         f"({', '.join(n for n, v in MODEL_CONFIGS.items() if _num_experts(v))})")
    return E, c.get("moe_intermediate_size") or c["intermediate_size"], c["hidden_size"], c["num_experts_per_tok"]


def experts_floor_s(topk_ids: torch.Tensor, width: int, hidden: int, dtype_bytes: int = 2,
                    bandwidth: float = H200_BANDWIDTH, flops: float = H200_BF16_FLOPS) -> float:
    """Lower bound of one MoE layer's experts on these routed tokens: max(bytes / bandwidth,
    FLOPs / peak); bytes = activated experts x (gate, up, down) x H x I + x in and y out."""
    T, k = topk_ids.shape
    active = int(torch.unique(topk_ids).numel())
    weight_bytes = active * 3 * hidden * width * dtype_bytes
    act_bytes = 2 * T * hidden * dtype_bytes
    fl = 2 * T * k * 3 * hidden * width
    return max((weight_bytes + act_bytes) / bandwidth, fl / flops)


def _event_time(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e-3 / iters


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODEL_CONFIGS))
    ap.add_argument("--tokens", default="1,64,2048")
    ap.add_argument("--out", help="write JSON rows here")
    args = ap.parse_args(argv)
    E, I, H, k = moe_shape(args.model)
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 2
    from atom.benchmarks.provenance import provenance
    from atom.model_ops.activation import silu_and_mul
    from atom.model_ops.moe.experts_ref import experts_reference
    from atom.model_ops.moe.experts_triton import fused_experts, skips_sorting
    from atom.model_ops.moe.tile_configs import find_tiles
    from atom.tuning.moe_tune import make_case
    from atom.utils.cuda_timing import graph_time
    tiles = find_tiles(E, I, H, torch.bfloat16, torch.cuda.get_device_name())
    rows = []
    print(f"{args.model}: E={E} I={I} H={H} top-{k}, tiles: {tiles.source or 'defaults'}")
    print(f"{'tokens':>6} {'path':>8} {'triton us':>10} {'F.linear us':>11} {'floor us':>9} {'speed-up':>8} {'% floor':>7}")
    for T in (int(t) for t in args.tokens.split(",")):
        x, w13, w2, w, ids = make_case(E, I, H, k, T, torch.bfloat16, "cuda")
        tri = graph_time([lambda: fused_experts(x, w13, w2, w, ids, silu_and_mul, tiles=tiles)])
        ref = _event_time(lambda: experts_reference(x, w13, w2, w, ids, silu_and_mul))
        floor = experts_floor_s(ids, I, H)
        row = {"model": args.model, "tokens": T, "path": "unsorted" if skips_sorting(T, k, E, tiles) else "sorted",
               "triton_us": tri * 1e6, "flinear_loop_us": ref * 1e6, "floor_us": floor * 1e6,
               "speedup": ref / tri, "roofline_fraction": floor / tri}
        rows.append(row)
        print(f"{T:>6} {row['path']:>8} {tri * 1e6:>10.1f} {ref * 1e6:>11.1f} {floor * 1e6:>9.1f} "
              f"{ref / tri:>8.2f} {100 * floor / tri:>6.0f}%")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"provenance": provenance(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
