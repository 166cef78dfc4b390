"""atom.viz: frames computed by hand on small synthetic records, figures inspected
(axes, lines, points), and a real run of the tiny random Llama."""
from __future__ import annotations

import io
import math

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PathCollection
from matplotlib.figure import Figure
from rich.console import Console

from atom.viz import (Frames, graph_usage, load_frames, plot_chunk_latency, plot_graph_capture_sizes,
                      plot_kv_usage, plot_prefix_cache_hit_rate, plot_roofline, recipe_table, requests_frame,
                      roofline_frame, run_summary, save_frames, steps_frame, summary_table, windowed_hit_rate)


def _step(step, t, lat, n, pre, dec, chunks, kv, hit=0, query=0, preempt=0, graph=None):
    return dict(step=step, time=t, latency=lat, schedule_s=0.001, run_s=lat - 0.001, num_seqs=n,
                prefill_tokens=pre, decode_tokens=dec, num_sampled=n, chunk_sizes=chunks, kv_usage=kv,
                prefix_hit_tokens=hit, prefix_query_tokens=query, preemptions=preempt, graph_size=graph)


@pytest.fixture
def steps_df() -> pd.DataFrame:
    return pd.DataFrame([
        _step(1, 10.00, 0.10, 2, 30, 0, [16, 14], 0.10, hit=16, query=32),
        _step(2, 10.10, 0.05, 2, 0, 2, [], 0.10),
        _step(3, 10.15, 0.05, 3, 10, 2, [10], 0.20),
        _step(4, 10.20, 0.04, 3, 0, 3, [], 0.20),
        _step(5, 10.24, 0.03, 5, 0, 5, [], 0.30, preempt=1),
        _step(6, 10.27, 0.03, 1, 0, 1, [], 0.05),
    ])


@pytest.fixture
def requests_df() -> pd.DataFrame:
    return pd.DataFrame([
        dict(request_id=str(i), prompt_tokens=p, output_tokens=4, cached_tokens=c, preemptions=0,
             ttft=0.1 * (i + 1), tpot=0.02, e2e=0.2 * (i + 1), finish_reason="length")
        for i, (p, c) in enumerate([(40, 0), (40, 32), (20, 16), (33, 32)])
    ])


# --- frames -------------------------------------------------------------------------
def test_steps_frame_derived_columns(steps_df):
    df = steps_frame(steps_df)
    assert df["tokens"].tolist() == [30, 2, 12, 3, 5, 1]
    assert df["max_chunk"].tolist() == [16, 0, 10, 0, 0, 0]
    assert df["is_decode"].tolist() == [False, True, False, True, True, True]
    assert df["elapsed"].round(6).tolist() == [0.0, 0.1, 0.15, 0.2, 0.24, 0.27]
    assert df["latency_ms"].round(6).tolist() == [100.0, 50.0, 50.0, 40.0, 30.0, 30.0]
    assert df["tok_per_s"].iloc[0] == pytest.approx(300.0)
    assert steps_df.columns.tolist() == list(steps_df.columns)  # input untouched


def test_requests_frame_derived_columns(requests_df):
    df = requests_frame(requests_df)
    assert df["cached_fraction"].round(4).tolist() == [0.0, 0.8, 0.8, round(32 / 33, 4)]
    assert df["ttft_ms"].round(6).tolist() == [100.0, 200.0, 300.0, 400.0]
    assert df["tpot_ms"].round(6).tolist() == [20.0] * 4


def test_frames_reject_the_wrong_frame(steps_df, requests_df):
    with pytest.raises(ValueError, match="not a steps frame"):
        steps_frame(requests_df)
    with pytest.raises(ValueError, match="not a requests frame"):
        requests_frame(steps_df)
    with pytest.raises(TypeError, match="cannot read steps from int"):
        steps_frame(3)
    empty = steps_frame(pd.DataFrame())
    assert len(empty) == 0 and "tokens" in empty.columns


