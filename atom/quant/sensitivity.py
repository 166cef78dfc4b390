"""Which layers mind being quantized: quantize one layer (or one group) at a time and
measure how far the model moves, teacher forced on a text.

    ex = SensitivityExplorer("embedded")                 # or a path, or an LLM
    df = ex.run("ptpc_fp8", by="layer")                  # one row per linear layer
    plot_sensitivity(df)
    cfg = online_config(df, keep=4)                      # the 4 most sensitive left unquantized
    ex.evaluate(cfg)                                     # the whole configuration's figures

One model is loaded once; each group's layers are re-quantized in place
(`atom.model_ops.quant.online.requantize_layer`, the path `online_quant_config` takes),
scored against the unquantized logits computed once, and put back, so a row costs one
forward of the text. Groups (`by`): "layer" (each linear layer), "decoder" (all linear
layers of one decoder layer) or "kind" (all layers of one projection kind: qkv_proj,
o_proj, gate_up_proj, down_proj).
"""
from __future__ import annotations

import json
import logging
import math
import re
from typing import Any, Optional

import pandas as pd

from atom.model_loader.online_quant import OnlineQuantPlan, linear_layers
from atom.model_ops.quant.online import requantize_layer, target_for
from atom.quant.metrics import Reference, TeacherForcedRun
from atom.quant.text import TEXT
from atom.quant_spec import ONLINE_QUANT_FORMATS

logger = logging.getLogger(__name__)

GROUPINGS = ("layer", "decoder", "kind")
COLUMNS = ["group", "layers", "kl", "kl_max", "top1", "ppl", "bytes_before", "bytes_after", "rank", "status"]


def _first_decoder(names: list[str]) -> int:
    """The first decoder layer index among `names` (0 when one is outside a decoder layer):
    the layers before it are unchanged, so the forward resumes there."""
    idx = [re.search(r"\.layers\.(\d+)\.", n) for n in names]
    return min(int(m.group(1)) for m in idx) if idx and all(idx) else 0


def _decoder_of(name: str) -> str:
    m = re.match(r"(.*\.layers\.\d+)\.", name)
    return m.group(1) if m else name


