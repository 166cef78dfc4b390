"""One decoder layer's decode chain at batch 1, Llama-3.1-8B shapes: bf16 against the 8-bit
formats (ptpc fp8 `fp8_dynamic`, int8 `w8a8_int8`) with and without the kernel plan's 8-bit
fusions ("norm+quant", "silu+quant", "split_k_fold"; `atom.tuning.fusions`).

An engine of the format's Llama-3.1-8B with two decoder layers and dummy weights (eager, with
the batch-1 GEMV choice a CUDA-graph start-up makes) runs one short request; the second
layer's inputs and forward context at its last decode step are kept. That layer forward
(norms, quantizers, projections, rotary + attention over the request's context, split-K
reductions), as the plan's fused forward runs it, is then captured `--reps` times in one CUDA
graph and replayed for each variant of the plan:
- "engine": the plan as the engine installs it (bf16; for 8-bit formats the same as "fused");
- "unfused": without the 8-bit fusions (the separate add + RMSNorm, act_quant, SiLU kernels
  and split-K reductions);
- "fused_no_fold": "norm+quant" and "silu+quant", the split-K reductions separate;
- "fused": all three.
Per variant: microseconds per layer (median of graph replays), the kernels one forward
launches (torch profiler, eager), and whether its output equals the unfused one bit for bit.
A diagnosis tool, not a benchmark (ms per decode step: `python -m atom.benchmarks.latency
--model llama-3.1-8b --batches 1 --quantization fp8_dynamic`).

    python3 scripts/quant_layer_chain.py --out chain.json [--formats bf16 fp8_dynamic w8a8_int8] [--reps 8]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile

import torch

NEW = ("norm+quant", "silu+quant", "split_k_fold")
VARIANTS = {"unfused": NEW, "fused_no_fold": ("split_k_fold",), "fused": ()}  # name -> fusions taken out


def build(fmt: str, layers: int, context: int):
    """The engine, its second decoder layer and that layer's (positions, hidden, residual,
    forward context) at the last decode step of one request of `context` tokens."""
    from atom import LLM, SamplingParams
    from atom.benchmarks.workloads import write_model_config
    from atom.model_ops.attention.metadata import current_forward_context
    from atom.tuning.gemv_choice import choose_gemv_shapes
    folder = write_model_config("llama-3.1-8b", folder=tempfile.mkdtemp(prefix=f"chain-{fmt}-"),
                                quantization=None if fmt == "bf16" else fmt)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = layers
    with open(path, "w") as f:
        json.dump(cfg, f)
    llm = LLM(folder, load_dummy="xavier", enforce_eager=True, max_model_len=4 * context, num_kvcache_blocks=64,
              max_num_seqs=4, enable_log_stats=False)
    runner = llm.engine.runner
    choose_gemv_shapes(runner.plan, runner.model)  # what a CUDA-graph start-up chooses for batch 1
    layer = runner.model.model.layers[1]
    inner, seen = layer.forward, []

    def record(positions, hidden, residual):
        meta = current_forward_context()
        if meta.max_query_len == 1:
            seen.append((positions.clone(), hidden.clone(), residual.clone(), meta))
        return inner(positions, hidden, residual)

    layer.forward = record
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 500, (context,), generator=g).tolist()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    layer.forward = inner
    if not seen:
        raise RuntimeError("no decode step reached the layer")
    return llm, runner, seen[-1]


def kernels_of(fn) -> list[str]:
    """The GPU kernels one call of `fn` launches, in order (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def short(name: str) -> str:
    return name.split("(")[0].split("<")[0][:60]


def run_format(fmt: str, args) -> list[dict]:
    from atom.model_ops.attention.metadata import forward_context
    from atom.utils.cuda_timing import graph_time
    llm, runner, (positions, hidden, residual, meta) = build(fmt, args.layers, args.context)
    base = runner.plan
    layer = runner.model.model.layers[1]
    variants = {"engine": ()} if fmt == "bf16" else VARIANTS
    rows, outs = [], {}
    for name, drop in variants.items():
        plan = dataclasses.replace(base, fusions=tuple(f for f in base.fusions if f not in drop))
        runner.install_plan(plan)
        meta.plan = plan

        def call():
            return layer.forward(positions, hidden, residual)

        with forward_context(meta):
            out = call()
            torch.cuda.synchronize()
            names = kernels_of(call)
            us = graph_time([call] * args.reps, args.iters) * 1e6
        outs[name] = out
        ref = outs.get("unfused")
        same = None if ref is None else all(torch.equal(a, b) for a, b in zip(out, ref))
        diff = None if ref is None else max(float((a.float() - b.float()).abs().max()) for a, b in zip(out, ref))
        rows.append(dict(format=fmt, variant=name, fusions=list(plan.fusions), us_per_layer=round(us, 2),
                         kernels_per_layer=len(names), kernels=[short(n) for n in names],
                         same_as_unfused=same, max_abs_diff_vs_unfused=diff))
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("kernels", "fusions")}), flush=True)
    runner.install_plan(base)
    del llm, runner
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="write the JSON here")
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8_dynamic", "w8a8_int8"])
    ap.add_argument("--reps", type=int, default=8, help="layer forwards per captured graph")
    ap.add_argument("--iters", type=int, default=50, help="graph replays timed (median)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the model (the second is timed)")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before the decode steps")
    args = ap.parse_args()
    import triton
    rows = []
    for fmt in args.formats:
        rows += run_format(fmt, args)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "args": vars(args), "results": rows}, f, indent=1)
    print(f"\n{'format':<12} {'variant':<14} {'us/layer':>9} {'kernels':>8}  same-as-unfused")
    for r in rows:
        print(f"{r['format']:<12} {r['variant']:<14} {r['us_per_layer']:>9.2f} {r['kernels_per_layer']:>8}  "
              f"{r['same_as_unfused']}")


if __name__ == "__main__":
    main()