def test_windowed_hit_rate_over_requests(requests_df):
    w = windowed_hit_rate(requests_df, window=2, block_size=16)
    # looked-up tokens: full blocks before the last prompt token = [32, 32, 16, 32]
    assert w["query_tokens"].tolist() == [32, 32, 16, 32]
    assert w["hit_rate"].tolist() == pytest.approx([0.0, 0.5, 1.0, 1.0])
    assert w["cumulative_hit_rate"].tolist() == pytest.approx([0.0, 0.5, 0.6, 80 / 112])
    w = windowed_hit_rate(requests_df, window=2)  # without block size: over whole prompts
    assert w["hit_rate"].tolist() == pytest.approx([0.0, 32 / 80, 48 / 60, 48 / 53])
    with pytest.raises(ValueError, match="window=0"):
        windowed_hit_rate(requests_df, 0)


def test_windowed_hit_rate_over_steps(steps_df):
    w = windowed_hit_rate(steps_df, window=2)
    assert w["hit_rate"].iloc[0] == 0.5 and w["hit_rate"].iloc[1] == 0.5
    assert math.isnan(w["hit_rate"].iloc[2])  # nothing looked up in steps 2-3
    assert w["cumulative_hit_rate"].iloc[-1] == 0.5


def test_graph_usage_from_steps(steps_df):
    u = graph_usage(steps_df, [4, 1, 2])
    # decode steps 2 (bs 2 -> 2), 4 (bs 3 -> 4, one padded row), 5 (bs 5: eager), 6 (bs 1 -> 1)
    assert u.steps["graph_size"].tolist() == [pd.NA, 2, pd.NA, 4, pd.NA, 1]
    assert u.steps["padded_tokens"].tolist() == [0, 0, 0, 1, 0, 0]
    assert u.by_size.to_dict("list") == {"graph_size": [1, 2, 4], "replays": [1, 1, 1],
                                         "real_tokens": [1, 2, 3], "padded_tokens": [0, 0, 1]}
    t = u.totals
    assert (t["steps"], t["graph_steps"], t["eager_steps"]) == (6, 3, 3)
    assert (t["real_tokens"], t["padded_tokens"], t["max_batch_size"]) == (6, 1, 5)
    assert t["padding_fraction"] == pytest.approx(1 / 7)


def test_graph_usage_recorded_size_wins_and_trace(steps_df):
    steps_df.loc[1, "graph_size"] = 4  # a GPU run that replayed graph 4 for batch 2
    u = graph_usage(steps_df, [1, 2, 4])
    assert u.steps["graph_size"].iloc[1] == 4 and u.steps["padded_tokens"].iloc[1] == 2
    trace = graph_usage([1, 3, 5, 9, 17], [1, 2, 4, 8, 16])
    assert trace.steps["graph_size"].tolist() == [1, 4, 8, 16, pd.NA]
    assert trace.totals["padded_tokens"] == 0 + 1 + 3 + 7
    assert trace.totals["eager_steps"] == 1


def test_save_and_load_frames_round_trip(tmp_path, steps_df, requests_df):
    paths = save_frames(Frames(steps_df, requests_df, {}), str(tmp_path), meta={"run": "x"})
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["meta.json", "requests.jsonl", "steps.jsonl"]
    f = load_frames(str(tmp_path))
    assert f.meta == {"run": "x"}
    assert f.steps["chunk_sizes"].tolist() == [[16, 14], [], [10], [], [], []]
    assert f.steps["graph_size"].isna().all()
    assert steps_frame(f.steps)["tokens"].tolist() == [30, 2, 12, 3, 5, 1]
    assert f.requests["cached_tokens"].tolist() == [0, 32, 16, 32]
    with pytest.raises(FileNotFoundError, match="save_frames"):
        load_frames(str(tmp_path / "nothing"))


def test_roofline_frame():
    df = roofline_frame([{"name": "a", "measured": 10, "bound": 40},
                         {"name": "b", "measured": 5.0, "bound": 4.0, "unit": "ms/token"},
                         {"model": "qwen3-0.6b", "device": "H200", "atom_tok_s": 30000, "roofline_tok_s": 60000}])
    assert df["fraction"].tolist() == pytest.approx([0.25, 0.8, 0.5])
    assert df["name"].iloc[2] == "qwen3-0.6b (H200)"
    with pytest.raises(ValueError, match="lacks"):
        roofline_frame([{"name": "x"}])


