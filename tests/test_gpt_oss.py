"""GPT-OSS: greedy tokens identical to transformers (fp32) on a tiny random model (sinks,
router and expert biases non-zero, layers alternating a window of 8 and full attention, YaRN)
across scheduling settings, with the Triton experts kernel, and from an MXFP4 checkpoint in
GPT-OSS's layout (transformers dequantizes it as the reference); the pieces against
transformers' own modules; bad configs refused at load."""
import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

from atom import LLM, SamplingParams
from atom.model_ops.moe import describe_moe_layers
from atom.model_ops.moe.layer import activation_of, relayout
from atom.models.gpt_oss import topk_then_softmax
from atom.quant_config import QuantizationConfig
from atom.tuning.plan import KernelPlan
from conftest import check_greedy_in_setting, hf_reference, random_prompts
from tiny_gpt_oss import NOT_CONVERTED, make_tiny_gpt_oss, make_tiny_gpt_oss_mxfp4, tiny_gpt_oss_model

PROMPT_LENS = (3, 9, 17, 40, 90)  # window 8: all but the first are longer
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# transformers' own reader of the MXFP4 checkpoint, dequantizing it: not its hub kernels (with the
# `kernels` package installed, transformers >= 5.25 would fetch them, and nothing is downloaded here)
DEQUANTIZED = dict(quantization_config=transformers.Mxfp4Config(dequantize=True))
SETTINGS = {
    "plain": dict(),
    "chunked_prefill_prefix_caching": dict(max_num_batched_tokens=32, enable_prefix_caching=True),
    "preemption": dict(num_kvcache_blocks=8, kv_cache_block_size=16),
}


def prompts(lens=PROMPT_LENS, seed=1):
    return random_prompts(lens, seed)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))
    ps = prompts()
    return path, ps, hf_reference(path, ps)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(tiny, setting):
    path, ps, ref = tiny
    check_greedy_in_setting(path, ps, ref, setting, SETTINGS[setting], GREEDY, num_kvcache_blocks=64)


def test_model_reads_like_the_config(tiny):
    path, _, _ = tiny
    model = LLM(path, enable_log_stats=False, num_kvcache_blocks=16).engine.runner.model
    attn = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.sliding_window for a in attn] == [8, None, 8, None]
    assert all(a.sinks is layer.self_attn.sinks for a, layer in zip(attn, model.model.layers))
    assert model.model.layers[0].self_attn.rotary_emb.attention_factor == pytest.approx(0.1 * torch.log(
        torch.tensor(8.0)).item() + 1)
    rows = describe_moe_layers(model)
    assert [r["activation"] for r in rows] == ["gpt_oss_swiglu(alpha=1.702,limit=7.0)"] * 4
    assert {r["method"] for r in rows} == {"unquantized"}


def test_fused_checkpoint_layout_is_transposed_and_interleaved(tiny):
    """transformers writes gate_up_proj [E, H, 2I] with gate/up interleaved along 2I and
    down_proj [E, I, H]; the layer holds [E, 2I, H] as [gate | up] rows and [E, H, I]."""
    path, _, _ = tiny
    t = load_file(os.path.join(path, "model.safetensors"))
    gu, gub, d = (t[f"model.layers.1.mlp.experts.{n}"] for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj"))
    assert gu.shape == (4, 96, 128) and gub.shape == (4, 128) and d.shape == (4, 64, 96)
    experts = LLM(path, enable_log_stats=False, num_kvcache_blocks=16).engine.runner.model.model.layers[1].mlp.experts
    torch.testing.assert_close(experts.w13_weight[:, :64], gu[:, :, 0::2].transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(experts.w13_weight[:, 64:], gu[:, :, 1::2].transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(experts.w13_bias, torch.cat((gub[:, 0::2], gub[:, 1::2]), 1), rtol=0, atol=0)
    torch.testing.assert_close(experts.w2_weight, d.transpose(1, 2), rtol=0, atol=0)


def test_activation_and_router_match_transformers():
    """The clamped SwiGLU on [gate | up] halves == transformers' `_apply_gate` on interleaved
    columns (values past the limit included); the router == `GptOssTopKRouter`."""
    model = tiny_gpt_oss_model(swiglu_limit=1.5)
    mlp = model.model.layers[0].mlp
    h = torch.randn(10, 128) * 4
    halves = relayout(h.T, ["interleaved"], per_expert=True).T  # the loader's de-interleave (rows = columns of h)
    ours = activation_of("gpt_oss_swiglu(alpha=1.702,limit=1.5)")(halves)
    assert (h.abs() > 1.5).any()
    torch.testing.assert_close(ours, mlp.experts._apply_gate(h), rtol=0, atol=0)
    x = torch.randn(12, 96)
    logits, scores, ids = mlp.router(x)
    w, i = topk_then_softmax(logits, 2)
    assert torch.equal(i, ids)
    torch.testing.assert_close(w, scores, rtol=0, atol=0)


def test_triton_experts_kernel_in_the_engine(tiny):
    """The plan's Triton experts kernel (interpreted) with biases and the clamped activation:
    transformers' tokens on prefill (sorted path) and decode (unsorted path)."""
    path, ps, ref = tiny
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=32)
    llm.engine.runner.install_plan(KernelPlan(moe_kernel="triton"))
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(ps[1:3], sp, use_tqdm=False)] == [r[:4] for r in ref[1:3]]
    assert llm.engine.runner.plan.moe_tile_tables


def test_triton_attention_backend_in_the_engine(tiny):
    """The Triton attention backend (interpreted) runs GPT-OSS's sinks and alternating window
    / full layers in the engine: transformers' tokens, with prompts longer than the window and
    decode steps past it."""
    pytest.importorskip("triton")
    from atom.model_ops.attention.triton_backend import TritonAttentionBackend
    path, ps, ref = tiny
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=32)
    runner = llm.engine.runner
    runner.set_attention_backend(TritonAttentionBackend(runner.attn_layers, 64, runner.device))
    assert {a.sliding_window for a in runner.attn_layers} == {8, None}
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(ps[1:3], sp, use_tqdm=False)] == [r[:5] for r in ref[1:3]]
    assert "TritonAttentionBackend" in repr(runner.attn_backend)


