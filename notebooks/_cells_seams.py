"""Cells of notebook 08: the engine's parts seen from a notebook (see _build.py)."""

from _cells_engine import SETUP

PARTS = [
    ("md", """
# 08 · The engine's parts: linear methods, KV-cache specs, the kernel plan, streaming

Every layer gets its behaviour from an object it is handed: a method per linear layer
(from the quantization config), a backend per attention layer (which declares what its KV
cache stores), and the engine's kernel plan (start-up kernel choices and fusions). Here we
look at each on the embedded model, then stream a request step by step and run a step
that verifies two draft tokens at once.
"""),
    ("code", SETUP + """
from atom import LLM, SamplingParams
from atom.viz import kernel_plan_frame, kv_cache_frame, linear_methods_frame
llm = LLM("embedded", max_model_len=512, enable_log_stats=False, num_kvcache_blocks=64)
runner = llm.engine.runner
runner
"""),
    ("md", "## A method per linear layer\nLayer, method, format and bytes; the bytes add up to what the layers hold."),
    ("code", """
methods = linear_methods_frame(llm)
print(methods.head(5).to_string())
by_class = methods.groupby("class")["bytes"].sum() / 2**20
ax = by_class.plot.barh(title="MiB of weights by layer class")
assert set(methods["method"]) == {"unquantized"}
assert len(methods) == 4 * llm.config.hf_config.num_hidden_layers + 1  # + the LM head
ax.figure
"""),
    ("md", "## KV-cache specs\nEach attention layer's backend declares what it stores per token; the manager sized all of them from one budget."),
    ("code", """
kv = kv_cache_frame(llm)
print(runner.kv_cache_manager)
print(kv.head(3).to_string())
assert (kv["kind"] == "full").all() and kv["bytes"].sum() == runner.kv_cache_config.nbytes
"""),
    ("md", """
## The attention kernel's tiles by decode batch
`pick_attention_config` decides from shapes only (so that a step's launch can be captured in
a CUDA graph): KV segments for small batches, and over an FP8 cache 128-key tiles from
`FP8_WIDE_TILE_MIN_SEQS` sequences (the bytes a tile of bf16's 64 keys; docs/perf has the
long-context timings). Llama-3.1-8B's attention shape, an H200's 132 SMs off the GPU.
"""),
    ("code", """
import pandas as pd, torch
from atom.model_ops.attention.triton_unified import FP8_WIDE_TILE_MIN_SEQS, pick_attention_config
rows = []
for seqs in (1, 8, 16, 17, 48, 256):
    for kv in ("bf16", "fp8"):
        c = pick_attention_config(seqs, seqs, 32, 8, 128, 1, torch.device("cpu"), kv_fp8=kv == "fp8")
        rows.append(dict(sequences=seqs, kv=kv, TILE_N=c["TILE_N"], segments=c["num_splits"]))
tiles = pd.DataFrame(rows).pivot(index="sequences", columns="kv", values=["TILE_N", "segments"])
wide = tiles[("TILE_N", "fp8")] == 128
assert (tiles[("TILE_N", "bf16")] == 64).all() and (wide == (tiles.index >= FP8_WIDE_TILE_MIN_SEQS)).all()
tiles
"""),
    ("md", """
## The kernel plan
On a CPU the plan is the torch references, without fusions or timed choices; on a GPU it
holds the one-row GEMV and cuBLASLt choices with their timings. A plan saves to JSON and
loads into another engine (`runner.install_plan(KernelPlan.load(path))`).
"""),
    ("code", """
import tempfile, os
from atom.tuning import KernelPlan
print(runner.plan)
path = runner.plan.save(os.path.join(tempfile.mkdtemp(), "plan.json"))
again = KernelPlan.load(path)
assert again.to_dict() == runner.plan.to_dict()
kernel_plan_frame(llm)
"""),
    ("md", "## Streaming: `LLMEngine.step()` returns every request that advanced\nIts new tokens and new text (incremental, UTF-8 safe); the pieces add up to the final text."),
    ("code", """
engine = llm.engine
rid = engine.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=12))
pieces, final = [], None
while not engine.is_finished():
    for out in engine.step():
        if out.request_id == rid:
            pieces.append(out.new_text)
            final = out if out.finished else final
print(pieces)
assert "".join(pieces) == final.text and final.finished
"""),
    ("md", """
## A multi-token step
A proposer guesses the next tokens; the step runs them as extra query tokens, keeps those the
model itself samples and takes its own token at the first mismatch. Here the guesses are the
greedy continuation found by a first run, with a wrong guess at the end.
"""),
    ("code", """
prompt = llm.tokenizer.encode("The capital of France is")
greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
plain = llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids

class Guess:  # proposes the known continuation, then a wrong token
    def propose(self, seqs):
        out = []
        for s in seqs:
            done = s.num_output_tokens
            out.append(plain[done:done + 2] + [0])
        return out

engine.proposer = Guess()
drafted = llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids
engine.proposer = None
steps = llm.stats.steps().tail(4)
print(plain, drafted)
print(steps[["num_seqs", "decode_tokens", "num_sampled"]].to_string())
assert drafted == plain and steps["num_sampled"].max() > 1  # same tokens, several per step
"""),
]

NOTEBOOKS = {"08_engine_parts": PARTS}
