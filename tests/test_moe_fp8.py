"""FP8 experts (`Fp8MoEMethod`): the layer against a per-token reference written here
(dequantize each chosen expert, fake-quantize its inputs, fp32 products) for per-channel
x dynamic per-token, per-tensor x static and per-tensor x dynamic; and end to end, a tiny
Qwen3-MoE checkpoint in compressed-tensors' FP8_DYNAMIC layout gives the greedy tokens of a
fake-quantized transformers model, with the format shown by describe_moe_layers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from atom.model_ops.moe import FusedMoE, Fp8MoEMethod, TopK, describe_moe_layers
from atom.quant_config import QuantizationConfig
from atom.quant_spec import LayerQuantConfig, QuantType
from conftest import hf_greedy
from tiny_fp8_moe import (FP8, FP8_DYNAMIC, dequant, fake_quant_transformers, fq_token, quant_fp8_channel,
                          quant_fp8_tensor, write_fp8_dynamic_checkpoint)
from tiny_moe import make_tiny_moe

E, H, I, K = 6, 64, 32, 2


class OneSpec:
    def __init__(self, s):
        self.s = s

    def get_layer_quant_config(self, prefix):
        return self.s


SPECS = {
    "channel_token": (LayerQuantConfig(QuantType.per_Token, FP8, True, "compressed-tensors", act_scheme="token"),
                      quant_fp8_channel, "fp8 per-channel, act dynamic per-token"),
    "tensor_static": (LayerQuantConfig(QuantType.per_Tensor, FP8, False, "compressed-tensors", act_scheme="tensor"),
                      quant_fp8_tensor, "fp8 per-tensor, act static per-tensor"),
    "tensor_dynamic": (LayerQuantConfig(QuantType.per_Tensor, FP8, True, "fp8"), quant_fp8_tensor,
                       "fp8 per-tensor, act dynamic per-tensor"),
}
INPUT_SCALES = {"gate_proj": 0.02, "up_proj": 0.03, "down_proj": 0.01}


def fq(x, kind, static=None):
    x = x.float()
    if kind == "token":
        return fq_token(x)
    s = torch.tensor(static) if static is not None else x.abs().amax().clamp(min=1e-12) / 448
    return (x / s).clamp(-448, 448).to(FP8).float() * s


def build_layer(name, dtype, seed=0):
    spec, quant, fmt = SPECS[name]
    g = torch.Generator().manual_seed(seed)
    layer = FusedMoE(E, H, I, TopK(E, K, renormalize=True), quant_config=OneSpec(spec), prefix="t.experts")
    assert isinstance(layer.method, Fp8MoEMethod) and layer.w13_weight.dtype == FP8
    ref = {}
    for e in range(E):
        for proj, part, shape in (("gate_proj", "w1", (I, H)), ("up_proj", "w3", (I, H)), ("down_proj", "w2", (H, I))):
            q = quant(torch.randn(shape, generator=g) * 0.3)
            target = "w2" if part == "w2" else "w13"
            for suffix, t in q.items():
                p = getattr(layer, f"{target}_{suffix}")
                p.weight_loader(p, t, (e, part))
            if spec.act_scheme == "tensor" and not spec.is_dynamic:
                p = getattr(layer, f"{target}_input_scale")
                p.weight_loader(p, torch.tensor([INPUT_SCALES[proj]], dtype=torch.bfloat16), (e, part))
            ref[(e, proj)] = dequant(q)
    assert layer.missing_shards() == []
    layer.method.process_weights_after_loading(layer)
    return layer, ref, spec, fmt


def reference(x, logits, ref, spec):
    """Token by token: the same TopK choice, each chosen expert from its own dequantized weights."""
    w, ids = TopK(E, K, renormalize=True)(logits)
    static = spec.act_scheme == "tensor" and not spec.is_dynamic
    kind = "token" if spec.act_scheme == "token" else "tensor"
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(E):
        tok, slot = torch.where(ids == e)
        if len(tok) == 0:
            continue
        xe = x[tok]
        s13 = float(torch.tensor(max(INPUT_SCALES["gate_proj"], INPUT_SCALES["up_proj"])).bfloat16()) if static else None
        s2 = float(torch.tensor(INPUT_SCALES["down_proj"]).bfloat16()) if static else None
        xq = fq(xe, kind, s13)
        gate = F.linear(xq, ref[(e, "gate_proj")]).to(x.dtype)
        up = F.linear(xq, ref[(e, "up_proj")]).to(x.dtype)
        a = F.silu(gate) * up
        y = F.linear(fq(a, kind, s2), ref[(e, "down_proj")]).to(x.dtype)
        out.index_add_(0, tok, y.float() * w[tok, slot, None])
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SPECS))
def test_fp8_experts_match_reference(name, dtype):
    layer, ref, spec, fmt = build_layer(name, dtype)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(23, H, generator=g)).to(dtype)
    logits = torch.randn(23, E, generator=g) * 2
    got = layer(x, logits)
    want = reference(x, logits, ref, spec)
    assert got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    assert layer.method.format(layer) == fmt
    dense = sum(t.numel() for t in ref.values()) * 4
    assert layer.method.weight_bytes(layer) < 0.45 * dense  # e4m3 values + fp32 scales, vs fp32 weights


def test_per_channel_activation_quant_matters():
    """A check that can fail: without activation fake-quant the reference differs."""
    layer, ref, spec, _ = build_layer("channel_token", torch.float32)
    g = torch.Generator().manual_seed(2)
    x, logits = torch.randn(16, H, generator=g), torch.randn(16, E, generator=g)
    unquant_act = LayerQuantConfig(QuantType.per_Token, FP8, True, "x", act_scheme="none")
    assert not torch.allclose(layer(x, logits), reference(x, logits, ref, unquant_act), rtol=1e-5, atol=1e-5)


def test_moe_method_for_picks_fp8_from_a_compressed_tensors_config():
    qc = QuantizationConfig(transformers.PretrainedConfig(quantization_config=FP8_DYNAMIC))
    layer = FusedMoE(E, H, I, TopK(E, K), quant_config=qc, prefix="model.layers.0.mlp.experts")
    assert type(layer.method) is Fp8MoEMethod and layer.w13_weight_scale.shape == (E, 2 * I, 1)
    assert "fp8 per-channel" in repr(layer.method)


def test_misfit_scale_is_refused():
    layer, *_ = build_layer("channel_token", torch.float32)
    p = layer.w13_weight_scale
    with pytest.raises(ValueError, match=r"w13_weight_scale: checkpoint tensor for expert 2, part w1, has shape"):
        p.weight_loader(p, torch.ones(I), (2, "w1"))


@pytest.fixture(scope="module")
def fp8_qwen3_moe(tmp_path_factory):
    base = make_tiny_moe(tmp_path_factory.mktemp("qwen3_moe_base"), "qwen3_moe")
    dst = str(tmp_path_factory.mktemp("qwen3_moe_fp8_dynamic"))
    deq = write_fp8_dynamic_checkpoint(base, dst)
    return base, dst, deq


def test_fp8_dynamic_qwen3_moe_checkpoint_generates_like_fake_quant_transformers(fp8_qwen3_moe):
    from atom import LLM, SamplingParams
    from atom.viz import moe_layers_frame
    from safetensors import safe_open
    base, path, deq = fp8_qwen3_moe
    with safe_open(f"{path}/model.safetensors", "pt") as st:
        assert st.get_tensor("model.layers.0.mlp.experts.3.gate_proj.weight").dtype == FP8
        assert st.get_tensor("model.layers.0.mlp.experts.3.gate_proj.weight_scale").shape == (32, 1)
        assert st.get_tensor("model.layers.0.mlp.gate.weight").dtype == torch.float32
    ref_model = fake_quant_transformers(base, deq)
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 17, 40)]
    ref = [hf_greedy(ref_model, p, 8) for p in ps]
    assert ref != [hf_greedy(plain, p, 8) for p in ps]  # the fp32 model's tokens would not pass
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=64)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    model = llm.engine.runner.model
    ids = torch.tensor(ps[2])
    with torch.no_grad():
        fq_logits = ref_model(ids[None]).logits[0]
        plain_logits = plain(ids[None]).logits[0]
    assert (fq_logits - plain_logits).abs().max() > 1e-3  # quantization is visible: the reference is not the fp32 model
    rows = describe_moe_layers(model)
    assert [r["layer"] for r in rows] == ["model.layers.0.mlp.experts", "model.layers.2.mlp.experts"]
    frame = moe_layers_frame(llm)
    assert set(frame["method"]) == {"fp8"} and set(frame["format"]) == {"fp8 per-channel, act dynamic per-token"}
    fp32_bytes = 8 * 3 * 32 * 64 * 4
    assert (frame["bytes"] < 0.3 * fp32_bytes).all()
    exp = model.model.layers[0].mlp.experts
    torch.testing.assert_close(exp.w13_weight[3, :32].float() * exp.w13_weight_scale[3, :32],
                               deq["model.layers.0.mlp.experts.3.gate_proj.weight"], rtol=0, atol=0)
