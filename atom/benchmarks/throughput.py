"""Offline throughput: ATOM and a peer on the same requests, in one command.

CPU (default without a GPU): the embedded SmolLM2-135M at batch 1 and on 32 mixed-length
requests, against HF transformers' `generate` on the same weights.

    python -m atom.benchmarks.throughput --device cpu

GPU: the nano-vllm workload (256 sequences, lengths uniform in [100, 1024], temperature
0.6, ignore_eos: 133,966 output tokens) on a model shape with dummy weights, against HF
(`--peer hf`, on a subset: it pads) or vLLM (`--peer vllm`, where importable), with the
fraction of the roofline.

    python -m atom.benchmarks.throughput --device cuda --model qwen3-0.6b --peer hf --out r.json

Quantized formats and the FP8 KV cache (GPU; `--peer vllm` or `none`): `--quantization
FORMAT` writes the model folder's config.json with the producer's `quantization_config`
(`atom.benchmarks.quant_formats`: fp8_dynamic, fp8_block, w8a8_int8, w4a16, mxfp4_w4a16;
what vLLM runs for each on the H200 is in its docstring) and both engines load it with
dummy weights; `--kv-cache-dtype fp8` gives both an FP8 KV cache; `--workload long` runs 64
sequences of 4096-8192 input and 100-512 output tokens (max_model_len raised to fit). The
roofline counts the format's weight bytes and the KV dtype's.

    python -m atom.benchmarks.throughput --model llama-3.1-8b --peer vllm --quantization fp8_dynamic --out q.json
    python -m atom.benchmarks.throughput --model llama-3.1-8b --peer vllm --workload long --kv-cache-dtype fp8
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch

from atom.benchmarks.peer_vllm import add_engine_limit_args, add_format_args
from atom.benchmarks.provenance import provenance
from atom.benchmarks.workloads import (DEFAULT_CACHE_DIR, WORKLOADS, Request, make_workload, mixed_workload,
                                      needed_model_len, warmup_workload, write_model_config)

logger = logging.getLogger(__name__)


def run_atom(llm, requests: list[Request], temperature: float) -> tuple[int, float]:
    from atom import SamplingParams
    sps = [SamplingParams(temperature=temperature, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], sps, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return sum(o.num_output_tokens for o in outs), dt


def step_breakdown(llm, first_step: int) -> dict:
    """Where the wall time of a run went, from the engine's step records after `first_step`:
    steps with prompt tokens against decode-only steps (each step's time runs to the start of
    the next), and the mean decode step by batch size."""
    steps = llm.stats.steps()
    if steps.empty or "step" not in steps:
        return {}
    steps = steps[steps["step"] > first_step].reset_index(drop=True)
    if steps.empty:
        return {}
    dur = steps["time"].shift(-1) - steps["time"]
    dur.iloc[-1] = steps["latency"].iloc[-1]
    pre = steps["prefill_tokens"] > 0
    bands = ((1, 16), (17, 64), (65, 128), (129, 192), (193, 100_000))
    by_batch = {}
    for lo, hi in bands:
        sel = ~pre & steps["num_seqs"].between(lo, hi)
        if sel.any():
            by_batch[f"{lo}-{hi}"] = {"steps": int(sel.sum()), "mean_ms": float(dur[sel].mean() * 1e3)}
    return {"steps": len(steps), "prefill_steps": int(pre.sum()), "prefill_s": float(dur[pre].sum()),
            "prompt_tokens": int(steps["prefill_tokens"].sum()), "decode_steps": int((~pre).sum()),
            "decode_s": float(dur[~pre].sum()), "decode_ms_by_batch": by_batch}


def run_hf(model, requests: list[Request], temperature: float, pad_id: int) -> tuple[int, float]:
    """One batched `generate` with left padding, run to the longest request; counts only
    the tokens each request asked for (what a user of transformers would get)."""
    dev = model.device
    longest = max(len(r.prompt_token_ids) for r in requests)
    ids = torch.full((len(requests), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(requests):
        n = len(r.prompt_token_ids)
        ids[i, longest - n:] = torch.tensor(r.prompt_token_ids)
        mask[i, longest - n:] = 1
    new = max(r.max_tokens for r in requests)
    kw = dict(do_sample=temperature > 0, max_new_tokens=new, min_new_tokens=new, pad_token_id=pad_id)
    if temperature > 0:
        kw.update(temperature=temperature, top_k=0, top_p=1.0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids.to(dev), attention_mask=mask.to(dev), **kw)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return sum(r.max_tokens for r in requests), time.perf_counter() - t0


def load_hf(path: str, device: str, dtype: torch.dtype, dummy: bool):
    import transformers
    if dummy:
        cfg = transformers.AutoConfig.from_pretrained(path)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return model.eval()


def cpu_main(args) -> dict:
    from atom import LLM
    from atom.model_loader.embedded import ensure_embedded_model
    path = ensure_embedded_model()
    llm = LLM(path, max_model_len=1024, enable_log_stats=False, max_num_batched_tokens=2048)
    hf = load_hf(path, "cpu", torch.float32, dummy=False)
    vocab = llm.config.hf_config.vocab_size
    scenarios = {
        "batch1": mixed_workload(1, (64, 64), (128, 128), vocab, seed=1),
        "mixed32": mixed_workload(32, (32, 256), (32, 128), vocab, seed=0),
    }
    warm = mixed_workload(2, (16, 16), (8, 8), vocab, seed=2)
    run_atom(llm, warm, 0.0)
    run_hf(hf, warm, 0.0, pad_id=0)
    results = {}
    for name, reqs in scenarios.items():
        # alternate the two engines and keep each one's best run: the machine is shared
        a_runs, h_runs = [], []
        for _ in range(args.repeat):
            a_runs.append(run_atom(llm, reqs, 0.0))
            h_runs.append(run_hf(hf, reqs, 0.0, pad_id=0))
        (a_tok, a_s), (h_tok, h_s) = min(a_runs, key=lambda r: r[1]), min(h_runs, key=lambda r: r[1])
        results[name] = {"requests": len(reqs), "output_tokens": a_tok,
                         "atom_runs_s": [r[1] for r in a_runs], "hf_runs_s": [r[1] for r in h_runs],
                         "atom_tok_s": a_tok / a_s, "hf_tok_s": h_tok / h_s,
                         "atom_s": a_s, "hf_s": h_s, "speedup": (a_tok / a_s) / (h_tok / h_s)}
    return {"device": "cpu", "model": "SmolLM2-135M-Instruct (embedded, fp32)",
            "threads": torch.get_num_threads(), "scenarios": results}


def atom_kv_dtype(kv_cache_dtype: str) -> str:
    """The benchmark's --kv-cache-dtype (auto / fp8) as ATOM's kv_cache_dtype."""
    return "fp8" if kv_cache_dtype == "fp8" else "bf16"


def linear_formats(llm) -> list[str]:
    """The distinct formats of the engine's linear layers: which format really ran (the
    kernel of each layer is in `linear_methods_frame`)."""
    from atom.viz import linear_methods_frame
    try:
        frame = linear_methods_frame(llm)
    except Exception as e:  # an engine whose model lives in another process: the figures still count
        logger.warning("the linear layers' formats are not readable here (%s)", e)
        return []
    return sorted(set(frame["format"].astype(str)))


def gemm_choices(llm) -> list[dict]:
    """The start-up cuBLASLt choices of the engine (`KernelPlan.rows`, kind "gemm": rows, N, K,
    dtype, the library's and the best candidate's us, what runs), to read a run's products by."""
    runner = getattr(getattr(llm, "engine", llm), "runner", None)  # (none where the model is in another process)
    plan = getattr(runner, "plan", None)
    return [r for r in plan.rows() if r["kind"] == "gemm"] if plan is not None else []


