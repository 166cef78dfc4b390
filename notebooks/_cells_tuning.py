"""Cells of notebooks 05-07: quantization dispatch, CUDA graphs, roofline (see _build.py)."""

from _cells_engine import SETUP

QUANT = [
    ("md", """
# 05 · Quantization dispatch: which layer gets which `LayerQuantConfig`

`QuantizationConfig` reads `hf_config.quantization_config` and answers, per layer name,
how that layer is quantized: exclusions first, then per-layer patterns, then the global
spec. Here on two hand-written configs, an AMD Quark one and a compressed-tensors one --
no checkpoint needed.
"""),
    ("code", SETUP + """
import pandas as pd
import transformers
from atom.config import Config, QuantizationConfig
from atom.quant_spec import QuantType

LAYERS = ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_up_proj",
          "model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.o_proj", "model.layers.3.mlp.gate",
          "model.layers.3.mlp.experts.w13", "model.layers.3.mlp.down_proj", "lm_head"]

def dispatch(qc, layers=LAYERS):
    rows = []
    for name in layers:
        spec = qc.get_layer_quant_config(name)
        rows.append({"layer": name, "quant_type": spec.quant_type.name, "dtype": str(spec.quant_dtype).replace("torch.", ""),
                     "dynamic": spec.is_dynamic, "excluded": qc.is_excluded(name)})
    return pd.DataFrame(rows).set_index("layer")
"""),
    ("md", "## Quark: a global spec, per-layer patterns, exclusions"),
    ("code", """
QUARK = {
    "quant_method": "quark",
    "global_quant_config": {
        "weight": {"dtype": "fp8_e4m3", "qscheme": "per_channel", "is_dynamic": False},
        "input_tensors": {"dtype": "fp8_e4m3", "qscheme": "per_channel", "is_dynamic": False},
    },
    "layer_quant_config": {
        "*.mlp.experts.*": {"weight": {"dtype": "fp4", "qscheme": "per_group", "group_size": 32},
                            "input_tensors": {"dtype": "fp4", "qscheme": "per_group"}},
        "*.self_attn.o_proj": {"weight": {"dtype": "int8", "qscheme": "per_tensor"}},
    },
    "exclude": ["lm_head", "model.layers.0.mlp", "re:.*\\\\.mlp\\\\.gate$"],
}
quark = QuantizationConfig(transformers.PretrainedConfig(quantization_config=QUARK))
print(quark.get_name(), "| global:", quark.global_quant_config)
quark_table = dispatch(quark)
quark_table
"""),
    ("code", """
q = quark_table
assert q.loc["model.layers.3.self_attn.q_proj", "quant_type"] == "per_Token"          # global: per-channel fp8
assert not q.loc["model.layers.3.self_attn.q_proj", "dynamic"]
assert q.loc["model.layers.3.self_attn.o_proj", "dtype"] == "int8"                    # pattern *.self_attn.o_proj
assert q.loc["model.layers.3.mlp.experts.w13", "quant_type"] == "per_1x32"            # fp4 forces 1x32 groups
assert q.loc["model.layers.0.mlp.gate_up_proj", "excluded"]                            # parent module excluded
assert q.loc["model.layers.3.mlp.gate", "excluded"] and q.loc["lm_head", "excluded"]  # regex, exact name
assert q.loc["model.layers.0.self_attn.o_proj", "dtype"] == "int8"                    # layer 0 attention is not excluded
"""),
    ("md", "## compressed-tensors: config groups and an ignore list"),
    ("code", """
COMPRESSED = {
    "quant_method": "compressed-tensors",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
    "ignore": ["lm_head", "re:.*mlp.gate$"],
}
ct = QuantizationConfig(transformers.PretrainedConfig(quantization_config=COMPRESSED))
ct_table = dispatch(ct)
ct_table
"""),
    ("code", """
c = ct_table
quantized = c[~c["excluded"]]
assert set(quantized["quant_type"]) == {"per_Token"} and set(quantized["dtype"]) == {"float8_e4m3fn"}
assert quantized["dynamic"].all()                    # activations: dynamic per-token scales
assert c.loc["lm_head", "quant_type"] == "No" and c.loc["model.layers.3.mlp.gate", "excluded"]
"""),
    ("md", "## Checkpoint names vs ATOM's packed layers\nA checkpoint excludes `q_proj`; ATOM's layer is `qkv_proj`. `remap_layer_name` adds the packed names."),
    ("code", """
shard = QuantizationConfig(transformers.PretrainedConfig(quantization_config={**COMPRESSED, "ignore": ["model.layers.1.self_attn.q_proj"]}))
before = shard.is_excluded("model.layers.1.self_attn.qkv_proj")
shard.remap_layer_name()
after = shard.is_excluded("model.layers.1.self_attn.qkv_proj")
print("qkv_proj excluded before remap:", before, "| after:", after, "|", shard.exclude_layers)
assert (before, after) == (False, True)
"""),
    ("md", "## Through `Config`\n`Config` builds the `QuantizationConfig` from the model's config; the model's layers ask it for their spec."),
    ("code", """
hf = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=128, quantization_config=QUARK)
cfg = Config(model="quark-llama", hf_config=hf)
assert cfg.quant_config.get_name() == "quark"
layers = [f"model.layers.{i}.{m}" for i in range(4) for m in
          ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")] + ["lm_head"]
full = dispatch(cfg.quant_config, layers)
counts = full.groupby(["quant_type", "dtype"]).size().rename("layers")
counts.to_frame()
"""),
    ("code", """
from matplotlib.figure import Figure
fig = Figure(figsize=(6.4, 3.0), layout="constrained")
ax = fig.add_subplot()
labels = [f"{t}\\n{d}" for t, d in counts.index]
ax.bar(labels, counts.values, color="tab:blue")
ax.set_ylabel("linear layers"); ax.set_title("quark config on a 4-layer Llama: layers per spec")
assert counts.sum() == len(layers) and counts[("No", "bfloat16")] == 3   # lm_head + layer 0's two MLP layers
fig
"""),
    ("md", """
## Which 4-bit kernel runs a product
A W4A16 or MXFP4 layer's GPU kernel depends on the rows of x (`w4_config`): the one-row GEMV
(`w4_gemv1`, batch-1 decode), the CUDA-core GEMV up to 4 rows, the tensor-core swap-AB kernel
(`w4_dot`) to 64 rows, and from `W4_DEQUANT_MIN_M` rows (65) the weight written out in the
activations' dtype for the library GEMM (bf16; int4 in fp16 too) (`w4_dequant`: the Llama-3.1-8B workload 2x faster than on the in-kernel
decode, docs/perf). The table needs no GPU.
"""),
    ("code", """
import torch
from atom.model_ops.kernels.w4_gemm import w4_config
rows = [dict(format=f, shape=f"{n}x{k}", M=m, kernel=w4_config(m, n, k, torch.bfloat16, g, f)[0])
        for f, g in (("int4", 128), ("mxfp4", 32)) for n, k in ((6144, 4096), (28672, 4096))
        for m in (1, 2, 4, 8, 64, 65, 512)]
kernels = pd.DataFrame(rows).pivot(index=["format", "shape"], columns="M", values="kernel")
assert (kernels[1] == "w4_gemv1").all() and (kernels[4] == "w4_gemv").all() and (kernels[8] == "w4_dot").all()
assert (kernels[64] == "w4_dot").all() and (kernels[65] == "w4_dequant").all()
kernels
"""),
    ("md", "The write-out's tiles (`scripts/w4_dequant_probe.py` on an H100, checked in under `docs/perf/raw`): microseconds to write each Llama-3.1-8B weight out in bf16, by tile (rows, words, warps), and the whole route at 128 rows against bf16 `F.linear` and the in-kernel decode (`w4_dot`). The module's tile is the fastest in total in both formats."),
    ("code", """
import json, pathlib
import atom
from atom.model_ops.kernels import w4_dequant
raw = pathlib.Path(atom.__file__).resolve().parents[1] / "docs" / "perf" / "raw" / "2026-12-06j-h100-call7-w4-dequant-probe.json"
probe = pd.DataFrame(json.loads(raw.read_text())["rows"])
tiles = probe.dropna(subset=["us"]).assign(tile=lambda d: list(zip(*(d[c].astype(int) for c in ("BLOCK_N", "BLOCK_W", "num_warps")))))
assert tiles["same_bits"].all()
by_tile = tiles.pivot_table(index="tile", columns=["format", "N", "K"], values="us")
totals = by_tile.T.groupby(level="format").sum().T
module_tile = (w4_dequant.BLOCK_N, w4_dequant.BLOCK_W, w4_dequant.NUM_WARPS)
assert (totals.idxmin() == [module_tile] * len(totals.columns)).all()
route = probe[probe["M"].notna()][["format", "N", "K", "bf16_us", "written out_us", "w4_dot_us"]]
display(totals.sort_values("int4").round(1))
route.round(1)
"""),
    ("md", "The one-row GEMV against the GEMV it replaced at M = 1 and bf16 `F.linear`, from the H200 sweep checked in under `docs/perf/raw` (`scripts/w4_gemv1_sweep.py`): microseconds per product, the best tile with the fp16 pair products (HALF2, the table's choice) and without."),
    ("code", """
import json, pathlib
import atom
raw = pathlib.Path(atom.__file__).resolve().parents[1] / "docs" / "perf" / "raw" / "2026-12-04b-h200-w4-gemv1-sweep.json"
sweep = pd.DataFrame(json.loads(raw.read_text())["rows"])
sweep["HALF2"] = sweep["cfg"].map(lambda c: c["HALF2"])
best = sweep.pivot_table(index=["format", "N", "K"], columns="HALF2", values="us", aggfunc="min")
best.columns = ["float32 products", "HALF2"]
best = best.join(sweep.groupby(["format", "N", "K"]).agg(old_gemv=("old_us", "first"), bf16=("bf16_us", "first")))
assert (best["HALF2"] < best["old_gemv"]).all() and (sweep["rel_err"] < 1e-2).all()
fig = Figure(figsize=(7.0, 3.0), layout="constrained")
ax = fig.add_subplot()
best[["HALF2", "float32 products", "old_gemv", "bf16"]].plot.bar(ax=ax, rot=30)
ax.set_ylabel("us per product (M = 1)"); ax.set_title("4-bit one-row GEMV on an H200, Llama-3.1-8B shapes")
display(best.round(2))
fig
"""),
    ("md", "Where a batch-1 decode step's time goes in the engine, per layer, from a profile checked in under `docs/perf/raw` (`scripts/gpu_profile.py --sequence 60`, PDL off, an H100): each product's kernel time against the time its weight's bytes take at the H100's 3.35 TB/s. The small products take 2.3-2.7x their bytes' time, the large ones ~1.5x (docs/perf row 2 and `raw/history.md` 2026-12-06k: the loads of a step are issued late, after its products)."),
    ("code", """
import re
raw_dir = pathlib.Path(atom.__file__).resolve().parents[1] / "docs" / "perf" / "raw"
PRODUCTS = ["q/k/v", "attention", "o_proj", "gate-up", "silu", "down"]
WEIGHTS = {"q/k/v": (6144, 4096), "o_proj": (4096, 4096), "gate-up": (28672, 4096), "down": (4096, 14336)}
frames = []
for fmt, bits in (("mxfp4_w4a16", 4 + 8 / 32), ("w4a16", 4 + 16 / 128)):
    text = (raw_dir / f"2026-12-06k-h100-call1-prof-nopdl-seq-{fmt}.log").read_text()
    seq = re.findall(r"^\s*\d+\s+([\d.]+) us\s+(\S+)", text.split("kernels in order:")[1], re.M)
    first = [name for _, name in seq].index("_unified_attn_kernel") - 1   # a layer starts at its q/k/v product
    layers = [seq[i:i + 6] for i in range(first, len(seq) - 5, 6)]
    assert all([n for _, n in layer][1] == "_unified_attn_kernel" for layer in layers)
    us = pd.DataFrame([[float(t) for t, _ in layer] for layer in layers], columns=PRODUCTS).median()
    bytes_us = pd.Series({k: n * k_ * bits / 8 / 3.35e6 for k, (n, k_) in WEIGHTS.items()})
    frames.append(pd.DataFrame({"format": fmt, "us": us, "bytes_us": bytes_us}))
layer = pd.concat(frames).rename_axis("kernel").reset_index()
layer["x_bytes"] = layer["us"] / layer["bytes_us"]
products = layer.dropna(subset=["bytes_us"])
assert (products["x_bytes"] > 1.2).all()   # none near its bytes' time
fig = Figure(figsize=(7.0, 3.0), layout="constrained")
ax = fig.add_subplot()
products.pivot(index="kernel", columns="format", values="us").loc[list(WEIGHTS)].plot.bar(ax=ax, rot=0)
ax.plot(range(4), products[products["format"] == "w4a16"].set_index("kernel").loc[list(WEIGHTS), "bytes_us"],
        "k_", markersize=20, label="bytes at 3.35 TB/s")
ax.set_ylabel("us a layer"); ax.set_title("batch-1 decode, Llama-3.1-8B, H100, PDL off"); ax.legend()
display(layer.round(2))
fig
"""),
    ("md", """
Two opt-in 4-bit fusions timed beside the tree on one H100 each (`raw/history.md` 2026-12-07d):
"w4_gate_up_silu" (SiLU-and-mul inside gate-up) and "w4_down_add_norm" (down's epilogue writes the
next layer's normed input; q/k/v then runs without the norm in its loop). Batch-1 decode ms/step
from the raw JSON, then the PDL-off kernel times a layer with and without the second: q/k/v lost
its norm's instructions yet ran slower, on the plain products' 8-warp tile (since then the
fusion keeps q/k/v's own 4-warp tile).
"""),
    ("code", """
runs = []
for path in sorted(raw_dir.glob("2026-12-07d-h100-call[1-7]-l-lat1-var*.json")):
    m = re.match(r".*-(call\d)-l-lat1-var(asis|gate_up_silu|down_add_norm)-(w4a16|mxfp4_w4a16)\.json", path.name)
    if m:  # the 4-bit runs (the calls' FP8 KV runs are not)
        call, variant, fmt = m.groups()
        runs.append(dict(call=call, format=fmt, variant=variant,
                         ms=json.loads(path.read_text())["results"][0]["ms_per_step"]))
runs = pd.DataFrame(runs)
pairs = runs.pivot_table(index=["call", "format"], columns="variant", values="ms")
pairs["change"] = pairs[["gate_up_silu", "down_add_norm"]].max(axis=1) / pairs["asis"] - 1
assert len(pairs) == 8 and (pairs["change"].abs() < 0.015).all()  # neither fusion moves decode by 1.5%


def layer_kernels_us(log_name):
    # median us of each of a decoder layer's six kernels (PRODUCTS) over the whole layers
    # of a `var_prof` log's in-order list
    text = (raw_dir / log_name).read_text()
    seq = re.findall(r"^\s*\d+\s+([\d.]+) us\s+(\S+)", text.split("kernels in order:")[1], re.M)
    first = [name for _, name in seq].index("_unified_attn_kernel") - 1
    layers = [seq[i:i + 6] for i in range(first, len(seq) - 5, 6)]
    assert all([n for _, n in layer][1] == "_unified_attn_kernel" for layer in layers)
    return pd.DataFrame([[float(t) for t, _ in layer] for layer in layers], columns=PRODUCTS).median()


seq_us = pd.DataFrame({variant: layer_kernels_us(f"2026-12-07d-h100-call8-prof-nopdl-seq-{variant}-w4a16.log")
                       for variant in ("asis", "down_add_norm")})
assert seq_us.loc["q/k/v", "down_add_norm"] > seq_us.loc["q/k/v", "asis"]  # fewer instructions, slower tile
display(pairs.round(3))
seq_us.round(2)
"""),
    ("md", """
The 4-bit opt-ins and tiles prepared after that lease, timed on two H100s (`raw/history.md`
2026-12-07e): each variant's batch-1 decode against the tree (`asis`) of the same call. None is
faster; the 4-warp tile of the plain products and "w4_down_add_norm" on the norm GEMV's tile
cost the most.
"""),
    ("code", """
runs = []
for path in sorted(raw_dir.glob("2026-12-07e-h100-call[127]-l-lat1-var*.json")):
    call, variant, fmt = re.match(r".*-(call\\d)-l-lat1-var(\\w+?)-(w4a16|mxfp4_w4a16)\\.json", path.name).groups()
    runs.append(dict(call=call, format=fmt, variant=variant,
                     ms=json.loads(path.read_text())["results"][0]["ms_per_step"]))
runs = pd.DataFrame(runs)
base = runs[runs["variant"] == "asis"].set_index(["call", "format"])["ms"]
runs["change_%"] = 100 * (runs["ms"] / [base[(c, f)] for c, f in zip(runs["call"], runs["format"])] - 1)
change = runs[runs["variant"] != "asis"].pivot_table(index="variant", columns="format", values="change_%")
assert len(change) == 8 and (change > -0.5).all().all()   # no variant faster than the tree
fig = Figure(figsize=(7.0, 3.0), layout="constrained")
ax = fig.add_subplot()
change.sort_values("w4a16").plot.barh(ax=ax)
ax.axvline(0, color="k", lw=0.8); ax.set_xlabel("batch-1 decode vs the tree, %")
ax.set_title("Llama-3.1-8B, H100, one run each (MXFP4 early / down_add_norm: mean of two)")
display(change.round(1))
fig
"""),
    ("md", """
The opt-in "w4_l2_next": at batch 1 the q/k/v GEMV's warps, after their loop, ask L2 for o_proj's
words and the first 16 MiB of gate-up's (one bulk prefetch a warp), so that these stream while
the attention runs (`fusions.L2_NEXT_BYTES` turns on the later products' stages too). How
Llama-3.1-8B's int4 regions split over q/k/v's grid (768 programs of 4 warps), from
`w4_gemv1.l2_next_args`:
"""),
    ("code", """
from atom.model_ops.kernels import w4_gemv1
from atom.tuning.fusions import L2_NEXT_BYTES
o_words, gate_up_words = torch.zeros(4096, 512, dtype=torch.int32), torch.zeros(28672, 512, dtype=torch.int32)
args = w4_gemv1.l2_next_args([(o_words, o_words.numel() * 4), (gate_up_words, L2_NEXT_BYTES["gate_up_from_qkv"])],
                             768, 4)
regions = pd.DataFrame([dict(region=name, MiB=args[f"{key}_count"] * 4 / 2**20, chunk_bytes=args[f"{key}_chunk"] * 4,
                             warps=-(-args[f"{key}_count"] // args[f"{key}_chunk"]))
                        for name, key in (("o_proj", "l2a"), ("gate-up", "l2b"))])
assert args["L2N"] == 2 and (regions["chunk_bytes"] % 16 == 0).all() and (regions["warps"] <= 768 * 4).all()
regions
"""),
    ("md", """
Timed (`raw/history.md` 2026-12-07f): no form of it is faster in batch-1 decode. The PDL-off
kernels of a W4A16 layer, the tree against `l2_next_o` (o_proj's words asked of L2 during the
attention), on an H200 and an H100: o_proj barely moves with its words in L2, the q/k/v GEMV
that issues the prefetch slows down. Beside each kernel, its weight bytes at the HBM's speed.
"""),
    ("code", """
runs = []
for path in sorted(raw_dir.glob("2026-12-07f-h100-call1-l-lat1-var*.json")):
    variant, fmt = re.match(r".*-l-lat1-var(\\w+?)-(w4a16|mxfp4_w4a16)\\.json", path.name).groups()
    runs.append(dict(format=fmt, variant=variant, ms=json.loads(path.read_text())["results"][0]["ms_per_step"]))
runs = pd.DataFrame(runs).pivot_table(index="variant", columns="format", values="ms")
l2_change = 100 * (runs.drop(index="asis") / runs.loc["asis"] - 1)
assert len(l2_change) == 4 and (l2_change > -0.5).all().all()   # none faster than the tree
layer_us = pd.DataFrame({(gpu, variant): layer_kernels_us(f"2026-12-07f-{call}-prof-nopdl-seq-{variant}-w4a16.log")
                         for gpu, call in (("H200", "h200-call11"), ("H100", "h100-call2"))
                         for variant in ("asis", "l2_next_o")})
int4_weights = {"q/k/v": 6144 * 4096, "o_proj": 4096 * 4096, "gate-up": 28672 * 4096, "down": 4096 * 14336}
for gpu, tbs in (("H200", 4.8), ("H100", 3.35)):  # half a byte a weight, a bf16 scale a group of 128
    layer_us[(gpu, "bytes at HBM speed")] = pd.Series({k: n * (0.5 + 2 / 128) / tbs / 1e6 for k, n in int4_weights.items()})
assert (layer_us.loc["o_proj", ("H200", "l2_next_o")] > 3 * layer_us.loc["o_proj", ("H200", "bytes at HBM speed")])
assert (layer_us.loc["q/k/v", (slice(None), "l2_next_o")].values > layer_us.loc["q/k/v", (slice(None), "asis")].values).all()
display(l2_change.round(1))
layer_us.round(2)
"""),
    ("md", """
"w4_gate_up_silu" (SiLU-and-mul inside 4-bit gate-up) became a default once its gated loop
carried the up rows' pointers instead of adding the up offset to every load's address each step
(`raw/history.md` 2026-12-07g). The batch-1 decode runs of one H100, three of each: the tree
before the change as the baseline, and the gated product; then the tiles and CHAIN forms timed
beside them: none faster.
"""),
    ("code", """
runs = []
for path in sorted(raw_dir.glob("2026-12-07g-h100-call[13]-l-lat1-var*.json")):
    call, variant, fmt = re.match(r".*-(call\\d)-l-lat1-var\\w_(\\w+?)-(w4a16|mxfp4_w4a16)\\.json", path.name).groups()
    runs.append(dict(call=call, format=fmt, variant=variant, ms=json.loads(path.read_text())["results"][0]["ms_per_step"]))
runs = pd.DataFrame(runs)
gated = runs[runs["variant"].isin(["asis", "gate_up_silu"])].pivot_table(
    index="variant", columns="format", values="ms", aggfunc=["mean", "count"])
assert (gated["count"] == 3).all().all()
assert (gated.loc["gate_up_silu", "mean"] < gated.loc["asis", "mean"]).all()  # faster in both formats
others = runs[~runs["variant"].isin(["asis", "gate_up_silu"])].set_index(["variant", "format"])["ms"]
base = gated["mean"].loc["asis"]
change = pd.Series({k: 100 * (v / base[k[1]] - 1) for k, v in others.items()}, name="% against the mean tree")
assert (change > -0.1).all()  # the DW = 2 tiles and CHAIN: none faster on this H100
display(gated.round(3))
change.round(1)
"""),
    ("md", """
int4's gated gate-up runs a tile of its own (`w4_gemv1.GATED_TILES`: 8 gate + 8 up rows over 2
warps, each thread's word pair in one fp16 chain), found by compiling the gated tiles for sm90
on the CPU and timed on an H100 (`raw/history.md` 2026-12-07h): the tile `gated_tiles` picks per
shape and format, then each variant's two batch-1 decode runs against the tree's (`asis`).
"""),
    ("code", """
from atom.model_ops.kernels import w4_gemv1
picks = pd.DataFrame({(fmt, rows): w4_gemv1.gated_tiles(rows, fmt, 4096) for fmt in ("int4", "mxfp4_pairs")
                      for rows in (6144, 28672)}).T.fillna("")
assert picks.loc[("int4", 28672), "CHAIN"] is True and picks.loc[("int4", 6144), "CHAIN"] == ""
runs = []
for path in sorted(raw_dir.glob("2026-12-07h-h100-call3-r[12]*-l-lat1-var*.json")):
    variant, fmt = re.match(r".*-l-lat1-var(\\w+?)-(w4a16|mxfp4_w4a16)\\.json", path.name).groups()
    runs.append(dict(format=fmt, variant=variant, ms=json.loads(path.read_text())["results"][0]["ms_per_step"]))
runs = pd.DataFrame(runs).pivot_table(index=["format", "variant"], values="ms", aggfunc=["mean", "count"])
base = runs["mean"]["ms"].xs("asis", level="variant")
runs["% against asis"] = [100 * (m / base[f] - 1) for (f, _), m in runs["mean"]["ms"].items()]
assert (runs["count"]["ms"] == 2).all()
assert runs.loc[("w4a16", "gated_chain8"), "% against asis"].item() < -3  # kept: GATED_TILES["int4"]
assert runs.loc[("mxfp4_w4a16", "gated_chain8"), "% against asis"].item() > 0  # MXFP4 keeps its tile
display(picks)
runs.round(3)
"""),
    ("md", """
The same choices on a second H100 (`raw/history.md` 2026-12-07i): each variant's batch-1 decode
beside the tree in one call. The halved gated tile that `GATED_TILES` replaced and the scale
strides at runtime are both slower, so both choices stay; int4's plain tiles on chained word pairs
without words ahead are slower still (a pair load then covers o_proj's row in one step).
"""),
    ("code", """
runs = {}
for path in sorted(raw_dir.glob("2026-12-07i-h100-call1-r1int4-l-lat1-var*.json")):
    variant = re.match(r".*-l-lat1-var(\\w+?)-w4a16\\.json", path.name).group(1)
    runs[variant] = json.loads(path.read_text())["results"][0]["ms_per_step"]
runs = pd.Series(runs, name="W4A16 ms/step")
change = (100 * (runs / runs["asis"] - 1)).rename("% against asis")
assert change["gated_table"] > 3 and change["runtime_scale_strides"] > 0 and change["plain_chain"] > 5
pd.concat([runs, change], axis=1).round(3)
"""),
    ("md", """
The tiles prepared on the CPU for MXFP4's gated gate-up and int4's down, timed on a third H100
(`raw/history.md` 2026-12-07j): none faster than the tree. Then the opt-in
`w4_gemv1.FOLD_PAIR_SCALES`, untimed: the sm90 loop instructions a step of each MXFP4 table tile as
committed, with the fold, and with the fold and CHAIN (`raw/2026-12-07j-cpu-sm90-fold-mix.txt`),
and what `fp4_pairs.fold_scales` does to a layer's scale bytes (an all-zero block's byte becomes
127; a byte outside `FOLD_SCALES` keeps the layer in the checkpoint's layout).
"""),
    ("code", """
from atom.model_ops.kernels import fp4_pairs
runs = {}
for path in sorted(raw_dir.glob("2026-12-07j-h100-call[12]-l-lat1-var*.json")):
    variant, fmt = re.match(r".*-l-lat1-var(\\w+?)-(w4a16|mxfp4_w4a16)\\.json", path.name).groups()
    runs[(fmt, variant)] = json.loads(path.read_text())["results"][0]["ms_per_step"]
runs = pd.Series(runs, name="ms/step")
change = pd.Series({k: 100 * (v / runs[(k[0], "asis")] - 1) for k, v in runs.items()}, name="% against asis")
assert (change.drop([("w4a16", "deep_chain8")]) >= 0).all() and abs(change[("w4a16", "deep_chain8")]) < 1
display(pd.concat([runs, change], axis=1).round(3))
mix, tree = {}, None
for line in (raw_dir / "2026-12-07j-cpu-sm90-fold-mix.txt").read_text().splitlines():
    if line.startswith("== "):
        tree = {"main": "as committed", "var-fold_e8m0": "fold", "var-fold_chain": "fold + CHAIN"}[line.split()[1]]
    elif line.strip():
        name, steps = re.match(r"(\\S+) mxfp4_pairs: (\\d+) a step", line).groups()
        mix[(name, tree)] = int(steps)
mix = pd.Series(mix).unstack()[["as committed", "fold", "fold + CHAIN"]]
assert (mix["fold"] < mix["as committed"]).all() and (mix["fold + CHAIN"] <= mix["fold"]).all()
display(mix)
words = torch.tensor([[0, 0, 0, 0, 0x12345678, 1, 2, 3]], dtype=torch.int32)
scales = torch.tensor([[0, 120]], dtype=torch.uint8)
assert fp4_pairs.fold_scales(words, scales).tolist() == [[127, 120]]
assert fp4_pairs.fold_scales(words, torch.tensor([[0, 128]], dtype=torch.uint8)) is None
fp4_pairs.FOLD_SCALES, fp4_pairs.fold_scales(words, scales)
"""),
    ("md", """
The fold timed (`raw/history.md` 2026-12-08a): on an H100, two calls, each variant beside the tree
as it then was (the fold off), Llama-3.1-8B MXFP4 batch-1 decode. The fold alone is ~2% faster
in both calls and is now the default (`FOLD_PAIR_SCALES`); CHAIN over it is level with the tree.
Below: the flag as the tree has it, and the table tile o_proj's pair words take (the launcher
adds the kernel's FOLD from the flag).
"""),
    ("code", """
from atom.model_ops.kernels import w4_gemv1
runs = {}
for path in sorted(raw_dir.glob("2026-12-08a-h100-call[12]-l-lat1-var*-mxfp4_w4a16.json")):
    call, variant = re.match(r".*-(call\\d)-l-lat1-var(\\w+?)-mxfp4_w4a16\\.json", path.name).groups()
    runs[(call, variant)] = json.loads(path.read_text())["results"][0]["ms_per_step"]
runs = pd.Series(runs, name="MXFP4 ms/step").unstack()
change = (100 * runs.div(runs["asis"], axis=0) - 100).round(2).add_suffix(" %")
assert (change["fold_e8m0 %"] < -2).all() and change.loc["call1", "fold_chain %"] > change.loc["call1", "fold_e8m0 %"]
display(pd.concat([runs, change], axis=1))
assert w4_gemv1.FOLD_PAIR_SCALES
w4_gemv1.FOLD_PAIR_SCALES, w4_gemv1.tiles(4096, "mxfp4_pairs", 4096)
"""),
    ("md", """
Two words of a row a load (`w4_gemv1`'s DW = 2: one 8-byte load split in its int32 halves, so a
load, an address sum and a scale load serve 16 weights): the best tile each way from a later
H200 sweep, and what the tables load per shape. MXFP4's tables read pairs (faster alone and in
batch-1 decode); int4 keeps single words (its pair tiles were slower in decode, docs/perf).
"""),
    ("code", """
from atom.model_ops.kernels import w4_gemv1
raw = pathlib.Path(atom.__file__).resolve().parents[1] / "docs" / "perf" / "raw" / "2026-12-04g-h200-call1-w4-gemv1-sweep.json"
pairs = pd.DataFrame(json.loads(raw.read_text())["rows"])
pairs = pairs[pairs["cfg"].map(lambda c: c["HALF2"])]
pairs["DW"] = pairs["cfg"].map(lambda c: c.get("DW", 1))
by_dw = pairs.pivot_table(index=["format", "N", "K"], columns="DW", values="us", aggfunc="min")
by_dw.columns = ["one word a load", "two words a load"]
by_dw["table loads"] = [w4_gemv1.tiles(n, f, k).get("DW", 1) for f, n, k in by_dw.index]
assert (by_dw.loc["mxfp4", "two words a load"] < by_dw.loc["mxfp4", "one word a load"]).all()
assert (by_dw.loc["mxfp4", "table loads"] == 2).all() and (by_dw.loc["int4", "table loads"] == 1).all()
fig = Figure(figsize=(7.0, 3.0), layout="constrained")
ax = fig.add_subplot()
by_dw[["one word a load", "two words a load"]].plot.bar(ax=ax, rot=30)
ax.set_ylabel("us per product (M = 1)"); ax.set_title("one-row GEMV, HALF2: words a load (H200)")
display(by_dw.round(2))
fig
"""),
    ("md", """
What the fp16 pair products cost in accuracy, on the CPU: `w4_gemv1.half2_ref` repeats the
HALF2 path's roundings in torch (each word column's x scaled by a power of two into
[2^14, 2^15) and rounded to fp16, four fp16 FMAs a half-word, the halves added in fp16).
Its error against the exact product, as a fraction of the largest output, beside what
rounding the dequantized weights to bf16 costs (the tensor-core kernels' operands) and
bf16's own output rounding, for plain activations and for a few 300x outliers.
"""),
    ("code", """
from atom.model_ops.kernels import w4_gemv1
from atom.model_ops.kernels.w4_gemm import dequantize_w4, w4_linear_ref
gen = torch.Generator().manual_seed(0)
N, K, g = 64, 4096, 128
packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (N, K // 8), generator=gen, dtype=torch.int32)
scales = (torch.rand(N, K // g, generator=gen) / K ** 0.5).bfloat16()
err = lambda y, ref: ((y.float() - ref).abs().max() / ref.abs().max()).item()
rows = []
for kind in ("plain", "outliers"):
    x = torch.randn(1, K, generator=gen)
    if kind == "outliers":
        x[0, ::97] *= 300
    x = x.bfloat16()
    exact = w4_linear_ref(x.float(), packed, scales, None, None, "int4", g, K)
    w_bf16 = dequantize_w4(packed, scales, None, "int4", g, K).bfloat16().float()
    rows.append(dict(activations=kind, HALF2=err(w4_gemv1.half2_ref(x, packed, scales, None, None, g), exact),
                     bf16_weights=err(x.float() @ w_bf16.T, exact), bf16_output=err(exact.bfloat16(), exact)))
half2_err = pd.DataFrame(rows).set_index("activations")
assert (half2_err["HALF2"] < 2e-3).all()
half2_err.style.format("{:.1e}")
"""),
    ("md", """
Two ways to issue fewer instructions a weight in that GEMV. MXFP4 pair words
(`kernels/fp4_pairs.py`, the plan's "fp4_pair_words", a default fusion on the Triton backend:
batch-1 MXFP4 decode 4% faster, docs/perf; CHAIN stays opt-in): the same
codes with their bits placed so that each fp16 pair (columns i, i + 4) comes from one or two
shifts of the word and one or two masks, 11 decode instructions a word instead of 15. CHAIN (a
tile key, two words a load): a word pair's eight fp16 pair products in one chain, x scaled per
16 columns, so that the widening and scaling come once per 16 weights; `half2_ref(chain=2)`
gives its rounding. The placement, then the PTX the kernel runs a word, then CHAIN's error:
"""),
    ("code", """
from atom.model_ops.kernels import fp4_pairs, h2_ptx
layout = fp4_pairs.layout_frame()
decode = lambda fmt: sum(line.split(".")[0] in ("shl", "shr", "and", "or") for line in h2_ptx.h2_ptx(fmt).splitlines())
ptx_ops = pd.Series({f: decode(f) for f in ("int4", "mxfp4", "mxfp4_pairs")}, name="PTX decode ops a word")
assert ptx_ops["mxfp4_pairs"] < ptx_ops["mxfp4"]
x = torch.randn(1, K, generator=gen).bfloat16()
exact = w4_linear_ref(x.float(), packed, scales, None, None, "int4", g, K)
chain_err = pd.Series({f"{c} word(s) a chain": err(w4_gemv1.half2_ref(x, packed, scales, None, None, g, chain=c), exact)
                       for c in (1, 2)}, name="error / largest output")
assert (chain_err < 2e-3).all()
display(layout, ptx_ops.to_frame(), chain_err.to_frame())
"""),
    ("md", """
How the weights travel. Options of the one-row tile that change no bit of the result, only
how the weight stream is fetched: the scale rows asked of L2 before the PDL wait (SPF), L2
prefetches a few steps ahead (L2D), the loop pipelined through shared memory (STAGES), L2-only
word loads (WCACHE ".cg", PF1: scale lines into L1 too) and Triton's register cap (maxnreg).
From the H100 options sweep under `docs/perf/raw` (`scripts/w4_gemv1_sweep.py --options`):
each option's time over Llama-3.1-8B's four shapes against the table's tile then (no SPF, no
cap). SPF and MXFP4's maxnreg = 64 are in the tables now (batch-1 decode agreed); the rest
were slower. MXFP4's deep tile (down) has room for 128 registers instead: see the register caps
below.
"""),
    ("code", """
raw = pathlib.Path(atom.__file__).resolve().parents[1] / "docs" / "perf" / "raw" / "2026-12-06e-h100-call1-w4-gemv1-options.json"
opts = pd.DataFrame(json.loads(raw.read_text())["rows"])
opts["option"] = opts["options"].map(lambda o: ", ".join(f"{k}={v}" for k, v in o.items()) or "table")
total = opts.pivot_table(index="option", columns="format", values="us", aggfunc="sum")
travel = (total / total.loc["table"] - 1).mul(100).round(1).sort_values("mxfp4")
assert travel.loc["AHEAD=False, STAGES=3", "int4"] > 50 and travel.loc["SPF=True", "mxfp4"] < 0
assert all(w4_gemv1.tiles(n, f, k)["SPF"] for f in ("int4", "mxfp4") for n, k in ((4096, 4096), (28672, 4096), (4096, 14336)))
assert [w4_gemv1.tiles(n, "mxfp4", k)["maxnreg"] for n, k in ((4096, 4096), (28672, 4096), (4096, 14336))] == [64, 64, 128]
fig = Figure(figsize=(7.0, 3.6), layout="constrained")
ax = fig.add_subplot()
travel[travel.abs().max(axis=1) < 40].plot.barh(ax=ax)
ax.set_xlabel("% time against the table's tile (H100, 4 shapes)"); ax.set_title("one-row GEMV: how the weights travel")
display(travel)
fig
"""),
    ("md", """
Register caps. Under Triton's maxnreg = 64 ptxas keeps MXFP4's loop in 64 registers by issuing
the next step's words (loaded a step ahead) at the end of the step, so only ~60-90
instructions separate them from their use (DRAM latency is several hundred cycles); with
room for 128 it issues them early (`scripts/w4_gemv_sass.py --tables 128` prints each tile's
registers and that cover without a GPU). Llama-3.1-8B's batch-1 decode on one H100 with each
tile's cap changed in a copy of the tree (`h200_lease.sh var`, the JSON under `docs/perf/raw`):
only the deep tile (down: 512 programs of 4 warps, under 4 an SM, so no program is lost) gains;
int4, whose loop ptxas leaves at 59-69 registers, loses with every cap.
"""),
    ("code", """
raw = pathlib.Path(atom.__file__).resolve().parents[1] / "docs" / "perf" / "raw"
names = {"asis": "as was (MXFP4 64 everywhere; int4 none)", "nreg_deep128": "MXFP4 down 128",
         "nreg_all128": "MXFP4 all three 128", "wide_nreg128": "int4 gate-up 128",
         "wide_ahead128": "int4 gate-up 128, words ahead", "all_ahead128": "int4 all three 128, gate-up ahead"}
caps = pd.DataFrame([dict(variant=names[f.name.split("-var")[1].rsplit("-", 1)[0]],
                          format=f.name.rsplit("-", 1)[1][:-5],
                          ms=json.loads(f.read_text())["results"][0]["ms_per_step"])
                     for f in sorted(raw.glob("2026-12-07a-h100-call1-l-lat1-var*.json"))])
bf16 = json.loads((raw / "2026-12-07a-h100-call1-l-lat1-bf16.json").read_text())["results"][0]["ms_per_step"]
caps["x bf16"] = (bf16 / caps["ms"]).round(3)
caps = caps.set_index(["format", "variant"]).sort_index()
assert caps.loc[("mxfp4_w4a16", "MXFP4 down 128"), "ms"] < 0.96 * caps.loc[("mxfp4_w4a16", names["asis"]), "ms"]
caps
"""),
    ("md", """
Rows prepared by the kernel in front (the plan's opt-in "w4_prepared_x", `kernels/h2_xpack.py`):
the scaling and packing above happen once, in the add + RMSNorm or SiLU kernel, instead of in
every GEMV program; a word column becomes 8 int32 (four fp16 pairs, its exponent e, its sum).
`prepare_ref` is that form in torch; decoding it gives x back to fp16's 11 bits. With
"w4_o_proj_norm" o_proj's GEMV writes gate-up's input this way itself (with the sums of h^2 for
the norm), so no norm kernel runs between them.
"""),
    ("code", """
from atom.model_ops.kernels.h2_xpack import prepare_ref
x = torch.randn(1, 64, generator=gen).bfloat16()
cols = prepare_ref(x, odd16=True)
pairs = cols[:, :4]
halves = torch.cat([(pairs & 0xFFFF).to(torch.int16).view(torch.float16), (pairs >> 16).to(torch.int16).view(torch.float16)], 1)
back = halves.double() * torch.exp2(cols[:, 4:5].double() - 141) * torch.tensor([1.0, 16.0] * 4, dtype=torch.float64)
prepared = pd.DataFrame({"e": cols[:, 4].numpy(), "sum x": cols[:, 5].view(torch.float32).numpy(),
                         "largest |x|": x.float().reshape(-1, 8).abs().amax(1).numpy(),
                         "decode error / largest": ((back - x.double().reshape(-1, 8)).abs().amax(1)
                                                    / x.double().reshape(-1, 8).abs().amax(1)).numpy()})
assert (prepared["decode error / largest"] < 2 ** -10).all()
prepared
"""),
    ("md", """
"merge_in_attention" (a default on NVIDIA GPUs): split decode attention merges its segments in the program of
each token and kv head that finishes last (an arrival counter), so the merge kernel's launch
goes. The Triton launches of one split decode step both ways (the interpreter on the CPU):
"""),
    ("code", """
from atom.model_ops.attention.triton_unified import AttentionWorkspace, unified_attention
from atom.tuning.launches import KernelLaunches
B, Hkv, qpkv, D, bs = 2, 2, 2, 32, 16
lens = torch.tensor([40, 70], dtype=torch.int32)
tables = torch.arange(B * 5, dtype=torch.int32).reshape(B, 5)
kc, vc = (torch.randn(B * 5, bs, Hkv, D, generator=gen) for _ in range(2))
q = torch.randn(B, Hkv * qpkv, D, generator=gen)
ws = AttentionWorkspace(8, Hkv * qpkv, D)
launches, outs = {}, {}
for merge in (False, True):
    out = torch.empty_like(q)
    with KernelLaunches() as trace:
        unified_attention(q, kc, vc, out, torch.arange(B + 1, dtype=torch.int32), lens, tables, D ** -0.5, 1,
                          workspace=ws, num_kv_splits=4, merge_in_kernel=merge)
    launches["in the kernel" if merge else "merge kernel"], outs[merge] = trace.counts(), out
assert torch.allclose(outs[False], outs[True], atol=1e-5) and not ws.arrival_counts.any()
pd.DataFrame(launches).fillna(0).astype(int)
"""),
    ("md", """
`triton_unified.SKIP_EMPTY_SEGMENTS` (opt-in, not timed in decode yet): under that merge, the segments a
short context leaves without keys store no partial and are not counted in, and the merge reads only the
others. Which of the 4 segments stored a partial (its log-sum-exp no longer the NaN written before),
both ways, with the same output:
"""),
    ("code", """
stored, merged = {}, {}
for skip in (False, True):  # one call's "skip_empty" (the module's SKIP_EMPTY_SEGMENTS stays as it is)
    ws.partial_lse.fill_(float("nan"))
    out = torch.empty_like(q)
    unified_attention(q, kc, vc, out, torch.arange(B + 1, dtype=torch.int32), lens, tables, D ** -0.5, 1,
                      workspace=ws, num_kv_splits=4, merge_in_kernel=True, config=dict(skip_empty=skip))
    merged[skip] = out
    for b in range(B):
        stored[("skip_empty" if skip else "default", f"{int(lens[b])} keys")] = (~ws.partial_lse[b, 0, :4].isnan()).tolist()
assert torch.equal(merged[False], merged[True]) and not ws.arrival_counts.any()
segments = pd.DataFrame(stored, index=[f"segment {i}" for i in range(4)])
assert segments["default"].all().all() and segments["skip_empty"].sum().tolist() == [1, 2]  # 64-key tiles
segments
"""),
    ("md", """
## Which kernel runs a ptpc FP8 product
An 8-bit layer's GPU product also depends on the rows of x (`quant.common.route_for`): the
tensor-core swap-AB kernel (`dot`) up to 64 rows, and for ptpc fp8 into narrow outputs from
long rows (o_proj, down) up to 128; torch._scaled_mm (cuBLASLt) above. The table needs no GPU.
"""),
    ("code", """
from atom.model_ops.quant.common import route_for
LLAMA = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
routes = pd.DataFrame([dict(layer=l, M=m, route=route_for("fp8", m, k, n, torch.bfloat16, "cpu"))
                       for l, (n, k) in LLAMA.items() for m in (1, 8, 64, 80, 128, 192, 512)]
                      ).pivot(index="layer", columns="M", values="route")
assert (routes[[1, 64]] == "dot").all().all() and (routes[512] == "scaled_mm").all()
assert routes.loc["down", 128] == "dot" and routes.loc["gate_up", 128] == "scaled_mm"
routes
"""),
    ("md", "Why: the H200 sweep of those products above 64 rows (`scripts/fp8_gemm_sweep.py`, checked in under `docs/perf/raw`): cuBLASLt's 128 x 128 tiles give a 4096-wide output 32 programs for 132 SMs; the swap-AB kernel's 128-row tile splits K in four instead; its 256-row tile (192 rows and up) is slower than cuBLASLt."),
    ("code", """
raw = pathlib.Path(atom.__file__).resolve().parents[1] / "docs" / "perf" / "raw" / "2026-12-04e-h200-fp8-gemm-sweep.json"
fp8 = pd.DataFrame(json.loads(raw.read_text())["rows"])
best = fp8.pivot_table(index=["N", "K", "M"], columns="kernel", values="us", aggfunc="min")
best = best.join(fp8.groupby(["N", "K", "M"]).agg(scaled_mm=("scaled_mm_us", "first"), bf16=("bf16_us", "first")))
routed = best.reset_index().apply(lambda r: route_for("fp8", int(r.M), int(r.K), int(r.N), torch.bfloat16, "cpu"), axis=1)
best["route"] = routed.values
on_dot = best[best["route"] == "dot"]
assert len(on_dot) and (on_dot["dot"] < on_dot["scaled_mm"]).all()  # the route takes the faster kernel there
fig = Figure(figsize=(7.0, 3.0), layout="constrained")
ax = fig.add_subplot()
best.loc[(4096, 14336), ["scaled_mm", "dot", "gemm", "bf16"]].plot(ax=ax, marker="o")
ax.set_ylabel("us per product"); ax.set_xlabel("rows (M)"); ax.set_title("down_proj 4096 x 14336, ptpc FP8 on an H200")
display(best.round(1))
fig
"""),
    ("md", """
Where torch._scaled_mm runs, its cuBLASLt call takes the heuristic's first pick (one 128 x 128
tile at every decode row count). At start-up the engine times cuBLASLt's other candidates with
the same row-wise scales at each CUDA-graph capture size (and a full prefill step) that takes
that route, and where the swap-AB kernel's 128-row tile runs o_proj and down (65-128 rows,
timed against that kernel), as it does for bf16 layers, and keeps the fastest that agrees
within 1e-2 of the largest output (`atom.tuning.gemm_choice`). Which of the Llama products it
times, by rows (no GPU needed; on a GPU `llm.engine.runner.plan.to_frame()` lists each choice
with the engine's and the chosen kernel's microseconds):
"""),
    ("code", """
from atom.tuning.gemm_choice import is_timed
sizes = [1, 8, 64, 65, 96, 128, 129, 192, 256, 512]
timed = pd.DataFrame([dict(layer=l, M=m, timed=is_timed(m, torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta")))
                      for l, (n, k) in LLAMA.items() for m in sizes]).pivot(index="layer", columns="M", values="timed")
assert not timed[[1, 64]].any().any() and timed[[129, 512]].all().all()
both = [m for m in sizes if m in routes.columns]
# timed where scaled_mm runs, and where the swap-AB kernel runs from 65 rows
want = routes[both].apply(lambda col: (col == "scaled_mm") | ((col == "dot") & (col.name >= 65)))
assert (timed[both] == want).all().all()
timed
"""),
    ("md", """
At one row the ptpc FP8 products run `fp8_gemv1`, whose tile (rows a program, loads a step,
warps, words a load) was chosen from an H100's probe. At start-up the engine times the table's
tile and a few candidates per weight shape in CUDA graphs and runs a candidate where it is 2%
faster (`atom.tuning.fp8_tile_choice`; on a GPU `plan.to_frame()` shows rows of kind
"fp8_gemv1"). The same rule applied to the H100 probe checked in under `docs/perf/raw`: there
the table's tile stays at every Llama shape (no candidate is 2% faster), which is how the table
was made; another GPU's timings can pick otherwise.
"""),
    ("code", """
from atom.model_ops.kernels import fp8_gemv1
from atom.tuning import fp8_tile_choice
raw = pathlib.Path(atom.__file__).resolve().parents[1] / "docs" / "perf" / "raw" / "2026-12-06g-h100-call5-fp8-h2-probe.json"
probe = [r for r in json.loads(raw.read_text())["rows"]
         if r["kind"] == "ptpc" and not r["word_cache"] and not r["scales_first"]]
tile_rows = []
for (n, k), grp in pd.DataFrame(probe).groupby(["N", "K"]):
    us = {(r.BLOCK_N, r.BLOCK_W, r.num_warps, r.DW, r.AHEAD): r.us for r in grp.itertuples()}
    us = {t: v for t, v in us.items() if t in fp8_tile_choice.CANDIDATES and fp8_gemv1.even(n, k, t)}
    table = fp8_gemv1.tile_for(n, k)
    fastest = min(us, key=us.get)
    tile_rows.append(dict(N=n, K=k, table_tile=str(table), table_us=us[table], fastest=str(fastest),
                          fastest_us=us[fastest], runs=str(fp8_tile_choice.pick(us, table) or table)))
tile_choice = pd.DataFrame(tile_rows).set_index(["N", "K"])
assert (tile_choice["runs"] == tile_choice["table_tile"]).all()  # on this H100 no candidate is 2% faster
tile_choice.round(1)
"""),
    ("md", """
The quantizers divide each activation by its row's scale with a correctly rounded division.
`act_quant.div_by` and the one-row FP8 product quantizing its row on load ("quant_on_load",
`fp8_gemv1.fp8_gemv1_pending_launch`) get that quotient from one reciprocal r = 1 / xs a row
and two FMAs a value (Markstein's correction: q0 = x r, then q0 + (x - q0 xs) r), where
`div_rn` takes ~10 instructions and a slow-path branch a value; `fp8_gemv1.qx_ref` models the
on-load path in torch. Over every finite 16-bit value and a few scales whose reciprocal is
inexact, how many e4m3 values differ from `act_quant`'s, with the correction and with the
product x r alone:
"""),
    ("code", """
from atom.model_ops.kernels import fp8_gemv1
from atom.model_ops.kernels.act_quant import act_quant_ref
e4m3 = lambda v: v.clamp(-448, 448).to(torch.float8_e4m3fn).float()
rows = []
for dtype in (torch.bfloat16, torch.float16):
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    for amax in (1.0, 69.0, 76.0, 3968.0):
        h = every[torch.isfinite(every) & (every.float().abs() <= amax)]
        h = torch.cat([h, torch.tensor([amax], dtype=dtype)])[None, :]
        pm = h.float().abs().amax(1, keepdim=True)
        q, xs = fp8_gemv1.qx_ref(h, pm)
        ref, _ = act_quant_ref(h, "fp8", h.shape[1], 448.0)
        alone = e4m3(h.float() * (torch.ones(1) / xs))
        rows.append({"row": str(dtype)[6:], "amax": amax, "values": h.shape[1],
                     "differ, corrected": int((q.float() != ref.float()).sum()),
                     "differ, x r alone": int((alone != ref.float()).sum())})
on_load = pd.DataFrame(rows).set_index(["row", "amax"])
assert (on_load["differ, corrected"] == 0).all() and on_load["differ, x r alone"].sum() > 0
on_load
"""),
]

