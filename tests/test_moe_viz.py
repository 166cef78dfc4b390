"""The expert-load frame, summary and plot from a recorded (or saved) frame."""
import pandas as pd
import pytest

from atom.model_engine.stats import EngineStats
from atom.viz import expert_load_frame, expert_load_summary, plot_expert_load
import numpy as np


def stats():
    s = EngineStats(log_stats=False)
    s.record_expert_load(1, [0, 2], np.array([[3, 1, 0, 0], [2, 2, 0, 0]]))
    s.record_expert_load(2, [0, 2], np.array([[1, 0, 0, 1], [0, 0, 2, 0]]))
    return s


def test_frame_and_summary():
    df = expert_load_frame(stats())
    assert list(df.columns) == ["step", "layer", "expert", "tokens", "share"] and len(df) == 2 * 2 * 4
    assert df.groupby(["step", "layer"])["share"].sum().round(9).eq(1.0).all()
    summary = expert_load_summary(df.drop(columns="share")).set_index("layer")
    assert summary.loc[0].to_dict() == {"pairs": 6, "busiest_expert": 0, "busiest_share": 4 / 6,
                                        "max_over_mean": 4 / 1.5, "idle_experts": 1}
    assert summary.loc[2, "idle_experts"] == 1 and summary.loc[2, "pairs"] == 6


def test_window_keeps_the_last_steps():
    s = stats()
    s.set_window(1)
    assert expert_load_frame(s)["step"].unique().tolist() == [2]


def test_plot_and_bad_inputs():
    fig = plot_expert_load(stats())
    heat, line = fig.axes[:2]
    assert heat.get_title().startswith("share of tokens") and len(line.get_lines()) == 3  # 2 layers + the 1.0 line
    empty = plot_expert_load(EngineStats(log_stats=False))
    assert "no routing recorded" in empty.axes[0].get_title()
    with pytest.raises(ValueError, match="not an expert-load frame"):
        expert_load_frame(pd.DataFrame({"step": [1]}))
    with pytest.raises(TypeError, match="cannot read expert load from int"):
        expert_load_frame(3)
