"""Online quantization at load time (`online_quant_config`): the guide's fields, the
re-quantized layers against an independent RTN reference, the info summary, refusals."""
from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch
import transformers

from atom import LLM, SamplingParams
from atom.benchmarks.quant_reference import fake_quantized_copy
from atom.model_loader.online_quant import OnlineQuantPlan, linear_layers
from atom.model_ops.quant.online import (TARGETS, check_source, needs_gather, produce_ptpc_fp8, requantize_layer,
                                         scales_of, source_weight, target_for)
from atom.viz import linear_methods_frame
from conftest import hf_greedy
from tiny_quant import make_tiny_fp8_block_model

PTPC = {"global_quant_config": "ptpc_fp8"}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300]]


def _llm(path, **kw):
    return LLM(path, num_kvcache_blocks=16, enable_log_stats=False, **kw)


def _formats(llm) -> dict[str, str]:
    df = linear_methods_frame(llm)
    return dict(zip(df["layer"], df["method"]))


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ATOM_TORCH_PROFILER_DIR", raising=False)
    return tmp_path


def test_ptpc_fp8_greedy_tokens_equal_the_rtn_reference(tiny_llama, in_tmp):
    llm = _llm(tiny_llama, online_quant_config=PTPC)
    assert set(_formats(llm).values()) == {"fp8", "unquantized"}  # the LM head stays
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ref = fake_quantized_copy(hf, "ptpc_fp8")
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p, 12) for p in PROMPTS]


def test_mxfp4_greedy_tokens_equal_the_rtn_reference(tiny_llama, in_tmp):
    llm = _llm(tiny_llama, online_quant_config={"global_quant_config": "mxfp4"})
    assert set(_formats(llm).values()) == {"mxfp4", "unquantized"}  # the LM head stays
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ref = fake_quantized_copy(hf, "mxfp4")  # an independent OCP-MX round-to-nearest
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p, 12) for p in PROMPTS]
    layer = linear_layers(llm.engine.runner.model)["model.layers.0.mlp.down_proj"]
    assert layer.weight.dtype == torch.uint8 and layer.weight.shape == (64, 64)  # [out, in/2]
    assert layer.weight_scale.shape == (64, 4)  # one E8M0 scale per 32 inputs


def test_online_layer_is_the_checkpoint_layout(tiny_llama, in_tmp):
    plain, online = _llm(tiny_llama), _llm(tiny_llama, online_quant_config=PTPC)
    for name, layer in linear_layers(online.engine.runner.model).items():
        src = linear_layers(plain.engine.runner.model)[name]
        expect = produce_ptpc_fp8(src.weight.float())
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (layer.out_features, 1)
        assert torch.equal(layer.weight.view(torch.uint8), expect["weight"].view(torch.uint8))
        assert torch.equal(layer.weight_scale, expect["weight_scale"])
        assert repr(layer.method) == "Fp8LinearMethod(fp8 per-channel, act dynamic per-token)"


def test_info_json_in_working_directory(tiny_llama, in_tmp):
    llm = _llm(tiny_llama, online_quant_config={**PTPC, "exclude_layer": "model.layers.1.mlp"})
    files = glob.glob(str(in_tmp / "online_quant_info_*.json"))
    assert len(files) == 1 and llm.engine.runner.online_quant_info["info_path"] == files[0]
    info = json.load(open(files[0]))
    assert info["online_quant_config"]["global_quant_config"] == "ptpc_fp8"
    assert info["elapsed_s"] >= 0 and info["num_layers"] == 8 and info["num_quantized"] == 6
    by = {r["layer"]: r for r in info["layers"]}
    assert by["model.layers.1.mlp.down_proj"]["target"] is None
    assert by["model.layers.1.mlp.down_proj"]["chosen_by"] == "exclude_layer"
    row = by["model.layers.0.self_attn.o_proj"]
    assert row["target"] == "ptpc_fp8" and row["source"] == "float32" and row["chosen_by"] == "global_quant_config"
    assert row["format"].startswith("fp8 per-channel") and row["tp_split"] == "row" and row["tp_gather"] is False


