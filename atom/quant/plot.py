"""The sensitivity table as a bar chart (atom.viz style: one Figure, an optional Axes)."""
from __future__ import annotations

import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from atom.viz.plots import _axes


def plot_sensitivity(df: pd.DataFrame, ax: Axes | None = None, top: int | None = None) -> Figure:
    """KL divergence per group (bars, log scale) and top-1 agreement (points, right axis),
    in model order; `top` keeps only the most sensitive groups."""
    data = df.dropna(subset=["kl"])
    if top is not None:
        data = data.sort_values("kl", ascending=False).head(top).sort_index()
    fig, ax = _axes(ax, figsize=(max(6.4, 0.18 * len(data)), 4.0))
    x = range(len(data))
    ax.bar(x, data["kl"].clip(lower=1e-12), color="tab:blue", label="KL (nats)")
    ax.set_yscale("log")
    ax.set_ylabel("mean KL vs unquantized (nats)")
    labels = [g.replace("model.layers.", "L").replace("self_attn.", "").replace("mlp.", "") for g in data["group"]]
    ax.set_xticks(list(x), labels, rotation=90, fontsize=7)
    right = ax.twinx()
    right.plot(list(x), data["top1"] * 100, "o", color="tab:orange", markersize=3, label="top-1 agreement")
    right.set_ylabel("top-1 agreement (%)")
    fmt, by = df.attrs.get("format", "?"), df.attrs.get("by", "?")
    ax.set_title(f"sensitivity to {fmt}, one {by} at a time")
    return fig


def plot_choice(choice: pd.DataFrame, ax: Axes | None = None) -> Figure:
    """A `choose_formats` table as bars, one per group in model order: its table KL (log
    scale) coloured by the format chosen for it; the title gives the bytes against the budget."""
    fig, ax = _axes(ax, figsize=(max(6.4, 0.18 * len(choice)), 4.0))
    colours: dict[str, str] = {}
    for i, row in enumerate(choice.itertuples(index=False)):
        first = row.format not in colours
        c = colours.setdefault(row.format, f"C{len(colours)}")
        ax.bar(i, max(row.kl, 1e-12), color=c, label=row.format if first else None)
    ax.set_yscale("log")
    ax.set_ylabel("the group's own KL in its format (nats)")
    labels = [g.replace("model.layers.", "L").replace("self_attn.", "").replace("mlp.", "") for g in choice["group"]]
    ax.set_xticks(range(len(choice)), labels, rotation=90, fontsize=7)
    ax.legend(fontsize=8)
    a = choice.attrs
    if "budget" in a:
        ax.set_title(f"formats chosen within {a['budget'] / 2**20:.1f} MiB ({a['bytes'] / 2**20:.1f} MiB used)")
    return fig
