"""The start-up choice of the one-row ptpc FP8 product's tile (`tuning.fp8_tile_choice`):
which layers it times, when a candidate replaces the table's tile, what the plan keeps,
shows and saves, with a stand-in kernel and timer on the CPU; on a GPU (marked gpu) the
real timings, and a layer with the plan running the chosen tile."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from atom.model_ops.kernels import fp8_gemv1
from atom.model_ops.linear import Linear
from atom.tuning import fp8_tile_choice
from atom.tuning.plan import KernelPlan
from test_fp8_gemv1 import GPU_ONLY
from test_quant_methods import FORMATS, OneSpec, fill

TABLE = fp8_gemv1.DEFAULT_TILE
FAST, WRONG = (8, 128, 4, 2, True), (2, 128, 4, 2, True)


def _layer(k: int, n: int, fmt: str = "fp8_channel", prefix: str = "l") -> Linear:
    """A quantized `Linear` [k -> n] of one of test_quant_methods' FORMATS, weights loaded."""
    f = FORMATS[fmt]
    m = Linear(k, n, quant_config=OneSpec(f["spec"]), prefix=prefix)
    for name, t in f["quant"](torch.randn(n, k) * 0.02).items():
        fill(m, name, t, None)
    m.method.process_weights_after_loading(m)
    return m


def test_pick_replaces_the_table_only_by_a_clear_gain():
    assert fp8_tile_choice.pick({TABLE: 10.0, FAST: 9.7}, TABLE) == FAST  # 3% faster
    assert fp8_tile_choice.pick({TABLE: 10.0, FAST: 9.9}, TABLE) is None  # 1%: within the noise
    assert fp8_tile_choice.pick({TABLE: 10.0, FAST: 11.0}, TABLE) is None
    assert fp8_tile_choice.pick({TABLE: 10.0, FAST: 9.9}, TABLE, min_gain=1.0) == FAST
    with pytest.raises(ValueError, match="the table's tile"):
        fp8_tile_choice.pick({FAST: 9.0}, TABLE)


def test_only_rowwise_fp8_layers_on_the_gpu_are_taken():
    model = nn.ModuleDict({"a": _layer(1024, 64, prefix="a"), "b": _layer(1024, 64, prefix="b"),
                           "c": _layer(2048, 32, prefix="c"), "tensor": _layer(1024, 64, "fp8_tensor_dynamic", "t"),
                           "bf16": Linear(1024, 64).to(torch.bfloat16)})
    assert fp8_tile_choice.one_row_layers(model) == {}  # CPU weights: no kernel to time
    groups = fp8_tile_choice.one_row_layers(model, gpu_only=False)
    assert {key: [id(m) for m in ms] for key, ms in groups.items()} == {
        (64, 1024): [id(model["a"]), id(model["b"])], (32, 2048): [id(model["c"])]}


def _stand_ins(monkeypatch, us: dict, seen: list):
    """The kernel as the exact product (WRONG: 5% off), a timer reporting `us` by tile, every
    layer on the CPU taken."""
    def launch(xq, xs, w, ws, bias=None, out=None, out_dtype=torch.bfloat16, tile=None):
        y = (xq.float() @ w.float().t()) * xs * ws[None, :]
        return (y * 1.05 if tile == WRONG else y).to(out_dtype)

    def graph_time(calls, iters=25):
        for c in calls:
            c()
        tile = calls[0].keywords["tile"]
        seen.append((tile, len(calls)))
        return us[tile] * 1e-6

    monkeypatch.setattr(fp8_gemv1, "fp8_gemv1_launch", launch)
    monkeypatch.setattr(fp8_gemv1, "takes", lambda xq, xs, w, ws: True)
    monkeypatch.setattr(fp8_tile_choice, "graph_time", graph_time)
    monkeypatch.setattr(fp8_tile_choice, "_enough_weights", lambda ws: ws)
    monkeypatch.setattr(fp8_tile_choice, "one_row_layers",
                        functools.partial(fp8_tile_choice.one_row_layers, gpu_only=False))


def test_the_choice_records_the_fastest_agreeing_tile(monkeypatch, caplog, tmp_path):
    """Every covering candidate is timed over the shape's layers; the one 5% off is not used
    (and not timed); the fastest that agrees goes into the plan where it beats the table's
    tile by 2%, and the plan shows, saves and loads the choice and the timings."""
    seen = []
    us = {TABLE: 10.0, FAST: 9.0, WRONG: 5.0, (4, 128, 4, 2, True): 9.5, (4, 64, 2, 2, True): 10.5,
          (8, 256, 8, 2, True): 12.0}
    _stand_ins(monkeypatch, us, seen)
    model = nn.ModuleList([_layer(4096, 64, prefix="a"), _layer(4096, 64, prefix="b")])
    plan = KernelPlan(backend="triton")
    with caplog.at_level("WARNING"):
        out = fp8_tile_choice.choose_fp8_tiles(plan, model)
    assert "disagrees" in caplog.text and str(WRONG) in caplog.text
    assert set(out) == {(64, 4096)} and WRONG not in out[(64, 4096)]
    assert [t for t, _ in seen] == [t for t in dict.fromkeys((TABLE, *fp8_tile_choice.CANDIDATES)) if t != WRONG]
    assert all(n == 2 for _, n in seen)  # both layers' weights in each graph
    assert plan.fp8_tiles == {(64, 4096): FAST}
    assert plan.fp8_tile(torch.empty(64, 4096)) == FAST and plan.fp8_tile(torch.empty(64, 2048)) is None
    row = [r for r in plan.rows() if r["kind"] == "fp8_gemv1"]
    assert row == [{"kind": "fp8_gemv1", "rows": 1, "n": 64, "k": 4096, "dtype": "float8_e4m3fn",
                    "variant": "plain", "library_us": 10.0, "best_us": 9.0, "runs": str(FAST), "tried": 5,
                    "fastest": str(FAST)}]
    assert "fp8_gemv1 tiles=1/1 chosen/timed" in repr(plan)
    back = KernelPlan.load(plan.save(tmp_path / "plan.json"))  # through JSON: tuples, AHEAD's bool
    assert back.fp8_tiles == plan.fp8_tiles and back.fp8_tile_timings == plan.fp8_tile_timings
    assert back.fp8_tiles[(64, 4096)][4] is True