GRAPHS = [
    ("md", """
# 06 · CUDA-graph capture sizes and padding waste

On a GPU, a decode batch of `n` sequences replays the captured graph of the smallest size
`>= n`; the rows in between are padding. Which sizes to capture trades capture time and
memory against that waste. The plan needs no GPU: `CompilationConfig.capture_sizes` and
`.padded_size(n)`.
"""),
    ("code", SETUP + """
import pandas as pd
import torch
from atom.config import CompilationConfig
from atom.viz import graph_usage, plot_graph_capture_sizes
default = CompilationConfig()
print(len(default.capture_sizes), "sizes:", default.capture_sizes[:12], "...", default.capture_sizes[-1])
{n: default.padded_size(n) for n in (1, 7, 9, 17, 100, 500, 513)}
"""),
    ("code", """
assert default.capture_sizes[:8] == list(range(1, 9)) and default.capture_sizes[8:11] == [16, 32, 48]
assert default.padded_size(9) == 16 and default.padded_size(100) == 112 and default.padded_size(513) is None
plot_graph_capture_sizes(config=default)
"""),
    ("md", """
## A batch-size trace
nano-vllm's workload with 64 requests, all admitted at once: the decode batch shrinks as
requests finish (output lengths uniform in [100, 512]). Each decode step replays a graph.
"""),
    ("code", """
from atom.benchmarks.workloads import nano_vllm_workload
reqs = nano_vllm_workload(64, max_input=512, max_output=512)
outs = [r.max_tokens for r in reqs]
trace = [sum(o > t for o in outs) for t in range(1, max(outs))]   # sequences alive at decode step t
plans = {
    "default (1..8, then every 16)": default.capture_sizes,
    "powers of two": [1, 2, 4, 8, 16, 32, 64],
    "every size 1..64": list(range(1, 65)),
}
usage = {name: graph_usage(trace, sizes) for name, sizes in plans.items()}
pd.DataFrame({name: {"graphs": len(plans[name]), **{k: u.totals[k] for k in ("graph_steps", "real_tokens", "padded_tokens", "padding_fraction")}}
              for name, u in usage.items()}).T
"""),
    ("code", """
d = usage["default (1..8, then every 16)"]
by_hand = sum(default.padded_size(n) - n for n in trace)
assert d.totals["padded_tokens"] == by_hand and d.totals["graph_steps"] == len(trace)
assert usage["every size 1..64"].totals["padded_tokens"] == 0
assert usage["powers of two"].totals["padded_tokens"] >= d.totals["padded_tokens"]
plot_graph_capture_sizes(trace, plans["powers of two"])
"""),
    ("code", "plot_graph_capture_sizes(trace, default.capture_sizes)"),
    ("md", """
## Steps with prefill tokens: token buckets
A prefill step of a few hundred tokens is bound by the host (Python and kernel launches), not
the GPU, so steps with prefill tokens replay graphs too (graph modes FULL / TR_HYBRID, and the
unset mode at level 0): one per (tokens, sequence rows) bucket, the step padded up to it. The
buckets for an engine's limits, and the padding a trace of prefill lengths would cost:
"""),
    ("code", """
from atom.model_engine.mixed_graphs import bucket_keys, token_buckets
keys = bucket_keys(max_num_batched_tokens=8192, max_num_seqs=256)
buckets = pd.DataFrame(keys, columns=["tokens", "sequence rows"]).groupby("tokens")["sequence rows"].apply(list)
prompts = [40, 200, 300, 513, 700, 1500, 2100]
sizes = token_buckets(8192)
padded = {n: next((t for t in sizes if t >= n), None) for n in prompts}
assert padded[513] == 768 and padded[2100] is None  # past the largest bucket: eager
display(buckets.to_frame())
pd.DataFrame({"prompt tokens": prompts, "bucket": [padded[n] for n in prompts],
              "padding": [(padded[n] - n) if padded[n] else 0 for n in prompts]})
"""),
    ("md", """
## On a GPU: the real replays
With CUDA, the engine records the graph size each step replayed (`graph_size` in the steps
frame; `mixed_graph_tokens` for steps with prefill tokens), and `llm.engine.runner.graphs`
(`.mixed_graphs`) counts replays and padded rows. Without a GPU this section shows what it
would run.
"""),
    ("code", """
if torch.cuda.is_available():
    from atom import LLM, SamplingParams
    from atom.viz import steps_frame
    sizes = [1, 2, 4, 8, 16]
    llm = LLM("embedded", max_model_len=512, max_num_seqs=16, capture_sizes=sizes, enable_log_stats=False)
    lens = [8 + 6 * i for i in range(12)]
    llm.generate([[100 + i] * 16 for i in range(12)], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens], use_tqdm=False)
    g = llm.engine.runner.graphs
    real = graph_usage(llm, sizes)
    print(g)
    assert {s: n for s, n in g.replays.items() if n} == {int(r.graph_size): int(r.replays) for r in real.by_size.itertuples() if r.replays}
    assert g.padded_tokens == real.totals["padded_tokens"]
    print(llm.engine.runner.mixed_graphs)  # the prefill steps' graphs (level 0's unset mode records them)
    display(plot_graph_capture_sizes(llm, sizes))
else:
    print("no GPU: the plan above is all there is to see here (torch.cuda.is_available() is False)")
"""),
]