class SensitivityExplorer:
    """One loaded model, its unquantized logits on `text` (a string, or token ids), and
    per-group quantization runs. `model`: an `LLM`, a model path or "embedded"
    (`llm_kwargs` go to `LLM`); `max_tokens` cuts the text."""

    def __init__(self, model: Any = "embedded", text: str | list[int] | None = None, max_tokens: int = 256,
                 **llm_kwargs):
        from atom import LLM
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
            raise ValueError(f"max_tokens={max_tokens!r} is invalid: must be an int >= 2")
        if isinstance(model, LLM):
            self.llm = model
        else:
            kw = {"enable_log_stats": False, "num_kvcache_blocks": -(-max_tokens // 16) + 1}
            kw.update(llm_kwargs)
            self.llm = LLM(model, **kw)
        text = TEXT if text is None else text
        if isinstance(text, str):
            if self.llm.tokenizer is None:
                raise ValueError("text is a string but the model has no tokenizer: pass token ids")
            text = self.llm.tokenizer.encode(text)
        self.token_ids = [int(t) for t in text][:max_tokens]
        if len(self.token_ids) < 2:
            raise ValueError(f"text={text!r} is invalid: needs at least 2 tokens")
        self.runner = self.llm.engine.runner
        self.layers = linear_layers(self.runner.model)
        self.forward = TeacherForcedRun(self.runner, self.token_ids)
        self.base = self.forward.logits()  # also records each decoder layer's input
        self.reference = Reference(self.base, self.token_ids)  # base's terms of the scores, once

    def groups(self, by: str = "layer") -> dict[str, list[str]]:
        """Group name -> the linear layers in it, in model order."""
        if by not in GROUPINGS:
            raise ValueError(f"by={by!r} is invalid: must be one of {GROUPINGS}")
        out: dict[str, list[str]] = {}
        for name in self.layers:
            key = {"layer": name, "decoder": _decoder_of(name), "kind": name.rsplit(".", 1)[-1]}[by]
            out.setdefault(key, []).append(name)
        return out

    def quantized_scores(self, fmt: str, names: list[str]) -> dict[str, Any]:
        """Scores with `names` quantized to `fmt` (all others as loaded), then restored."""
        undos, before, after = [], 0, 0
        try:
            for n in names:
                layer = self.layers[n]
                before += layer.method.weight_bytes(layer)
                undos.append(requantize_layer(layer, target_for(fmt, n)))
                after += layer.method.weight_bytes(layer)
            out = self.reference.scores(self.forward.logits(start=_first_decoder(names)))
        finally:
            for undo in reversed(undos):
                undo()
        return {**out, "bytes_before": before, "bytes_after": after}

    def run(self, fmt: str, by: str = "layer", within: list[str] | str | None = None) -> pd.DataFrame:
        """One row per group: KL (mean / max, nats), top-1 agreement and perplexity with only
        that group quantized to `fmt`, its weight bytes before / after, and `rank` (1: the
        largest KL). A group whose layers the format cannot hold gets NaNs and `status`.
        `within`: only the groups whose layers lie under these module names (e.g. the
        decoder layers a coarser run found sensitive)."""
        target_for(fmt, "", "fmt")  # a bad / unavailable format fails before any work
        prefixes = [within] if isinstance(within, str) else within
        groups = self.groups(by)
        if prefixes is not None:
            groups = {g: names for g, names in groups.items()
                      if all(any(n == p or n.startswith(p + ".") for p in prefixes) for n in names)}
            if not groups:
                raise ValueError(f"within={within!r} is invalid: no {by} group lies under it")
        rows = []
        for group, names in groups.items():
            row = {"group": group, "layers": len(names), "status": "ok"}
            try:
                row.update(self.quantized_scores(fmt, names))
            except NotImplementedError as exc:
                row.update(kl=math.nan, kl_max=math.nan, top1=math.nan, ppl=math.nan, status=f"refused: {exc}")
            rows.append(row)
        df = pd.DataFrame(rows)
        for col in COLUMNS:
            if col not in df:
                df[col] = math.nan
        df["rank"] = df["kl"].rank(ascending=False, method="first")
        df = df[COLUMNS]
        base = self.reference.scores(self.base)
        df.attrs.update(format=fmt, by=by, tokens=len(self.token_ids), ppl_base=base["ppl_base"])
        return df

    def evaluate(self, cfg: dict) -> dict[str, Any]:
        """The figures of a whole `online_quant_config` (every layer it targets quantized)."""
        plan = OnlineQuantPlan(cfg)
        names_by_fmt: dict[str, list[str]] = {}
        for name, (fmt, _field) in plan.targets(self.runner.model).items():
            if fmt is not None:
                names_by_fmt.setdefault(fmt, []).append(name)
        undos, before, after = [], 0, 0
        try:
            for fmt, names in names_by_fmt.items():
                for n in names:
                    layer = self.layers[n]
                    before += layer.method.weight_bytes(layer)
                    undos.append(requantize_layer(layer, target_for(fmt, n)))
                    after += layer.method.weight_bytes(layer)
            out = self.reference.scores(self.forward.logits())
        finally:
            for undo in reversed(undos):
                undo()
        total = sum(m.method.weight_bytes(m) for m in self.layers.values())
        return {**out, "layers_quantized": len(undos), "linear_bytes": total - before + after,
                "linear_bytes_unquantized": total}

    def __repr__(self) -> str:
        return (f"SensitivityExplorer({type(self.runner.model).__name__}, {len(self.layers)} linear layers, "
                f"{len(self.token_ids)} tokens)")


def most_sensitive(df: pd.DataFrame, n: int) -> list[str]:
    """The `n` groups with the largest KL."""
    return list(df.dropna(subset=["kl"]).sort_values("kl", ascending=False)["group"].head(n))


def online_config(df: pd.DataFrame, keep: int, fmt: Optional[str] = None) -> dict:
    """An `online_quant_config` that quantizes everything to `fmt` (default: the table's)
    but the `keep` most sensitive groups of `df` (excluded by exact name or prefix: a
    decoder layer's name covers its layers; a projection kind becomes the glob `*.<kind>`)."""
    fmt = fmt or df.attrs.get("format")
    if fmt not in ONLINE_QUANT_FORMATS:
        raise ValueError(f"fmt={fmt!r} is invalid for online_quant_config: must be one of "
                         f"{sorted(ONLINE_QUANT_FORMATS)} (the guide's target formats)")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ValueError(f"keep={keep!r} is invalid: must be an int >= 0")
    kind = df.attrs.get("by") == "kind"
    exclude = [f"*.{g}" if kind else g for g in most_sensitive(df, keep)]
    return {"global_quant_config": fmt, "exclude_layer": exclude}


def write_online_config(df: pd.DataFrame, keep: int, path: str, fmt: Optional[str] = None) -> dict:
    """`online_config(df, keep, fmt)` written to `path` as JSON (what --online_quant_config takes)."""
    cfg = online_config(df, keep, fmt)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return cfg
