"""Where a GPU run spends its time: step-kind totals from the engine's step records and the
top CUDA kernels of a window of steps (torch profiler). A diagnosis tool, not a benchmark.

    python3 scripts/gpu_profile.py --model qwen3-0.6b --scenario workload   # nano-vllm workload
    python3 scripts/gpu_profile.py --model qwen3-0.6b --scenario bs1        # batch-1 decode
    python3 scripts/gpu_profile.py --model deepseek-v2-lite --windows 0:2,300:20 --no-summary
    python3 scripts/gpu_profile.py --model qwen3-0.6b --level 3 --windows 0:3   # the compiled prefill steps
    python3 scripts/gpu_profile.py --scenario prefill --prompt-len 512 --windows 0:1  # one request's prefill (TTFT)
    python3 scripts/gpu_profile.py --model llama-3.1-8b --scenario bs1 --quantization w4a16 --no-summary
        # the kernels of the first two (prefill) steps and of 20 steps after step 300
"""
from __future__ import annotations

import argparse

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from atom import LLM, SamplingParams
from atom.benchmarks.workloads import (MODEL_CONFIGS, mixed_workload, nano_vllm_workload, prefill_requests,
                                      write_model_config)


def step_summary(steps) -> str:
    kinds = {"prefill (or mixed)": steps[steps.prefill_tokens > 0], "decode": steps[steps.prefill_tokens == 0]}
    lines = [f"{len(steps)} steps, {steps.latency.sum():.3f} s"]
    for name, s in kinds.items():
        host = {k: s[k].mean() * 1e3 for k in ("schedule_s", "prepare_s", "launch_s", "sample_s", "post_s") if k in s}
        lines.append(f"  {name}: {len(s)} steps, {s.latency.sum():.3f} s, mean {s.latency.mean() * 1e3:.3f} ms, "
                     f"mean seqs {s.num_seqs.mean():.1f}; host ms " + ", ".join(f"{k}={v:.3f}" for k, v in host.items()))
    return "\n".join(lines)


def gpu_busy(prof) -> str:
    """How much of the window's GPU timeline (first kernel start to last kernel end) had a
    kernel or copy running: the rest is bubbles between kernels and between steps."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return "no GPU events"
    busy, (cur_s, cur_e) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy, cur_s = busy + cur_e - cur_s, s
        cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, e in spans) - spans[0][0]
    return (f"GPU busy {busy / 1e3:.2f} ms of a {span / 1e3:.2f} ms window ({100 * busy / span:.1f}%), "
            f"{len(spans)} kernels and copies")


def largest_gaps(prof, count: int = 5) -> str:
    """The window's longest idle stretches of the GPU, each with the kernels either side: a
    gap before a step's first copy is the host preparing (or waiting to enqueue) that step."""
    evs = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA
                  and e.time_range.end > e.time_range.start), key=lambda e: e.time_range.start)
    gaps, end, last = [], None, None
    for e in evs:
        if end is not None and e.time_range.start > end:
            gaps.append((e.time_range.start - end, last.name, e.name))
        if end is None or e.time_range.end > end:
            end, last = e.time_range.end, e
    gaps.sort(reverse=True)
    total = sum(g for g, _, _ in gaps)
    lines = [f"idle: {total / 1e3:.2f} ms in {len(gaps)} gaps; the longest:"]
    lines += [f"  {g:8.1f} us  after {a[:50]}  before {b[:50]}" for g, a, b in gaps[:count]]
    return "\n".join(lines)


def kernel_sequence(prof, limit: int) -> str:
    """The first `limit` kernels and copies of the window in launch order, with their times:
    what one layer of a step runs, kernel by kernel."""
    evs = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA
                  and e.time_range.end > e.time_range.start), key=lambda e: e.time_range.start)
    return "\n".join(f"{i:4d} {(e.time_range.end - e.time_range.start):8.2f} us  {e.name[:110]}"
                     for i, e in enumerate(evs[:limit]))