# --- plots --------------------------------------------------------------------------
def _scatter(ax) -> list[PathCollection]:
    return [c for c in ax.collections if isinstance(c, PathCollection)]


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def test_plot_chunk_latency(steps_df):
    fig = plot_chunk_latency(steps_df)
    assert isinstance(fig, Figure) and len(fig.axes) == 2  # plot + colorbar
    ax = fig.axes[0]
    (pts,) = _scatter(ax)
    xy = pts.get_offsets()
    assert xy[:, 0].tolist() == [30, 2, 12, 3, 5, 1]
    assert np.allclose(xy[:, 1], [100, 50, 50, 40, 30, 30])
    assert pts.get_array().tolist() == [16, 0, 10, 0, 0, 0]
    assert "latency" in ax.get_ylabel()
    assert _png(fig).startswith(b"\x89PNG")


def test_plot_prefix_cache_hit_rate(requests_df):
    fig = plot_prefix_cache_hit_rate(requests_df, window=2, block_size=16)
    ax = fig.axes[0]
    windowed, cumulative = ax.get_lines()
    assert windowed.get_ydata().tolist() == pytest.approx([0.0, 0.5, 1.0, 1.0])
    assert cumulative.get_ydata().tolist() == pytest.approx([0.0, 0.5, 0.6, 80 / 112])
    (pts,) = _scatter(ax)
    assert len(pts.get_offsets()) == 4


def test_plot_graph_capture_sizes_plan_only():
    fig = plot_graph_capture_sizes(capture_sizes=[1, 2, 4, 8])
    assert len(fig.axes) == 1
    ax = fig.axes[0]
    graph_line = ax.get_lines()[0]
    assert graph_line.get_xdata().tolist() == list(range(1, 9))
    assert graph_line.get_ydata().tolist() == [1, 2, 4, 4, 8, 8, 8, 8]
    bars = [p for p in ax.patches]
    # padding bars: heights padded - batch for batch sizes 1..8
    assert [b.get_height() for b in bars] == [0, 0, 1, 0, 3, 2, 1, 0]
    (pts,) = _scatter(ax)
    assert len(pts.get_offsets()) == 4


def test_plot_graph_capture_sizes_from_config_and_steps(steps_df):
    from atom.config import CompilationConfig
    fig = plot_graph_capture_sizes(steps_df, config=CompilationConfig(cudagraph_capture_sizes=[1, 2, 4]))
    assert len(fig.axes) == 2
    bottom = fig.axes[1]
    heights = [p.get_height() for p in bottom.patches]
    # real rows at graphs 1, 2, 4; padding rows stacked on them; the batch of 5 ran eagerly
    assert heights == [1, 2, 3, 0, 0, 1, 5]
    assert [t.get_text() for t in bottom.get_xticklabels()] == ["1", "2", "4", "no graph"]
    assert "3 graph steps" in bottom.get_title()
    with pytest.raises(ValueError, match="capture_sizes or a config"):
        plot_graph_capture_sizes(steps_df)


def test_plot_kv_usage(steps_df):
    fig = plot_kv_usage(steps_df)
    main, twin = fig.axes
    (kv,) = main.get_lines()
    assert kv.get_xdata().tolist() == [1, 2, 3, 4, 5, 6]
    assert np.allclose(kv.get_ydata(), [10, 10, 20, 20, 30, 5])
    (pre,) = _scatter(main)
    assert pre.get_offsets().tolist() == [[5.0, 30.0]]
    assert twin.get_lines()[0].get_ydata().tolist() == [2, 2, 3, 3, 5, 1]
    fig = plot_kv_usage(steps_df, x="elapsed")
    assert np.allclose(fig.axes[0].get_lines()[0].get_xdata(), [0, 0.1, 0.15, 0.2, 0.24, 0.27])
    with pytest.raises(ValueError, match="x='time'"):
        plot_kv_usage(steps_df, x="time")


