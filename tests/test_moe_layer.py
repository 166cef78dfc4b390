"""`FusedMoE` on its own: loading per-expert and fused tensors, what it refuses, shared
experts, dummy weights, the MoE method seam and what it shows."""
import pytest
import torch
from torch import nn

from atom.model_ops.moe import FusedMoE, MoEMethod, TopK, UnquantizedMoEMethod, describe_moe_layers, moe_method_for
from atom.model_loader.loader import init_dummy_weights


def layer(E=4, H=8, I=6, k=2, **kw):
    return FusedMoE(E, H, I, TopK(E, k, renormalize=True), prefix="model.layers.0.mlp.experts", layer_idx=0, **kw)


def test_per_expert_and_fused_loading_fill_the_same_stacks():
    a, b = layer(), layer()
    g = torch.Generator().manual_seed(0)
    gate, up, down = torch.randn(4, 6, 8, generator=g), torch.randn(4, 6, 8, generator=g), torch.randn(4, 8, 6, generator=g)
    for e in range(4):
        a.weight_loader(a.w13_weight, gate[e], (e, "w1"))
        a.weight_loader(a.w13_weight, up[e], (e, "w3"))
        a.weight_loader(a.w2_weight, down[e], (e, "w2"))
    b.weight_loader(b.w13_weight, torch.cat([gate, up], dim=1), (None, "w13"))
    b.weight_loader(b.w2_weight, down, (None, "w2"))
    assert torch.equal(a.w13_weight, b.w13_weight) and torch.equal(a.w2_weight, b.w2_weight)
    assert torch.equal(a.w13_weight[2, :6], gate[2]) and torch.equal(a.w13_weight[2, 6:], up[2])
    assert a.missing_shards() == [] == b.missing_shards()


def test_missing_and_misshapen_tensors_are_named():
    m = layer()
    m.weight_loader(m.w13_weight, torch.zeros(6, 8), (1, "w1"))
    missing = m.missing_shards()
    assert "model.layers.0.mlp.experts.w13_weight[1].w3" in missing and "model.layers.0.mlp.experts.w13_weight[1].w1" not in missing
    assert len(missing) == 4 * 3 - 1
    with pytest.raises(ValueError, match=r"w13_weight: checkpoint tensor for expert 0, part w3, has shape \(8, 8\), expected \(6, 8\)"):
        m.weight_loader(m.w13_weight, torch.zeros(8, 8), (0, "w3"))
    with pytest.raises(ValueError, match=r"expert 4 is outside \[0, 4\)"):
        m.weight_loader(m.w2_weight, torch.zeros(8, 6), (4, "w2"))
    with pytest.raises(ValueError, match=r"part 'w9' is not one of \('w1', 'w3'\)"):
        m.weight_loader(m.w13_weight, torch.zeros(6, 8), (0, "w9"))


def test_checkpoint_mapping_names():
    mapping = FusedMoE.checkpoint_mapping(gate="w1", up="w3", down="w2")

    def target(name):
        for pat, dst, part in mapping:
            if (m := pat.search(name)):
                return name[:m.start()] + dst, m.groupdict().get("expert"), part
    assert target("model.layers.3.mlp.experts.11.w3.weight") == ("model.layers.3.mlp.experts.w13_weight", "11", "w3")
    assert target("model.layers.3.mlp.experts.2.w2.weight") == ("model.layers.3.mlp.experts.w2_weight", "2", "w2")
    assert target("model.layers.3.mlp.experts.gate_up_proj") == ("model.layers.3.mlp.experts.w13_weight", None, "w13")
    assert target("model.layers.3.mlp.experts.down_proj.weight") == ("model.layers.3.mlp.experts.w2_weight", None, "w2")
    assert target("model.layers.3.mlp.experts.2.w2.bias") == ("model.layers.3.mlp.experts.w2_bias", "2", "w2")
    assert target("model.layers.3.mlp.gate.weight") is None


def test_shared_experts_biases_and_forward():
    torch.manual_seed(0)
    shared = nn.Linear(8, 8, bias=False)
    m = layer(bias=True, shared_experts=shared)
    init_dummy_weights(m, "xavier")  # 3-D stacks get each expert's own fans
    assert m.w13_weight.std() < 1.0 and "w13_bias" in dict(m.named_parameters())
    x, logits = torch.randn(5, 8), torch.randn(5, 4)
    plain = FusedMoE(4, 8, 6, TopK(4, 2, renormalize=True), bias=True)
    plain.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("shared")})
    torch.testing.assert_close(m(x, logits), plain(x, logits) + shared(x))


def test_bad_layer_settings_are_refused():
    with pytest.raises(ValueError, match="picks among 8 experts but the layer has 4"):
        FusedMoE(4, 8, 6, TopK(8, 2))
    with pytest.raises(ValueError, match="hidden_act='relu' has no gated MoE activation"):
        FusedMoE(4, 8, 6, TopK(4, 2), activation="relu")


def test_method_seam_and_description():
    m = layer()
    assert isinstance(moe_method_for(None, "x"), UnquantizedMoEMethod) and isinstance(m.method, MoEMethod)
    row, = describe_moe_layers(nn.ModuleDict({"moe": m}))
    assert row["experts"] == 4 and row["top_k"] == 2 and row["bytes"] == (4 * 12 * 8 + 4 * 8 * 6) * 4
    assert row["format"] == "float32" and "renormalize=True" in row["routing"]
    assert "experts=4, hidden=8, width=6" in repr(m) and "top_k=2" in repr(m)


def test_quantized_experts_are_refused_naming_the_layer():
    import transformers
    from atom.quant_config import QuantizationConfig
    # compressed-tensors W8A8 int8 (per channel x per token): no MoE method stores int8 experts
    int8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "block_structure": None}
    qc = QuantizationConfig(transformers.PretrainedConfig(quantization_config={
        "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {**int8, "strategy": "channel", "dynamic": False},
                                      "input_activations": {**int8, "strategy": "token", "dynamic": True}}}}))
    with pytest.raises(NotImplementedError, match="layer 'model.layers.0.mlp.experts'.*no MoE method"):
        layer(quant_config=qc)
