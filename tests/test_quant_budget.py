"""Mixed precision under a size budget (`atom.quant.budget`) on hand-made tables: the greedy
choice against brute force, its hull, its limits, and the config it writes."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest
import torch
from matplotlib.figure import Figure

from atom.model_loader.online_quant import OnlineQuantPlan
from atom.quant import choose_formats, mixed_config, plot_choice
from atom.quant.budget import AS_LOADED, _hull


def table(fmt: str, rows: dict[str, tuple[int, float]], by: str = "layer", before: int = 100) -> pd.DataFrame:
    """A `SensitivityExplorer.run` table: group -> (bytes_after, kl); kl NaN = refused."""
    df = pd.DataFrame([{"group": g, "layers": 1, "kl": kl, "bytes_before": before, "bytes_after": b,
                        "status": "ok" if not math.isnan(kl) else "refused: no kernel"}
                       for g, (b, kl) in rows.items()])
    df.attrs.update(format=fmt, by=by)
    return df


def brute_force(tables: list[pd.DataFrame], budget: int) -> float:
    """The least summed KL of any assignment within `budget` (formats only)."""
    opts = {}
    for t in tables:
        for r in t.itertuples(index=False):
            if r.status == "ok":
                opts.setdefault(r.group, []).append((r.bytes_after, r.kl))
    best = math.inf
    for combo in itertools.product(*opts.values()):
        if sum(b for b, _ in combo) <= budget:
            best = min(best, sum(k for _, k in combo))
    return best


def unit_tables():
    """Four formats of 1-4 bytes a group, KL falling convexly (each byte saves less than the
    one before): the greedy choice is then exactly the optimum at every budget."""
    saves = {"a": (8.0, 4.0, 1.0), "b": (5.0, 3.0, 2.5), "c": (9.0, 0.5, 0.1), "d": (2.0, 1.9, 1.8)}
    tables = []
    for k, fmt in enumerate(["f1", "f2", "f3", "f4"]):
        tables.append(table(fmt, {g: (k + 1, 20.0 - sum(s[:k])) for g, s in saves.items()}))
    return tables


@pytest.mark.parametrize("budget", range(4, 17))
def test_greedy_equals_brute_force_on_unit_steps(budget):
    tables = unit_tables()
    choice = choose_formats(tables, budget, allow_unquantized=False)
    assert choice.attrs["bytes"] <= budget and choice["bytes"].sum() == choice.attrs["bytes"]
    assert choice.attrs["kl_sum"] == pytest.approx(brute_force(tables, budget))
    assert list(choice["group"]) == ["a", "b", "c", "d"]


@pytest.mark.parametrize("seed", range(8))
def test_greedy_within_one_upgrade_of_brute_force(seed):
    """Random sizes and KLs: never below the optimum (it is one), never above it by more than
    one upgrade's saving (the bound the module docstring states, taken loosely: the largest)."""
    g = torch.Generator().manual_seed(seed)
    groups = [f"g{i}" for i in range(5)]
    tables = []
    for fmt in ("f1", "f2", "f3"):
        b = torch.randint(1, 20, (5,), generator=g).tolist()
        k = (torch.rand(5, generator=g) * 10).tolist()
        tables.append(table(fmt, {grp: (b[i], k[i]) for i, grp in enumerate(groups)}))
    smallest = sum(min(t.set_index("group").loc[grp, "bytes_after"] for t in tables) for grp in groups)
    for budget in (smallest, smallest + 7, smallest + 20, smallest + 60):
        choice = choose_formats(tables, budget, allow_unquantized=False)
        best = brute_force(tables, budget)
        spread = max(t.set_index("group").loc[grp, "kl"] for t in tables for grp in groups)
        assert choice.attrs["bytes"] <= budget
        assert best - 1e-9 <= choice.attrs["kl_sum"] <= best + spread


def test_budget_extremes_and_monotone():
    tables = unit_tables()
    smallest = choose_formats(tables, 4, allow_unquantized=False)
    assert set(smallest["format"]) == {"f1"} and smallest.attrs["bytes"] == 4
    largest = choose_formats(tables, 10**6, allow_unquantized=False)
    assert set(largest["format"]) == {"f4"}
    with_loaded = choose_formats(tables, 10**6)  # the loaded layer (KL 0) is the best of all
    assert set(with_loaded["format"]) == {AS_LOADED} and with_loaded["kl"].sum() == 0
    kls = [choose_formats(tables, b, allow_unquantized=False).attrs["kl_sum"] for b in range(4, 17)]
    assert all(x >= y for x, y in zip(kls, kls[1:])) and kls[0] > kls[-1]


