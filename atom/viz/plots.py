"""Plots of what the engine did. Each returns a matplotlib `Figure` (built without pyplot,
so it works under any backend, Agg included, and shows inline in Jupyter).

Every plot takes a live `LLM` / `LLMEngine` / `EngineStats` or a DataFrame saved earlier
(`load_frames`), and an optional `ax` to draw into.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from atom.viz.frames import graph_usage, requests_frame, roofline_frame, steps_frame, windowed_hit_rate

logger = logging.getLogger(__name__)


def register_ipython_display() -> bool:
    """Show `Figure`s returned by a notebook cell as PNG, whatever the matplotlib backend.

    Figures built without pyplot have no inline display of their own; this registers one
    with the running IPython (once; a formatter already there, e.g. from the inline
    backend, is kept). Called when `atom.viz` is imported. Returns True if registered.
    """
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    if ip is None or not hasattr(ip, "display_formatter"):
        return False
    png = ip.display_formatter.formatters["image/png"]
    if _has_printer(png):
        return False
    from IPython.core.pylabtools import print_figure
    png.for_type(Figure, lambda fig: print_figure(fig, "png", bbox_inches="tight"))
    return True


def _has_printer(formatter) -> bool:
    try:
        formatter.lookup_by_type(Figure)
        return True
    except KeyError:
        return False


register_ipython_display()


def _axes(ax: Axes | None, figsize=(6.4, 4.0)) -> tuple[Figure, Axes]:
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def plot_chunk_latency(src: Any, ax: Axes | None = None) -> Figure:
    """Step latency (ms) against tokens run in the step, one point per step, coloured by
    the largest prefill chunk of the step (0: decode only)."""
    df = steps_frame(src)
    fig, ax = _axes(ax)
    pts = ax.scatter(df["tokens"], df["latency_ms"], c=df["max_chunk"], cmap="viridis", s=18,
                     label="step")
    fig.colorbar(pts, ax=ax, label="largest prefill chunk (tokens)")
    ax.set_xlabel("tokens in step (prefill + decode)")
    ax.set_ylabel("step latency (ms)")
    ax.set_title(f"step latency vs tokens per step ({len(df)} steps)")
    ax.grid(alpha=0.3)
    return fig


def plot_prefix_cache_hit_rate(src: Any, window: int = 16, block_size: int | None = None,
                               ax: Axes | None = None) -> Figure:
    """Prefix-cache hit rate over finished requests: windowed (line), cumulative (dashed),
    and each request's cached fraction of its prompt (points)."""
    df = requests_frame(src)
    w = windowed_hit_rate(df, window, block_size)
    fig, ax = _axes(ax)
    ax.plot(w["index"], w["hit_rate"], label=f"hit rate, last {window} requests")
    ax.plot(w["index"], w["cumulative_hit_rate"], ls="--", label="cumulative hit rate")
    ax.scatter(range(len(df)), df["cached_fraction"], s=12, alpha=0.6, color="gray",
               label="cached fraction of each prompt")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("finished request #")
    ax.set_ylabel("prefix-cache hit rate")
    ax.set_title("prefix cache")
    ax.legend(loc="lower right", fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def plot_graph_capture_sizes(steps: Any = None, capture_sizes: Iterable[int] | None = None,
                             config: Any = None, max_batch: int | None = None) -> Figure:
    """CUDA-graph capture sizes against batch sizes.

    Top: the plan -- the graph size a decode batch of `n` replays, and the padding it
    wastes (shaded). Bottom (when `steps` is given: a steps frame, an LLM, or a trace of
    batch sizes): how often each batch size was seen and the padded tokens per graph size.
    `capture_sizes` may come from `config` (a Config or CompilationConfig).
    """
    if capture_sizes is None:
        if config is None:
            raise ValueError("plot_graph_capture_sizes needs capture_sizes or a config")
        cc = getattr(config, "compilation_config", config)
        capture_sizes = cc.capture_sizes
    sizes = sorted({int(s) for s in capture_sizes})
    usage = graph_usage(steps, sizes) if steps is not None else None
    if max_batch:
        top = int(max_batch)
    elif usage is not None:  # zoom on the batch sizes seen (and the graph that covers them)
        seen_max = usage.totals["max_batch_size"]
        i = int(np.searchsorted(sizes, seen_max))
        top = max(8, seen_max, sizes[i] if i < len(sizes) else seen_max)
    else:
        top = sizes[-1] if sizes else 8
    fig = Figure(figsize=(7.0, 6.0 if usage is not None else 3.6), layout="constrained")
    axes = fig.subplots(2 if usage is not None else 1, 1, squeeze=False)[:, 0]
    ax = axes[0]
    bs = np.arange(1, top + 1)
    idx = np.searchsorted(sizes, bs)
    padded = np.array([sizes[i] if i < len(sizes) else np.nan for i in idx], dtype=float)
    ok = ~np.isnan(padded)
    ax.bar(bs[ok], padded[ok] - bs[ok], bottom=bs[ok], width=1.0, color="tab:red", alpha=0.35,
           label="padding rows")
    ax.plot(bs, padded, drawstyle="steps-mid", color="tab:blue", label="graph size replayed")
    ax.plot(bs, bs, color="gray", lw=0.8, label="batch size")
    shown = [s for s in sizes if s <= top]
    ax.scatter(shown, shown, marker="o", s=14, color="tab:blue", zorder=3, label="captured sizes")
    if top > (sizes[-1] if sizes else 0):
        ax.axvspan(sizes[-1] + 0.5 if sizes else 0.5, top + 0.5, color="gray", alpha=0.1,
                   label="no graph (eager)")
    ax.set_xlim(0.5, top + 0.5)
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("graph size")
    ax.set_title(f"capture plan: {len(sizes)} sizes, up to {sizes[-1] if sizes else 0}")
    ax.legend(fontsize="small", loc="upper left")
    ax.grid(alpha=0.3)
    if usage is not None:
        ax2 = axes[1]
        used = usage.by_size[usage.by_size["replays"] > 0]
        labels = [str(g) for g in used["graph_size"]]
        ax2.bar(labels, used["real_tokens"], color="tab:blue", label="real rows")
        ax2.bar(labels, used["padded_tokens"], bottom=used["real_tokens"], color="tab:red", alpha=0.6,
                label="padding rows")
        eager = usage.steps[usage.steps["graph_size"].isna() & usage.steps["is_decode"]]
        if len(eager):
            ax2.bar(["no graph"], [int(eager["batch_size"].sum())], color="tab:gray",
                    label="decode rows run eagerly")
        t = usage.totals
        ax2.set_title(f"{t['graph_steps']} graph steps, {t['eager_steps']} eager; "
                      f"padding {t['padded_tokens']} rows ({t['padding_fraction']:.1%})")
        ax2.set_xlabel("graph size replayed")
        ax2.set_ylabel("rows computed (all steps)")
        ax2.legend(fontsize="small")
        ax2.grid(alpha=0.3, axis="y")
    return fig


def plot_kv_usage(src: Any, x: str = "step", ax: Axes | None = None) -> Figure:
    """KV-cache usage (fraction of blocks in use) after each step, with the number of
    running sequences on a second axis. `x`: "step" or "elapsed" (seconds)."""
    if x not in ("step", "elapsed"):
        raise ValueError(f"x={x!r} is invalid: must be 'step' or 'elapsed'")
    df = steps_frame(src)
    fig, ax = _axes(ax)
    ax.plot(df[x], df["kv_usage"] * 100, color="tab:purple", label="KV usage")
    ax.set_ylabel("KV blocks in use (%)")
    ax.set_xlabel("step" if x == "step" else "time (s)")
    ax.set_ylim(0, max(1.0, float(df["kv_usage"].max() * 100 * 1.1) if len(df) else 1.0))
    pre = df[df["preemptions"] > 0]
    if len(pre):
        ax.scatter(pre[x], pre["kv_usage"] * 100, color="tab:red", marker="x", label="preemption")
    twin = ax.twinx()
    twin.plot(df[x], df["num_seqs"], color="tab:gray", lw=0.8, alpha=0.7, label="sequences in step")
    twin.set_ylabel("sequences in step")
    ax.set_title("KV cache usage")
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def plot_roofline(points: Any, ax: Axes | None = None, label: str = "measured") -> Figure:
    """Measured figures against the bound from `atom.benchmarks.roofline`: one pair of bars
    per row (measured, bound), annotated with the fraction of the bound reached.

    `points`: rows for `roofline_frame` (name, measured, bound, unit), throughput JSONs,
    or a DataFrame of them. Rows of different units get one panel each. `label` names the
    first bar of each pair (e.g. "recipe target" for figures that were not measured).
    """
    df = roofline_frame(points)
    units = list(dict.fromkeys(df["unit"])) or ["tok/s"]
    if ax is not None and len(units) > 1:
        raise ValueError(f"points mix units {units}: plot them without ax (one panel per unit)")
    if ax is None:
        fig = Figure(figsize=(8.5, 1.2 + 0.9 * max(1, len(df)) * (1 if len(units) == 1 else 1.2)),
                     layout="constrained")
        axes = fig.subplots(len(units), 1, squeeze=False)[:, 0]
    else:
        fig, axes = ax.figure, [ax]
    for a, unit in zip(axes, units):
        d = df[df["unit"] == unit].reset_index(drop=True)
        y = np.arange(len(d))
        a.barh(y - 0.2, d["measured"], height=0.38, color="tab:blue", label=label)
        a.barh(y + 0.2, d["bound"], height=0.38, color="tab:gray", alpha=0.6,
               label="roofline " + ("ceiling" if unit == "tok/s" else "floor"))
        for i, r in d.iterrows():
            a.text(r["measured"], i - 0.2, f" {r['fraction']:.0%} of roofline", va="center", fontsize="small")
        a.set_yticks(y, d["name"])
        a.invert_yaxis()
        a.set_xlabel(unit)
        a.set_title(f"{label} vs roofline (" + ("higher is better" if unit == "tok/s" else "lower is better") + ")")
        a.set_xlim(0, 1.45 * float(max(d["measured"].max(), d["bound"].max())))
        a.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        a.grid(alpha=0.3, axis="x")
    return fig
