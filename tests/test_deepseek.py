"""DeepSeek-V2 / V3 (MLA, YaRN + interleaved rope, shared + routed experts) give transformers'
greedy tokens (fp32) on tiny random models: mixed prompt lengths, chunked prefill with prefix
caching, preemption, the Triton MLA backend (interpreter); the checkpoint's tensors land where
they belong; the latent cache is what is allocated."""
import json

import pytest
import torch
import transformers
from safetensors import safe_open

from atom import LLM, SamplingParams
from atom.model_ops.moe import FusedMoE
from conftest import check_greedy_in_setting, hf_greedy
from tiny_deepseek import YARN, make_tiny_deepseek

VARIANTS = ["v2", "v2_lite", "v3", "v3_noq"]
PROMPT_LENS = (3, 17, 40, 90, 130)
N = 12
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


def prompts(seed=1, lens=PROMPT_LENS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module", params=VARIANTS)
def model_and_ref(request, tmp_path_factory):
    path = make_tiny_deepseek(tmp_path_factory.mktemp(f"tiny_deepseek_{request.param}"), request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ps = prompts()
    return request.param, path, ps, [hf_greedy(hf, p, N) for p in ps]


SETTINGS = {
    "plain": dict(),
    "chunked_prefix_caching": dict(max_num_batched_tokens=32, enable_prefix_caching=True),
    "preemption": dict(num_kvcache_blocks=12, kv_cache_block_size=16),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(model_and_ref, setting):
    variant, path, ps, ref = model_and_ref
    check_greedy_in_setting(path, ps, ref, setting, SETTINGS[setting], GREEDY, num_kvcache_blocks=96)


def test_shared_prefix_in_one_batch(tmp_path):
    path = make_tiny_deepseek(tmp_path / "m", "v3")
    base = prompts(seed=3, lens=(48,))[0]
    ps = [base + [5 + i, 9, 11] for i in range(3)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = [hf_greedy(hf, p, 6) for p in ps]
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=48, enable_prefix_caching=True)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate(ps[:1], sp, use_tqdm=False)
    rest = llm.generate(ps[1:], sp, use_tqdm=False)
    assert [o.token_ids for o in first + rest] == ref
    assert all(o.num_cached_tokens == 48 for o in rest)


def test_triton_mla_backend_in_the_engine(tmp_path):
    """The Triton backend (latent write + split-KV absorbed decode; interpreter on CPU)."""
    pytest.importorskip("triton")
    from atom.model_ops.attention.mla_triton import TritonMLABackend
    path = make_tiny_deepseek(tmp_path / "m", "v3")
    ps = [[5, 6, 7, 8, 9], list(range(10, 50))]  # the second is chunked: 32 + 8 tokens
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=32, max_num_batched_tokens=32)
    runner = llm.engine.runner
    runner.set_attention_backend(TritonMLABackend(runner.attn_layers, 64, runner.device))
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 5) for p in ps]
    assert "TritonMLABackend" in repr(runner.attn_backend)


def test_triton_mla_backend_under_preemption(model_and_ref):
    """The Triton MLA backend (interpreter) when sequences are preempted and recomputed."""
    pytest.importorskip("triton")
    from atom.model_ops.attention.mla_triton import TritonMLABackend
    variant, path, ps, ref = model_and_ref
    if variant != "v3":
        pytest.skip("one variant is enough for the backend")
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=12, kv_cache_block_size=16)
    runner = llm.engine.runner
    runner.set_attention_backend(TritonMLABackend(runner.attn_layers, 64, runner.device))
    assert [o.token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)] == ref
    assert llm.stats.steps()["preemptions"].sum() > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_q_proj_and_kv_a_land_in_one_matrix_without_q_lora(tmp_path):
    """Without q_lora_rank, q_proj + kv_a_proj_with_mqa -> the rows of fused_qkv_a_proj (one
    product for both), and the layer's split gives back each projection."""
    path = make_tiny_deepseek(tmp_path / "m", "v2_lite")
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=8)
    attn = llm.engine.runner.model.model.layers[1].self_attn
    with safe_open(f"{path}/model.safetensors", "pt") as st:
        q = st.get_tensor("model.layers.1.self_attn.q_proj.weight")
        kv_a = st.get_tensor("model.layers.1.self_attn.kv_a_proj_with_mqa.weight")
    fused = attn.fused_qkv_a_proj.weight.cpu()
    assert not hasattr(attn, "q_proj") and attn.fused_qkv_a_proj.out_sizes == [q.shape[0], kv_a.shape[0]]
    assert torch.equal(fused[:q.shape[0]], q) and torch.equal(fused[q.shape[0]:], kv_a)


