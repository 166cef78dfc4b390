"""compressed-tensors config groups: each group quantizes the layers its `targets` match (by
compressed-tensors' rules: exact name > `re:` regex > class "Linear"; `re.match` from the start
of the name), a packed layer's shards must agree, `ignore` wins, a layer no group matches stays
unquantized; and Quark's `layer_type_quant_config`.

The precedence cases were checked against compressed-tensors 0.19's `match_targets`
(`.venv-prod`): for `model.layers.0.self_attn.q_proj` and the targets `Linear`,
`re:.*self_attn.*`, `re:.*q_proj$`, `re:.*layers.0.*` it orders the matches
`['re:.*layers.0.*', 're:.*q_proj$', 're:.*self_attn.*', 'Linear']` (the first wins), an exact
name comes before every regex, and `re:mlp` does not match `model.layers.0.mlp.down_proj`.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from atom.benchmarks.quant_formats import FORMATS
from atom.config import QuantizationConfig
from atom.model_ops.quant import UnquantizedLinearMethod, linear_method_for
from atom.quant_spec import DTYPE_KEYS, GenericParser, GroupMatcher, LayerQuantConfig, QuantType

FP8 = torch.float8_e4m3fn
INT4 = DTYPE_KEYS["i4x2"]

ATTN = ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
        "model.layers.7.self_attn.qkv_proj", "model.layers.7.self_attn.o_proj"]
MLP = ["model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj",
       "model.layers.7.mlp.gate_up_proj", "model.layers.7.mlp.down_proj", "model.layers.3.mlp.experts"]


def hf_with(quant: dict) -> transformers.PretrainedConfig:
    return transformers.PretrainedConfig(quantization_config=quant)


def group(fmt: str, targets: list[str]) -> dict:
    """The config group llm-compressor 0.14 writes for the producer scheme `fmt`, with `targets`."""
    g = copy.deepcopy(FORMATS[fmt].quantization_config()["config_groups"]["group_0"])
    g["targets"] = list(targets)
    return g


def ct(groups: dict, ignore=("lm_head",)) -> dict:
    """A whole compressed-tensors `quantization_config` with these config groups."""
    out = copy.deepcopy(FORMATS["fp8_dynamic"].quantization_config(ignore=list(ignore)))
    out["config_groups"] = groups
    out["format"] = "mixed-precision" if len(groups) > 1 else out["format"]
    return out


#: W4A16 (int4, group 128) for the MLP, FP8 dynamic (per-channel weights, per-token activations)
#: for attention: the mixed checkpoint llm-compressor writes for a recipe with two schemes
MIXED = ct({"group_0": group("w4a16", ["re:.*mlp.*"]), "group_1": group("fp8_dynamic", ["re:.*self_attn.*"])})


def fields(spec: LayerQuantConfig) -> dict:
    return spec.to_dict()


# ---------------------------------------------------------------------------
# several groups
# ---------------------------------------------------------------------------


def test_two_groups_each_layer_gets_its_own_groups_spec():
    qc = QuantizationConfig(hf_with(MIXED))
    for name in ATTN:
        assert fields(qc.get_layer_quant_config(name)) == {
            "quant_type": "per_Token", "quant_dtype": "float8_e4m3fn", "is_dynamic": True,
            "quant_method": "compressed-tensors", "symmetric": True, "act_scheme": "token", "act_dtype": "fp8",
        }, name
    for name in MLP:
        assert fields(qc.get_layer_quant_config(name)) == {
            "quant_type": "per_1x128", "quant_dtype": "uint8", "is_dynamic": True,
            "quant_method": "compressed-tensors", "group_size": 128, "symmetric": True, "act_scheme": "none",
        }, name
    # the methods the layers are built with follow
    assert type(linear_method_for(qc, "model.layers.0.self_attn.o_proj")).__name__ == "Fp8LinearMethod"
    assert type(linear_method_for(qc, "model.layers.0.mlp.down_proj")).__name__ == "Int4LinearMethod"


def test_two_groups_specs_equal_each_scheme_read_alone():
    qc = QuantizationConfig(hf_with(MIXED))
    w4a16 = GenericParser().parse(FORMATS["w4a16"].quantization_config())
    fp8 = GenericParser().parse(FORMATS["fp8_dynamic"].quantization_config())
    assert fields(qc.get_layer_quant_config("model.layers.1.mlp.down_proj")) == fields(w4a16)
    assert fields(qc.get_layer_quant_config("model.layers.1.self_attn.o_proj")) == fields(fp8)


def test_layer_no_group_matches_stays_unquantized():
    qc = QuantizationConfig(hf_with({**MIXED, "ignore": []}))
    # lm_head is neither mlp nor self_attn, and no group targets "Linear"
    spec = qc.get_layer_quant_config("lm_head")
    assert spec == LayerQuantConfig(QuantType.No, torch.bfloat16, True, "")
    assert isinstance(linear_method_for(qc, "lm_head"), UnquantizedLinearMethod)
    assert qc.global_quant_config.quant_type is QuantType.No  # no class-wide group


def test_regex_targets_match_from_the_start_of_the_name():
    qc = QuantizationConfig(hf_with(ct({
        "group_0": group("fp8_dynamic", ["re:mlp"]),  # re.match: "model..." does not start with "mlp"
        "group_1": group("w4a16", ["re:model\\.layers\\.[0-3]\\.mlp\\.down_proj"]),  # no "$": a prefix
    })))
    assert qc.get_layer_quant_config("model.layers.0.mlp.down_proj").quant_dtype == INT4
    assert qc.get_layer_quant_config("model.layers.3.mlp.down_proj").quant_dtype == INT4
    assert qc.get_layer_quant_config("model.layers.4.mlp.down_proj").quant_type is QuantType.No
    assert qc.get_layer_quant_config("mlp.down_proj").quant_dtype == FP8


def test_precedence_exact_name_then_regex_then_class():
    qc = QuantizationConfig(hf_with(ct({
        "linear": group("w8a8_int8", ["Linear"]),
        "attn": group("fp8_dynamic", ["re:.*self_attn.*"]),
        "one": group("w4a16", ["model.layers.2.self_attn.o_proj"]),
    })))
    assert qc.get_layer_quant_config("model.layers.2.self_attn.o_proj").quant_dtype == INT4   # exact name
    assert qc.get_layer_quant_config("model.layers.1.self_attn.o_proj").quant_dtype == FP8    # regex
    assert qc.get_layer_quant_config("model.layers.1.mlp.down_proj").quant_dtype == torch.int8  # class
    assert qc.get_layer_quant_config("lm_head").quant_type is QuantType.No  # ignored
    assert qc.global_quant_config.quant_dtype == torch.int8  # the "Linear" group's


def test_two_matching_regexes_the_one_that_sorts_first_wins():
    # compressed-tensors sorts the targets: "re:.*layers.0.*" < "re:.*self_attn.*", whatever the group order
    for order in (("a", "b"), ("b", "a")):
        groups = {order[0]: group("fp8_dynamic", ["re:.*self_attn.*"]), order[1]: group("w4a16", ["re:.*layers.0.*"])}
        qc = QuantizationConfig(hf_with(ct(groups)))
        assert qc.get_layer_quant_config("model.layers.0.self_attn.o_proj").quant_dtype == INT4
        assert qc.get_layer_quant_config("model.layers.1.self_attn.o_proj").quant_dtype == FP8


def test_target_in_two_groups_belongs_to_the_later(caplog):
    with caplog.at_level("WARNING"):
        qc = QuantizationConfig(hf_with(ct({"g0": group("fp8_dynamic", ["Linear"]), "g1": group("w4a16", ["Linear"])})))
    assert qc.get_layer_quant_config("model.layers.0.mlp.down_proj").quant_dtype == INT4
    assert "'Linear' is in config groups 'g0' and 'g1'" in caplog.text


def test_matcher_class_targets_and_no_match():
    groups = GenericParser().parse_groups(MIXED)
    assert [(g.name, g.targets) for g in groups] == [("group_0", ("re:.*mlp.*",)), ("group_1", ("re:.*self_attn.*",))]
    m = GroupMatcher(groups)
    assert m.match("model.layers.0.mlp.down_proj")[0] == "re:.*mlp.*"
    assert m.match("lm_head") is None and m.class_match() is None


# ---------------------------------------------------------------------------
# packed layers
# ---------------------------------------------------------------------------


def test_packed_layer_matched_by_its_shards():
    # "re:.*_proj$" names the checkpoint's q/k/v; the packed name "qkv_proj" itself is no module there
    qc = QuantizationConfig(hf_with(ct({"g": group("fp8_dynamic", ["re:.*\\.[qkv]_proj$"])})))
    assert qc.get_layer_quant_config("model.layers.0.self_attn.qkv_proj").quant_dtype == FP8
    assert qc.get_layer_quant_config("model.layers.0.self_attn.o_proj").quant_type is QuantType.No


def test_packed_layer_whose_shards_disagree_is_refused():
    qc = QuantizationConfig(hf_with(ct({
        "group_0": group("fp8_dynamic", ["re:.*q_proj$"]),
        "group_1": group("w4a16", ["Linear"]),
    })))
    with pytest.raises(ValueError, match=(
            r"layer 'model.layers.0.self_attn.qkv_proj' packs the checkpoint shards .*"
            r"'model.layers.0.self_attn.q_proj' by group 'group_0' \(target 're:.\*q_proj\$'\), "
            r"'model.layers.0.self_attn.k_proj' by group 'group_1' \(target 'Linear'\)")):
        qc.get_layer_quant_config("model.layers.0.self_attn.qkv_proj")
    # refused when the layer is built, before any weight is loaded
    with pytest.raises(ValueError, match="must resolve to the same config group"):
        linear_method_for(qc, "model.layers.0.self_attn.qkv_proj")
    assert qc.get_layer_quant_config("model.layers.0.mlp.gate_up_proj").quant_dtype == INT4  # gate/up agree


def test_packed_layer_with_a_shard_no_group_matches_is_refused():
    qc = QuantizationConfig(hf_with(ct({"g": group("w4a16", ["re:.*gate_proj$"])})))
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.up_proj' by no group \(unquantized\)"):
        qc.get_layer_quant_config("model.layers.1.mlp.gate_up_proj")


def test_packed_shards_in_groups_of_identical_schemes_are_accepted():
    qc = QuantizationConfig(hf_with(ct({
        "q": group("fp8_dynamic", ["re:.*q_proj$"]),
        "rest": group("fp8_dynamic", ["Linear"]),
    })))
    assert qc.get_layer_quant_config("model.layers.0.self_attn.qkv_proj").quant_dtype == FP8


def test_packed_names_follow_the_models_mapping():
    cfg = ct({"attn_a": group("fp8_dynamic", ["re:.*q_a_proj$"]), "rest": group("w4a16", ["Linear"])})
    deepseek = {"q_a_proj": ("fused_qkv_a_proj", 0), "kv_a_proj_with_mqa": ("fused_qkv_a_proj", 1),
                "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    qc = QuantizationConfig(hf_with(cfg))
    # before the model's mapping is known, fused_qkv_a_proj is a layer of its own name
    assert qc.get_layer_quant_config("model.layers.0.self_attn.fused_qkv_a_proj").quant_dtype == INT4
    qc.remap_layer_name(None, deepseek)
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.kv_a_proj_with_mqa' by group 'rest'"):
        qc.get_layer_quant_config("model.layers.0.self_attn.fused_qkv_a_proj")
    # the mapping has no q/k/v: qkv_proj is matched as itself
    assert qc.get_layer_quant_config("model.layers.0.self_attn.qkv_proj").quant_dtype == INT4


# ---------------------------------------------------------------------------
# ignore
# ---------------------------------------------------------------------------


def test_ignore_wins_over_every_group():
    cfg = ct({
        "linear": group("w4a16", ["Linear"]),
        "attn": group("fp8_dynamic", ["re:.*self_attn.*"]),
        "one": group("w8a8_int8", ["model.layers.5.mlp.down_proj"]),
    }, ignore=["lm_head", "re:.*mlp.gate$", "model.layers.5.mlp.down_proj", "model.layers.1.self_attn.q_proj"])
    qc = QuantizationConfig(hf_with(cfg))
    for name in ("lm_head", "model.layers.2.mlp.gate", "model.layers.5.mlp.down_proj"):
        assert qc.get_layer_quant_config(name).quant_type is QuantType.No, name
    qc.remap_layer_name(transformers.LlamaConfig())
    # an ignored shard excludes its packed layer (as before): no shard check is reached
    assert qc.get_layer_quant_config("model.layers.1.self_attn.qkv_proj").quant_type is QuantType.No
    assert qc.get_layer_quant_config("model.layers.2.self_attn.qkv_proj").quant_dtype == FP8
    assert qc.get_layer_quant_config("model.layers.2.mlp.gate_up_proj").quant_dtype == INT4


# ---------------------------------------------------------------------------
# one "Linear" group: as before
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [f for f in FORMATS if FORMATS[f].weights is not None])
def test_one_linear_group_behaves_as_before(fmt):
    cfg = FORMATS[fmt].quantization_config(ignore=["lm_head", "re:.*mlp.gate$"])
    qc = QuantizationConfig(hf_with(cfg))
    g = qc.global_quant_config
    assert fields(g) == fields(GenericParser().parse(cfg))  # the one-spec reading of the whole config
    for name in ATTN + MLP:
        assert qc.get_layer_quant_config(name) is g, name
    for name in ("lm_head", "model.layers.4.mlp.gate"):
        assert qc.get_layer_quant_config(name).quant_type is QuantType.No


def test_repr_names_the_groups():
    assert "config_groups=['group_0', 'group_1']" in repr(QuantizationConfig(hf_with(MIXED)))


def test_one_linear_group_pinned_specs():
    fp8 = QuantizationConfig(hf_with(FORMATS["fp8_dynamic"].quantization_config())).global_quant_config
    assert (fp8.quant_type, fp8.quant_dtype, fp8.is_dynamic, fp8.act_scheme) == (
        QuantType.per_Token, FP8, True, "token")
    w4 = QuantizationConfig(hf_with(FORMATS["w4a16"].quantization_config())).global_quant_config
    assert (w4.quant_type, w4.quant_dtype, w4.group_size, w4.act_scheme) == (QuantType.per_1x128, INT4, 128, "none")


# ---------------------------------------------------------------------------
# refusals and hashing
# ---------------------------------------------------------------------------


def test_generic_parse_refuses_several_groups():
    with pytest.raises(ValueError, match=r"config_groups=\['group_0', 'group_1'\] is invalid here: .*parse_groups"):
        GenericParser().parse(MIXED)


def test_group_without_targets_or_with_a_bad_regex_is_refused():
    g = group("fp8_dynamic", ["Linear"])
    del g["targets"]
    with pytest.raises(ValueError, match=r"config_groups.group_0.targets=None is invalid: must be a non-empty list"):
        QuantizationConfig(hf_with(ct({"group_0": g})))
    with pytest.raises(ValueError, match=r"config_groups.group_0.targets=\[\] is invalid"):
        QuantizationConfig(hf_with(ct({"group_0": group("fp8_dynamic", [])})))
    with pytest.raises(ValueError, match=r"config_groups.bad.targets entry 're:\(' is invalid: bad regex"):
        QuantizationConfig(hf_with(ct({"ok": group("fp8_dynamic", ["Linear"]), "bad": group("w4a16", ["re:("])})))


def test_unreadable_group_is_named():
    g = group("fp8_dynamic", ["re:.*mlp.*"])
    g["weights"]["num_bits"] = 3
    g["input_activations"] = None
    with pytest.raises(ValueError, match=r"config_groups.g1 \(targets \['re:.\*mlp.\*'\]\) cannot be read: "
                                         ".*cannot tell the weight dtype"):
        QuantizationConfig(hf_with(ct({"g0": group("fp8_dynamic", ["re:.*self_attn.*"]), "g1": g})))


def test_activation_only_group_refuses_only_the_layers_it_matches():
    acts = group("fp8_dynamic", ["re:.*self_attn$"])  # the attention module, none of the linears
    acts["weights"] = None
    qc = QuantizationConfig(hf_with(ct({"w": group("w4a16", ["Linear"]), "acts": acts})))
    assert qc.get_layer_quant_config("model.layers.0.self_attn.o_proj").quant_dtype == INT4
    on_linear = group("fp8_dynamic", ["re:.*o_proj$"])
    on_linear["weights"] = None
    qc = QuantizationConfig(hf_with(ct({"w": group("w4a16", ["Linear"]), "acts": on_linear})))
    with pytest.raises(ValueError, match=r"layer 'model.layers.0.self_attn.o_proj' is matched by compressed-tensors "
                                         r"config group 'acts' \(target 're:.\*o_proj\$'\), which cannot be loaded: "
                                         r"config_groups.acts.weights=None: the group quantizes no weights"):
        qc.get_layer_quant_config("model.layers.0.self_attn.o_proj")


def test_hash_sees_the_groups_targets():
    a = QuantizationConfig(hf_with(MIXED)).compute_hash()
    swapped = ct({"group_0": group("w4a16", ["re:.*self_attn.*"]), "group_1": group("fp8_dynamic", ["re:.*mlp.*"])})
    assert a == QuantizationConfig(hf_with(MIXED)).compute_hash()
    assert a != QuantizationConfig(hf_with(swapped)).compute_hash()


# ---------------------------------------------------------------------------
# Quark layer_type_quant_config
# ---------------------------------------------------------------------------

QUARK_FP8 = {"weight": {"dtype": "fp8_e4m3", "qscheme": "per_channel", "is_dynamic": False},
             "input_tensors": {"dtype": "fp8_e4m3", "qscheme": "per_channel", "is_dynamic": True}}
QUARK_INT8 = {"weight": {"dtype": "int8", "qscheme": "per_tensor", "symmetric": True}}
QUARK_INT4 = {"weight": {"dtype": "int4", "qscheme": "per_group", "group_size": 32, "symmetric": True}}


def quark(**extra) -> dict:
    return {"quant_method": "quark", "global_quant_config": QUARK_FP8, "layer_quant_config": {},
            "layer_type_quant_config": {}, "exclude": ["lm_head"], **extra}


def test_quark_empty_layer_type_quant_config_changes_nothing():
    qc = QuantizationConfig(hf_with(quark()))
    assert qc.get_layer_quant_config("model.layers.0.mlp.down_proj") is qc.global_quant_config
    assert qc.compute_hash() == QuantizationConfig(hf_with({**quark(), "layer_type_quant_config": None})).compute_hash()


def test_quark_linear_type_config_between_layer_patterns_and_global():
    qc = QuantizationConfig(hf_with(quark(layer_type_quant_config={"Linear": QUARK_INT8},
                                          layer_quant_config={"*.self_attn.o_proj": QUARK_INT4})))
    assert qc.global_quant_config.quant_dtype == FP8
    assert qc.get_layer_quant_config("model.layers.0.self_attn.o_proj").quant_dtype == INT4  # pattern first
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.experts"):
        spec = qc.get_layer_quant_config(name)
        assert (spec.quant_type, spec.quant_dtype) == (QuantType.per_Tensor, torch.int8), name  # every layer a Linear
    assert qc.get_layer_quant_config("lm_head").quant_type is QuantType.No  # exclude wins
    assert qc.compute_hash() != QuantizationConfig(hf_with(quark())).compute_hash()


def test_quark_conv_type_config_names_no_layer_and_unknown_type_is_refused():
    qc = QuantizationConfig(hf_with(quark(layer_type_quant_config={"Conv2d": QUARK_INT8})))
    assert qc.get_layer_quant_config("model.layers.0.mlp.down_proj") is qc.global_quant_config
    with pytest.raises(ValueError, match=r"layer_type_quant_config=\{'Embedding': .*\} is invalid: keys must be one "
                                         r"of Quark's layer types \['Linear', 'Conv2d', 'ConvTranspose2d'\]"):
        QuantizationConfig(hf_with(quark(layer_type_quant_config={"Embedding": QUARK_INT8})))
    with pytest.raises(ValueError, match=r"layer_type_quant_config=\['Linear'\] is invalid: must be a dict"):
        QuantizationConfig(hf_with(quark(layer_type_quant_config=["Linear"])))
    with pytest.raises(ValueError, match=r"layer_type_quant_config.Linear='int8' is invalid: must be a layer config"):
        QuantizationConfig(hf_with(quark(layer_type_quant_config={"Linear": "int8"})))