def test_info_json_under_profiler_dir(tiny_llama, in_tmp, monkeypatch):
    target = in_tmp / "prof"
    monkeypatch.setenv("ATOM_TORCH_PROFILER_DIR", str(target))
    _llm(tiny_llama, online_quant_config=PTPC)
    assert len(glob.glob(str(target / "online_quant_info_*.json"))) == 1
    assert not glob.glob(str(in_tmp / "online_quant_info_*.json"))


@pytest.mark.parametrize("cfg", [{}, "{}", None])
def test_empty_config_is_off(tiny_llama, in_tmp, cfg):
    plain = _llm(tiny_llama)
    llm = _llm(tiny_llama, online_quant_config=cfg)
    assert set(_formats(llm).values()) == {"unquantized"}
    assert llm.engine.runner.online_quant_info is None and not os.listdir(in_tmp)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == \
        [o.token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]


EXCLUDES = [
    ("model.layers.0.mlp.down_proj", {"model.layers.0.mlp.down_proj"}),                      # exact
    ("model.layers.1", {f"model.layers.1.{p}" for p in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                        "mlp.gate_up_proj", "mlp.down_proj")}),  # prefix
    ("model.layers.1.", {f"model.layers.1.{p}" for p in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                         "mlp.gate_up_proj", "mlp.down_proj")}),  # prefix.
    (["*.o_proj"], {"model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"}),   # glob
    (["re:model\\.layers\\.0\\.self_attn"], {"model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj"}),
    (["model.layers.0.self_attn.k_proj"], {"model.layers.0.self_attn.qkv_proj"}),  # a shard: its packed layer
    (["model.layers.0.mlp.down", "re:.*up_proj$"], {"model.layers.0.mlp.gate_up_proj",       # a bare prefix
                                                    "model.layers.1.mlp.gate_up_proj"}),     # of a name: no
]


@pytest.mark.parametrize("exclude,expected", EXCLUDES, ids=["exact", "prefix", "prefix_dot", "glob", "regex", "shard", "list"])
def test_exclude_layer_patterns(tiny_llama, in_tmp, exclude, expected):
    llm = _llm(tiny_llama, online_quant_config={**PTPC, "exclude_layer": exclude})
    methods = _formats(llm)
    left = {n for n, m in methods.items() if m == "unquantized" and n != "lm_head"}
    assert left == expected


def test_layer_quant_config_patterns_without_global(tiny_llama, in_tmp):
    llm = _llm(tiny_llama, online_quant_config={"layer_quant_config": {"*.mlp.*": "ptpc_fp8"}})
    methods = _formats(llm)
    assert {n for n, m in methods.items() if m == "fp8"} == {
        f"model.layers.{i}.mlp.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")}


def test_plan_order_exclude_then_patterns_then_global(tiny_llama):
    plan = OnlineQuantPlan({"global_quant_config": "w8a8_int8", "layer_quant_config": {"*.mlp.*": "ptpc_fp8"},
                            "exclude_layer": ["model.layers.1.mlp"]})
    assert plan.format_for("model.layers.0.mlp.down_proj") == "ptpc_fp8"
    assert plan.format_for("model.layers.1.mlp.down_proj") is None
    assert plan.format_for("model.layers.1.self_attn.o_proj") == "w8a8_int8"
    assert "ptpc_fp8" in repr(plan)