@pytest.fixture(scope="module")
def tiny_mxfp4(tmp_path_factory):
    return make_tiny_gpt_oss_mxfp4(tmp_path_factory.mktemp("gpt_oss_mxfp4"))


@pytest.fixture(scope="module")
def mxfp4_ref(tiny_mxfp4):
    ps = prompts(lens=(3, 17, 40))
    return ps, hf_reference(tiny_mxfp4, ps, **DEQUANTIZED)


@pytest.mark.parametrize("setting", ["plain", "chunked_prefill_prefix_caching"])
def test_mxfp4_checkpoint_matches_transformers_dequantized(tiny_mxfp4, mxfp4_ref, setting):
    """GPT-OSS's MXFP4 layout (blocks + e8m0 scales, written with the engine's numerics):
    the engine keeps the experts packed and gives the tokens of transformers running the
    same checkpoint dequantized (its own reader of the format, fp32)."""
    t = load_file(os.path.join(tiny_mxfp4, "model.safetensors"))
    assert t["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (4, 128, 3, 16)
    assert t["model.layers.0.mlp.experts.down_proj_scales"].shape == (4, 96, 2)
    assert not any(n.endswith("experts.gate_up_proj") for n in t)
    ps, ref = mxfp4_ref
    llm = LLM(tiny_mxfp4, enable_log_stats=False, **{"num_kvcache_blocks": 64, **SETTINGS[setting]})
    assert [o.token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)] == ref
    model = llm.engine.runner.model
    experts = model.model.layers[0].mlp.experts
    assert experts.method.name == "mxfp4" and experts.w13_weight.dtype == torch.uint8
    assert experts.w13_weight.shape == (4, 128, 48) and experts.w2_weight_scale.shape == (4, 96, 2)
    assert model.model.layers[0].self_attn.qkv_proj.method.name == "unquantized"  # modules_to_not_convert
    rows = describe_moe_layers(model)
    assert {r["format"] for r in rows} == {"mxfp4 1x32 e8m0, weight only"}


def test_mxfp4_triton_experts_in_the_engine(tiny_mxfp4, mxfp4_ref):
    """The plan's Triton MXFP4 experts kernel (interpreted; weights dequantized in registers,
    biases, the clamped activation): transformers' tokens, and no host sync left."""
    from atom.model_engine.gpu_setup import host_syncing_layers
    ps, ref = mxfp4_ref
    llm = LLM(tiny_mxfp4, enable_log_stats=False, num_kvcache_blocks=32)
    runner = llm.engine.runner
    assert host_syncing_layers(runner)
    runner.install_plan(KernelPlan(moe_kernel="triton"))
    assert host_syncing_layers(runner) == []
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(ps[1:3], sp, use_tqdm=False)] == [r[:4] for r in ref[1:3]]
    assert {r["kernel"] for r in describe_moe_layers(runner.model)} == {
        "triton grouped GEMM (mxfp4 dequantized in registers)"}


def test_mxfp4_checkpoint_under_preemption(tiny_mxfp4):
    """The packed MXFP4 experts with preemption (recomputed prompts), all five prompt lengths."""
    ps = prompts()
    check_greedy_in_setting(tiny_mxfp4, ps, hf_reference(tiny_mxfp4, ps, **DEQUANTIZED), "preemption",
                            SETTINGS["preemption"], GREEDY, num_kvcache_blocks=64)


