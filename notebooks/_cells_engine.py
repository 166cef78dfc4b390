"""Cells of notebooks 01-04: the engine and its components (see _build.py)."""

SETUP = """
import logging, os, warnings
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message="IProgress not found")
logging.basicConfig(level=logging.WARNING)
import atom.viz  # also shows matplotlib Figures returned by a cell as images
from rich.console import Console
console = Console(width=100)
"""

QUICKSTART = [
    ("md", """
# 01 · Quickstart: `LLM.generate` on the embedded model

ATOM ships a default model, SmolLM2-135M-Instruct (`LLM("embedded")`), so everything here
runs offline on a CPU. We generate, look at what each request returned, then at what the
engine recorded step by step.
"""),
    ("code", SETUP + """
from atom import LLM, SamplingParams
llm = LLM("embedded", max_model_len=1024, enable_log_stats=False)
llm
"""),
    ("md", "## Chat: greedy answers\n`chat` applies the model's chat template, then calls `generate`."),
    ("code", """
questions = ["What is the capital of France?", "What is 2+2?"]
outs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
for q, o in zip(questions, outs):
    print(f"{q!r} -> {o.text!r} ({o.num_output_tokens} tokens, {o.finish_reason})")
"""),
    ("code", """
assert "paris" in outs[0].text.lower()
assert "4" in outs[1].text
"""),
    ("md", """
## Sampling: temperature, top-p, seeds
A request with a `seed` draws from its own generator: the same seed gives the same tokens,
whatever else shares the batch.
"""),
    ("code", """
sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, seed=1234)
a, b, c = llm.generate(["Once upon a time", "Once upon a time", "The weather today"], sp, use_tqdm=False)
print(repr(a.text)); print(repr(c.text))
print(f"ttft {a.ttft * 1e3:.0f} ms, tpot {a.tpot * 1e3:.0f} ms, prompt tokens {a.num_prompt_tokens}")
"""),
    ("code", """
assert a.token_ids == b.token_ids, "same seed, same tokens"
assert len(a.token_ids) <= 12 and a.ttft > 0
"""),
    ("md", "## What the engine recorded\nOne row per step (`llm.stats.steps()`), one per finished request (`llm.stats.requests()`). `atom.viz` adds derived columns and plots."),
    ("code", """
from atom.viz import steps_frame, requests_frame, summary_table, plot_chunk_latency
steps, reqs = steps_frame(llm), requests_frame(llm)
steps[["step", "num_seqs", "prefill_tokens", "decode_tokens", "chunk_sizes", "latency_ms", "kv_usage"]].head(8)
"""),
    ("code", """
console.print(summary_table(llm))
reqs[["request_id", "prompt_tokens", "output_tokens", "ttft_ms", "tpot_ms", "finish_reason"]]
"""),
    ("code", """
assert steps["num_sampled"].sum() == reqs["output_tokens"].sum() == sum(o.num_output_tokens for o in outs + [a, b, c])
assert len(reqs) == 5
plot_chunk_latency(llm)
"""),
]