@pytest.mark.parametrize("cfg,err,match", [
    ({"global_quant_config": "int3"}, ValueError, r"online_quant_config.global_quant_config='int3' is invalid"),
    ({"layer_quant_config": {"*.mlp.*": "fp16"}}, ValueError, r"online_quant_config.layer_quant_config\['\*.mlp.\*'\]"),
    ({"exclude_layer": ["re:("]}, ValueError, r"online_quant_config.exclude_layer='re:\(' is invalid: bad regex"),
    ({"exclude_layer": 3}, ValueError, r"online_quant_config.exclude_layer=3 is invalid"),
])
def test_bad_config_is_refused_before_weights_load(tiny_llama, tmp_path, in_tmp, cfg, err, match):
    no_weights = tmp_path / "config_only"
    no_weights.mkdir()
    shutil.copy(os.path.join(tiny_llama, "config.json"), no_weights)
    with pytest.raises(err, match=match):  # not "has no *.safetensors files": nothing loaded yet
        _llm(str(no_weights), online_quant_config=cfg)


def test_fp8_block_source_is_dequantized_then_requantized(tmp_path, in_tmp):
    path = make_tiny_fp8_block_model(tmp_path / "fp8_block")
    block = _llm(path)
    assert {m for n, m in _formats(block).items() if n != "lm_head"} == {"fp8"}
    online = _llm(path, online_quant_config=PTPC)
    info = online.engine.runner.online_quant_info
    assert {r["source"] for r in info["layers"]} == {"fp8 block 128x128, act dynamic 1x128"}
    blocks = linear_layers(block.engine.runner.model)
    for name, layer in linear_layers(online.engine.runner.model).items():
        expect = produce_ptpc_fp8(source_weight(blocks[name]))  # the blocks, dequantized
        assert layer.method.weight_scheme == "channel"
        assert torch.equal(layer.weight.view(torch.uint8), expect["weight"].view(torch.uint8))
    outs = online.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == 12 for o in outs)


def test_other_quantized_sources_are_refused(tiny_llama):
    llm = _llm(tiny_llama)
    layer = linear_layers(llm.engine.runner.model)["model.layers.0.mlp.down_proj"]
    undo = requantize_layer(layer, target_for("w8a8_int8"))
    assert "online quantization starts from unquantized weights or FP8 block" in check_source(layer)
    with pytest.raises(ValueError, match="layer 'model.layers.0.mlp.down_proj' cannot be quantized online"):
        source_weight(layer)
    undo()
    assert check_source(layer) is None


def test_requantize_and_undo_restore_the_layer(tiny_llama):
    llm = _llm(tiny_llama)
    layer = linear_layers(llm.engine.runner.model)["model.layers.0.self_attn.qkv_proj"]
    x = torch.randn(3, layer.in_features)
    before = layer(x)
    for name in TARGETS:
        if name == "fp8_block":
            continue  # in_features 64: refused (see the explorer's status)
        undo = requantize_layer(layer, target_for(name))
        err = ((layer(x) - before).norm() / before.norm()).item()
        assert 0 < err < 0.2, name
        undo()
        assert torch.equal(layer(x), before) and layer.method.name == "unquantized"


# --- the tensor-parallel gather rule ------------------------------------------------------
@pytest.mark.parametrize("fmt,split,size,tp,gather", [
    ("ptpc_fp8", "column", 1024, 2, False),   # per-row scales: rows split, scales whole
    ("ptpc_fp8", "row", 1024, 2, True),       # a row's amax spans both ranks
    ("w8a8_int8", "row", 1024, 4, True),
    ("w4a16_g64", "row", 1024, 4, False),     # 256 local columns: whole groups
    ("w4a16_g64", "row", 96, 2, True),        # 48 local columns cut a group
    ("fp8_block", "column", 1024, 4, False),
    ("fp8_block", "column", 576, 3, True),    # 192 rows: a 128-row block cut
    ("ptpc_fp8", "row", 1024, 1, False),      # one rank: never
])
def test_gather_rule(fmt, split, size, tp, gather):
    assert needs_gather(TARGETS[fmt], split, size, tp) is gather