def kernel_table(engine, num_steps: int, sequence: int = 0) -> str:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            engine.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
    seq = f"\nthe first {sequence} kernels in order:\n" + kernel_sequence(prof, sequence) if sequence else ""
    return gpu_busy(prof) + "\n" + largest_gaps(prof) + "\n" + table + seq


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODEL_CONFIGS))
    ap.add_argument("--scenario", choices=["workload", "bs1", "prefill"], default="workload",
                    help="prefill: one request at a time, --prompt-len tokens, one output token (what a lone request's TTFT holds)")
    ap.add_argument("--prompt-len", type=int, default=512, help="prefill scenario: prompt tokens")
    ap.add_argument("--repeats", type=int, default=20, help="prefill scenario: requests in the summary")
    ap.add_argument("--windows", default="300:20",
                    help="profiled windows as first_step:steps, comma-separated (steps before a window run unprofiled)")
    ap.add_argument("--level", type=int, default=0, help="compilation level (0-3)")
    ap.add_argument("--graph-mode", default=None, help="cudagraph_mode (default: the level's)")
    ap.add_argument("--quantization", default="bf16",
                    help="a format of atom.benchmarks.quant_formats (the model folder's quantization_config)")
    ap.add_argument("--sequence", type=int, default=0,
                    help="also list each window's first N kernels in launch order (one layer's kernels)")
    ap.add_argument("--no-summary", dest="summary", action="store_false",
                    help="skip the whole-workload run that gives the per-kind step totals (a short warm-up instead)")
    args = ap.parse_args()
    windows = sorted((int(a), int(b)) for a, b in (w.split(":") for w in args.windows.split(",")))
    path = write_model_config(args.model, quantization=args.quantization)
    cc = {"level": args.level, **({"cudagraph_mode": args.graph_mode} if args.graph_mode else {})}
    vocab = MODEL_CONFIGS[args.model]["vocab_size"]
    if args.scenario == "workload":
        llm = LLM(path, load_dummy="xavier", max_model_len=4096, enable_log_stats=False,
                  max_num_seqs=512, max_num_batched_tokens=16384,
                  compilation_config=cc)
        reqs = nano_vllm_workload(256)
        sps = [SamplingParams(temperature=0.6, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    elif args.scenario == "prefill":
        llm = LLM(path, load_dummy="xavier", max_model_len=4096, enable_log_stats=False,
                  compilation_config=cc)
        reqs = prefill_requests(args.prompt_len, args.repeats + 1, vocab)
        sps = [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)] * len(reqs)
    else:
        llm = LLM(path, load_dummy="xavier", max_model_len=2048, enable_log_stats=False, max_num_seqs=8,
                  compilation_config={"cudagraph_capture_sizes": [1], **cc})
        reqs = mixed_workload(1, (128, 128), (512, 512), vocab, seed=1)
        sps = [SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)]
        windows = [(min(first, 100), n) for first, n in windows]
    prompts = [r.prompt_token_ids for r in reqs]
    if args.summary and args.scenario == "prefill":  # one at a time: each step holds one prefill
        for p, sp in zip(prompts[:-1], sps):
            llm.generate([p], sp, use_tqdm=False)
        print(step_summary(llm.stats.steps().iloc[2:]), flush=True)  # past the first (warm-up) steps
        prompts, sps = prompts[-1:], sps[-1:]  # a prompt not in the prefix cache for the window
    elif args.summary:
        llm.generate(prompts, sps, use_tqdm=False)  # warm-up and the step records
        print(step_summary(llm.stats.steps()), flush=True)
    else:  # kernels compiled, graphs captured
        warm = mixed_workload(16, (64, 512), (16, 64), vocab, seed=1)
        llm.generate([r.prompt_token_ids for r in warm],
                     SamplingParams(temperature=0.6, max_tokens=64, ignore_eos=True), use_tqdm=False)
    engine = llm.engine
    from atom.outputs import RequestOutputKind
    engine.default_output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate: no per-step text
    for p, sp in zip(prompts, sps):
        engine.add_request(p, sp)
    done = 0
    for first, n in windows:
        for _ in range(first - done):
            engine.step()
        print(f"kernels of {n} steps from step {first}:")
        print(kernel_table(engine, n, args.sequence), flush=True)
        done = first + n


if __name__ == "__main__":
    main()