CONFIG = [
    ("md", """
# 02 · `Config`, `EngineArgs` and what validation says

`Config` holds everything the engine needs. It is built (and validated) before any weight
is loaded; a bad value raises a `ValueError` naming the field, the value and what is allowed.
`EngineArgs` is the command line: every flag, parsed into a `Config`.
"""),
    ("code", SETUP + """
import argparse, dataclasses
import pandas as pd
import transformers
from atom import Config, EngineArgs
from atom.model_loader.embedded import ensure_embedded_model
path = ensure_embedded_model()
cfg = Config(model=path, max_model_len=1024, max_num_seqs=32)
cfg
"""),
    ("md", "## Derived fields\nSome fields come from the model's HF config (`max_model_len` when not given, dtype, EOS ids); others are derived (CUDA-graph capture sizes)."),
    ("code", """
derived = {
    "architectures": cfg.hf_config.architectures, "max_model_len": cfg.max_model_len,
    "torch_dtype": cfg.torch_dtype, "eos_token_id": cfg.eos_token_id,
    "kv_cache_block_size": cfg.kv_cache_block_size, "capture_sizes": cfg.capture_sizes[:10] + ["..."],
    "quant method": cfg.quant_config.get_name() or "(none)",
}
pd.Series(derived, name="value").to_frame()
"""),
    ("code", """
assert cfg.max_model_len == 1024 and cfg.max_num_seqs == 32
assert cfg.hf_config.architectures == ["LlamaForCausalLM"]
assert cfg.capture_sizes[:8] == list(range(1, 9))
eager = Config(model=path, enforce_eager=True)
assert eager.capture_sizes == [] and eager.max_model_len == cfg.hf_config.max_position_embeddings
"""),
    ("md", "## Without touching the disk\nPassing `hf_config` skips loading anything: handy to explore settings for a model you do not have."),
    ("code", """
big = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                               max_position_embeddings=131072)
cfg8b = Config(model="llama-like-8b", hf_config=big, max_model_len=8192, kv_cache_block_size=32)
assert cfg8b.max_model_len == 8192 and cfg8b.kv_cache_block_size == 32
cfg8b.max_model_len, cfg8b.kv_cache_block_size
"""),
    ("md", "## The command line: `EngineArgs`"),
    ("code", """
parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
args = parser.parse_args(["--model", path, "--max-num-seqs", "8", "--enable-prefix-caching",
                          "--enforce-eager", "--max-model-len", "2048"])
ea = EngineArgs.from_cli_args(args)
cfg_cli = ea.create_engine_config()
changed = [(f.name, getattr(ea, f.name), f.default) for f in dataclasses.fields(EngineArgs)
           if getattr(ea, f.name) != f.default]
pd.DataFrame(changed, columns=["field", "value", "default"])  # the flags given above
"""),
    ("code", """
assert (cfg_cli.max_num_seqs, cfg_cli.enable_prefix_caching, cfg_cli.max_model_len) == (8, True, 2048)
assert cfg_cli.capture_sizes == []  # --enforce-eager: no CUDA graphs
"""),
    ("md", "## What validation says\nEach bad value is refused before anything heavy happens, with a message that says what to change."),
    ("code", """
bad = {"max_num_seqs": 0, "kv_cache_block_size": 7, "gpu_memory_utilization": 1.5,
       "kv_cache_dtype": "fp4", "max_num_batched_tokens": 0, "scheduler_delay_factor": -1}
errors = {}
for field, value in bad.items():
    try:
        Config(model=path, **{field: value})
    except ValueError as e:
        errors[field] = str(e)
pd.set_option("display.max_colwidth", None)
pd.DataFrame({"field": list(errors), "message": list(errors.values())})
"""),
    ("code", """
assert set(errors) == set(bad), f"not refused: {set(bad) - set(errors)}"
for field, message in errors.items():
    assert message.startswith(f"{field}="), message  # names the field and the value
# Not every surprise is an error: a max_model_len above the model's positions is clamped.
assert Config(model=path, max_model_len=10**7).max_model_len == cfg.hf_config.max_position_embeddings
try:
    Config(model="/no/such/model")
except ValueError as e:
    print(e)
    assert "model" in str(e)
else:
    raise AssertionError("a missing model folder must be refused")
"""),
    ("md", "The same errors reach the command line: `EngineArgs(block_size=7).create_engine_config()` raises before the model loads."),
    ("code", """
try:
    EngineArgs(model=path, block_size=7).create_engine_config()
except ValueError as e:
    caught = e
print(caught)
assert "block_size" in str(caught) or "kv_cache_block_size" in str(caught)
"""),
]