def test_mxfp4_quant_config_quantizes_experts_only():
    cfg = QuantizationConfig(transformers.GptOssConfig(quantization_config={
        "quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED + ["model.layers.3.mlp.experts"]}))
    q = cfg.get_layer_quant_config
    assert q("model.layers.0.mlp.experts").quant_dtype == torch.float4_e2m1fn_x2
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.router", "lm_head",
                 "model.layers.3.mlp.experts", "model.layers.1.dense.up_proj"):
        assert not q(name).is_quantized, name


def _edit_config(path, **fields):
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("fields, match", [
    (dict(num_experts_per_tok=5), r"num_experts_per_tok=5 is invalid.*num_experts=4"),
    (dict(swiglu_limit=-1.0), r"swiglu_limit=-1.0 is invalid"),
    (dict(layer_types=["sliding_attention", "chunked_attention"] * 2), r"layer_types\[1\]='chunked_attention'"),
    (dict(sliding_window=None), r"layer_types\[0\]='sliding_attention' needs sliding_window"),
])
def test_bad_configs_fail_at_load(tmp_path, fields, match):
    path = make_tiny_gpt_oss(tmp_path, num_hidden_layers=4)
    _edit_config(path, **fields)
    with pytest.raises(ValueError, match=match):
        LLM(path, enable_log_stats=False, num_kvcache_blocks=16)


def test_config_checks_transformers_leaves_to_the_engine():
    """Fields transformers' strict config would refuse itself, for configs built otherwise."""
    from types import SimpleNamespace
    from atom.models.gpt_oss import check_config
    cfg = transformers.GptOssConfig(num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2).to_dict()
    for fields, match in ((dict(layer_types=["full_attention"] * 3), r"layer_types has 3 entries but num_hidden_layers=4"),
                          (dict(swiglu_alpha=True), r"swiglu_alpha=True is invalid"),
                          (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}),
                           r"rope_type='llama3' is not supported for GPT-OSS")):
        with pytest.raises(ValueError, match=match):
            check_config(SimpleNamespace(**{**cfg, **fields}))


def test_config_without_swiglu_fields_takes_gpt_oss_constants():
    """Released checkpoints' config.json carry `swiglu_limit` but no `swiglu_alpha`, and
    transformers before 5.2x has neither field: GPT-OSS's 1.702 and 7.0 then."""
    from types import SimpleNamespace
    from atom.models.gpt_oss import check_config, swiglu_param
    cfg = transformers.GptOssConfig(num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2).to_dict()
    cfg.pop("swiglu_alpha", None), cfg.pop("swiglu_limit", None)
    check_config(SimpleNamespace(**cfg))
    assert swiglu_param(SimpleNamespace(**cfg), "swiglu_alpha") == 1.702
    assert swiglu_param(SimpleNamespace(**cfg), "swiglu_limit") == 7.0
    assert swiglu_param(SimpleNamespace(**cfg, swiglu_alpha=2.0), "swiglu_alpha") == 2.0


def test_mxfp4_width_not_a_multiple_of_32_is_refused(tiny_mxfp4, tmp_path):
    import shutil
    path = shutil.copytree(tiny_mxfp4, tmp_path / "m")
    _edit_config(path, intermediate_size=48)
    with pytest.raises(NotImplementedError, match=r"experts.*intermediate_size=48 is not a multiple of 32"):
        LLM(str(path), enable_log_stats=False, num_kvcache_blocks=16)


def test_experts_op_takes_the_parametrised_activation_by_name():
    """Under torch.compile the experts run as `atom::moe_experts` with the activation by name:
    the GPT-OSS name with its alpha / limit gives the reference's result (biases included)."""
    from atom.model_ops.moe import experts_op  # noqa: F401  (registers the op)
    from atom.model_ops.moe.experts_ref import experts_reference
    from atom.model_ops.moe.tile_configs import TileTable
    g = torch.Generator().manual_seed(0)
    E, H, I, T, k = 4, 32, 16, 5, 2
    x, w13, w2 = torch.randn(T, H, generator=g), torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    w, ids = topk_then_softmax(torch.randn(T, E, generator=g), k)
    name = "gpt_oss_swiglu(alpha=1.702,limit=2.0)"
    want = experts_reference(x, w13, w2, w, ids, activation_of(name), b13, b2)
    tiles = TileTable(E, I, H, "float32", "cpu").to_json()  # default tiles
    got = torch.ops.atom.moe_experts(x, w13, w2, w, ids, b13, b2, name, tiles)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(want, experts_reference(x, w13, w2, w, ids, activation_of("gpt_oss_swiglu"), b13, b2))


def test_glob_exclusions_name_parent_modules():
    """`modules_to_not_convert` globs such as "model.layers.*.self_attn" name a module above
    the layer: its layers stay unquantized (as transformers' `should_convert_module`)."""
    cfg = QuantizationConfig(transformers.LlamaConfig(quantization_config={
        "quant_method": "fp8", "activation_scheme": "dynamic", "modules_to_not_convert": ["model.layers.*.self_attn"]}))
    assert not cfg.get_layer_quant_config("model.layers.3.self_attn.qkv_proj").is_quantized
    assert cfg.get_layer_quant_config("model.layers.3.mlp.gate_up_proj").is_quantized
    assert cfg.get_layer_quant_config("model.layers.3.self_attention_x").is_quantized  # a module boundary
