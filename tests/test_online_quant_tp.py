"""Online quantization under tensor parallel (`online_quant_config` with
tensor_parallel_size=2, gloo on a CPU).

- Engines (one worker process): tiny Llama and Qwen3 with ptpc_fp8 everywhere give, at TP=2,
  the greedy tokens of the same config at TP=1 once TP=1 quantizes a row-parallel layer's
  activations per rank as TP=2 does (ptpc's dynamic per-token activation scale is taken over
  the columns a rank holds, by the fp8 method's design, not by online quantization: the
  weights are TP=1's exactly, see below); MXFP4 (weight groups and activation groups of 32
  inside a rank's columns) gives TP=1's tokens as they are. The summary says the row-parallel
  o_proj / down_proj gathered for ptpc and the column-parallel qkv / gate_up did not, and
  only rank 0 wrote it.
- Ranks as threads of this process (gloo): every rank's quantized tensors (weights and
  scales) equal the matching slice of the one-rank model's, bit for bit, for ptpc_fp8 and
  mxfp4, linear layers and MoE experts (split by width or whole); the gather was needed
  (the row-parallel slice alone gives other scales); only rank 0 wrote the summary.
- Refusals, by name, before anything loads or waits: MXFP4 experts split by width, a
  row-parallel MXFP4 split that cuts a group of 32, and a caller on one rank asking for a
  layer that would need the other ranks' slices.
"""
from __future__ import annotations

import glob
import json
import os
from types import SimpleNamespace

import pytest
import torch

from atom import LLM, SamplingParams
from atom.config import Config
from atom.distributed.state import ParallelState, building
from atom.model_loader.loader import load_weights
from atom.model_loader.online_quant import OnlineQuantPlan, apply_online_quant, linear_layers, moe_layers
from atom.model_ops.linear import RowParallelLinear
from atom.model_ops.moe import MoEMethod
from atom.model_ops.quant import LinearMethod
from atom.model_ops.quant.common import fake_quant_act, product
from atom.model_ops.quant.online import produce_ptpc_fp8
from atom.models.registry import resolve_architecture
from parallel_helpers import PROMPTS
from test_parallel_moe import run_ranks
from tiny_moe import make_tiny_moe

os.environ.setdefault("OMP_NUM_THREADS", "1")  # spawned workers inherit it
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KW = dict(num_kvcache_blocks=32, enable_log_stats=False)
PTPC = {"global_quant_config": "ptpc_fp8"}
MXFP4 = {"global_quant_config": "mxfp4"}
MXFP4_EXPERTS = {"layer_quant_config": {"*experts": "mxfp4"}}
ROW = ("o_proj", "down_proj")


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """The engines (and their spawned workers) run in an empty working directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ATOM_TORCH_PROFILER_DIR", raising=False)
    return tmp_path


def tokens(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def activations_per_rank(llm, world: int = 2) -> None:
    """Make a TP=1 engine's fp8 row-parallel layers quantize their input as `world` ranks
    do: each rank's columns with their own per-token scale, the partial products summed."""
    for layer in llm.engine.runner.model.modules():
        if isinstance(layer, RowParallelLinear) and layer.method.name == "fp8":
            method = layer.method

            def apply(lay, x, method=method):
                w = method.dequantized_weight(lay)
                parts = [product(xr, fake_quant_act(xr, "fp8", "token"), wr, None)
                         for xr, wr in zip(x.chunk(world, -1), w.chunk(world, -1))]
                y = parts[0]
                for p in parts[1:]:
                    y = y + p
                return y if lay.bias is None else y + lay.bias

            method.apply = apply


def info_files(folder) -> list[str]:
    return glob.glob(os.path.join(str(folder), "online_quant_info_*.json"))