BLOCKS = [
    ("md", """
# 03 · `BlockManager` by hand: hashes, prefix hits, eviction

The block manager keeps the paged KV cache's bookkeeping: which blocks each sequence owns,
and -- with prefix caching -- which full blocks hold which tokens, under a hash chained over
the previous block. No model and no tensors are needed to watch it work.
"""),
    ("code", SETUP + """
import pandas as pd
from atom.model_engine.block_manager import BlockManager, chain_hash
from atom.model_engine.sequence import Sequence

def blocks_table(bm):
    return pd.DataFrame([(b.block_id, b.ref_count, b.hash is not None, b.token_ids, b.block_id in bm.free_blocks)
                         for b in bm.blocks], columns=["block", "refs", "hashed", "tokens", "free"])

def prefill(bm, seq):
    \"\"\"What the scheduler + runner do for a whole prompt in one step.\"\"\"
    cached = bm.allocate_prefix(seq)
    bm.append_slots(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.publish_full_blocks(seq)
    return cached

bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
bm
"""),
    ("md", "## One sequence: full blocks get published under chained hashes"),
    ("code", """
a = Sequence(list(range(1, 11)))          # 10 tokens: 2 full blocks + 2 tokens
print("cached:", prefill(bm, a), "| block table:", a.block_table)
assert a.block_hashes[0] == chain_hash(-1, [1, 2, 3, 4])
assert a.block_hashes[1] == chain_hash(a.block_hashes[0], [5, 6, 7, 8])
blocks_table(bm).head(4)
"""),
    ("md", "## A second sequence with the same first 8 tokens hits both blocks\nThe last prompt token is never served from the cache (its logits are needed), so at most `(n-1)//block_size` blocks can hit."),
    ("code", """
b = Sequence(list(range(1, 9)) + [99, 98, 97])
cached_b = prefill(bm, b)
print("cached:", cached_b, "| a:", a.block_table, "| b:", b.block_table, "|", bm)
assert cached_b == 8 and b.block_table[:2] == a.block_table[:2]
assert bm.blocks[a.block_table[0]].ref_count == 2
"""),
    ("md", "## Freed blocks keep their hash until reused\nA block whose count drops to 0 goes to the free list with its contents; a later sequence can still hit it."),
    ("code", """
bm.free(a); bm.free(b)
c = Sequence(list(range(1, 9)) + [5])
cached_c = prefill(bm, c)
print("after free, c cached:", cached_c)
assert cached_c == 8
bm.free(c)
blocks_table(bm)
"""),
    ("md", "## Eviction: new content takes the least recently freed blocks\nFilling the cache with other tokens reuses the free blocks, oldest first; the hashes they held are dropped."),
    ("code", """
fillers = [Sequence([1000 + 10 * i + j for j in range(8)]) for i in range(4)]  # 4 x 2 blocks = the whole cache
for s in fillers:
    prefill(bm, s)
for s in fillers:
    bm.free(s)
d = Sequence(list(range(1, 9)) + [5])
print("after eviction, d cached:", prefill(bm, d), "|", bm)
assert d.num_cached_tokens == 0
bm.free(d)
"""),
    ("md", """
## A stream of requests: hit rate against cache size
Two hundred requests, each starting with one of six 64-token system prompts followed by
a 20-token question; 4 run at a time. At most 64 of each prompt's 80 looked-up tokens can
hit (0.8). With enough blocks the system prompts stay cached; with too few, they are
evicted between uses.
"""),
    ("code", """
import random
from collections import deque

def simulate(num_blocks, n=200, live=4, num_systems=6, seed=0):
    rng = random.Random(seed)
    systems = [[rng.randrange(10_000) for _ in range(64)] for _ in range(num_systems)]
    bm = BlockManager(num_blocks, 16, enable_prefix_caching=True)
    running, rows = deque(), []
    for i in range(n):
        if len(running) == live:
            bm.free(running.popleft())
        s = Sequence(rng.choice(systems) + [rng.randrange(10_000) for _ in range(20)])
        cached = prefill(bm, s)
        running.append(s)
        rows.append({"request_id": str(i), "prompt_tokens": s.num_tokens, "output_tokens": 0, "cached_tokens": cached})
    return pd.DataFrame(rows), bm

big, bm_big = simulate(num_blocks=64)
small, bm_small = simulate(num_blocks=24)
pd.DataFrame({"blocks": [64, 24], "hit rate": [bm_big.hit_rate, bm_small.hit_rate],
              "hit tokens": [bm_big.num_hit_tokens, bm_small.num_hit_tokens]})
"""),
    ("code", """
from matplotlib.figure import Figure
from atom.viz import plot_prefix_cache_hit_rate, windowed_hit_rate
fig = Figure(figsize=(10, 3.6), layout="constrained")
ax1, ax2 = fig.subplots(1, 2, sharey=True)
plot_prefix_cache_hit_rate(big, window=20, block_size=16, ax=ax1); ax1.set_title("64 blocks")
plot_prefix_cache_hit_rate(small, window=20, block_size=16, ax=ax2); ax2.set_title("24 blocks: evictions")
fig
"""),
    ("code", """
w_big = windowed_hit_rate(big, 200, block_size=16)["hit_rate"].iloc[-1]
assert abs(w_big - bm_big.hit_rate) < 1e-9   # the frame's hit rate is the block manager's
assert bm_big.hit_rate > 0.7 > 0.6 > bm_small.hit_rate  # 6 x 4 system blocks stay in 64 blocks, not in 24
"""),
]

