"""Qwen3-MoE and Mixtral: greedy tokens identical to transformers (fp32) on tiny random
models, across scheduling settings and checkpoint layouts; bad configs and incomplete
checkpoints refused at load; routing statistics that add up."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom import LLM, SamplingParams
from atom.tuning.plan import KernelPlan
from conftest import check_greedy_in_setting, hf_reference, random_prompts
from tiny_moe import make_tiny_moe

PROMPT_LENS = (3, 17, 40, 90, 130)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

MODELS = {
    # sparse layers 0 and 2, dense layer 1 (mlp_only_layers), renormalised top-2
    "qwen3_moe": ("qwen3_moe", dict()),
    # only layer 1 sparse (decoder_sparse_step 2), raw softmax weights, top-3
    "qwen3_moe_step2_unnormalised": ("qwen3_moe", dict(norm_topk_prob=False, decoder_sparse_step=2,
                                                        mlp_only_layers=[], num_experts_per_tok=3)),
    "mixtral": ("mixtral", dict()),
}

SETTINGS = {
    "plain": dict(),
    "chunked_prefill_prefix_caching": dict(max_num_batched_tokens=32, enable_prefix_caching=True),
    "preemption": dict(num_kvcache_blocks=14, kv_cache_block_size=16),
}


def prompts(lens=PROMPT_LENS, seed=1):
    return random_prompts(lens, seed)


@pytest.fixture(scope="module", params=list(MODELS))
def model_and_ref(request, tmp_path_factory):
    arch, kw = MODELS[request.param]
    path = make_tiny_moe(tmp_path_factory.mktemp(request.param), arch, **kw)
    ps = prompts()
    return path, ps, hf_reference(path, ps)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(model_and_ref, setting):
    path, ps, ref = model_and_ref
    check_greedy_in_setting(path, ps, ref, setting, SETTINGS[setting], GREEDY, num_kvcache_blocks=64)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fused_3d_checkpoint_loads(arch, tmp_path):
    """transformers >= 5 keeps experts as 3-D tensors (mlp.experts.gate_up_proj / down_proj);
    a checkpoint saved that way gives the same tokens."""
    path = make_tiny_moe(tmp_path, arch, fused=True)
    names = list(load_file(os.path.join(path, "model.safetensors")))
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names) and not any(".experts.0." in n for n in names)
    ps = prompts(lens=(5, 33))
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=32)
    assert [o.token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)] == hf_reference(path, ps)


def test_triton_experts_kernel_in_the_engine(tmp_path):
    """The plan's Triton experts kernel (interpreted here) gives transformers' tokens too, on a
    prefill (sorted path) and on decode steps (unsorted: 2 tokens x top-2 <= 8 experts)."""
    path = make_tiny_moe(tmp_path, "qwen3_moe")
    ps = prompts(lens=(6, 21))
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=32)
    runner = llm.engine.runner
    runner.install_plan(KernelPlan(moe_kernel="triton"))
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(ps, sp, use_tqdm=False)] == hf_reference(path, ps, 4)
    assert runner.plan.moe_tile_tables  # the layers asked the plan for their tiles


def _edit_config(path, **fields):
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("arch, fields, match", [
    ("qwen3_moe", dict(num_experts_per_tok=9), r"num_experts_per_tok=9 is invalid.*\[1, num_experts=8\]"),
    ("qwen3_moe", dict(decoder_sparse_step=0), r"decoder_sparse_step=0 is invalid"),
    ("qwen3_moe", dict(use_sliding_window=True), r"use_sliding_window=True is not implemented"),
    ("qwen3_moe", dict(hidden_act="gelu_new"), r"hidden_act='gelu_new' has no gated MoE activation"),
    ("mixtral", dict(sliding_window=64), r"sliding_window=64 is not implemented for Mixtral"),
    ("mixtral", dict(num_local_experts=0), r"num_local_experts=0 is invalid"),
    ("mixtral", dict(num_experts_per_tok=5), r"num_experts_per_tok=5 is invalid.*num_local_experts=4"),
])
def test_bad_configs_fail_at_load(tmp_path, arch, fields, match):
    path = make_tiny_moe(tmp_path, arch)
    _edit_config(path, **fields)
    with pytest.raises(ValueError, match=match):
        LLM(path, enable_log_stats=False, num_kvcache_blocks=16)


def test_checkpoint_missing_an_expert_is_refused(tmp_path):
    path = make_tiny_moe(tmp_path, "mixtral")
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*layers\.1\.mlp\.experts\.w13_weight\[3\]\.w3"):
        LLM(path, enable_log_stats=False, num_kvcache_blocks=16)


def test_routing_stats_add_up(tmp_path):
    path = make_tiny_moe(tmp_path, "qwen3_moe")
    ps = prompts(lens=(7, 40))
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=32, max_num_batched_tokens=32,
              record_expert_load=True)
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_reference(path, ps)  # recording changes nothing
    load, steps = llm.stats.expert_load(), llm.stats.steps()
    assert sorted(load["layer"].unique()) == [0, 2] and load["expert"].max() == 7  # sparse layers only
    per = load.groupby(["step", "layer"])["tokens"].sum().unstack()
    tokens = steps.set_index("step")["prefill_tokens"] + steps.set_index("step")["decode_tokens"]
    for layer in (0, 2):
        assert per[layer].tolist() == (tokens * 2).loc[per.index].tolist()  # tokens x top_k, every step
    assert len(per) == len(steps)


def test_routing_stats_off_by_default_and_refused_without_moe(tmp_path, tiny_llama):
    path = make_tiny_moe(tmp_path, "mixtral")
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=16)
    llm.generate(prompts(lens=(4,)), GREEDY, use_tqdm=False)
    assert llm.engine.runner.expert_recorder is None and llm.stats.expert_load().empty
    assert all(m.recorder is None for m in llm.engine.runner.model.modules() if hasattr(m, "recorder"))
    with pytest.raises(ValueError, match="need a model with MoE layers: this one has none"):
        LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=16, record_expert_load=True)


def test_dummy_weights_run(tmp_path):
    """A folder with only config.json (the benchmarks' way) builds and generates: the stacked
    experts get dummy values like any parameter."""
    path = make_tiny_moe(tmp_path, "qwen3_moe")
    os.remove(os.path.join(path, "model.safetensors"))
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=16, load_dummy="xavier")
    w13 = llm.engine.runner.model.model.layers[0].mlp.experts.w13_weight
    assert w13.abs().sum() > 0 and 0.05 < float(w13.std()) < 0.5  # xavier over each expert's [2I, H]
    out = llm.generate(prompts(lens=(9,)), GREEDY, use_tqdm=False)
    assert len(out[0].token_ids) == 16


def test_host_syncing_experts_kernels_are_found_for_the_eager_fallback(tmp_path):
    """The torch reference reads routed counts on the host; gpu_setup turns graphs and
    compilation off for such layers instead of failing in capture."""
    from atom.model_engine.gpu_setup import host_syncing_layers
    llm = LLM(make_tiny_moe(tmp_path / "m"), enable_log_stats=False, num_kvcache_blocks=16)
    runner = llm.engine.runner
    runner.install_plan(KernelPlan(moe_kernel="reference"))  # what a CPU plan runs; a GPU's default is Triton
    found = host_syncing_layers(runner)
    assert found and all(".mlp.experts" in name for name, _ in found)
    runner.install_plan(KernelPlan(backend="triton", moe_kernel="triton"))
    assert host_syncing_layers(runner) == []  # the grouped GEMM does not sync
