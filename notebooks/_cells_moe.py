"""Cells of notebook 10: MoE routing on a tiny Qwen3-MoE (see _build.py)."""

from _cells_engine import SETUP

MOE = [
    ("md", """
# 10 · MoE routing: which expert gets which token, layer by layer, step by step

A mixture-of-experts layer sends each token to `top_k` of its `E` experts. ATOM's `FusedMoE`
takes the router's logits, picks the experts with a `TopK` (softmax top-k, optionally
renormalised; sigmoid and grouped choice for DeepSeek), and runs the experts through its
`MoEMethod` with the kernel the engine's plan chose. With `record_expert_load=True` the engine
counts, in every step, how many tokens each expert of each layer received.

Here on a tiny random Qwen3-MoE (3 layers, the middle one dense, 8 experts, top-2), built
with transformers in a temporary folder: nothing is downloaded.
"""),
    ("code", SETUP + """
import tempfile
import torch, transformers
cfg = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                  max_position_embeddings=1024, initializer_range=0.4, tie_word_embeddings=False)
torch.manual_seed(0)
hf_model = transformers.Qwen3MoeForCausalLM(cfg).eval()
path = tempfile.mkdtemp(prefix="tiny-qwen3-moe-")
hf_model.save_pretrained(path)
sorted(p.name for p in __import__("pathlib").Path(path).iterdir())
"""),
    ("md", "## The engine and its MoE layers\nLayers 0 and 2 are sparse; layer 1 keeps a dense MLP (`mlp_only_layers`)."),
    ("code", """
from atom import LLM, SamplingParams
from atom.viz import moe_layers_frame
llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=64, max_num_batched_tokens=64, record_expert_load=True)
layers = moe_layers_frame(llm)
print(layers[["layer", "experts", "top_k", "width", "method", "bytes"]].to_string())
assert layers["layer"].tolist() == ["model.layers.0.mlp.experts", "model.layers.2.mlp.experts"]
assert (layers["bytes"] == 8 * 3 * 64 * 32 * 4).all()   # E x (gate, up, down) x H x I, fp32
llm.engine.runner.model.model.layers[0].mlp
"""),
    ("md", """
## The router alone
`TopK` is a plain module: logits in, (weights, expert ids) out. With `renormalize` (Qwen3's
`norm_topk_prob`, Mixtral always) the chosen probabilities sum to one.
"""),
    ("code", """
from atom.model_ops.moe import TopK
logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 0.1, 3.0, 2.9]])
for renorm in (False, True):
    w, ids = TopK(4, 2, renormalize=renorm)(logits)
    print(f"renormalize={renorm}: ids {ids.tolist()}  weights {w.numpy().round(3).tolist()}")
assert torch.allclose(w.sum(-1), torch.ones(2)) and ids.tolist() == [[0, 1], [2, 3]]
"""),
    ("md", "## Generate, and check against transformers\nGreedy tokens from ATOM and from transformers on the same weights (fp32) are identical."),
    ("code", """
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 30, 70, 120)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
ref = [hf_model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(p):].tolist()
       for p in prompts]
assert [o.token_ids for o in outs] == ref
print(len(llm.stats.steps()), "steps;", [len(o.token_ids) for o in outs], "tokens each")
"""),
    ("md", """
## Tokens per expert, per layer, per step
`llm.stats.expert_load()` has one row per (step, layer, expert). Each token counts once per
chosen expert, so a layer's counts in a step add up to the step's tokens times `top_k`.
"""),
    ("code", """
from atom.viz import expert_load_frame, expert_load_summary, plot_expert_load
load = expert_load_frame(llm)
print(load.head(8).to_string())
steps = llm.stats.steps().set_index("step")
per_step = load.groupby(["step", "layer"])["tokens"].sum().unstack()
for layer in per_step.columns:
    assert (per_step[layer] == 2 * (steps["prefill_tokens"] + steps["decode_tokens"])).all()
expert_load_summary(llm)
"""),
    ("md", "## The plot\nLeft: each layer's share of tokens per expert over the run. Right: the busiest expert's load over the mean, per step (1 = balanced)."),
    ("code", """
fig = plot_expert_load(llm)
assert len(fig.axes) >= 2
fig
"""),
    ("md", """
## How the experts run
On a CPU the plan picks the torch reference (a loop over the experts that got tokens); on a
GPU the Triton grouped GEMM over (token, expert) pairs sorted by expert. Sorting pays only
when an expert gets more than one pair on average (`T * top_k > E`); below that the unsorted
path multiplies each pair directly. `moe_align` shows the sorted layout: blocks of `BLOCK_M`
pairs, each block one expert's, padded.
"""),
    ("code", """
import pandas as pd
from atom.model_ops.moe.experts_triton import moe_align, skips_sorting
plan = llm.engine.runner.plan
print(plan, "->", plan.experts_kernel(torch.zeros(1, 64)))
ids = torch.tensor([[3, 1], [1, 0], [3, 1], [2, 3]])
pairs, block_expert = moe_align(ids, num_experts=4, block_m=4)
print(pd.DataFrame(pairs.view(-1, 4).numpy(), index=[f"expert {e}" for e in block_expert.tolist()]).replace(ids.numel(), "·"))
rule = pd.DataFrame([{"model": m, "tokens": T, "path": "sorted" if not skips_sorting(T, k, E) else "unsorted"}
                     for m, E, k in (("Qwen3-30B-A3B", 128, 8), ("Mixtral-8x7B", 8, 2)) for T in (1, 4, 16, 64)])
assert plan.experts_kernel(torch.zeros(1, 64)) == "reference"
assert rule.set_index(["model", "tokens"]).loc[("Qwen3-30B-A3B", 16), "path"] == "unsorted"
rule.pivot(index="tokens", columns="model", values="path")
"""),
    ("md", """
## The tuned tiles
On a GPU the tiles of the grouped GEMM, and whether to sort at all, come from a file per
(experts, width, hidden, dtype, GPU) that `python -m atom.tuning.moe_tune` writes from
CUDA-graph timings. DeepSeek-V2-Lite's H200 file: short tiles (16 rows) while an expert gets a
few pairs, taller ones from ~200 tokens; the sorted path wins at every count there.
"""),
    ("code", """
from atom.model_ops.moe.tile_configs import CONFIG_DIR, config_file_name, tiles_frame
tiles = tiles_frame(CONFIG_DIR / config_file_name(64, 1408, 2048, "bfloat16", "NVIDIA H200"))
assert set(tiles.path) == {"sorted"}
tiles[["tokens", "BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "sorted_us", "unsorted_us"]]
"""),
    ("md", """
## What a decode step reads
A decode step reads the dense weights plus the experts its tokens activate: with B tokens,
about E (1 - (1 - k/E)^B) experts per sparse layer. For Qwen3-30B-A3B that is 3.4 B
parameters at batch 1 and nearly all 30.5 B by batch 64 (`atom.benchmarks.roofline`).
"""),
    ("code", """
from atom.benchmarks.roofline import model_cost
from atom.benchmarks.workloads import MODEL_CONFIGS
c = model_cost(MODEL_CONFIGS["qwen3-30b-a3b"])
batches = [1, 2, 4, 8, 16, 32, 64, 128, 256]
active = pd.Series([c.step_weight_params(b) / 1e9 for b in batches], index=batches, name="B params read per step")
assert 3.0 < active[1] < 3.6 and active[256] > 30
ax = active.plot(logx=True, marker="o", title="Qwen3-30B-A3B: weights a decode step reads")
ax.set_xlabel("tokens in the step"); ax.set_ylabel("billion parameters")
ax.figure
"""),
]