# --- engines: TP=2 (one worker process) against TP=1 ------------------------------------
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
def test_tp2_ptpc_fp8_matches_tp1_and_gathers_only_row_parallel_layers(arch, request, in_tmp):
    path = request.getfixturevalue(arch)
    tp1 = LLM(path, online_quant_config=PTPC, **KW)
    activations_per_rank(tp1)  # the one difference TP=2 makes (module docstring)
    want = tokens(tp1)
    os.remove(tp1.engine.runner.online_quant_info["info_path"])
    with LLM(path, online_quant_config=PTPC, tensor_parallel_size=2, **KW) as llm:
        assert tokens(llm) == want
        info = llm.engine.runner.online_quant_info  # the driver's (rank 0)
        assert [w.alive for w in llm.engine.executor.workers] == [True]
    assert info["tp_size"] == 2 and info["num_quantized"] == info["num_layers"] == 8
    for row in info["layers"]:
        row_parallel = row["layer"].endswith(ROW)
        assert row["tp_split"] == ("row" if row_parallel else "column"), row
        assert row["tp_gather"] is row_parallel, row  # a row's scale spans both ranks' columns
        assert row["format"] == "fp8 per-channel, act dynamic per-token"
    files = info_files(in_tmp)
    assert files == [info["info_path"]]  # written once, by rank 0 (the worker wrote none)
    assert json.load(open(files[0]))["layers"] == info["layers"]


