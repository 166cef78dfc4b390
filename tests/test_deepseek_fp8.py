"""DeepSeek-V3's native fp8 checkpoint (128 x 128 block weights with `weight_scale_inv`, dynamic
1 x 128 activations) on tiny random models: the block-scaled fp8 experts against a per-expert
reference, the quantized `kv_b_proj` dequantized once for MLA, and greedy tokens equal to
transformers on the dequantized weights with every other quantized linear's input
fake-quantized per 1 x 128 group (plain, chunked prefill with prefix caching, preemption,
the Triton MLA backend)."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from atom import LLM, SamplingParams
from atom.model_ops.moe import FusedMoE, Fp8MoEMethod, TopK
from atom.quant_spec import LayerQuantConfig, QuantType
from conftest import check_greedy_in_setting, hf_greedy
from test_deepseek import SETTINGS  # the same three settings as the unquantized models
from tiny_deepseek import make_tiny_deepseek
from tiny_fp8_moe import FP8, copy_all_but_weights, dequant_block, fake_quant_transformers, fq_group, quant_fp8_block

NATIVE_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# every quantized linear's in_features a multiple of the 1 x 128 activation group
SHAPE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, kv_lora_rank=128, q_lora_rank=128,
             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_attention_heads=4, num_key_value_heads=4)
N = 12
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


class OneSpec:
    def __init__(self, s):
        self.s = s

    def get_layer_quant_config(self, prefix):
        return self.s


def block_spec(block):
    return LayerQuantConfig(QuantType.per_1x128, FP8, True, "fp8", block_size=block, act_scheme="group",
                            act_group_size=block[1])


# (E, H, I, block): DeepSeek's 128 x 128, and 64 x 32 blocks whose rows end in a partial block
@pytest.mark.parametrize("E,H,I,block", [(4, 256, 128, (128, 128)), (6, 64, 32, (64, 32))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_fp8_experts_match_a_per_expert_reference(E, H, I, block, dtype):
    K = 2
    layer = FusedMoE(E, H, I, TopK(E, K, renormalize=True), quant_config=OneSpec(block_spec(block)), prefix="t.experts")
    assert isinstance(layer.method, Fp8MoEMethod) and layer.w13_weight.dtype == FP8
    assert layer.w13_weight_scale_inv.shape == (E, 2 * -(-I // block[0]), H // block[1])
    g = torch.Generator().manual_seed(0)
    ref = {}
    for e in range(E):
        for proj, part, shape in (("gate_proj", "w1", (I, H)), ("up_proj", "w3", (I, H)), ("down_proj", "w2", (H, I))):
            q = quant_fp8_block(torch.randn(shape, generator=g) * 0.3, block)
            target = "w2" if part == "w2" else "w13"
            for suffix, t in q.items():
                p = getattr(layer, f"{target}_{suffix}")
                p.weight_loader(p, t, (e, part))
            ref[(e, proj)] = dequant_block(q, block)
    assert layer.missing_shards() == []
    layer.method.process_weights_after_loading(layer)
    x = torch.randn(19, H, generator=g).to(dtype)
    logits = torch.randn(19, E, generator=g) * 2
    got = layer(x, logits)
    w, ids = TopK(E, K, renormalize=True)(logits)
    want = torch.zeros(x.shape)
    for e in range(E):
        tok, slot = torch.where(ids == e)
        if len(tok):
            xq = fq_group(x[tok], block[1])
            gate = F.linear(xq, ref[(e, "gate_proj")]).to(dtype)
            up = F.linear(xq, ref[(e, "up_proj")]).to(dtype)
            y = F.linear(fq_group(F.silu(gate) * up, block[1]), ref[(e, "down_proj")]).to(dtype)
            want.index_add_(0, tok, y.float() * w[tok, slot, None])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want.to(dtype), **tol)
    assert layer.method.format(layer) == f"fp8 block {block[0]}x{block[1]}, act dynamic 1x{block[1]}"
    # the block scales are kept as blocks, not expanded per row
    assert layer.w13_block_scale.shape == layer.w13_weight_scale_inv.shape


def test_block_fp8_experts_refuse_a_width_the_activation_group_does_not_tile():
    with pytest.raises(NotImplementedError, match=r"layer 't.experts'.*intermediate_size=96 is not a multiple of the 128"):
        FusedMoE(4, 128, 96, TopK(4, 2), quant_config=OneSpec(block_spec((128, 128))), prefix="t.experts")


def write_native_fp8(src: str, dst: str) -> dict[str, torch.Tensor]:
    """`src` (an fp32 DeepSeek-V3 folder) -> `dst` as DeepSeek's fp8 checkpoints are stored:
    every decoder projection (attention with `kv_a_proj_with_mqa`, dense MLP, shared and
    routed experts) float8_e4m3fn
    with `weight_scale_inv` per 128 x 128 block; the router, norms, embeddings and LM head
    as they were. Returns {weight name: dequantized fp32 weight}."""
    copy_all_but_weights(src, dst)
    out, deq = {}, {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        if ".layers." in name and name.endswith(("_proj.weight", "_mqa.weight")):
            q = quant_fp8_block(t)
            out[name], out[name + "_scale_inv"] = q["weight"], q["weight_scale_inv"]
            deq[name] = dequant_block(q)
        else:
            out[name] = t
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as fh:
        config = json.load(fh)
    config["quantization_config"] = NATIVE_FP8
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(config, fh)
    return deq


@pytest.fixture(scope="module")
def fp8_v3(tmp_path_factory):
    base = make_tiny_deepseek(tmp_path_factory.mktemp("tiny_v3_base"), "v3", **SHAPE)
    dst = str(tmp_path_factory.mktemp("tiny_v3_fp8"))
    deq = write_native_fp8(base, dst)
    # kv_b_proj runs as its dequantized weight (MLA's absorbed decode multiplies by it)
    ref_model = fake_quant_transformers(base, deq, fq=fq_group, weight_only=("kv_b_proj",))
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 17, 40, 90, 130)]
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return base, dst, ps, [hf_greedy(ref_model, p, N) for p in ps], [hf_greedy(plain, p, N) for p in ps]


def test_native_fp8_without_q_lora_packs_q_proj_with_kv_a(tmp_path):
    """Without q_lora_rank, the fp8 q_proj and kv_a_proj_with_mqa (each with its 128 x 128 block
    scales; kv_a's 144 rows end in a partial block) load into one packed fused_qkv_a_proj, and
    greedy tokens equal transformers on the fake-quantized checkpoint."""
    shape = {**SHAPE, "q_lora_rank": None}
    base = make_tiny_deepseek(tmp_path / "base", "v2_lite", **shape)
    dst = str(tmp_path / "fp8")
    deq = write_native_fp8(base, dst)
    ref_model = fake_quant_transformers(base, deq, fq=fq_group, weight_only=("kv_b_proj",))
    g = torch.Generator().manual_seed(7)
    ps = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 33, 70)]
    llm = LLM(dst, enable_log_stats=False, num_kvcache_blocks=64)
    attn = llm.engine.runner.model.model.layers[0].self_attn
    fused = attn.fused_qkv_a_proj
    assert fused.weight.dtype == FP8 and fused.out_sizes == [4 * 48, 144]
    assert fused.weight_scale_inv.shape == (2 + 2, 1)  # ceil(192 / 128) + ceil(144 / 128) row blocks
    got = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
    assert got == [hf_greedy(ref_model, p, N) for p in ps]


def test_checkpoint_layout_and_the_loaded_methods(fp8_v3):
    from safetensors import safe_open
    _, path, *_ = fp8_v3
    with safe_open(f"{path}/model.safetensors", "pt") as st:
        assert st.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight").dtype == FP8
        assert st.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight_scale_inv").shape == (1, 1)
        assert st.get_tensor("model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv").shape == (2, 1)
        assert st.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.float32
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=32)
    model = llm.engine.runner.model
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(type(m.method) is Fp8MoEMethod and m.method.block == (128, 128) for m in experts)
    attn = [m for m in model.modules() if hasattr(m, "kv_b_weight")]
    assert attn and all(m.kv_b_weight is not None and m.kv_b_weight.dtype == llm.engine.runner.dtype for m in attn)
    kv_b = attn[0].kv_b_proj
    assert kv_b.weight.dtype == FP8 and kv_b.method.name != "unquantized"
    torch.testing.assert_close(attn[0].kv_b_weight.float(), kv_b.method.dequantized_weight(kv_b).float())


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_native_fp8_v3_gives_fake_quant_transformers_tokens(fp8_v3, setting):
    _, path, ps, ref, plain = fp8_v3
    assert ref != plain  # the fp32 model's tokens would not pass: the quantization is visible
    check_greedy_in_setting(path, ps, ref, setting, SETTINGS[setting], GREEDY, num_kvcache_blocks=64)


def test_native_fp8_v3_on_the_triton_mla_backend(fp8_v3):
    """The Triton MLA backend (interpreter on CPU) reads the same dequantized kv_b weight."""
    pytest.importorskip("triton")
    from atom.model_ops.attention.mla_triton import TritonMLABackend
    _, path, ps, ref, _ = fp8_v3
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=32, max_num_batched_tokens=32)
    runner = llm.engine.runner
    runner.set_attention_backend(TritonMLABackend(runner.attn_layers, 64, runner.device))
    outs = llm.generate(ps[:3], GREEDY, use_tqdm=False)  # the third is chunked: 32 + 8 tokens
    assert [o.token_ids for o in outs] == ref[:3]
    assert "TritonMLABackend" in repr(runner.attn_backend)


def test_native_fp8_v3_with_the_triton_fp8_experts(fp8_v3):
    """The plan's Triton experts kernel on the fp8 block experts (interpreted): the tokens of
    the fake-quantized reference, and no host sync left in the MoE layers."""
    pytest.importorskip("triton")
    from atom.model_engine.gpu_setup import host_syncing_layers
    from atom.tuning.plan import KernelPlan
    _, path, ps, ref, _ = fp8_v3
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=32)
    runner = llm.engine.runner
    assert host_syncing_layers(runner)  # the reference's loop
    runner.install_plan(KernelPlan(moe_kernel="triton"))
    assert host_syncing_layers(runner) == []
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(ps[1:3], sp, use_tqdm=False)] == [r[:4] for r in ref[1:3]]


def test_kv_b_copy_follows_a_swapped_method(fp8_v3):
    """The sensitivity explorer swaps a layer's method (and undoes it): MLA's copy of kv_b_proj
    follows, so the absorbed decode never multiplies by a stale weight."""
    from atom.model_ops.quant.online import requantize_layer, target_for
    _, path, *_ = fp8_v3
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=16)
    attn = next(m for m in llm.engine.runner.model.modules() if hasattr(m, "kv_b_weight"))
    before = attn.kv_b_weight.clone()
    undo = requantize_layer(attn.kv_b_proj, target_for("ptpc_fp8"))
    w_uk, _ = attn.absorb_weights()
    now = attn.kv_b_proj.method.dequantized_weight(attn.kv_b_proj).to(before.dtype)
    assert not torch.equal(now, before)
    torch.testing.assert_close(w_uk, now.view(w_uk.shape[0], -1, w_uk.shape[-1])[:, :w_uk.shape[1]])
    undo()
    w_uk, _ = attn.absorb_weights()
    torch.testing.assert_close(w_uk, before.view(w_uk.shape[0], -1, w_uk.shape[-1])[:, :w_uk.shape[1]])
