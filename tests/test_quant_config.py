"""QuantType, LayerQuantConfig, the parsers and QuantizationConfig."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from config_fixtures import clean_atom_env, write_llama_config  # noqa: F401

from atom.config import Config, QuantizationConfig
from atom.quant_spec import (
    DTYPE_KEYS,
    ONLINE_QUANT_FORMATS,
    GenericParser,
    LayerQuantConfig,
    QuantType,
    QuarkParser,
    dtype_from_key,
    key_from_dtype,
    online_quant_spec,
)

FP8 = torch.float8_e4m3fn
FP4 = DTYPE_KEYS["fp4x2"]


def hf_with(quant: dict | None, dtype: str | None = None) -> transformers.PretrainedConfig:
    kwargs = {} if quant is None else {"quantization_config": quant}
    if dtype is not None:
        kwargs["dtype"] = dtype
    return transformers.PretrainedConfig(**kwargs)


# ---------------------------------------------------------------------------
# QuantType / LayerQuantConfig / dtype keys
# ---------------------------------------------------------------------------


def test_quant_type_members():
    assert [m.name for m in QuantType] == [
        "No", "per_Tensor", "per_Token", "per_1x32", "per_1x128", "per_128x128",
    ]


def test_layer_quant_config_defaults():
    spec = LayerQuantConfig()
    assert spec.quant_type is QuantType.No
    assert spec.quant_dtype == torch.bfloat16
    assert spec.is_dynamic is True
    assert spec.quant_method == ""
    assert spec.is_quantized is False


def test_layer_quant_config_is_frozen():
    spec = LayerQuantConfig(QuantType.per_Token, FP8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.quant_type = QuantType.No  # type: ignore[misc]
    assert spec.is_quantized


def test_layer_quant_config_validates_types():
    with pytest.raises(ValueError, match="quant_type='per_Token' is invalid"):
        LayerQuantConfig("per_Token")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="quant_dtype='fp8' is invalid"):
        LayerQuantConfig(QuantType.per_Token, "fp8")  # type: ignore[arg-type]


def test_mxfp4_forces_per_1x32():
    assert LayerQuantConfig(QuantType.per_Token, FP4).quant_type is QuantType.per_1x32


def test_dtype_keys():
    assert DTYPE_KEYS["fp8"] == torch.float8_e4m3fn
    assert DTYPE_KEYS["i8"] == torch.int8
    assert DTYPE_KEYS["i4x2"] == torch.uint8
    expected_fp4 = getattr(torch, "float4_e2m1fn_x2", torch.uint8)
    assert DTYPE_KEYS["fp4x2"] == expected_fp4
    assert dtype_from_key("i8") == torch.int8
    assert key_from_dtype(torch.float8_e4m3fn) == "fp8"
    assert key_from_dtype(torch.bfloat16) is None
    with pytest.raises(ValueError, match="quant dtype key 'fp16' is invalid"):
        dtype_from_key("fp16")


def test_layer_quant_config_to_dict():
    d = LayerQuantConfig(QuantType.per_1x128, FP8, False, "fp8").to_dict()
    assert d == {"quant_type": "per_1x128", "quant_dtype": "float8_e4m3fn", "is_dynamic": False, "quant_method": "fp8"}


# ---------------------------------------------------------------------------
# Unquantized
# ---------------------------------------------------------------------------


def test_unquantized_model():
    qc = QuantizationConfig(hf_with(None, dtype="float16"))
    assert qc.hf_quant_config is None
    assert qc.get_name() == "" and qc.quant_method == ""
    assert qc.torch_dtype == torch.float16
    spec = qc.get_layer_quant_config("model.layers.0.mlp.down_proj")
    assert spec == LayerQuantConfig(QuantType.No, torch.float16, True, "")
    assert qc.global_quant_config.quant_type is QuantType.No
    assert qc.exclude_layers == []
    assert qc._parsed.layer_pattern_specs == []


def test_none_hf_config_defaults_bf16():
    qc = QuantizationConfig(None)
    assert qc.torch_dtype == torch.bfloat16
    assert qc.global_quant_config == LayerQuantConfig()


# ---------------------------------------------------------------------------
# Quark
# ---------------------------------------------------------------------------

QUARK = {
    "quant_method": "quark",
    "global_quant_config": {
        "weight": {"dtype": "fp8_e4m3", "qscheme": "per_channel", "is_dynamic": False},
        "input_tensors": {"dtype": "fp8_e4m3", "qscheme": "per_channel", "is_dynamic": False},
    },
    "layer_quant_config": {
        "*.mlp.experts.*": {
            "weight": {"dtype": "fp4", "qscheme": "per_group", "group_size": 32},
            "input_tensors": {"dtype": "fp4", "qscheme": "per_group"},
        },
        "*.self_attn.o_proj": {
            "weight": {"dtype": "int8", "qscheme": "per_tensor"},
        },
    },
    "exclude": ["lm_head", "model.layers.0.mlp", "re:.*\\.mlp\\.gate$"],
}


def test_quark_global_spec():
    qc = QuantizationConfig(hf_with(QUARK))
    assert qc.get_name() == "quark"
    assert qc.global_quant_config == LayerQuantConfig(QuantType.per_Token, FP8, False, "quark")
    assert qc.hf_quant_config is QUARK or qc.hf_quant_config == QUARK


def test_quark_layer_overrides():
    qc = QuantizationConfig(hf_with(QUARK))
    patterns = [p for p, _ in qc._parsed.layer_pattern_specs]
    assert patterns == ["*.mlp.experts.*", "*.self_attn.o_proj"]
    experts = qc.get_layer_quant_config("model.layers.3.mlp.experts.w13")
    assert experts == LayerQuantConfig(QuantType.per_1x32, FP4, True, "quark")
    o_proj = qc.get_layer_quant_config("model.layers.3.self_attn.o_proj")
    assert o_proj.quant_type is QuantType.per_Tensor and o_proj.quant_dtype == torch.int8
    assert o_proj.is_dynamic is True  # no input_tensors -> dynamic
    assert qc.get_layer_quant_config("model.layers.3.self_attn.qkv_proj") == qc.global_quant_config


def test_quark_exclusions():
    qc = QuantizationConfig(hf_with(QUARK))
    assert qc.exclude_layers == ["lm_head", "model.layers.0.mlp", "re:.*\\.mlp\\.gate$"]
    no = qc.get_layer_quant_config("lm_head")
    assert no.quant_type is QuantType.No and no.quant_dtype == torch.bfloat16
    # A parent module name excludes its children, on a "." boundary only.
    assert qc.get_layer_quant_config("model.layers.0.mlp.experts.w13").quant_type is QuantType.No
    assert qc.get_layer_quant_config("model.layers.0.mlpx").quant_type is QuantType.per_Token
    # re: regex
    assert qc.get_layer_quant_config("model.layers.5.mlp.gate").quant_type is QuantType.No
    assert qc.get_layer_quant_config("model.layers.5.mlp.gate_up_proj").quant_type is QuantType.per_Token
    # Exclusion wins over a matching per-layer pattern.
    assert qc.is_excluded("model.layers.0.mlp.experts.w2")


@pytest.mark.parametrize(
    "qscheme,expected",
    [("per_channel", QuantType.per_Token), ("per_tensor", QuantType.per_Tensor), ("per_group", QuantType.per_1x32)],
)
def test_quark_qscheme_mapping(qscheme, expected):
    spec = QuarkParser().parse({"weight": {"dtype": "int8", "qscheme": qscheme}})
    assert spec.quant_type is expected


@pytest.mark.parametrize(
    "dtype,key",
    [("fp8_e4m3", "fp8"), ("fp4", "fp4x2"), ("int8", "i8"), ("int4", "i4x2"), ("uint4", None)],
)
def test_quark_dtype_mapping(dtype, key):
    spec = QuarkParser().parse({"weight": {"dtype": dtype, "qscheme": "per_tensor"}})
    # uint4 (unsigned, zero points) is its own dtype: no method reads it as signed int4
    assert spec.quant_dtype == (DTYPE_KEYS[key] if key else torch.uint4)
    if key == "fp4x2":
        assert spec.quant_type is QuantType.per_1x32


def test_quark_is_dynamic_defaults_true_and_reads_input_tensors():
    p = QuarkParser()
    assert p.parse({"weight": {"dtype": "fp8_e4m3", "qscheme": "per_tensor"}}).is_dynamic is True
    assert p.parse({"weight": {"dtype": "fp8_e4m3", "qscheme": "per_tensor"}, "input_tensors": None}).is_dynamic
    static = {"weight": {"dtype": "fp8_e4m3", "qscheme": "per_tensor"}, "input_tensors": {"is_dynamic": False}}
    assert p.parse(static).is_dynamic is False


def test_quark_weight_list_and_missing_weight():
    p = QuarkParser(default_dtype=torch.float16)
    spec = p.parse({"weight": [{"dtype": "fp4", "qscheme": "per_group"}, {"dtype": "fp8_e4m3"}]})
    assert spec.quant_dtype == FP4
    none = p.parse({"weight": None})
    assert none.quant_type is QuantType.No and none.quant_dtype == torch.float16


def test_quark_invalid_entries():
    with pytest.raises(ValueError, match="qscheme='per_block' is invalid"):
        QuarkParser().parse({"weight": {"dtype": "int8", "qscheme": "per_block"}})
    with pytest.raises(ValueError, match="weight.dtype='bf16' is invalid"):
        QuarkParser().parse({"weight": {"dtype": "bf16", "qscheme": "per_tensor"}})


# ---------------------------------------------------------------------------
# Other formats
# ---------------------------------------------------------------------------

DEEPSEEK_FP8 = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}

COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        }
    },
    "ignore": ["lm_head", "re:.*mlp.gate$"],
}


def test_generic_fp8_block():
    qc = QuantizationConfig(hf_with(DEEPSEEK_FP8))
    assert qc.get_name() == "fp8"
    assert qc.global_quant_config == LayerQuantConfig(QuantType.per_1x128, FP8, True, "fp8")


def test_generic_static_activation_scheme():
    qc = QuantizationConfig(hf_with({**DEEPSEEK_FP8, "activation_scheme": "static"}))
    assert qc.global_quant_config.is_dynamic is False


def test_generic_per_tensor_fallback():
    spec = GenericParser().parse({"quant_method": "fp8", "activation_scheme": "dynamic"})
    assert spec.quant_type is QuantType.per_Tensor and spec.quant_dtype == FP8


def test_compressed_tensors_channel_fp8_and_ignore():
    qc = QuantizationConfig(hf_with(COMPRESSED_TENSORS))
    g = qc.global_quant_config
    assert (g.quant_type, g.quant_dtype, g.is_dynamic, g.quant_method) == (
        QuantType.per_Token, FP8, True, "compressed-tensors",
    )
    assert qc.exclude_layers == ["lm_head", "re:.*mlp.gate$"]
    assert qc.get_layer_quant_config("lm_head").quant_type is QuantType.No
    assert qc.get_layer_quant_config("model.layers.1.mlp.gate").quant_type is QuantType.No
    assert qc.get_layer_quant_config("model.layers.1.mlp.down_proj") is g


def test_compressed_tensors_static_input():
    cfg = {
        "quant_method": "compressed-tensors",
        "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}, "input_activations": {"dynamic": False}}},
    }
    spec = GenericParser().parse(cfg)
    assert spec.quant_dtype == torch.int8 and spec.is_dynamic is False and spec.quant_type is QuantType.per_Token


def test_channel_detected_without_compressed_tensors():
    spec = GenericParser().parse({"quant_method": "w8a8", "dtype": "int8", "scheme": "per_channel"})
    assert spec.quant_type is QuantType.per_Token and spec.quant_dtype == torch.int8


def test_mxfp4_group_32():
    spec = GenericParser().parse({"quant_method": "mxfp4", "group_size": 32})
    assert spec.quant_type is QuantType.per_1x32 and spec.quant_dtype == FP4


def test_mxfp4_forced_per_1x32_without_group():
    spec = GenericParser().parse({"quant_method": "mxfp4"})
    assert spec.quant_type is QuantType.per_1x32


def test_gptq_style_bits_group_128():
    spec = GenericParser().parse({"quant_method": "gptq", "bits": 4, "group_size": 128})
    assert spec.quant_type is QuantType.per_1x128 and spec.quant_dtype == torch.uint8


def test_weight_dtype_field():
    spec = GenericParser().parse({"quant_method": "custom", "weight_dtype": "int4", "group_size": 32})
    assert spec.quant_dtype == DTYPE_KEYS["i4x2"] and spec.quant_type is QuantType.per_1x32


def test_unknown_format_errors():
    with pytest.raises(ValueError, match="quantization_config=.* is invalid: cannot tell the weight dtype"):
        QuantizationConfig(hf_with({"quant_method": "mystery"}))


def test_modules_to_not_convert_excluded():
    qc = QuantizationConfig(hf_with({**DEEPSEEK_FP8, "modules_to_not_convert": ["lm_head"]}))
    assert qc.get_layer_quant_config("lm_head").quant_type is QuantType.No


def test_glob_exclusion():
    qc = QuantizationConfig(hf_with({**DEEPSEEK_FP8, "ignore": ["*.shared_experts.*"]}))
    assert qc.is_excluded("model.layers.1.mlp.shared_experts.down_proj")
    assert not qc.is_excluded("model.layers.1.mlp.experts.down_proj")


def test_bad_regex_exclusion_errors():
    with pytest.raises(ValueError, match="exclude_layers='re:\\(' is invalid"):
        QuantizationConfig(hf_with({**DEEPSEEK_FP8, "ignore": ["re:("]}))


def test_quantization_config_on_multimodal_text_config():
    outer = transformers.PretrainedConfig()
    outer.text_config = hf_with(DEEPSEEK_FP8)
    assert QuantizationConfig(outer).get_name() == "fp8"


# ---------------------------------------------------------------------------
# remap_layer_name / compute_hash
# ---------------------------------------------------------------------------


def test_remap_default_qkv_and_gate_up():
    qc = QuantizationConfig(hf_with({**DEEPSEEK_FP8, "ignore": ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"]}))
    assert not qc.is_excluded("model.layers.0.self_attn.qkv_proj")
    out = qc.remap_layer_name(transformers.LlamaConfig())
    assert out is qc
    assert "model.layers.0.self_attn.qkv_proj" in qc.exclude_layers
    assert "model.layers.0.mlp.gate_up_proj" in qc.exclude_layers
    assert "model.layers.0.self_attn.q_proj" in qc.exclude_layers  # originals kept
    assert qc.is_excluded("model.layers.0.self_attn.qkv_proj")


def test_remap_nano_vllm_style_mapping():
    qc = QuantizationConfig(hf_with({**QUARK, "exclude": ["model.layers.1.self_attn.k_proj"]}))
    mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
    qc.remap_layer_name(None, mapping)
    assert qc.is_excluded("model.layers.1.self_attn.qkv_proj")


def test_remap_vllm_style_mapping_and_patterns():
    quant = dict(QUARK)
    quant["layer_quant_config"] = {"*.gate_proj": QUARK["layer_quant_config"]["*.self_attn.o_proj"]}
    quant["exclude"] = []
    qc = QuantizationConfig(hf_with(quant))
    qc.remap_layer_name(None, {"gate_up_proj": ["gate_proj", "up_proj"]})
    patterns = [p for p, _ in qc._parsed.layer_pattern_specs]
    assert patterns == ["*.gate_proj", "*.gate_up_proj"]
    assert qc.get_layer_quant_config("model.layers.2.mlp.gate_up_proj").quant_dtype == torch.int8


def test_remap_deepseek_q_a_proj_needs_q_lora_rank():
    quant = {**DEEPSEEK_FP8, "ignore": ["model.layers.0.self_attn.q_a_proj"]}
    with_lora = transformers.PretrainedConfig(q_lora_rank=1536)
    with_lora.model_type = "deepseek_v3"
    qc = QuantizationConfig(hf_with(quant)).remap_layer_name(with_lora)
    assert qc.is_excluded("model.layers.0.self_attn.fused_qkv_a_proj")
    no_lora = transformers.PretrainedConfig(q_lora_rank=None)
    no_lora.model_type = "deepseek_v3"
    qc2 = QuantizationConfig(hf_with(quant)).remap_layer_name(no_lora)
    assert not qc2.is_excluded("model.layers.0.self_attn.fused_qkv_a_proj")


def test_remap_does_not_touch_similar_names():
    qc = QuantizationConfig(hf_with({**DEEPSEEK_FP8, "ignore": ["model.layers.0.self_attn.q_a_proj"]}))
    qc.remap_layer_name(transformers.LlamaConfig())  # q_proj mapping must not hit q_a_proj
    assert qc.exclude_layers == ["model.layers.0.self_attn.q_a_proj"]


def test_remap_bad_mapping_errors():
    qc = QuantizationConfig(hf_with(DEEPSEEK_FP8))
    with pytest.raises(ValueError, match="packed_modules_mapping"):
        qc.remap_layer_name(None, {"q_proj": 3})


def test_compute_hash():
    a = QuantizationConfig(hf_with(QUARK)).compute_hash()
    b = QuantizationConfig(hf_with(QUARK)).compute_hash()
    c = QuantizationConfig(hf_with(DEEPSEEK_FP8)).compute_hash()
    assert a == b and a != c
    assert len(a) == 64 and int(a, 16) >= 0
    qc = QuantizationConfig(hf_with({**DEEPSEEK_FP8, "ignore": ["model.layers.0.self_attn.q_proj"]}))
    before = qc.compute_hash()
    qc.remap_layer_name(transformers.LlamaConfig())
    assert qc.compute_hash() != before


def test_repr_summarises():
    text = repr(QuantizationConfig(hf_with(DEEPSEEK_FP8)))
    assert "method='fp8'" in text and "per_1x128" in text


# ---------------------------------------------------------------------------
# Config integration and online formats
# ---------------------------------------------------------------------------


def test_config_detects_quantization_from_checkpoint(tmp_path):
    path = write_llama_config(tmp_path / "q", quantization_config=DEEPSEEK_FP8)
    cfg = Config(path)
    assert cfg.quant_config.get_name() == "fp8"
    assert cfg.quant_config.get_layer_quant_config("model.layers.0.mlp.down_proj").quant_type is QuantType.per_1x128


def test_online_quant_formats():
    assert online_quant_spec("ptpc_fp8") == LayerQuantConfig(QuantType.per_Token, FP8, True, "online")
    assert online_quant_spec("mxfp4").quant_type is QuantType.per_1x32
    assert online_quant_spec("mxfp4").quant_dtype == FP4
    assert set(ONLINE_QUANT_FORMATS) == {"ptpc_fp8", "mxfp4"}
    with pytest.raises(ValueError, match="must be one of"):
        online_quant_spec("int2")


def test_non_string_exclusion_errors():
    with pytest.raises(ValueError, match="exclude_layers=3 is invalid"):
        QuantizationConfig(hf_with({**DEEPSEEK_FP8, "ignore": [3]}))


@pytest.mark.parametrize("act_bits,act_type,act_key", [(8, "int", "i8"), (8, "float", "fp8")])
def test_compressed_tensors_weight_dtype_comes_from_the_weights(act_bits, act_type, act_key):
    """W4A8: the activations' num_bits / type (listed first, as llm-compressor writes the group)
    must not decide the weight format."""
    group = {"input_activations": {"num_bits": act_bits, "type": act_type, "strategy": "token", "dynamic": True,
                                   "symmetric": True},
             "targets": ["Linear"],
             "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True,
                         "dynamic": False}}
    spec = GenericParser().parse({"quant_method": "compressed-tensors", "format": "pack-quantized",
                                  "config_groups": {"group_0": group}})
    assert key_from_dtype(spec.quant_dtype) == "i4x2"
    assert spec.group_size == 128 and spec.act_scheme == "token" and spec.act_dtype == act_key
