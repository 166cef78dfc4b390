"""Decode latency: ms per step at batch 1, 8, 64 (128-token prompts, 512 greedy tokens),
eager against CUDA graphs, next to the bandwidth floor (weights + KV read per step).

    python -m atom.benchmarks.latency --model qwen3-0.6b [--batches 1 8 64] [--profile] [--peer vllm]

`--peer vllm` measures vLLM first, in a child process, on the same prompts: its ms per
decode step is (time for N new tokens - time for 1 new token) / (N - 1).

`--quantization FORMAT` (`atom.benchmarks.quant_formats`: fp8_dynamic, fp8_block, w8a8_int8,
w4a16, mxfp4_w4a16) writes the producer's `quantization_config` into the model folder, and
both engines load it with dummy weights; `--kv-cache-dtype fp8` gives both an FP8 KV cache.
The floor counts the format's weight bytes and the KV dtype's. A format vLLM does not run
is reported and ATOM still runs.

    python -m atom.benchmarks.latency --model llama-3.1-8b --batches 1 --peer vllm --quantization w4a16

`--profile` adds a per-step host profile: scheduling, input preparation, launch or graph
replay + sampling, output processing (from the engine's step records).
"""
from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from atom.benchmarks.peer_vllm import add_format_args
from atom.benchmarks.provenance import provenance
from atom.benchmarks.roofline import decode_floor_ms
from atom.benchmarks.workloads import DEFAULT_CACHE_DIR, MODEL_CONFIGS, mixed_workload, write_model_config


PROFILE = ("schedule_s", "prepare_s", "launch_s", "sample_s", "post_s")


def measure(llm, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> dict:
    from atom import SamplingParams
    reqs = mixed_workload(batch, (prompt_len, prompt_len), (new_tokens, new_tokens), vocab, seed=batch)
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    prompts = [r.prompt_token_ids for r in reqs]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    llm.stats.clear()
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    total = time.perf_counter() - t0
    steps = llm.stats.steps()
    dec = steps[(steps.prefill_tokens == 0) & (steps.num_seqs == batch)]
    ms = float(dec.latency.median() * 1e3)
    prof = {k: float(dec[k].median() * 1e3) for k in PROFILE if k in dec}
    return {"batch": batch, "ms_per_step": ms, "total_s": total, "decode_steps": len(dec), "profile_ms": prof}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODEL_CONFIGS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--modes", nargs="+", default=["eager", "graphs"], choices=["eager", "graphs"])
    ap.add_argument("--level", type=int, default=0, help="compilation level for the graphs mode")
    ap.add_argument("--profile", action="store_true", help="print the per-step host profile")
    ap.add_argument("--peer", choices=["none", "vllm"], default="none")
    ap.add_argument("--repeat", type=int, default=2, help="peer: timed runs per batch (best kept)")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR,
                    help="ATOM's compilation cache dir (keeps the GEMM choice); '' for none")
    add_format_args(ap)
    ap.add_argument("--out", help="write JSON here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from atom import LLM
    from atom.benchmarks.throughput import atom_kv_dtype, linear_formats
    from rich.console import Console
    from rich.table import Table
    cfg = MODEL_CONFIGS[args.model]
    path = write_model_config(args.model, quantization=args.quantization)
    args.max_model_len, args.max_num_seqs = 2048, max(args.batches)  # both engines run with these
    peer, peer_note = {}, ""
    if args.peer == "vllm":
        from atom.benchmarks.peer_vllm import peer_result
        peer, peer_note = peer_result("latency", path, cfg["vocab_size"], args,
                                      ["--batches", *map(str, args.batches), "--prompt-len", str(args.prompt_len),
                                       "--new-tokens", str(args.new_tokens)])
        peer = peer or {}
    results, plans, formats = [], {}, []
    for mode in args.modes:
        kw = dict(enforce_eager=True) if mode == "eager" else dict(
            compilation_config={"level": args.level, "cudagraph_capture_sizes": sorted(set(args.batches)),
                                "cache_dir": args.cache_dir})
        llm = LLM(path, load_dummy="xavier", max_model_len=args.max_model_len, enable_log_stats=False,
                  max_num_seqs=args.max_num_seqs, kv_cache_dtype=atom_kv_dtype(args.kv_cache_dtype), **kw)
        formats = linear_formats(llm)
        for b in args.batches:
            r = measure(llm, b, args.prompt_len, args.new_tokens, cfg["vocab_size"])
            ctx = args.prompt_len + args.new_tokens // 2
            r.update(mode=mode, floor_ms=decode_floor_ms(cfg, b, ctx, weight_format=args.quantization,
                                                         kv_cache_dtype=args.kv_cache_dtype))
            if peer:
                r["peer_ms"] = peer["ms_per_step"][str(b)]
            results.append(r)
        plans[mode] = llm.engine.runner.plan.rows()  # this engine's one-row and cuBLASLt choices
        del llm
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    t = Table(title=f"decode latency — {args.model} {args.quantization}, KV {args.kv_cache_dtype}",
              caption=peer_note or None)
    cols = ["mode", "batch", "ATOM ms/step"] + (["vLLM ms/step"] if peer else []) + [
        "floor ms", "ATOM of floor"] + (["vLLM of floor"] if peer else []) + (
        ["schedule", "prepare", "launch", "sample+wait", "post"] if args.profile else [])
    for c in cols:
        t.add_column(c)
    for r in results:
        pm = r.get("peer_ms")  # None: the peer's run gave no figure at this batch
        row = [r["mode"], str(r["batch"]), f"{r['ms_per_step']:.3f}"] + (
            [f"{pm:.3f}" if pm else "n/a"] if peer else []) + [f"{r['floor_ms']:.3f}",
                                                               f"{r['floor_ms'] / r['ms_per_step']:.0%}"] + (
            [f"{r['floor_ms'] / pm:.0%}" if pm else "n/a"] if peer else [])
        if args.profile:
            row += [f"{r['profile_ms'].get(k, float('nan')):.3f}" for k in PROFILE]
        t.add_row(*row)
    Console().print(t)
    choices = [c for rows in plans.values() for c in rows if c["kind"] == "gemv"]
    for c in choices:
        Console().print(f"one-row {c['n']}x{c['k']} {c['variant']}: unfused {c['library_us']} us, "
                        f"Triton GEMV {c['best_us']} us -> {c['runs']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
                       "atom_linear_formats": formats, "peer_note": peer_note, "date": time.strftime("%Y-%m-%d"),
                       "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                       "peer": peer and f"vLLM {peer['vllm_version']}", "results": results,
                       "one_row_choices": choices, "kernel_plans": plans, **provenance()}, f, indent=1)


if __name__ == "__main__":
    main()