def test_no_clear_gain_keeps_the_table_and_drops_an_older_choice(monkeypatch):
    us = {t: 10.0 for t in fp8_tile_choice.CANDIDATES}
    us[FAST] = us[WRONG] = 9.9
    _stand_ins(monkeypatch, us, [])
    plan = KernelPlan(backend="triton", fp8_tiles={(64, 4096): FAST})
    fp8_tile_choice.choose_fp8_tiles(plan, nn.ModuleList([_layer(4096, 64)]))
    assert plan.fp8_tiles == {} and plan.fp8_tile_timings[(64, 4096)][0] == TABLE


def test_a_tile_the_kernel_cannot_run_is_refused():
    """Built or loaded, a plan refuses a tile that does not cover its shape or that the kernel
    cannot run at all, naming the entry, and timings without the table tile's time."""
    with pytest.raises(ValueError, match="5 entries"):
        KernelPlan.from_dict({"fp8_tiles": [{"key": [64, 4096], "tile": [4, 128, 4]}]})
    with pytest.raises(ValueError, match=r"fp8_tiles\[\(60, 4096\)\]=\(8, 128, 4, 2, True\).*does not cover"):
        KernelPlan(fp8_tiles={(60, 4096): FAST})  # 60 rows: not a multiple of 8
    with pytest.raises(ValueError, match="does not cover"):
        KernelPlan.from_dict({"fp8_tiles": [{"key": [64, 1536], "tile": list(FAST)}]})  # K: not 1024-byte steps
    with pytest.raises(ValueError, match="DW"):
        KernelPlan(fp8_tiles={(64, 1536): (4, 128, 4, 3, True)})  # 3 words a load: covers, but no such load
    for bad in ((0, 128, 4, 2, True), (3, 128, 4, 2, True), (4, 96, 4, 2, True), (4, 128, 3, 2, True)):
        with pytest.raises(ValueError, match="powers of two"):
            KernelPlan(fp8_tiles={(48, 12288): bad})
    with pytest.raises(ValueError, match="the table's tile"):
        KernelPlan(fp8_tile_timings={(64, 4096): (TABLE, {FAST: 9.0})})
    with pytest.raises(ValueError, match="powers of two"):
        fp8_gemv1.fp8_gemv1_launch(torch.zeros(1, 1024).to(torch.float8_e4m3fn), torch.ones(1),
                                   torch.zeros(64, 1024).to(torch.float8_e4m3fn), torch.ones(64), tile=(3, 128, 4, 2, True))
    assert KernelPlan(fp8_tiles={(64, 1024): FAST}).fp8_tiles == {(64, 1024): FAST}


@pytest.mark.gpu
@GPU_ONLY
def test_gpu_choice_times_every_covering_tile_and_the_layer_runs_the_chosen_one(monkeypatch):
    """Llama-3.1-8B's o_proj shape: the table's tile and every covering candidate timed (in
    us, plausible for 16 MB at HBM speed), the chosen tile (if any) within 1e-2 of the
    table's product; a layer whose plan holds a tile launches that tile at one row."""
    from test_gemm_tuning_fp8 import fp8_layer
    torch.manual_seed(0)
    layers = nn.ModuleList([fp8_layer(4096, 4096, f"o{i}") for i in range(4)])
    plan = KernelPlan(backend="triton")
    out = fp8_tile_choice.choose_fp8_tiles(plan, layers)
    us = out[(4096, 4096)]
    covering = [t for t in dict.fromkeys((TABLE, *fp8_tile_choice.CANDIDATES)) if fp8_gemv1.even(4096, 4096, t)]
    assert list(us) == covering and all(2.0 < v < 200.0 for v in us.values())
    tile = (4, 128, 4, 2, True)
    m = layers[0]
    m.plan = KernelPlan(backend="triton", fp8_tiles={(4096, 4096): tile})
    launch, ran = fp8_gemv1.fp8_gemv1_launch, []
    monkeypatch.setattr(fp8_gemv1, "fp8_gemv1_launch", lambda *a, **k: ran.append(k.get("tile")) or launch(*a, **k))
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    y = m(x)
    m.plan = None
    ref = m(x)
    assert ran == [tile, None]
    assert ((y.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()).item()
