"""The sensitivity explorer (`atom.quant`): its table, the fragile layer it finds, the
online_quant_config it writes, and the quant_accuracy benchmark on a tiny model."""
from __future__ import annotations

import json

import pytest
import torch
from matplotlib.figure import Figure

from atom import LLM
from atom.benchmarks.quant_accuracy import compare, table
from atom.quant import (SensitivityExplorer, choose_formats, mixed_config, most_sensitive, online_config,
                        plot_sensitivity, write_online_config)
from atom.viz import linear_methods_frame
from tiny_quant import BLOCK_SHAPE, make_fragile
from conftest import make_tiny_model

IDS = torch.randint(3, 512, (120,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def fragile(tmp_path_factory):
    """An explorer on a tiny Llama whose layer 1 down_proj is fragile (`make_fragile`)."""
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_fragile"), "llama")
    llm = LLM(path, num_kvcache_blocks=16, enable_log_stats=False)
    name = make_fragile(llm.engine.runner.model, decoder=1)
    return SensitivityExplorer(llm, IDS), name


def test_table_has_a_row_per_layer_with_sane_figures(fragile):
    ex, _ = fragile
    df = ex.run("ptpc_fp8", by="layer")
    assert list(df["group"]) == list(ex.layers) and len(df) == 8
    assert (df["kl"] >= 0).all() and df["top1"].between(0, 1).all() and (df["status"] == "ok").all()
    assert (df["bytes_after"] < df["bytes_before"]).all() and sorted(df["rank"]) == list(range(1, 9))
    assert df.attrs["format"] == "ptpc_fp8" and df.attrs["tokens"] == len(IDS) and df.attrs["ppl_base"] > 1
    # each row restored its layer: the unquantized logits come back exactly
    assert torch.equal(ex.forward.logits(), ex.base)
    assert set(linear_methods_frame(ex.llm)["method"]) == {"unquantized"}


@pytest.mark.parametrize("fmt", ["ptpc_fp8", "w8a8_int8"])  # per-row scales (int4's groups of 32 confine it)
def test_the_fragile_layer_is_the_most_sensitive(fragile, fmt):
    ex, name = fragile
    df = ex.run(fmt)
    assert most_sensitive(df, 1) == [name], df.to_string()
    row = df.set_index("group").loc[name]
    others = df[df["group"] != name]
    assert row["rank"] == 1 and row["kl"] > 2 * others["kl"].max() and row["top1"] < others["top1"].min()


def test_groups_by_decoder_and_kind(fragile):
    ex, _ = fragile
    dec = ex.run("ptpc_fp8", by="decoder")
    assert list(dec["group"]) == ["model.layers.0", "model.layers.1"] and (dec["layers"] == 4).all()
    assert most_sensitive(dec, 1) == ["model.layers.1"]
    kind = ex.run("ptpc_fp8", by="kind")
    assert list(kind["group"]) == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert most_sensitive(kind, 1) == ["down_proj"]
    assert online_config(kind, 1) == {"global_quant_config": "ptpc_fp8", "exclude_layer": ["*.down_proj"]}


def test_refused_layers_get_a_status(fragile):
    df = fragile[0].run("fp8_block").set_index("group")  # in_features 64: no 1x128 activation groups
    refused = df["status"].str.startswith("refused")
    assert set(df.index[~refused]) == {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}  # in 128
    assert df.loc[refused, "kl"].isna().all() and (df.loc[~refused, "kl"] > 0).all()
    assert "in_features=64 is not a multiple of the 128-wide activation group" in df["status"].iloc[0]


def test_online_config_leaves_the_sensitive_layers_out_and_loads(fragile, tmp_path, monkeypatch):
    ex, name = fragile
    df = ex.run("ptpc_fp8")
    cfg = write_online_config(df, 2, str(tmp_path / "cfg.json"))
    assert json.load(open(tmp_path / "cfg.json")) == cfg
    assert cfg["global_quant_config"] == "ptpc_fp8" and cfg["exclude_layer"][0] == name
    assert len(cfg["exclude_layer"]) == 2
    kept, everything = ex.evaluate(cfg), ex.evaluate({"global_quant_config": "ptpc_fp8"})
    assert kept["layers_quantized"] == 6 and kept["kl"] < everything["kl"] / 10
    assert kept["linear_bytes"] > everything["linear_bytes"]
    monkeypatch.chdir(tmp_path)
    llm = LLM(ex.llm.config.model, num_kvcache_blocks=16, enable_log_stats=False, online_quant_config=cfg)
    methods = dict(zip(*linear_methods_frame(llm)[["layer", "method"]].T.values))
    assert methods[name] == "unquantized" and methods["model.layers.0.mlp.down_proj"] == "fp8"


def test_a_format_per_layer_beats_uniform_at_the_same_size(fragile, tmp_path, monkeypatch):
    """Within uniform ptpc_fp8's bytes the choice leaves the fragile layer to MXFP4 (its
    groups of 32 confine the outlier) and the rest in fp8; within uniform w4a16_g32's it
    spends the bytes on the layers that gain most. Both measure better than the uniform
    configuration of that size, and the written config loads with those formats."""
    ex, name = fragile
    tables = [ex.run(f) for f in ("mxfp4", "ptpc_fp8")]
    for size in ("ptpc_fp8", "w4a16_g32"):
        uniform = ex.evaluate({"global_quant_config": size})
        choice = choose_formats(tables, uniform["linear_bytes"])
        mixed = ex.evaluate(mixed_config(choice))
        assert mixed["linear_bytes"] == choice.attrs["bytes"] <= uniform["linear_bytes"]
        assert mixed["layers_quantized"] == 8 and set(choice["format"]) == {"mxfp4", "ptpc_fp8"}
        assert mixed["kl"] < 0.6 * uniform["kl"] and mixed["top1"] > uniform["top1"], (size, mixed, uniform)
    fp8_size = choose_formats(tables, ex.evaluate({"global_quant_config": "ptpc_fp8"})["linear_bytes"])
    assert fp8_size.set_index("group")["format"].to_dict() == {g: "mxfp4" if g == name else "ptpc_fp8"
                                                               for g in ex.layers}
    cfg = mixed_config(fp8_size)
    assert cfg == {"global_quant_config": "ptpc_fp8", "layer_quant_config": {name: "mxfp4"}}
    monkeypatch.chdir(tmp_path)
    llm = LLM(ex.llm.config.model, num_kvcache_blocks=16, enable_log_stats=False, online_quant_config=cfg)
    methods = dict(zip(*linear_methods_frame(llm)[["layer", "method"]].T.values))
    assert {n: methods[n] for n in ex.layers} == {n: "mxfp4" if n == name else "fp8" for n in ex.layers}


def test_quant_mix_benchmark(fragile, capsys):
    """`atom.benchmarks.quant_mix` on the fragile model: per size, the mix within the uniform
    configuration's bytes, better on the fitted text, figures for the held-out one, a config
    that loads as it is; bad flags name themselves before any model loads."""
    from atom.benchmarks.quant_mix import compare_mix, main, table as mix_table
    ex, name = fragile
    result = compare_mix(ex.llm, IDS[:80], IDS[80:], sizes=("ptpc_fp8", "w4a16_g32"))
    assert result["tokens"] == {"fit": 80, "held_out": 40} and result["config_loads_as_is"] and "commit" in result
    for row in result["sizes"]:
        mix, uniform = row["mix"], row["uniform"]
        assert mix["fit"]["linear_bytes"] <= row["budget_bytes"] == uniform["fit"]["linear_bytes"]
        assert mix["held_out"]["linear_bytes"] == mix["fit"]["linear_bytes"]
        assert mix["fit"]["kl"] < uniform["fit"]["kl"] and 0 <= mix["held_out"]["top1"] <= 1
        assert sum(row["formats"].values()) == 8 and set(row["formats"]) <= {"mxfp4", "ptpc_fp8"}
    assert result["sizes"][0]["config"]["layer_quant_config"] == {name: "mxfp4"}
    json.dumps(result)
    assert "w4a16_g32" in mix_table(result)
    for argv, flag in ((["--candidates", "int3"], "--candidates"), (["--tokens", "1"], "--tokens 1")):
        with pytest.raises(SystemExit):
            main(argv)
        assert flag in capsys.readouterr().err


def test_bad_arguments_name_the_field(fragile):
    ex, _ = fragile
    with pytest.raises(ValueError, match="fmt='int3' is invalid"):
        ex.run("int3")
    with pytest.raises(ValueError, match="by='head' is invalid"):
        ex.run("ptpc_fp8", by="head")
    df = ex.run("w8a8_int8", by="kind")
    with pytest.raises(ValueError, match="fmt='w8a8_int8' is invalid for online_quant_config"):
        online_config(df, 1)
    with pytest.raises(ValueError, match="max_tokens=1 is invalid"):
        SensitivityExplorer(ex.llm, IDS, max_tokens=1)


def test_plot(fragile):
    ex, _ = fragile
    fig = plot_sensitivity(ex.run("ptpc_fp8"))
    assert isinstance(fig, Figure) and "ptpc_fp8" in fig.axes[0].get_title()
    assert len(fig.axes[0].patches) == 8


def test_quant_accuracy_engine_within_one_point_of_the_reference(tmp_path):
    path = make_tiny_model(tmp_path / "tiny128", "llama", initializer_range=0.1, **BLOCK_SHAPE)
    llm = LLM(path, num_kvcache_blocks=32, enable_log_stats=False)
    ids = torch.randint(3, 512, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    result = compare(llm, ids)
    rows = {r["format"]: r for r in result["formats"]}
    assert list(rows) == ["ptpc_fp8", "fp8_block", "w8a8_int8", "w4a16_g64", "w4a16_g32", "mxfp4"]
    for fmt, r in rows.items():
        assert r["within_1_point"], (fmt, r)
        assert r["layers_quantized"] == 8 and r["engine"]["kl"] > 0
        assert abs(r["engine"]["kl"] - r["reference"]["kl"]) <= 0.05 * r["reference"]["kl"]
    assert rows["w8a8_int8"]["engine"]["top1"] > rows["w4a16_g32"]["engine"]["top1"]
    assert result["tokens"] == 400 and "commit" in result
    json.dumps(result)
    assert "ptpc_fp8" in table(result)


def test_quant_accuracy_command_on_smollm2(smollm2_path, tmp_path, capsys):
    """`python -m atom.benchmarks.quant_accuracy` on the embedded SmolLM2: the table on stdout,
    the JSON written, the engine within one point of the RTN reference; bad arguments name
    the flag and what it takes before any model loads."""
    from atom.benchmarks.quant_accuracy import main
    out = tmp_path / "acc.json"
    main(["--model", smollm2_path, "--formats", "ptpc_fp8", "--tokens", "96", "--out", str(out)])
    result = json.loads(out.read_text())
    (row,) = result["formats"]
    assert row["format"] == "ptpc_fp8" and row["within_1_point"] and result["tokens"] == 96
    assert 0.5 < row["engine"]["top1"] <= 1 and row["engine"]["kl"] > 0 and row["layers_quantized"] > 100
    assert "ptpc_fp8" in capsys.readouterr().out
    for argv, flag in ((["--formats", "int3"], "--formats"), (["--tokens", "1"], "--tokens 1")):
        with pytest.raises(SystemExit):
            main(argv)
        assert flag in capsys.readouterr().err