ROOFLINE = [
    ("md", """
# 07 · Roofline: how fast could it be?

A decode step reads every weight once plus the KV of every running sequence: its floor is
bytes / memory bandwidth. Prefill is bound by FLOPs / peak. `atom.benchmarks.roofline`
computes these floors for a workload; benchmarks report the measured figure as a fraction.
"""),
    ("code", SETUP + """
import json, pathlib, time
import pandas as pd
import torch
import atom
from atom.benchmarks.roofline import H200_BANDWIDTH, H200_BF16_FLOPS, decode_floor_ms, model_cost, workload_floor
from atom.benchmarks.workloads import MODEL_CONFIGS, nano_vllm_workload
from atom.viz import plot_roofline, roofline_frame
costs = {name: model_cost(cfg) for name, cfg in MODEL_CONFIGS.items()}
pd.DataFrame({name: {"params (B)": c.params / 1e9, "weights bf16 (GB)": 2 * c.params / 1e9,
                     "KV per token (KiB)": c.kv_bytes_per_token / 1024, "layers": c.layers} for name, c in costs.items()}).T
"""),
    ("md", "## Floors of the nano-vllm workload on one H200\n256 requests, input and output lengths uniform in [100, 1024]; 4.3 TB/s and 790 TFLOP/s (measured on the lent H200)."),
    ("code", """
w = nano_vllm_workload()
plens, olens = [len(r.prompt_token_ids) for r in w], [r.max_tokens for r in w]
floors = {name: workload_floor(cfg, plens, olens) for name, cfg in MODEL_CONFIGS.items()}
table = pd.DataFrame({name: {"output tokens": f.output_tokens, "floor (s)": f.seconds, "decode (s)": f.decode_seconds,
                             "prefill (s)": f.prefill_seconds, "tok/s ceiling": f.tokens_per_s,
                             "batch-1 decode floor (ms/token)": decode_floor_ms(MODEL_CONFIGS[name], 1, 640)}
                      for name, f in floors.items()}).T
table
"""),
    ("code", """
q, l = floors["qwen3-0.6b"], floors["llama-3.1-8b"]
assert sum(olens) == 133_966 == q.output_tokens
assert q.tokens_per_s > l.tokens_per_s > 0
# batch-1 decode floor by hand: weights (+ a little KV) over bandwidth
by_hand = 2 * costs["llama-3.1-8b"].params / H200_BANDWIDTH * 1e3
assert by_hand < decode_floor_ms(MODEL_CONFIGS["llama-3.1-8b"], 1, 640) < by_hand * 1.02
"""),
    ("md", "The recipes' targets against these bounds (`recipes/qwen3-0.6b-throughput-h200.yaml`, `recipes/llama-3.1-8b-latency-h200.yaml`):"),
    ("code", """
targets = [
    {"name": "qwen3-0.6b nano-vllm (recipe: >= 25k)", "measured": 25_000, "bound": q.tokens_per_s, "unit": "tok/s"},
    {"name": "llama-3.1-8b batch-1 (recipe: <= 4.3)", "measured": 4.3,
     "bound": decode_floor_ms(MODEL_CONFIGS["llama-3.1-8b"], 1, 128 + 256), "unit": "ms/token"},
]
plot_roofline(targets, label="recipe target")
"""),
    ("md", """
## A CPU measurement against its own roofline
The same reasoning on this machine: measure the memory bandwidth here (a large tensor
copy reads and writes every byte), then time batch-1 decode of the embedded model (fp32
weights) and compare.
"""),
    ("code", """
x = torch.empty(64 * 2**20, dtype=torch.float32)   # 256 MiB, far beyond any cache
y = torch.empty_like(x)
y.copy_(x)
times = []
for _ in range(5):
    t0 = time.perf_counter(); y.copy_(x); times.append(time.perf_counter() - t0)
cpu_bandwidth = 2 * x.numel() * x.element_size() / min(times)   # read + write
del x, y
print(f"CPU copy bandwidth: {cpu_bandwidth / 1e9:.1f} GB/s ({torch.get_num_threads()} threads)")
"""),
    ("code", """
from atom import LLM, SamplingParams
from atom.viz import steps_frame
llm = LLM("embedded", max_model_len=512, enable_log_stats=False)
cfg = llm.config.hf_config.to_dict()
dtype_bytes = llm.engine.runner.dtype.itemsize
llm.generate([[200 + i for i in range(32)]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
llm.stats.clear()
llm.generate([[300 + i for i in range(32)]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
steps = steps_frame(llm)
measured_ms = steps.loc[steps["is_decode"], "latency_ms"].median()
floor_ms = decode_floor_ms(cfg, 1, 32 + 12, dtype_bytes=dtype_bytes, bandwidth=cpu_bandwidth)
c = model_cost(cfg, dtype_bytes)
print(f"SmolLM2-135M: {c.params / 1e6:.0f} M params read per step ({dtype_bytes} bytes each); "
      f"floor {floor_ms:.1f} ms/token, measured {measured_ms:.1f} ms/token ({floor_ms / measured_ms:.0%} of roofline)")
"""),
    ("code", """
assert dtype_bytes == 4 and 100e6 < c.params < 170e6
assert abs(floor_ms - (c.params * 4 + 44 * c.kv_bytes_per_token) / cpu_bandwidth * 1e3) < 1e-9
assert measured_ms > 0 and (steps["is_decode"]).sum() >= 20
plot_roofline([{"name": "SmolLM2-135M batch-1 decode (this CPU)", "measured": measured_ms, "bound": floor_ms, "unit": "ms/token"}])
"""),
    ("md", "## Measured GPU results, if any\n`python -m atom.benchmarks.throughput --out docs/perf/raw/NAME.json` writes these; they are plotted against their roofline."),
    ("code", """
perf_dir = pathlib.Path(atom.__file__).resolve().parents[1] / "docs" / "perf" / "raw"
# benchmark results are JSON objects; diagnosis probes (lists of rows) are left out
results = [r for p in sorted(perf_dir.glob("*.json")) if isinstance(r := json.loads(p.read_text()), dict)]
gpu = [r for r in results if "atom_tok_s" in r and "roofline_tok_s" in r]
cpu = [(name, s) for r in results for name, s in r.get("scenarios", {}).items()]
print(f"{len(results)} result files in {perf_dir}: {len(gpu)} with a roofline, {len(cpu)} CPU scenarios")
if cpu:
    display(pd.DataFrame([{"scenario": n, **{k: v for k, v in s.items() if not isinstance(v, dict)}} for n, s in cpu]))
if gpu:
    frame = roofline_frame(gpu)
    assert ((frame["fraction"] > 0) & (frame["fraction"] < 1.5)).all()
    display(plot_roofline(gpu))
"""),
]

NOTEBOOKS = {
    "05_quantization_dispatch": QUANT,
    "06_cuda_graph_capture_sizes": GRAPHS,
    "07_benchmark_roofline": ROOFLINE,
}