MOE += [
    ("md", """
## Where a run's time went
The engine records every step (`llm.stats.steps()`); the throughput benchmark splits a run
into steps with prompt tokens and decode-only steps (each step's time runs to the start of
the next) and averages the decode steps by batch size (`step_breakdown`, printed under its
table and kept in its JSON). On the H200 the MoE workloads spend ~12% of their time in 9
prefill steps and the rest in ~1,000 decode steps whose time barely falls with the batch:
every step reads nearly all expert weights.
"""),
    ("code", """
from atom.benchmarks.throughput import step_breakdown
split = step_breakdown(llm, first_step=0)
assert split["steps"] == len(llm.stats.steps()) == split["prefill_steps"] + split["decode_steps"]
assert split["prompt_tokens"] == sum(len(p) for p in prompts)
print({k: v for k, v in split.items() if k != "decode_ms_by_batch"})
pd.DataFrame(split["decode_ms_by_batch"]).T
"""),
    ("md", """
## DeepSeek's shared experts
DeepSeek's MoE block adds always-on shared experts to the routed ones. On a GPU the plan's
"shared_overlap" runs them on a second CUDA stream while the routed experts' grouped GEMMs
stream their weights (decode batches up to `SHARED_OVERLAP_MAX_TOKENS`); `describe_moe_layers`
says where (`shared_stream`). The plan of a CPU engine runs the torch reference: no fusions.
"""),
    ("code", """
from atom.tuning.plan import SHARED_OVERLAP_MAX_TOKENS
from atom.tuning.fusions import default_fusions
print("GPU plan fusions:", default_fusions("triton"))
print("this engine's plan:", plan.fusions, "| overlap up to", SHARED_OVERLAP_MAX_TOKENS, "tokens")
assert "shared_overlap" in default_fusions("triton") and plan.fusions == ()
"""),
    ("md", """
## MLA decode: the launch per batch, and what the H200 measured
DeepSeek's attention decodes over a latent cache (one 576-wide row a token) with a Triton
split-KV kernel. Its launch depends on the batch's shape only (`pick_mla_config`, so a CUDA
graph replays it): tiles, warps, pipeline stages (the latent tiles a program keeps in flight)
and the number of context segments per sequence. The checked-in sweep of the H200
(`scripts/mla_decode_sweep.py`) times the alternatives at DeepSeek-V2-Lite's shape.
"""),
    ("code", """
import json, pathlib
import atom
from atom.viz.mla_frames import mla_launch_frame, mla_sweep_frame
launch = mla_launch_frame([1, 8, 32, 64, 128, 256])
print(launch[["batch", "TILE_N", "num_warps", "num_stages", "num_splits", "programs_per_sm", "tiles_in_flight", "tiles_kib"]].to_string())
sweep_file = pathlib.Path(atom.__file__).resolve().parents[1] / "docs/perf/raw/2026-12-03g-h200-mla-sweep-pipelined.json"
if sweep_file.exists():
    sweep = mla_sweep_frame(str(sweep_file))
    table = sweep[sweep.is_default | sweep.is_best].pivot_table(index="case", columns="is_best", values="us", aggfunc="min")
    table.columns = ["default us" if not c else "best us" for c in table.columns]
    assert (sweep.of_peak > 0).all() and (sweep.of_peak < 1).all()   # latent-cache bandwidth below HBM's
    display(table)
assert (launch.tiles_in_flight >= 1).all() and launch.num_splits.is_monotonic_decreasing
"""),
]

NOTEBOOKS = {"10_moe_routing": MOE}