def gpu_main(args) -> dict:
    from atom import LLM
    from atom.benchmarks.roofline import workload_floor
    from atom.benchmarks.workloads import MODEL_CONFIGS
    path = write_model_config(args.model, quantization=args.quantization)
    reqs = make_workload(args.workload, args.num_seqs)
    args.num_seqs = len(reqs)
    if needed_model_len(reqs) > args.max_model_len:  # both engines run with these limits
        logger.warning("max_model_len raised from %d to %d for the %s workload", args.max_model_len,
                       needed_model_len(reqs), args.workload)
        args.max_model_len = needed_model_len(reqs)
    vocab = MODEL_CONFIGS[args.model]["vocab_size"]
    vllm_res, peer_note = None, ""
    if args.peer == "vllm":  # first, in a child process: each engine gets the whole GPU
        from atom.benchmarks.peer_vllm import peer_result
        vllm_res, peer_note = peer_result("throughput", path, vocab, args,
                                          ["--num-seqs", str(args.num_seqs), "--workload", args.workload])
    llm = LLM(path, load_dummy="xavier", max_model_len=args.max_model_len, enable_log_stats=False,
              enforce_eager=args.enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_dtype=atom_kv_dtype(args.kv_cache_dtype),
              compilation_config={"level": args.level, "cache_dir": args.cache_dir})
    run_atom(llm, mixed_workload(16, (64, 512), (16, 64), vocab, seed=1), args.temperature)  # warm-up
    run_atom(llm, warmup_workload(reqs), args.temperature)  # the timed run's shapes
    runs = []
    for _ in range(args.repeat):
        first = llm.stats.num_steps
        runs.append(run_atom(llm, reqs, args.temperature) + (step_breakdown(llm, first),))
    tok, sec, breakdown = min(runs, key=lambda r: r[1])
    floor = workload_floor(MODEL_CONFIGS[args.model], [len(r.prompt_token_ids) for r in reqs],
                           [r.max_tokens for r in reqs], weight_format=args.quantization,
                           kv_cache_dtype=args.kv_cache_dtype)
    res = {"device": torch.cuda.get_device_name(), "model": args.model, "quantization": args.quantization,
           "kv_cache_dtype": args.kv_cache_dtype, "workload": args.workload, "num_seqs": len(reqs),
           "max_model_len": args.max_model_len, "atom_linear_formats": linear_formats(llm),
           "output_tokens": tok, "atom_s": sec, "atom_tok_s": tok / sec,
           "all_runs_s": [r[1] for r in runs], "roofline_tok_s": floor.tokens_per_s,
           "roofline_fraction": (tok / sec) / floor.tokens_per_s, "enforce_eager": args.enforce_eager,
           "level": args.level, "atom_steps": breakdown, "atom_gemm_choices": gemm_choices(llm)}
    if args.peer == "hf":
        del llm
        torch.cuda.empty_cache()
        sub = reqs[:args.hf_seqs]
        hf = load_hf(path, "cuda", torch.bfloat16, dummy=True)
        run_hf(hf, mixed_workload(4, (64, 128), (8, 16), vocab, seed=1), args.temperature, pad_id=0)
        h_tok, h_s = run_hf(hf, sub, args.temperature, pad_id=0)
        res.update(peer="hf", peer_seqs=len(sub), peer_tok_s=h_tok / h_s, peer_s=h_s)
        res["speedup_vs_peer"] = res["atom_tok_s"] / res["peer_tok_s"]
    elif args.peer == "vllm":
        res["peer_note"] = peer_note  # vLLM's kernel for the format, or why it did not run
        if vllm_res is not None:
            res.update(peer=f"vLLM {vllm_res['vllm_version']}", peer_tok_s=vllm_res["tok_s"],
                       peer_s=vllm_res["seconds"], peer_runs_s=vllm_res["all_runs_s"])
            res["speedup_vs_peer"] = res["atom_tok_s"] / res["peer_tok_s"]
    return res


