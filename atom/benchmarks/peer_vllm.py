"""vLLM as the same-machine peer of `throughput.py --peer vllm`, where it is importable.

vLLM runs the same requests (token ids, per-request max_tokens, temperature, ignore_eos)
on the same config folder with dummy weights; one warm-up run, then the timed runs.
"""
from __future__ import annotations

import os
import time


def run_vllm_throughput(model_path: str, requests, args) -> dict:
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as e:
        raise SystemExit(f"--peer vllm: vLLM is not importable here ({e}); install it or use --peer hf")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    llm = LLM(model=model_path, load_format="dummy", max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
              skip_tokenizer_init=True)
    prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in requests]
    sps = [SamplingParams(temperature=args.temperature, max_tokens=r.max_tokens, ignore_eos=True,
                          detokenize=False) for r in requests]
    llm.generate(prompts[:16], sps[:16], use_tqdm=False)  # warm-up
    best = None
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sps, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if best is None or dt < best["seconds"]:
            best = {"seconds": dt, "tokens": tokens, "tok_s": tokens / dt}
    return best