def test_checkpoint_tensors_land_in_place(tmp_path):
    """q_a_proj + kv_a_proj_with_mqa -> rows of fused_qkv_a_proj; per-expert gate / up -> each
    expert's gate_up_proj; the V3 correction bias and the fp32 gate."""
    path = make_tiny_deepseek(tmp_path / "m", "v3")
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=8)
    model = llm.engine.runner.model
    with safe_open(f"{path}/model.safetensors", "pt") as st:
        t = {k: st.get_tensor(k) for k in st.keys()}
    attn = model.model.layers[1].self_attn
    q_rank = attn.q_lora_rank
    fused = attn.fused_qkv_a_proj.weight.cpu()  # the engine's device (a GPU where there is one)
    assert torch.equal(fused[:q_rank], t["model.layers.1.self_attn.q_a_proj.weight"])
    assert torch.equal(fused[q_rank:], t["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"])
    moe = model.model.layers[2].mlp
    inter = moe.experts.intermediate_size
    w13, w2 = moe.experts.w13_weight[5].cpu(), moe.experts.w2_weight[5].cpu()
    assert torch.equal(w13[:inter], t["model.layers.2.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(w13[inter:], t["model.layers.2.mlp.experts.5.up_proj.weight"])
    assert torch.equal(w2, t["model.layers.2.mlp.experts.5.down_proj.weight"])
    shared = moe.shared_experts.gate_up_proj.weight.cpu()
    assert torch.equal(shared[:inter], t["model.layers.2.mlp.shared_experts.gate_proj.weight"])
    bias = t["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert bias.abs().sum() > 0 and torch.equal(moe.gate.e_score_correction_bias.cpu(), bias)
    assert moe.gate.weight.dtype == torch.float32
    assert not hasattr(model.model.layers[0].mlp, "gate")  # first_k_dense_replace=1: a dense MLP


def test_latent_cache_is_allocated(tmp_path):
    path = make_tiny_deepseek(tmp_path / "m", "v2_lite")
    cfg = json.load(open(f"{path}/config.json"))
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=10, kv_cache_block_size=16)
    runner = llm.engine.runner
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    df = runner.kv_cache_manager.to_frame()
    assert list(df["kind"]) == ["latent"] * cfg["num_hidden_layers"]
    assert runner.kv_bytes_per_block == cfg["num_hidden_layers"] * 16 * latent * 4
    assert runner.attn_layers[0].kv_cache.shape == (10, 16, latent)
    assert runner.attn_backend.name == ("triton-mla" if torch.cuda.is_available() else "torch-mla")


def test_yarn_rope_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    from atom.model_ops.rotary import rope_parameters
    from atom.model_ops.rotary_yarn import DeepseekRotaryEmbedding, mla_softmax_scale
    cfg = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=32,
                                        q_lora_rank=None, max_position_embeddings=256, rope_parameters=dict(YARN))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    rot = DeepseekRotaryEmbedding(8, 256, rope_parameters(cfg))
    assert abs(rot.attention_factor - factor) < 1e-7 and factor != 1.0
    pos = torch.arange(256, dtype=torch.float32)
    torch.testing.assert_close(rot.cos_sin_cache[:, :4], (torch.outer(pos, inv_freq).cos() * factor))
    scale = mla_softmax_scale(24, rope_parameters(cfg))
    assert abs(scale - DeepseekV3Attention(cfg, 0).scaling) < 1e-9 and abs(scale - 24 ** -0.5) > 1e-3


def test_bad_routing_config_fails_at_load(tmp_path):
    path = make_tiny_deepseek(tmp_path / "m", "v2")
    cfg = json.load(open(f"{path}/config.json"))
    cfg["topk_method"] = "bogus"
    json.dump(cfg, open(f"{path}/config.json", "w"))
    with pytest.raises(ValueError, match="topk_method='bogus'"):
        LLM(path, enable_log_stats=False, num_kvcache_blocks=8)


def test_mlp_bias_is_refused_at_load(tmp_path):
    """transformers gives DeepSeek-V2's MLPs biases when mlp_bias is set; this file has none, so
    such a config is refused by name instead of loading without them."""
    path = make_tiny_deepseek(tmp_path / "m", "v2")
    cfg = json.load(open(f"{path}/config.json"))
    cfg["mlp_bias"] = True
    json.dump(cfg, open(f"{path}/config.json", "w"))
    with pytest.raises(ValueError, match="mlp_bias=True is not supported"):
        LLM(path, enable_log_stats=False, num_kvcache_blocks=8)


def test_mtp_layers_in_the_checkpoint_are_skipped(tmp_path):
    """A V3 checkpoint's multi-token-prediction layer (after the last decoder layer) loads past."""
    from safetensors.torch import save_file
    path = make_tiny_deepseek(tmp_path / "m", "v3")
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(4, 4),
               "model.layers.3.self_attn.kv_b_proj.weight": torch.zeros(4, 4)}, f"{path}/mtp.safetensors")
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=8)
    assert len(llm.engine.runner.model.model.layers) == 3