def check_args(args) -> None:
    """Settings that cannot run together, refused before anything is built."""
    if args.device == "cpu" and (args.quantization != "bf16" or args.kv_cache_dtype != "auto"
                                 or args.workload != "nano-vllm"):
        raise SystemExit(f"--quantization={args.quantization} / --kv-cache-dtype={args.kv_cache_dtype} / "
                         f"--workload={args.workload}: the CPU run measures the embedded bf16 model only; "
                         "use --device cuda")
    if args.peer == "hf" and (args.quantization != "bf16" or args.kv_cache_dtype != "auto"):
        raise SystemExit(f"--peer hf runs the bf16 model with a bf16 KV cache only (got --quantization="
                         f"{args.quantization}, --kv-cache-dtype={args.kv_cache_dtype}): use --peer vllm or none")


def report(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"throughput — {res['model']} on {res['device']}")
    if res["device"] == "cpu":
        for c in ("scenario", "requests", "out tokens", "ATOM tok/s", "HF tok/s", "ATOM / HF"):
            t.add_column(c)
        for name, r in res["scenarios"].items():
            t.add_row(name, str(r["requests"]), str(r["output_tokens"]), f"{r['atom_tok_s']:.1f}",
                      f"{r['hf_tok_s']:.1f}", f"{r['speedup']:.2f}x")
    else:
        t.title = (f"throughput — {res['model']} {res['quantization']}, KV {res['kv_cache_dtype']}, "
                   f"{res['workload']} x{res['num_seqs']} on {res['device']}")
        for c in ("engine", "out tokens", "seconds", "tok/s", "of roofline"):
            t.add_column(c)
        t.add_row("ATOM", str(res["output_tokens"]), f"{res['atom_s']:.2f}", f"{res['atom_tok_s']:,.0f}",
                  f"{res['roofline_fraction']:.0%}")
        if "peer_tok_s" in res:
            t.add_row(res["peer"] + (f" ({res['peer_seqs']} seqs)" if "peer_seqs" in res else ""), "",
                      f"{res['peer_s']:.2f}", f"{res['peer_tok_s']:,.0f}",
                      f"{res['peer_tok_s'] / res['roofline_tok_s']:.0%}")
            t.caption = f"ATOM / {res['peer']}: {res['speedup_vs_peer']:.2f}x"
        elif res.get("peer_note"):
            t.add_row("vLLM", "", "", "did not run", "")
            t.caption = res["peer_note"]
        t.add_row(f"roofline ({res['quantization']}, KV {res['kv_cache_dtype']})", "", "",
                  f"{res['roofline_tok_s']:,.0f}", "100%")
    Console().print(t)
    b = res.get("atom_steps")
    if b:
        bands = ", ".join(f"{k}: {v['steps']} x {v['mean_ms']:.2f} ms" for k, v in b["decode_ms_by_batch"].items())
        Console().print(f"ATOM's steps: {b['prefill_steps']} with prompt tokens ({b['prompt_tokens']} tokens) "
                        f"{b['prefill_s']:.2f} s, {b['decode_steps']} decode-only {b['decode_s']:.2f} s; "
                        f"decode by batch size: {bands}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="qwen3-0.6b", help="GPU: qwen3-0.6b or llama-3.1-8b (dummy weights)")
    ap.add_argument("--peer", choices=["none", "hf", "vllm"], default="hf")
    ap.add_argument("--num-seqs", type=int, default=None, help="GPU: default the workload's (nano-vllm 256, long 64)")
    ap.add_argument("--workload", default="nano-vllm", choices=sorted(WORKLOADS),
                    help="GPU: nano-vllm (inputs and outputs 100-1024) or long (inputs 4096-8192, outputs 100-512)")
    ap.add_argument("--hf-seqs", type=int, default=64, help="GPU: requests given to HF (it pads)")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--repeat", type=int, default=2)
    add_engine_limit_args(ap)
    add_format_args(ap)
    ap.add_argument("--level", type=int, default=0, help="compilation level (0-3) of ATOM's engine")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR,
                    help="ATOM's compilation cache dir (its GEMM choice is kept there: the first start-up on "
                         "a GPU searches wider, ~2 min for Llama-3.1-8B); '' for none")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    check_args(args)
    logging.basicConfig(level=logging.WARNING)
    res = cpu_main(args) if args.device == "cpu" else gpu_main(args)
    res["date"] = time.strftime("%Y-%m-%d")
    res["command"] = "python -m atom.benchmarks.throughput " + " ".join(argv or sys.argv[1:])
    res.update(provenance())
    report(res)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
