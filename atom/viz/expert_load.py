"""Expert load of a MoE model: how many tokens each expert of each layer got, step by step.

    llm = LLM(moe_model, record_expert_load=True); llm.generate(...)
    expert_load_frame(llm)        # step, layer, expert, tokens, share (of the layer's step)
    expert_load_summary(llm)      # one row per layer: pairs, busiest expert, max/mean load
    plot_expert_load(llm)         # heatmap layer x expert, and max/mean load per step

Every function takes an `LLM` / `LLMEngine` / `EngineStats` or a frame from
`EngineStats.expert_load()`.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from atom.viz.frames import _stats_of

COLUMNS = ["step", "layer", "expert", "tokens"]


def expert_load_frame(src: Any) -> pd.DataFrame:
    """One row per (step, layer, expert): `tokens` routed there and their `share` of the layer's
    (token, expert) pairs in that step."""
    if isinstance(src, pd.DataFrame):
        df = src.copy()
    else:
        stats = _stats_of(src)
        if stats is None:
            raise TypeError(f"cannot read expert load from {type(src).__name__}: pass an LLM, LLMEngine, "
                            "EngineStats or a DataFrame")
        df = stats.expert_load()
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"this DataFrame is not an expert-load frame: it lacks {missing}")
    total = df.groupby(["step", "layer"])["tokens"].transform("sum")
    df["share"] = (df["tokens"] / total.where(total > 0)).fillna(0.0)
    return df


def expert_load_summary(src: Any) -> pd.DataFrame:
    """Per layer over all steps: pairs, the busiest expert and its share, max/mean load
    (1.0 = perfectly balanced), experts that never got a token."""
    df = expert_load_frame(src)
    per = df.groupby(["layer", "expert"])["tokens"].sum().reset_index()
    rows = []
    for layer, g in per.groupby("layer"):
        t = g["tokens"].to_numpy()
        mean = t.mean() if len(t) else 0.0
        rows.append({"layer": layer, "pairs": int(t.sum()), "busiest_expert": int(g["expert"].iloc[t.argmax()]),
                     "busiest_share": float(t.max() / t.sum()) if t.sum() else 0.0,
                     "max_over_mean": float(t.max() / mean) if mean else 0.0, "idle_experts": int((t == 0).sum())})
    return pd.DataFrame(rows)


def plot_expert_load(src: Any, figsize=(11.0, 4.0)) -> Figure:
    """Left: each layer's share of tokens per expert over all steps (heatmap). Right: the load
    imbalance (busiest expert / mean) of each layer in each step."""
    df = expert_load_frame(src)
    fig = Figure(figsize=figsize, layout="constrained")
    heat, line = fig.subplots(1, 2, width_ratios=[3, 2])
    if df.empty:
        heat.set_title("no routing recorded (LLM(..., record_expert_load=True))")
        return fig
    grid = df.groupby(["layer", "expert"])["tokens"].sum().unstack(fill_value=0)
    share = grid.div(grid.sum(axis=1).replace(0, np.nan), axis=0).fillna(0.0)
    im = heat.imshow(share.to_numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    heat.set_yticks(range(len(share.index)), [str(i) for i in share.index])
    heat.set_xlabel("expert")
    heat.set_ylabel("layer")
    heat.set_title("share of tokens per expert (all steps)")
    fig.colorbar(im, ax=heat, label="share of the layer's pairs")
    per_step = df.groupby(["layer", "step"])["tokens"].agg(["max", "mean"])
    imbalance = (per_step["max"] / per_step["mean"].replace(0, np.nan)).dropna()
    for layer, s in imbalance.groupby(level="layer"):
        line.plot(s.index.get_level_values("step"), s.to_numpy(), lw=1, label=f"layer {layer}")
    line.axhline(1.0, color="gray", lw=0.8, ls="--")
    line.set_xlabel("step")
    line.set_ylabel("busiest expert / mean")
    line.set_title("load imbalance per step")
    line.legend(fontsize="small")
    line.grid(alpha=0.3)
    return fig