@pytest.mark.parametrize("fmt", ["ptpc_fp8", "w8a8_int8", "w4a16_g32", "fp8_block"])
@pytest.mark.parametrize("split", ["column", "row"])
def test_gather_rule_says_when_local_scales_differ(fmt, split):
    """Quantize two ranks' slices locally and compare with the full weight's scales sliced:
    the rule asks for a gather exactly when they differ."""
    torch.manual_seed(0)
    w = torch.randn(256, 320) * torch.rand(256, 1) * torch.rand(1, 320)
    target = TARGETS[fmt]
    dim = 0 if split == "column" else 1
    full = scales_of(target, w)
    parts = [scales_of(target, p) for p in w.chunk(2, dim)]
    if split == "column":
        same = torch.equal(torch.cat(parts, 0), full)
    else:  # per-row scales: each rank would hold every row's scale
        same = all(torch.equal(p, full) for p in parts) if full.shape[1] == 1 else \
            torch.equal(torch.cat(parts, 1), full)
    assert needs_gather(target, split, w.shape[dim], 2) is (not same)


def test_gather_rule_refuses_an_uneven_split():
    with pytest.raises(ValueError, match="tp_size=3 does not divide"):
        needs_gather(TARGETS["ptpc_fp8"], "row", 1024, 3)


