"""Cells of notebook 09: which layers of SmolLM2 mind being quantized (see _build.py)."""

from _cells_engine import SETUP

SENSITIVITY = [
    ("md", """
# 09 · Quantization sensitivity: which layers mind being quantized

`atom.quant.SensitivityExplorer` loads a model once, computes its logits on a text
(teacher forced: the text is one prefill), then quantizes one group of linear layers at a
time — in place, the way `online_quant_config` does at load — and measures how far the
next-token distributions move: mean KL divergence against the unquantized model, top-1
agreement and perplexity. Each group is put back before the next, and the forward resumes
at the first decoder layer that changed, so a row costs at most one forward of the text.

We look at the embedded SmolLM2-135M with per-channel FP8 (`ptpc_fp8`): coarse first (by
projection kind, by decoder layer), then layer by layer where it matters, and finally
write the `online_quant_config` that leaves the most sensitive layers unquantized.
"""),
    ("code", SETUP + """
from atom.quant import SensitivityExplorer, online_config, plot_sensitivity, write_online_config
ex = SensitivityExplorer("embedded", max_tokens=64)   # the default text, cut to 64 tokens
ex
"""),
    ("md", "## By projection kind\nAll 30 layers of one kind quantized at once: four rows. Int4 with groups of 64 (`w4a16_g64`) beside FP8."),
    ("code", """
import pandas as pd
kinds = pd.concat({fmt: ex.run(fmt, by="kind").set_index("group")[["kl", "top1", "ppl"]]
                   for fmt in ("ptpc_fp8", "w4a16_g64")}, axis=1)
print(kinds.round(4).to_string())
assert (kinds.xs("kl", axis=1, level=1) >= 0).all().all()
assert kinds.xs("top1", axis=1, level=1).stack().between(0, 1).all()
# 4-bit weights move the model much more than 8-bit ones, kind by kind
assert (kinds[("w4a16_g64", "kl")] > kinds[("ptpc_fp8", "kl")]).all()
"""),
    ("md", "## By decoder layer\nOne row per decoder layer (its four linear layers together)."),
    ("code", """
dec = ex.run("ptpc_fp8", by="decoder")
assert len(dec) == 30 and (dec["kl"] >= 0).all() and dec["top1"].between(0, 1).all()
print(dec.sort_values("kl", ascending=False).head(5)[["group", "kl", "top1", "ppl"]].to_string(index=False))
plot_sensitivity(dec)
"""),
    ("md", "## Layer by layer, inside the two most sensitive decoder layers"),
    ("code", """
top2 = list(dec.sort_values("kl", ascending=False)["group"].head(2))
fine = ex.run("ptpc_fp8", by="layer", within=top2)
assert len(fine) == 8 and set(fine["group"].str.rsplit(".", n=2).str[0]) == set(top2)
print(fine[["group", "kl", "top1", "bytes_before", "bytes_after"]].to_string(index=False))
plot_sensitivity(fine)
"""),
    ("md", """
## A configuration that leaves them out
`online_config(table, keep=N)` quantizes everything but the N most sensitive groups; `evaluate`
measures the whole configuration (all its layers quantized together) against quantizing
everything. The file it writes is what `--online_quant_config` takes.
"""),
    ("code", """
import json, os, tempfile
path = os.path.join(tempfile.mkdtemp(), "online_quant_config.json")
cfg = write_online_config(dec, keep=2, path=path)
print(json.load(open(path)))
everything_fp8 = ex.evaluate({"global_quant_config": "ptpc_fp8"})
rows = {"everything ptpc_fp8": everything_fp8, "2 decoder layers left out": ex.evaluate(cfg)}
summary = pd.DataFrame(rows).T[["kl", "top1", "ppl", "layers_quantized", "linear_bytes"]]
print(summary.to_string())
assert cfg["exclude_layer"] == top2 and summary["layers_quantized"].tolist() == [120, 112]
assert summary["kl"].iloc[1] < summary["kl"].iloc[0]
"""),
    ("md", """
## A format per layer, at the size of a uniform one
Leaving layers out costs bytes. At a fixed size the explorer can do better than one format
everywhere: with a table per candidate format (one layer at a time), `choose_formats` picks a
format for each layer so that the summed KL is least within a byte budget — the upgrades that
save the most KL per added byte first. Here the budget is what uniform int4 with groups of 32
(`w4a16_g32`) takes, and the candidates are the two formats `--online_quant_config` accepts:
MXFP4 (4.25 bits a weight) and per-channel FP8.
"""),
    ("code", """
from atom.quant import choose_formats, mixed_config, plot_choice
tables = [ex.run(fmt) for fmt in ("mxfp4", "ptpc_fp8")]          # 2 x 120 rows
uniform = {fmt: ex.evaluate({"global_quant_config": fmt}) for fmt in ("mxfp4", "w4a16_g32")}
uniform["ptpc_fp8"] = everything_fp8                               # evaluated above
choice = choose_formats(tables, budget_bytes=uniform["w4a16_g32"]["linear_bytes"])
print(choice["format"].value_counts().to_string())
plot_choice(choice)
"""),
    ("code", """
mix = mixed_config(choice)                  # an online_quant_config: a global format, the others by name
rows = {**{f"everything {fmt}": r for fmt, r in uniform.items()}, "the mix (w4a16_g32's size)": ex.evaluate(mix)}
same_size = pd.DataFrame(rows).T[["kl", "top1", "ppl", "linear_bytes"]]
print(same_size.to_string())
assert mix["global_quant_config"] in ("mxfp4", "ptpc_fp8") and len(mix["layer_quant_config"]) > 0
assert same_size["linear_bytes"].iloc[-1] <= same_size["linear_bytes"].loc["everything w4a16_g32"]
assert same_size["kl"].iloc[-1] < 0.8 * same_size["kl"].loc["everything w4a16_g32"]
"""),
]

NOTEBOOKS = {"09_quant_sensitivity": SENSITIVITY}
