"""vLLM as the same-machine peer of `throughput.py`, `latency.py` and `prefill.py` (`--peer vllm`).

vLLM runs in a child process (`run_in_child`), before ATOM builds its engine, so that
each engine finds the GPU memory free: the same requests (token ids, per-request
max_tokens, temperature, ignore_eos) on the same config folder with dummy weights, one
warm-up run, then the timed runs. The child prints one JSON line.

A quantized folder (`--quantization FORMAT`: its config.json holds the producer's
`quantization_config`) is run with `quantization="compressed-tensors"` named explicitly, so
that vLLM fails rather than silently running something else; `--kv-cache-dtype fp8` gives
vLLM `kv_cache_dtype="fp8"`. `engine_kwargs` and `child_command` build the arguments
without vLLM (tests check them).

Dummy weights: vLLM fills every parameter uniformly in +-1e-3 (`--peer-dummy vllm`, its own
rule), ATOM by `atom.model_loader.loader.dummy_fill` (xavier). For dense models that changes
no timing; a MoE model's routing depends on it (near-constant router scores can send most
tokens to the same few experts, so that a step reads far fewer expert bytes). `--peer-dummy
xavier` refills vLLM's parameters after loading with ATOM's rule (`xavier_refill`: norms 1,
biases 0, matrices xavier-normal over their last two dims, stacked experts each on its own
fans), so that both engines route statistically alike; tensors vLLM derives from the weights
at load (MLA's absorbed projections) keep the values derived from its own dummies.

    python -m atom.benchmarks.peer_vllm throughput --model-path DIR --num-seqs 256 [--workload long]
    python -m atom.benchmarks.peer_vllm latency --model-path DIR --batches 1 8 64 [--quantization fp8_dynamic]
    python -m atom.benchmarks.peer_vllm prefill --model-path DIR --prompt-lens 128 512 2048
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time

from atom.benchmarks.quant_formats import FORMATS, get_format
from atom.benchmarks.workloads import WORKLOADS, make_workload, mixed_workload, prefill_requests, warmup_workload

MARK = "VLLM_PEER_RESULT "


def engine_kwargs(args) -> dict:
    """The keyword arguments of vLLM's `LLM` for this run (no vLLM needed to build them)."""
    kw = dict(model=args.model_path, load_format="dummy", max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
              skip_tokenizer_init=True,
              # off, as in ATOM by default: a repeated timed run must not find its prompts cached
              enable_prefix_caching=False,
              kv_cache_dtype="fp8" if getattr(args, "kv_cache_dtype", "auto") == "fp8" else "auto")
    if get_format(getattr(args, "quantization", None)).weights is not None:
        kw["quantization"] = "compressed-tensors"
    return kw


def xavier_refill(model) -> int:
    """ATOM's dummy rule (`dummy_fill` for float parameters) applied in place to a loaded
    vLLM model; returns the number of parameters refilled. Runs inside vLLM's worker
    (`LLM.apply_model`); in place, so captured CUDA graphs keep their addresses."""
    import torch
    from atom.model_loader.loader import _xavier_std, float_dummy_role
    gens: dict = {}
    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.dtype.is_floating_point or p.element_size() < 2:
                continue
            if p.device not in gens:
                gens[p.device] = torch.Generator(device=p.device).manual_seed(0)
            gen = gens[p.device]
            role = float_dummy_role(name, p)
            if role == "one":
                p.fill_(1.0)
            elif role == "zero":
                p.zero_()
            else:  # a matrix (or each expert's) at a time, in chunks of rows: little scratch memory
                std = _xavier_std(p.shape)
                for mat in (p.data.unbind(0) if p.dim() == 3 else (p.data,)):  # views: written in place
                    for start in range(0, mat.shape[0], 8192):
                        rows = mat[start:start + 8192]
                        rows.copy_(torch.randn(rows.shape, generator=gen, device=rows.device,
                                               dtype=torch.float32) * std)
            n += 1
    return n


def _engine(args):
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # no flashinfer on the H200 machine
    if getattr(args, "peer_dummy", "vllm") == "xavier":
        if get_format(getattr(args, "quantization", None)).weights is not None:
            raise SystemExit("--peer-dummy xavier refills bf16 parameters only; a quantized run keeps vLLM's rule")
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model sends a function to the worker
    try:
        from vllm import LLM
    except ImportError as e:
        raise SystemExit(f"--peer vllm: vLLM is not importable here ({e}); install it or use another peer")
    llm = LLM(**engine_kwargs(args))
    if getattr(args, "peer_dummy", "vllm") == "xavier":
        counts = llm.apply_model(xavier_refill)
        logging.getLogger(__name__).info("vLLM parameters refilled with the xavier rule: %s", counts)
    return llm


def _run(llm, requests, temperature: float) -> tuple[int, float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in requests]
    sps = [SamplingParams(temperature=temperature, max_tokens=r.max_tokens, ignore_eos=True,
                          detokenize=False) for r in requests]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0


def throughput(args) -> dict:
    llm = _engine(args)
    reqs = make_workload(args.workload, args.num_seqs)
    _run(llm, mixed_workload(16, (64, 512), (16, 64), args.vocab_size, seed=1), args.temperature)  # warm-up
    _run(llm, warmup_workload(reqs), args.temperature)  # the timed run's shapes, as for ATOM
    runs = [_run(llm, reqs, args.temperature) for _ in range(args.repeat)]
    tokens, seconds = min(runs, key=lambda r: r[1])
    return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "all_runs_s": [r[1] for r in runs],
            "vllm_version": __import__("vllm").__version__}