def test_deepseek_v2_lite_shape():
    """The benchmark shape (REFERENCE.md) builds (on the meta device): 15.7 B parameters, MLA
    with a 576-value latent per token and layer = 31,104 B/token in bf16, YaRN mscale 0.707."""
    from atom.benchmarks.workloads import write_model_config
    from atom.models.deepseek_v2 import DeepseekV2ForCausalLM
    cfg = transformers.AutoConfig.from_pretrained(write_model_config("deepseek-v2-lite"))
    with torch.device("meta"):
        model = DeepseekV2ForCausalLM(cfg)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == 15.7
    attn = model.model.layers[0].self_attn.attn
    spec = attn.kv_cache_spec(torch.bfloat16)
    assert spec.page_bytes(1) * cfg.num_hidden_layers == 31104
    assert not hasattr(model.model.layers[0].mlp, "experts") and model.model.layers[1].mlp.experts.num_experts == 64
    # no q_lora_rank: [q_proj | kv_a_proj_with_mqa] packed into one matrix of 16 x 192 + 576 rows
    assert model.model.layers[0].self_attn.fused_qkv_a_proj.out_sizes == [3072, 576]
    assert model.packed_modules_mapping["q_proj"] == ("fused_qkv_a_proj", 0)
    assert "q_a_proj" not in model.packed_modules_mapping


@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_moe_block_equals_a_per_expert_loop(tmp_path, variant):
    """The fused layer (stacked experts, TopK from the routing) + shared experts equals the
    sum written out here: deepseek_topk's choice, each chosen expert's SiLU-gated MLP from its
    own checkpoint tensors, weighted, plus the shared experts."""
    import torch.nn.functional as F
    from atom.models.deepseek_routing import deepseek_topk
    path = make_tiny_deepseek(tmp_path / "m", variant)
    with safe_open(f"{path}/model.safetensors", "pt") as st:
        t = {k: st.get_tensor(k) for k in st.keys()}
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=8)
    moe = llm.engine.runner.model.model.layers[1].mlp
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    pre = "model.layers.1.mlp"

    def mlp(name, h):
        return F.linear(F.silu(F.linear(h, t[f"{name}.gate_proj.weight"])) * F.linear(h, t[f"{name}.up_proj.weight"]),
                        t[f"{name}.down_proj.weight"])

    w, ids = deepseek_topk(F.linear(x, t[f"{pre}.gate.weight"]), moe.gate.routing,
                           t.get(f"{pre}.gate.e_score_correction_bias"))
    ref = mlp(f"{pre}.shared_experts", x)
    for i in range(x.shape[0]):
        for j in range(ids.shape[1]):
            ref[i] += w[i, j] * mlp(f"{pre}.experts.{int(ids[i, j])}", x[i:i + 1])[0]
    dev = moe.experts.w13_weight.device  # the engine's device (a GPU where there is one)
    torch.testing.assert_close(moe(x.to(dev)).cpu(), ref, rtol=1e-4, atol=1e-4)
    assert len(set(ids.flatten().tolist())) > 3  # several experts take part


def test_routing_statistics_for_deepseek(tmp_path):
    """record_expert_load counts tokens x top_k per MoE layer (1 and 2; layer 0 is dense)
    every step, and changes no token."""
    path = make_tiny_deepseek(tmp_path / "m", "v3")
    ps = prompts(seed=5, lens=(7, 40))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=32, max_num_batched_tokens=32,
              record_expert_load=True)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in ps]
    load, steps = llm.stats.expert_load(), llm.stats.steps()
    assert sorted(load["layer"].unique()) == [1, 2] and load["expert"].max() == 7
    per = load.groupby(["step", "layer"])["tokens"].sum().unstack()
    tokens = (steps.set_index("step")["prefill_tokens"] + steps.set_index("step")["decode_tokens"]).loc[per.index]
    for layer in (1, 2):
        assert per[layer].tolist() == (tokens * 3).tolist()  # num_experts_per_tok=3
    assert len(per) == len(steps)


