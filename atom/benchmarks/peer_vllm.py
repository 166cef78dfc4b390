"""vLLM as the same-machine peer of `throughput.py` and `latency.py` (`--peer vllm`).

vLLM runs in a child process (`run_in_child`), before ATOM builds its engine, so that
each engine finds the GPU memory free: the same requests (token ids, per-request
max_tokens, temperature, ignore_eos) on the same config folder with dummy weights, one
warm-up run, then the timed runs. The child prints one JSON line.

    python -m atom.benchmarks.peer_vllm throughput --model-path DIR --num-seqs 256
    python -m atom.benchmarks.peer_vllm latency --model-path DIR --batches 1 8 64
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from atom.benchmarks.workloads import mixed_workload, nano_vllm_workload, warmup_workload

MARK = "VLLM_PEER_RESULT "


def _engine(args):
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # no flashinfer on the H200 machine
    try:
        from vllm import LLM
    except ImportError as e:
        raise SystemExit(f"--peer vllm: vLLM is not importable here ({e}); install it or use another peer")
    return LLM(model=args.model_path, load_format="dummy", max_model_len=args.max_model_len,
               gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
               skip_tokenizer_init=True,
               # off, as in ATOM by default: a repeated timed run must not find its prompts cached
               enable_prefix_caching=False)


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
    reqs = nano_vllm_workload(args.num_seqs)
    _run(llm, mixed_workload(16, (64, 512), (16, 64), args.vocab_size, seed=1), args.temperature)  # warm-up
    _run(llm, warmup_workload(reqs), args.temperature)  # the timed run's shapes, as for ATOM
    runs = [_run(llm, reqs, args.temperature) for _ in range(args.repeat)]
    tokens, seconds = min(runs, key=lambda r: r[1])
    return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "all_runs_s": [r[1] for r in runs],
            "vllm_version": __import__("vllm").__version__}


def latency(args) -> dict:
    """ms per decode step at each batch: (time for N new tokens - time for 1) / (N - 1)."""
    llm = _engine(args)
    out = {}
    for b in args.batches:
        reqs = mixed_workload(b, (args.prompt_len, args.prompt_len), (args.new_tokens, args.new_tokens),
                              args.vocab_size, seed=b)
        one = [type(r)(r.prompt_token_ids, 1) for r in reqs]
        _run(llm, reqs, 0.0)  # warm-up
        full = min(_run(llm, reqs, 0.0)[1] for _ in range(args.repeat))
        first = min(_run(llm, one, 0.0)[1] for _ in range(args.repeat))
        out[str(b)] = (full - first) / (args.new_tokens - 1) * 1e3
    return {"ms_per_step": out, "vllm_version": __import__("vllm").__version__}


def add_engine_limit_args(ap: argparse.ArgumentParser) -> None:
    """The engine limits `throughput.py` gives both engines, and this child's copy of them."""
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")


def run_in_child(kind: str, model_path: str, vocab_size: int, args, extra: list[str]) -> dict:
    """Runs this module in a fresh Python process; returns its result (SystemExit on failure)."""
    cmd = [sys.executable, "-m", "atom.benchmarks.peer_vllm", kind, "--model-path", model_path,
           "--vocab-size", str(vocab_size), "--temperature", str(getattr(args, "temperature", 0.0)),
           "--repeat", str(args.repeat), "--max-model-len", str(args.max_model_len),
           "--gpu-memory-utilization", str(getattr(args, "gpu_memory_utilization", 0.9)),
           "--max-num-seqs", str(getattr(args, "max_num_seqs", 256)),
           "--max-num-batched-tokens", str(getattr(args, "max_num_batched_tokens", 8192)), *extra]
    if getattr(args, "enforce_eager", False):
        cmd.append("--enforce-eager")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise SystemExit(f"--peer vllm: the vLLM run failed (exit {proc.returncode}); its output:\n{proc.stdout[-3000:]}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["throughput", "latency"])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--repeat", type=int, default=2)
    add_engine_limit_args(ap)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=512)
    args = ap.parse_args(argv)
    res = throughput(args) if args.kind == "throughput" else latency(args)
    print(MARK + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