def test_tp2_mxfp4_matches_tp1_tokens_without_any_gather(tiny_llama, in_tmp):
    """Rank slices of 32 (o_proj) and 64 (down_proj) input columns hold whole MXFP4 groups:
    nothing is gathered, and the activations' groups of 32 are inside a rank too."""
    tp1 = LLM(tiny_llama, online_quant_config=MXFP4, **KW)
    want = tokens(tp1)
    os.remove(tp1.engine.runner.online_quant_info["info_path"])
    with LLM(tiny_llama, online_quant_config=MXFP4, tensor_parallel_size=2, **KW) as llm:
        assert tokens(llm) == want
        o_proj = llm.engine.runner.model.model.layers[0].self_attn.o_proj
        assert o_proj.method.name == "mxfp4" and tuple(o_proj.weight.shape) == (64, 32 // 2)
        info = llm.engine.runner.online_quant_info
    assert {(r["tp_split"], r["tp_gather"]) for r in info["layers"]} == {("column", False), ("row", False)}
    assert info_files(in_tmp) == [info["info_path"]]  # the driver's alone


def test_tp2_expert_parallel_mxfp4_experts_match_tp1(tmp_path, in_tmp):
    """Experts split whole over the ranks are quantized as on one rank (weight-only MXFP4):
    TP=2 with expert parallel gives TP=1's tokens."""
    path = make_tiny_moe(tmp_path / "moe", "qwen3_moe")
    prompts = PROMPTS[:2]  # the experts' torch reference is the slow part on a CPU
    want = tokens(LLM(path, online_quant_config=MXFP4_EXPERTS, **KW), prompts)
    with LLM(path, online_quant_config=MXFP4_EXPERTS, tensor_parallel_size=2, enable_expert_parallel=True,
             **KW) as llm:
        assert tokens(llm, prompts) == want
        moe = llm.engine.runner.model.model.layers[0].mlp.experts
        assert moe.method.name == "mxfp4" and (moe.expert_start, moe.num_local_experts) == (0, 4)
        rows = {r["layer"]: r for r in llm.engine.runner.online_quant_info["layers"]}
    assert rows["model.layers.0.mlp.experts"]["tp_split"] == "experts"
    assert rows["model.layers.0.mlp.experts"]["tp_gather"] is False


# --- ranks as threads: each rank's tensors against the one-rank model's --------------------
def build(path: str, state: ParallelState, plan: OnlineQuantPlan):
    """What the runner does on one rank: build under `state`, check, load, post-process."""
    hf = Config(path).hf_config
    with building(state):
        model = resolve_architecture(hf)(hf, None)
    plan.check(model)
    load_weights(model, path)
    for m in model.modules():
        if isinstance(getattr(m, "method", None), (LinearMethod, MoEMethod)):
            m.method.process_weights_after_loading(m)
    return model


def params(module) -> dict[str, torch.Tensor]:
    """A layer's own parameters (fp8 as bytes, so that equality is bit for bit)."""
    return {n: (p.data.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p.data).clone()
            for n, p in module.named_parameters(recurse=False) if p is not None}


def quantized_ranks(path, cfg, folder: str, world=2, expert_parallel=False):
    """Per rank: (tensors of every quantized layer, the unquantized row-parallel slices, the
    summary apply_online_quant returned)."""
    plan = OnlineQuantPlan(cfg)

    def rank(group):
        group.expert_parallel = expert_parallel
        model = build(path, group, plan)
        local = {n: m.weight.detach().clone() for n, m in linear_layers(model).items() if n.endswith(ROW)}
        config = SimpleNamespace(tensor_parallel_size=world, model=path, torch_profiler_dir=folder)
        info = apply_online_quant(model, config, plan)
        layers = {**linear_layers(model), **moe_layers(model)}
        return {n: params(m) for n, m in layers.items() if m.method.name != "unquantized"}, local, info

    return run_ranks(world, rank)


def one_rank(path, cfg):
    plan = OnlineQuantPlan(cfg)
    model = build(path, ParallelState.single(), plan)
    plan.apply(model)
    return model


def linear_part(layer, name: str, t: torch.Tensor, r: int, world: int) -> torch.Tensor:
    """Rank r's part of the one-rank layer's tensor `name`: a row-parallel layer's columns
    (a per-row scale whole), a column-parallel layer's rows of every shard."""
    if layer.tp_mode == "row":
        return t if t.shape[1] == 1 else t.chunk(world, 1)[r]
    parts = []
    for sid in layer.shard_ids():
        start, size = layer.shard_range(sid)
        parts.append(t[start:start + size].chunk(world, 0)[r])
    return torch.cat(parts)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
@pytest.mark.parametrize("cfg", [PTPC, MXFP4], ids=["ptpc_fp8", "mxfp4"])
def test_each_rank_holds_its_slice_of_the_one_rank_tensors(arch, cfg, request, tmp_path):
    path = request.getfixturevalue(arch)
    ref = linear_layers(one_rank(path, cfg))
    ranks = quantized_ranks(path, cfg, folder=str(tmp_path))
    for r, (got, local, info) in enumerate(ranks):
        assert set(got) == set(ref)
        for name, layer in ref.items():
            want = params(layer)
            assert set(got[name]) == set(want), name
            for p, t in want.items():
                assert torch.equal(got[name][p], linear_part(layer, p, t, r, 2)), (r, name, p)
        rows = {row["layer"]: row for row in info["layers"]}
        for name, w in local.items():  # the row-parallel slices as loaded, before quantization
            scale = ref[name].weight_scale
            if cfg == PTPC:  # the slice alone: other per-row scales, so the ranks gathered
                assert rows[name]["tp_gather"] and not torch.equal(produce_ptpc_fp8(w.float())["weight_scale"], scale)
            else:
                assert not rows[name]["tp_gather"]
    assert ranks[0][2]["info_path"] is not None and ranks[1][2]["info_path"] is None  # rank 0 writes
    assert info_files(tmp_path) == [ranks[0][2]["info_path"]]


@pytest.mark.parametrize("cfg,expert_parallel", [(PTPC, False), (PTPC, True), (MXFP4_EXPERTS, True)],
                         ids=["ptpc_fp8_width", "ptpc_fp8_experts", "mxfp4_experts"])
def test_moe_experts_on_each_rank_are_their_slice_of_the_one_rank_experts(cfg, expert_parallel, tmp_path):
    """Width split (tensor parallel): w13's gate and up rows quantized locally, w2 gathered
    (its per-row ptpc scales span every rank's columns); whole experts: as on one rank."""
    path = make_tiny_moe(tmp_path / "moe", "qwen3_moe")  # 8 experts of width 32
    ref = moe_layers(one_rank(path, cfg))
    ranks = quantized_ranks(path, cfg, expert_parallel=expert_parallel, folder=str(tmp_path))
    for r, (got, _local, info) in enumerate(ranks):
        rows = {row["layer"]: row for row in info["layers"]}
        for name, moe in ref.items():
            want = params(moe)
            assert set(got[name]) == set(want), name
            for p, t in want.items():
                if expert_parallel:  # experts [4r, 4r + 4) whole
                    part = t[4 * r:4 * r + 4]
                elif p.startswith("w13"):  # [E, gate | up rows, ...]: each part's rows
                    part = torch.cat([h.chunk(2, 1)[r] for h in t.chunk(2, 1)], 1)
                else:  # w2 [E, H, I]: its columns; a per-row scale [E, H, 1] whole
                    part = t if t.shape[2] == 1 else t.chunk(2, 2)[r]
                assert torch.equal(got[name][p], part), (r, name, p)
            assert rows[name]["tp_split"] == ("experts" if expert_parallel else "width")
            assert rows[name]["tp_gather_parts"] == ([] if expert_parallel else ["w2"])


def test_moe_mxfp4_experts_split_by_width_are_refused_by_name(tmp_path):
    """The MXFP4 MoE method does not declare how its tensors split across ranks: experts
    split by width are refused before any weight loads (expert parallel runs them)."""
    path = make_tiny_moe(tmp_path / "moe", "qwen3_moe", moe_intermediate_size=64)  # 32 per rank: whole groups
    plan = OnlineQuantPlan(MXFP4_EXPERTS)
    hf = Config(path).hf_config
    with building(ParallelState(rank=0, world_size=2)):  # no collective before the refusal
        model = resolve_architecture(hf)(hf, None)
    with pytest.raises(NotImplementedError, match=r"targets the MoE experts 'model\.layers\.0\.mlp\.experts'.*"
                                                  r"mxfp4 MoE method does not declare how .*enable_expert_parallel"):
        plan.check(model)


def test_row_parallel_mxfp4_split_inside_a_group_is_refused_by_name():
    """A rank slice of 48 input columns would cut an MXFP4 group of 32 (the rule asks for a
    gather, and the rank's method cannot hold 48 columns): refused before loading."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.down_proj = RowParallelLinear(96, 64, prefix="down_proj", tp=ParallelState(rank=1, world_size=2))

    with pytest.raises(NotImplementedError, match=r"global_quant_config='mxfp4' targets layer 'down_proj'.*"
                                                  r"in_features=48 is not a multiple of 32"):
        OnlineQuantPlan(MXFP4).check(Block())


def test_requantizing_one_rank_alone_refuses_a_layer_that_needs_the_others():
    """A caller on one rank (the sensitivity explorer) gets the slice quantized where that
    gives the full weight's scales, and a refusal naming the layer where the ranks would have
    to gather (rather than a collective waiting for ranks that never come)."""
    from atom.model_ops.linear import MergedLinear
    from atom.model_ops.quant.online import requantize_layer, target_for
    state = ParallelState(rank=0, world_size=2)  # no group: nothing may be sent
    column = MergedLinear(64, [32, 32], prefix="mlp.gate_up_proj", tp=state)
    torch.nn.init.normal_(column.weight)
    requantize_layer(column, target_for("ptpc_fp8"))
    assert column.method.name == "fp8" and tuple(column.weight_scale.shape) == (32, 1)
    row = RowParallelLinear(64, 64, prefix="mlp.down_proj", tp=state)
    with pytest.raises(ValueError, match=r"layer 'mlp.down_proj' \(row-parallel over tensor_parallel_size=2\): "
                                         r"ptpc_fp8 needs the full weight gathered from every rank"):
        requantize_layer(row, target_for("ptpc_fp8"))
    assert row.method.name == "unquantized"


def test_a_split_that_cuts_a_block_is_refused_before_any_gather():
    """fp8 128x128 blocks over a column-parallel layer of 192 rows at tensor_parallel_size=2:
    each rank would hold 96 rows, half of a block, so no rank could keep its part of that
    block's scale after a gather; refused by name up front (a rank failing after the gather
    would leave the other waiting in the next collective). 256 rows (128 a rank) are fine."""
    from atom.model_ops.linear import ColumnParallelLinear
    from atom.model_ops.quant.online import refusal, target_for
    for rank in (0, 1):
        cut = ColumnParallelLinear(128, 192, prefix="mlp.up_proj", tp=ParallelState(rank=rank, world_size=2))
        why = refusal(target_for("fp8_block"), cut)
        assert why is not None and "one scale per 128 rows" in why and "96 rows per rank" in why
        whole = ColumnParallelLinear(128, 256, prefix="mlp.up_proj", tp=ParallelState(rank=rank, world_size=2))
        assert refusal(target_for("fp8_block"), whole) is None
        row = RowParallelLinear(192, 128, prefix="mlp.down_proj", tp=ParallelState(rank=rank, world_size=2))
        assert "in_features=96 is not a multiple of the 128-wide" in refusal(target_for("fp8_block"), row)
