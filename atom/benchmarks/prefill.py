"""Prefill latency: one request alone, a prompt of L tokens and one output token, the
engine's part of a lone request's time to first token. Per prompt length: the median wall
time of `generate` over fresh prompts (no prefix-cache hits), the median step time and its
host launch part (a step bound by the host launches nearly all of it), whether the step
replayed a CUDA graph, next to the floor (FLOPs at the bf16 peak, or the weights read once
at the HBM bandwidth, whichever is longer) and vLLM's time for the same requests.

    python -m atom.benchmarks.prefill --model qwen3-0.6b [--prompt-lens 128 512 2048] [--levels 0 3] [--peer vllm]
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch

from atom.benchmarks.provenance import provenance
from atom.benchmarks.roofline import prefill_floor_ms
from atom.benchmarks.workloads import DEFAULT_CACHE_DIR, MODEL_CONFIGS, prefill_requests, write_model_config


def measure(llm, prompt_len: int, repeats: int, vocab: int) -> dict:
    """Two warm-up requests of this length, then `repeats` timed ones, each alone."""
    from atom import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    reqs = prefill_requests(prompt_len, repeats + 2, vocab)
    times = []
    for i, r in enumerate(reqs):
        if i == 2:
            llm.stats.clear()
        t0 = time.perf_counter()
        llm.generate([r.prompt_token_ids], sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    steps = llm.stats.steps()
    pre = steps[steps.prefill_tokens > 0]
    return {"prompt_len": prompt_len, "ms": statistics.median(times[2:]) * 1e3,
            "step_ms": float(pre.latency.median() * 1e3), "launch_ms": float(pre.launch_s.median() * 1e3),
            "graph_steps": int(pre.mixed_graph_tokens.notna().sum()), "steps": len(pre)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODEL_CONFIGS))
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--levels", type=int, nargs="+", default=[0], help="compilation levels ATOM runs at")
    ap.add_argument("--repeat", type=int, default=10, help="timed requests per length")
    ap.add_argument("--peer", choices=["none", "vllm"], default="none")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR,
                    help="compilation cache (the start-up's cuBLASLt choices are kept there)")
    ap.add_argument("--out", help="write JSON here")
    args = ap.parse_args(argv)
    if min(args.prompt_lens) < 1 or args.repeat < 1:
        raise ValueError(f"--prompt-lens={args.prompt_lens} and --repeat={args.repeat} must be >= 1")
    logging.basicConfig(level=logging.WARNING)
    from atom import LLM
    from rich.console import Console
    from rich.table import Table
    cfg = MODEL_CONFIGS[args.model]
    path = write_model_config(args.model)
    args.max_model_len = max(2048, max(args.prompt_lens) + 16)
    args.max_num_batched_tokens = max(8192, max(args.prompt_lens))  # one step holds a whole prompt
    peer, note = {}, ""
    if args.peer == "vllm":
        from atom.benchmarks.peer_vllm import peer_result
        args.quantization = None
        peer, note = peer_result("prefill", path, cfg["vocab_size"], args,
                                 ["--prompt-lens", *map(str, args.prompt_lens)])
        peer = peer or {}
    results = []
    for level in args.levels:
        llm = LLM(path, load_dummy="xavier", max_model_len=args.max_model_len, enable_log_stats=False,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  compilation_config={"level": level, "cache_dir": args.cache_dir})
        for n in args.prompt_lens:
            r = measure(llm, n, args.repeat, cfg["vocab_size"])
            r.update(level=level, floor_ms=prefill_floor_ms(cfg, n))
            if peer:
                r["peer_ms"] = peer["ms"][str(n)]
            results.append(r)
        del llm
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    t = Table(title=f"prefill of one request, one output token — {args.model}", caption=note or None)
    cols = ["level", "prompt", "ATOM ms", "step ms", "host launch ms", "graph steps"] + (
        ["vLLM ms", "vLLM ms / ATOM ms"] if peer else []) + ["floor ms"]
    for c in cols:
        t.add_column(c)
    for r in results:
        t.add_row(str(r["level"]), str(r["prompt_len"]), f"{r['ms']:.2f}", f"{r['step_ms']:.2f}",
                  f"{r['launch_ms']:.2f}", f"{r['graph_steps']}/{r['steps']}",
                  *([f"{r['peer_ms']:.2f}", f"{r['peer_ms'] / r['ms']:.2f}x"] if peer else []),
                  f"{r['floor_ms']:.3f}")
    Console().print(t)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "date": time.strftime("%Y-%m-%d"), "peer_note": note,
                       "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                       "peer": peer and f"vLLM {peer['vllm_version']}", "results": results, **provenance()},
                      f, indent=1)


if __name__ == "__main__":
    main()