def test_triton_experts_kernel_in_the_engine(tmp_path):
    """The plan's Triton experts kernel (interpreted) inside the engine on a DeepSeek model:
    transformers' tokens on a prefill and decode steps."""
    pytest.importorskip("triton")
    from atom.tuning.plan import KernelPlan
    path = make_tiny_deepseek(tmp_path / "m", "v2")
    ps = prompts(seed=6, lens=(6, 21))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=32)
    runner = llm.engine.runner
    runner.install_plan(KernelPlan(moe_kernel="triton"))
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 4) for p in ps]
    assert runner.plan.moe_tile_tables


@pytest.mark.parametrize("variant", ["v2", "v3_noq", "v2_lite"])
def test_all_triton_kernels_in_the_engine(tmp_path, variant, monkeypatch):
    """Every layer on its Triton kernel as on a GPU (interpreted): the rope dims rotated in
    place by the rotary kernel (interleaved pairs for V2, halves for V3 with
    rope_interleave=false), the norms on strided rows, the latent write and decode on views,
    the experts kernel, the routing kernel: transformers' tokens on chunked prefills and decodes."""
    pytest.importorskip("triton")
    from atom.model_ops import kernels
    from atom.model_ops.attention.mla_triton import TritonMLABackend
    from atom.tuning.plan import KernelPlan
    path = make_tiny_deepseek(tmp_path / "m", variant)
    ps = prompts(seed=7, lens=(5, 40))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=32, max_num_batched_tokens=32)
    runner = llm.engine.runner
    runner.set_attention_backend(TritonMLABackend(runner.attn_layers, 64, runner.device))
    runner.install_plan(KernelPlan(backend="triton", force_kernels=True, moe_kernel="triton",
                                   fusions=("moe+shared",)))
    stacked = [m.shared_stack is not None for m in runner.model.modules() if isinstance(m, FusedMoE)]
    # the shared experts join the grouped GEMM where the routing kernel computes the rule (no groups)
    assert stacked and all(stacked) == (variant == "v2_lite") and any(stacked) == all(stacked)
    calls = []
    real = kernels.rotary_embedding
    monkeypatch.setattr(kernels, "rotary_embedding",
                        lambda *a, **kw: calls.append(kw.get("interleaved")) or real(*a, **kw))
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 4) for p in ps]
    assert calls and set(calls) == {variant != "v3_noq"}, "the rope dims did not go through the rotary kernel"


def test_describe_moe_layers_shows_deepseek(tmp_path):
    from atom.viz import moe_layers_frame
    path = make_tiny_deepseek(tmp_path / "m", "v3")
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=8)
    df = moe_layers_frame(llm)
    assert list(df["layer"]) == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    row = df.iloc[0]
    assert (row["experts"], row["top_k"], row["width"], row["shared_experts"], row["format"]) == (8, 3, 32, True, "float32")
    assert "scoring=sigmoid" in row["routing"] and "groups=2/4" in row["routing"] and "scale=2.5" in row["routing"]


def test_deepseek_v2_lite_roofline_cost():
    """The roofline reads the latent KV (31,104 B/token) and, per MoE layer, the shared
    experts, the router and the routed experts the step's tokens activate: at one token the
    top 6, so 2.45 B parameters multiplied per token (with the LM head), V2-Lite's published
    2.4 B activated; at a large batch every expert, the published 15.7 B in all."""
    from atom.benchmarks.roofline import model_cost
    from atom.benchmarks.workloads import MODEL_CONFIGS
    c = model_cost(MODEL_CONFIGS["deepseek-v2-lite"])
    assert c.kv_bytes_per_token == 31104
    assert (c.moe_layers, c.experts, c.top_k) == (26, 64, 6)
    assert 2.35e9 < c.token_matmul_params() < 2.5e9
    assert c.step_weight_params(1) == c.params + 26 * 6 * c.expert_params
    assert c.params == c.matmul_params + 102400 * 2048
    assert 15.5e9 < c.step_weight_params(4096) < 16.0e9