def latency(args) -> dict:
    """ms per decode step at each batch: (time for N new tokens - time for 1) / (N - 1); None
    (logged) where a hiccup made the one-token run the slower, which leaves no figure."""
    llm = _engine(args)
    out = {}
    for b in args.batches:
        reqs = mixed_workload(b, (args.prompt_len, args.prompt_len), (args.new_tokens, args.new_tokens),
                              args.vocab_size, seed=b)
        one = [type(r)(r.prompt_token_ids, 1) for r in reqs]
        _run(llm, reqs, 0.0)  # warm-up, both shapes
        _run(llm, one, 0.0)
        full = min(_run(llm, reqs, 0.0)[1] for _ in range(args.repeat))
        first = min(_run(llm, one, 0.0)[1] for _ in range(args.repeat))
        out[str(b)] = (full - first) / (args.new_tokens - 1) * 1e3 if full > first else None
        if out[str(b)] is None:
            logging.getLogger(__name__).warning("vLLM batch %d: %d new tokens took %.4f s, one %.4f s: no figure",
                                                b, args.new_tokens, full, first)
    return {"ms_per_step": out, "vllm_version": __import__("vllm").__version__}


def prefill(args) -> dict:
    """ms of one request with one output token, alone, per prompt length (median of
    `--repeat` fresh prompts after two warm-ups of that length)."""
    import statistics
    llm = _engine(args)
    out = {}
    for n in args.prompt_lens:
        reqs = prefill_requests(n, args.repeat + 2, args.vocab_size)
        times = [_run(llm, [r], 0.0)[1] for r in reqs]
        out[str(n)] = statistics.median(times[2:]) * 1e3
    return {"ms": out, "vllm_version": __import__("vllm").__version__}


def add_engine_limit_args(ap: argparse.ArgumentParser) -> None:
    """The engine limits `throughput.py` gives both engines, and this child's copy of them."""
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")


def add_format_args(ap: argparse.ArgumentParser) -> None:
    """`--quantization` and `--kv-cache-dtype`, the same for both engines."""
    ap.add_argument("--quantization", default="bf16", type=_format_name, metavar="FORMAT",
                    help=f"weight format (atom.benchmarks.quant_formats): {', '.join(FORMATS)}")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                    help="KV cache: auto (the model's dtype) or fp8 (e4m3 with scales)")
    ap.add_argument("--peer-dummy", default="vllm", choices=["vllm", "xavier"],
                    help="vLLM's dummy weights: its own uniform +-1e-3 rule, or refilled with ATOM's "
                         "xavier rule (bf16 only; MoE routing depends on it)")


def _format_name(value: str) -> str:
    try:
        return get_format(value).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def child_command(kind: str, model_path: str, vocab_size: int, args, extra: list[str]) -> list[str]:
    """The command line of the vLLM child for `args` (the benchmark's parsed arguments)."""
    cmd = [sys.executable, "-m", "atom.benchmarks.peer_vllm", kind, "--model-path", model_path,
           "--vocab-size", str(vocab_size), "--temperature", str(getattr(args, "temperature", 0.0)),
           "--repeat", str(args.repeat), "--max-model-len", str(args.max_model_len),
           "--gpu-memory-utilization", str(getattr(args, "gpu_memory_utilization", 0.9)),
           "--max-num-seqs", str(getattr(args, "max_num_seqs", 256)),
           "--max-num-batched-tokens", str(getattr(args, "max_num_batched_tokens", 8192)),
           "--quantization", get_format(getattr(args, "quantization", None)).name,
           "--kv-cache-dtype", getattr(args, "kv_cache_dtype", "auto"),
           "--peer-dummy", getattr(args, "peer_dummy", "vllm"), *extra]
    if getattr(args, "enforce_eager", False):
        cmd.append("--enforce-eager")
    return cmd


def run_in_child(kind: str, model_path: str, vocab_size: int, args, extra: list[str]) -> dict:
    """Runs this module in a fresh Python process; returns its result (SystemExit on failure)."""
    proc = subprocess.run(child_command(kind, model_path, vocab_size, args, extra), stdout=subprocess.PIPE, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise SystemExit(f"--peer vllm: the vLLM run failed (exit {proc.returncode}); its output:\n{proc.stdout[-3000:]}")


def peer_result(kind: str, model_path: str, vocab_size: int, args, extra: list[str]) -> tuple[dict | None, str]:
    """vLLM's result for this run, or (None, why not): a format vLLM does not run on sm90
    (`quant_formats.VLLM_SM90`) is not tried, and a failed child is reported, so that the
    benchmark still measures ATOM."""
    from atom.benchmarks.quant_formats import VLLM_SM90
    fmt = get_format(getattr(args, "quantization", None)).name
    support = VLLM_SM90[fmt]
    if not support.supported:
        return None, f"vLLM does not run {fmt} on sm90: {support.kernel}"
    try:
        return run_in_child(kind, model_path, vocab_size, args, extra), support.kernel
    except SystemExit as e:
        logging.getLogger(__name__).warning("%s", e)
        return None, f"vLLM failed on {fmt}: {str(e)[-500:]}"


def build_parser() -> argparse.ArgumentParser:
    """The child's command line (what `child_command` writes)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["throughput", "latency", "prefill"])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--num-seqs", type=int, default=None, help="default: the workload's")
    ap.add_argument("--workload", default="nano-vllm", choices=sorted(WORKLOADS))
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--repeat", type=int, default=2)
    add_engine_limit_args(ap)
    add_format_args(ap)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512, 2048])
    return ap


def main(argv=None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    res = {"throughput": throughput, "latency": latency, "prefill": prefill}[args.kind](args)
    print(MARK + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