def test_plot_roofline():
    fig = plot_roofline([{"name": "a", "measured": 10, "bound": 20}, {"name": "b", "measured": 30, "bound": 40}])
    (ax,) = fig.axes
    widths = [p.get_width() for p in ax.patches]
    assert widths == [10, 30, 20, 40]  # measured bars, then bound bars
    assert [t.get_text().strip() for t in ax.texts] == ["50% of roofline", "75% of roofline"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["measured", "roofline ceiling"]
    fig = plot_roofline([{"name": "a", "measured": 10, "bound": 20}], label="recipe target")
    assert fig.axes[0].get_legend().get_texts()[0].get_text() == "recipe target"
    fig = plot_roofline([{"name": "a", "measured": 10, "bound": 20},
                         {"name": "b", "measured": 5, "bound": 4, "unit": "ms/token"}])
    assert len(fig.axes) == 2 and fig.axes[1].get_xlabel() == "ms/token"


# --- tables -------------------------------------------------------------------------
def _text(table) -> str:
    c = Console(record=True, width=120)
    c.print(table)
    return c.export_text()


def test_summary_table(steps_df, requests_df):
    class Stats:  # what EngineStats looks like to the frames
        step_rows = steps_df.to_dict("records")
        request_rows = requests_df.to_dict("records")
    s = run_summary(Stats())
    assert s["steps"] == 6 and s["requests"] == 4 and s["output_tokens"] == 16
    assert s["wall_s"] == pytest.approx(0.30)
    assert s["output_tok_s"] == pytest.approx(16 / 0.30)
    assert s["prefix_hit_rate"] == 0.5 and s["preemptions"] == 1 and s["peak_kv_usage"] == 0.3
    text = _text(summary_table(Stats()))
    assert "prefix-cache hit rate" in text and "50.0%" in text


def test_recipe_table():
    result = {"name": "demo", "status": "fail", "metrics": {"throughput_tok_s": 12.5, "accuracy": 1.0},
              "units": {"throughput_tok_s": "tok/s"},
              "checks": [{"metric": "throughput_tok_s", "value": 12.5, "expected": {"min": 20}, "ok": False},
                         {"metric": "accuracy", "value": 1.0, "expected": {"value": 1.0}, "ok": True}]}
    text = _text(recipe_table(result))
    assert "demo" in text and "fail" in text
    assert "FAIL" in text and ">= 20" in text and "ok" in text


# --- a real run -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tiny_llama):
    from atom import LLM, SamplingParams
    llm = LLM(tiny_llama, max_num_batched_tokens=16, max_model_len=256, enable_log_stats=False,
              enable_prefix_caching=True, kv_cache_block_size=16)
    shared = list(range(10, 42))  # two full blocks shared by every prompt
    prompts = [shared + [50 + i] * n for i, n in enumerate((3, 9, 20))]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts[:1], sp, use_tqdm=False)
    llm.generate(prompts[1:], sp, use_tqdm=False)
    return llm, prompts


def test_real_run_frames(tiny_run, tmp_path):
    llm, prompts = tiny_run
    steps, reqs = steps_frame(llm), requests_frame(llm)
    assert len(reqs) == 3 and reqs["output_tokens"].tolist() == [4, 4, 4]
    assert (steps["tokens"] <= 16).all() and steps["max_chunk"].max() <= 16
    # every prompt token not served by the cache runs once, and every output token but the last
    cached = int(reqs["cached_tokens"].sum())
    assert cached == 64  # prompts 2 and 3 hit both shared blocks
    assert steps["tokens"].sum() == sum(map(len, prompts)) - cached + 3 * (4 - 1)
    assert steps["num_sampled"].sum() == 12
    w = windowed_hit_rate(reqs, window=3, block_size=16)
    assert w["hit_rate"].iloc[-1] == pytest.approx(64 / (32 + 32 + 48))
    u = graph_usage(llm, [1, 2, 4])
    decode = steps[steps["is_decode"]]
    assert u.totals["graph_steps"] == len(decode)
    assert u.totals["real_tokens"] == int(decode["num_seqs"].sum())
    save_frames(llm, str(tmp_path))
    back = load_frames(str(tmp_path))
    assert steps_frame(back.steps)["tokens"].tolist() == steps["tokens"].tolist()
    assert back.steps["chunk_sizes"].tolist() == steps["chunk_sizes"].tolist()


def test_real_run_plots(tiny_run):
    llm, _ = tiny_run
    n = llm.stats.num_steps
    fig = plot_chunk_latency(llm)
    assert len(_scatter(fig.axes[0])[0].get_offsets()) == n
    fig = plot_kv_usage(llm.stats)
    assert len(fig.axes[0].get_lines()[0].get_xdata()) == n
    fig = plot_prefix_cache_hit_rate(llm, window=2, block_size=16)
    assert len(fig.axes[0].get_lines()[0].get_ydata()) == 3
    fig = plot_graph_capture_sizes(llm, config=llm.config)
    assert len(fig.axes) == 2
    assert _png(fig).startswith(b"\x89PNG")
    text = _text(summary_table(llm))
    assert "requests" in text