def test_hull_drops_dominated_and_concave_options():
    opts = [(1, 10.0, "a"), (2, 9.5, "b"), (3, 4.0, "c"), (4, 5.0, "d"), (3, 6.0, "e"), (6, 3.9, "f")]
    # b is above the chord a-c (saves 0.5 where c saves 3 a byte), d costs more than c for more
    # KL, e is c's size with more KL; f saves little a byte but stays (the hull's last point)
    assert [o[2] for o in _hull(opts)] == ["a", "c", "f"]


def test_refused_rows_are_not_options_and_skipping_a_big_step():
    t1 = table("small", {"x": (10, 5.0), "y": (10, 4.0)})
    t2 = table("big", {"x": (50, 0.0), "y": (12, math.nan)})  # y refused in "big"
    choice = choose_formats([t1, t2], 40, allow_unquantized=False).set_index("group")
    assert choice.loc["y", "format"] == "small" and choice.loc["x", "format"] == "small"  # x's step does not fit
    choice = choose_formats([t1, t2], 60, allow_unquantized=False).set_index("group")
    assert choice.loc["x", "format"] == "big" and choice.attrs["bytes"] == 60


def test_bad_input_names_the_field():
    tables = unit_tables()
    with pytest.raises(ValueError, match="budget_bytes=3 is invalid: the smallest option of every group already takes 4"):
        choose_formats(tables, 3, allow_unquantized=False)
    assert choose_formats(tables, np.int64(4), allow_unquantized=False).attrs["bytes"] == 4  # numpy sums too
    for bad in (0, -5, True, "10", np.nan):
        with pytest.raises(ValueError, match="budget_bytes=.* is invalid: must be a positive"):
            choose_formats(tables, bad)
    with pytest.raises(ValueError, match="tables is empty"):
        choose_formats([], 10)
    with pytest.raises(ValueError, match="group layers differently"):
        choose_formats([tables[0], table("k", {"a": (1, 1.0)}, by="kind")], 10)
    with pytest.raises(ValueError, match=r"groups \['z'\] have no usable format"):
        choose_formats([table("f", {"z": (1, math.nan)})], 10, allow_unquantized=False)
    unnamed = tables[0].copy()
    unnamed.attrs = {}
    with pytest.raises(ValueError, match="attrs name the format"):
        choose_formats([unnamed], 10)


def test_mixed_config_patterns_and_guide_formats():
    names = ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"]
    t1 = table("mxfp4", {n: (10, 1.0 + i) for i, n in enumerate(names)})
    t2 = table("ptpc_fp8", {n: (20, 0.1) for n in names})
    choice = choose_formats([t1, t2], 45)  # one upgrade of 10 bytes: the largest KL saved, layer 1's
    cfg = mixed_config(choice)
    assert cfg == {"global_quant_config": "mxfp4",
                   "layer_quant_config": {"model.layers.1.mlp.down_proj": "ptpc_fp8"}}
    plan = OnlineQuantPlan(cfg)
    assert [plan.format_for(n) for n in names] == ["mxfp4", "mxfp4", "ptpc_fp8"]
    leave = choose_formats([t1], 10**4)
    assert mixed_config(leave) == {"exclude_layer": names}
    # decoder and kind groups become patterns over their layers
    dec = choose_formats([table("mxfp4", {"model.layers.0": (5, 1.0), "model.layers.1": (5, 2.0)}, by="decoder"),
                          table("ptpc_fp8", {"model.layers.0": (9, 0.1), "model.layers.1": (9, 0.1)}, by="decoder")],
                         14, allow_unquantized=False)
    assert mixed_config(dec) == {"global_quant_config": "mxfp4", "layer_quant_config": {"model.layers.1.*": "ptpc_fp8"}}
    kind = choose_formats([table("mxfp4", {"down_proj": (5, 1.0)}, by="kind")], 10**3)
    assert mixed_config(kind) == {"exclude_layer": ["*.down_proj"]}
    explorer_only = choose_formats([table("w4a16_g32", {n: (10, 1.0) for n in names})], 30)
    with pytest.raises(ValueError, match="format 'w4a16_g32' is invalid for online_quant_config"):
        mixed_config(explorer_only)
    assert mixed_config(explorer_only, guide_formats=False) == {"global_quant_config": "w4a16_g32"}


def test_plot_choice():
    choice = choose_formats(unit_tables(), 9, allow_unquantized=False)
    fig = plot_choice(choice)
    assert isinstance(fig, Figure) and len(fig.axes[0].patches) == 4
    assert "formats chosen within" in fig.axes[0].get_title()
    assert {t.get_text() for t in fig.axes[0].get_legend().get_texts()} == set(choice["format"])