# --- SmolLM2 --------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_ptpc_fp8_online(smollm2_path, in_tmp):
    """A real model with `exclude_layer`: 112 of its 120 linears re-quantized, and ATOM's greedy
    answer is the one transformers' SmolLM2 with the same layers fake-quantized gives,
    teacher-forced. Not token for token from free generation: fp8 activations make this
    model's answer to the prompt chaotic (a 1e-6 relative change of the embeddings moves the
    reference's first-token log-probabilities by ~0.3 while its top two are ~0.2 apart), so
    fp32 rounding order alone can pick the other of two near-tied tokens."""
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    msg = [{"role": "user", "content": "What is the capital of France?"}]
    excluded = ("model.layers.0.", "model.layers.29.")
    llm = LLM(smollm2_path, max_model_len=512, enable_log_stats=False, num_kvcache_blocks=32,
              online_quant_config={**PTPC, "exclude_layer": ["re:model\\.layers\\.(0|29)\\."]})
    out = llm.chat(msg, sp, use_tqdm=False)[0]
    info = llm.engine.runner.online_quant_info
    assert info["num_layers"] == 120 and info["num_quantized"] == 112
    assert {n for n, f in _formats(llm).items() if f == "unquantized" and n != "lm_head"} == \
        {f"{b}{p}" for b in excluded for p in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                "mlp.down_proj")}
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    ref = fake_quantized_copy(hf, "ptpc_fp8", only=lambda name, _m: not name.startswith(excluded))
    prompt = list(out.prompt_token_ids)
    with torch.inference_mode():
        lp = ref(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    gap = lp.max(-1).values - lp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert (gap == 0).float().mean() >= 0.75, gap   # mostly the reference's own argmax
    assert gap.max() < 0.5, gap                     # elsewhere a near-tie of the reference's


def test_compile_cache_key_includes_the_online_config(tiny_llama):
    from atom.config import Config
    plain = Config(tiny_llama).compute_hash()
    assert Config(tiny_llama, online_quant_config={}).compute_hash() == plain
    assert Config(tiny_llama, online_quant_config=PTPC).compute_hash() != plain


def test_moe_experts_are_quantized_online_and_formats_without_a_moe_method_refused(tmp_path, in_tmp):
    """A global ptpc_fp8 re-quantizes the experts too (FP8 MoE method, in the info summary);
    experts a format cannot hold are refused by name before weights load; MLA's kv_b_proj too."""
    from tiny_deepseek import make_tiny_deepseek
    from tiny_moe import make_tiny_moe
    moe = make_tiny_moe(tmp_path / "moe")
    llm = _llm(moe, online_quant_config=PTPC)
    experts = [m for m in llm.engine.runner.model.modules() if type(m).__name__ == "FusedMoE"]
    assert experts and {m.method.name for m in experts} == {"fp8"}
    rows = {r["layer"]: r for r in llm.engine.runner.online_quant_info["layers"]}
    assert rows["model.layers.0.mlp.experts"]["target"] == "ptpc_fp8"
    assert rows["model.layers.0.mlp.experts"]["source"] == "float32"  # the model's dtype, as loaded
    assert "fp8" in rows["model.layers.0.mlp.experts"]["format"]
    assert llm.generate(PROMPTS, GREEDY, use_tqdm=False)[0].token_ids
    model = llm.engine.runner.model  # what the GPU refusal of kernel-less formats skips
    assert {"model.layers.0.mlp.experts", "model.layers.0.self_attn.qkv_proj"} <= OnlineQuantPlan(PTPC).targeted(model)
    targeted = OnlineQuantPlan({**PTPC, "exclude_layer": "model.layers.0.mlp.experts"}).targeted(model)
    assert "model.layers.0.mlp.experts" not in targeted and "model.layers.0.self_attn.qkv_proj" in targeted
    assert "lm_head" not in targeted
    odd = make_tiny_moe(tmp_path / "odd", moe_intermediate_size=48)  # MXFP4 packs groups of 32
    with pytest.raises(NotImplementedError, match=r"mxfp4.*targets the MoE experts 'model\.layers\.\d+\.mlp\.experts'"
                                                  r".*intermediate_size=48 is not a multiple of 32"):
        _llm(odd, online_quant_config={"layer_quant_config": {"*experts": "mxfp4"}})
    ok = _llm(moe, online_quant_config={**PTPC, "exclude_layer": "re:.*experts"})  # excluded: as loaded
    assert {m.method.name for m in ok.engine.runner.model.modules() if type(m).__name__ == "FusedMoE"} == \
        {"unquantized"}
    ds = make_tiny_deepseek(tmp_path / "ds", "v3")
    with pytest.raises(ValueError, match=r"kv_b_proj', whose weight MLA's absorbed decode reads"):
        _llm(ds, online_quant_config={**PTPC, "exclude_layer": "re:.*experts"})


def test_mxfp4_experts_online_give_transformers_tokens_with_those_experts(tmp_path, in_tmp):
    """The guide's `{"*expert*": "mxfp4"}`: only the experts become MXFP4 (weight-only); the
    engine's greedy tokens equal transformers' with every expert matrix replaced by its MXFP4
    round trip (the exact reference of weight-only quantization), and differ from the plain model's."""
    from atom.model_ops.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
    from tiny_moe import make_tiny_moe
    path = make_tiny_moe(tmp_path / "moe", fused=True)
    llm = _llm(path, online_quant_config={"layer_quant_config": {"*expert*": "mxfp4"}})
    experts = [m for m in llm.engine.runner.model.modules() if type(m).__name__ == "FusedMoE"]
    assert experts and {m.method.name for m in experts} == {"mxfp4"}
    assert set(_formats(llm).values()) == {"unquantized"}  # the linear layers as loaded
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    plain = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    with torch.no_grad():
        for layer in hf.model.layers:
            ex = getattr(layer.mlp, "experts", None)
            for name in ("gate_up_proj", "down_proj"):
                if ex is not None and hasattr(ex, name):
                    w = getattr(ex, name)
                    w.copy_(dequantize_mxfp4(*quantize_mxfp4(w.float())))
    assert got == [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    assert got != plain, "MXFP4 experts changed no token: is the reference quantizing?"


def test_online_quant_with_tensor_parallel_is_accepted(tiny_llama):
    """No longer refused: tests/test_online_quant_tp.py runs it (each rank's tensors are the
    one-rank model's slices; ranks gather where the rule says so)."""
    from atom.config import Config
    from atom.model_engine.supported import unsupported_settings
    assert unsupported_settings(Config(tiny_llama, online_quant_config=PTPC, tensor_parallel_size=2)) == []