SCHEDULER = [
    ("md", """
# 04 · `Scheduler` and chunked prefill

Each step carries at most `max_num_seqs` sequences and `max_num_batched_tokens` tokens.
Running sequences go first (a decode costs one token); a long prompt is split into chunks
that fit the remaining budget, so prefills and decodes share steps. We drive a scheduler by
hand, then watch the real engine do the same on the embedded model.
"""),
    ("code", SETUP + """
import pandas as pd
from atom import SamplingParams
from atom.model_engine.block_manager import BlockManager
from atom.model_engine.scheduler import Scheduler
from atom.model_engine.sequence import Sequence

def drive(sched, max_steps=100):
    \"\"\"Schedule, 'run' (every sampling sequence emits token 7), postprocess; one row per step.\"\"\"
    rows = []
    for step in range(1, max_steps + 1):
        if sched.is_finished():
            break
        batch = sched.schedule()
        sampled = [[7] if s.samples_this_step else [] for s in batch.seqs]
        rows.append({"step": step, **{f"seq {s.seq_id}": n for s, n in zip(batch.seqs, batch.num_new_tokens)},
                     "tokens": batch.num_tokens, "preempted": batch.num_preempted})
        sched.postprocess(batch, sampled)
    return pd.DataFrame(rows).set_index("step").fillna(0).astype(int)

sp = SamplingParams(max_tokens=3, ignore_eos=True)
sched = Scheduler(BlockManager(64, 16), max_num_seqs=4, max_num_batched_tokens=32)
seqs = [Sequence([1] * n, sp) for n in (50, 20, 5)]
for s in seqs:
    sched.add(s)
trace = drive(sched)
trace
"""),
    ("code", """
cols = [f"seq {s.seq_id}" for s in seqs]
assert (trace["tokens"] <= 32).all()
assert trace[cols[0]].iloc[0] == 32 and trace[cols[0]].iloc[1] == 18   # 50 = 32 + 18
assert all(s.num_output_tokens == 3 for s in seqs)
"""),
    ("code", """
from matplotlib.figure import Figure
fig = Figure(figsize=(6.4, 3.2), layout="constrained")
ax = fig.add_subplot()
bottom = pd.Series(0, index=trace.index)
for c in cols:
    ax.bar(trace.index, trace[c], bottom=bottom, label=c)
    bottom += trace[c]
ax.axhline(32, color="gray", ls="--", lw=0.8, label="max_num_batched_tokens")
ax.set_xlabel("step"); ax.set_ylabel("tokens scheduled"); ax.legend(fontsize="small")
fig
"""),
    ("md", "## Preemption\nWith too few KV blocks, the most recently admitted sequence is preempted (its blocks freed) and recomputed later; its output is unchanged."),
    ("code", """
sched = Scheduler(BlockManager(num_blocks=6, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
tight = [Sequence([2] * 6, SamplingParams(max_tokens=8, ignore_eos=True)) for _ in range(3)]
for s in tight:
    sched.add(s)
t2 = drive(sched)
print(sched)
assert sched.num_preemptions > 0 and all(s.num_output_tokens == 8 for s in tight)
t2.T
"""),
    ("md", """
## The real engine: chunk sizes and step latency
The embedded model with `max_num_batched_tokens=64`: four prompts of 150, 90, 40 and 10
tokens are prefilled in chunks of at most 64 tokens, beside the decodes of the prompts
already done.
"""),
    ("code", """
import random
from atom import LLM
from atom.viz import steps_frame, plot_chunk_latency
llm = LLM("embedded", max_model_len=512, max_num_batched_tokens=64, enable_log_stats=False)
rng = random.Random(0)
prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (150, 90, 40, 10)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
steps = steps_frame(llm)
steps[["step", "num_seqs", "prefill_tokens", "decode_tokens", "chunk_sizes", "latency_ms"]]
"""),
    ("code", """
assert (steps["tokens"] <= 64).all() and steps["max_chunk"].max() == 64
assert steps["prefill_tokens"].sum() + steps["decode_tokens"].sum() == 290 + 4 * 7
assert all(o.num_output_tokens == 8 for o in outs)
plot_chunk_latency(llm)
"""),
]

NOTEBOOKS = {
    "01_quickstart": QUICKSTART,
    "02_config_and_cli": CONFIG,
    "03_block_manager_prefix_cache": BLOCKS,
    "04_scheduler_chunked_prefill": SCHEDULER,
}
