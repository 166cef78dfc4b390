"""Quantized linear methods (fp8, int8, int4) against dequantize-then-matmul references
written here, and tiny Llama checkpoints quantized by this file (compressed-tensors
FP8-dynamic / FP8-static / W8A8 / W4A16, DeepSeek fp8 block) loaded by `LLM` and compared
with transformers running the same fake-quantized weights in fp32."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from atom.model_ops.linear import Linear, MergedLinear, QKVLinear
from atom.quant_config import QuantizationConfig
from atom.quant_spec import LayerQuantConfig, QuantType
from conftest import hf_greedy, make_tiny_model

FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------------------
# quantizers and references (independent of atom's code)
# ---------------------------------------------------------------------------

def q_fp8_tensor(w):
    s = (w.abs().amax() / 448).reshape(1)
    return {"weight": (w / s).to(FP8), "weight_scale": s.bfloat16()}


def q_fp8_channel(w):
    s = w.abs().amax(1, keepdim=True) / 448
    return {"weight": (w / s).to(FP8), "weight_scale": s.bfloat16()}


def q_fp8_block(w, b, scale_name):
    out, inn = w.shape
    R, C = math.ceil(out / b), math.ceil(inn / b)
    wp = F.pad(w, (0, C * b - inn, 0, R * b - out))
    s = wp.reshape(R, b, C, b).abs().amax((1, 3)).clamp(min=1e-12) / 448
    full = s.repeat_interleave(b, 0).repeat_interleave(b, 1)[:out, :inn]
    return {"weight": (w / full).to(FP8), scale_name: s if scale_name == "weight_scale_inv" else s.bfloat16()}


def q_int8_channel(w):
    s = w.abs().amax(1, keepdim=True) / 127
    return {"weight": torch.round(w / s).clamp(-128, 127).to(torch.int8), "weight_scale": s.bfloat16()}


def pack_nibbles(v, dim=1):
    """compressed-tensors' pack_to_int32: values in [-8, 7] stored + 8, 8 per int32 along
    `dim` (nibble i of column j = element 8j + i), zero padded."""
    u = (v.to(torch.int64) + 8)
    if dim == 0:
        u = u.t()
    rows, cols = u.shape
    u = F.pad(u, (0, (-cols) % 8)).reshape(rows, -1, 8)
    packed = (u << (torch.arange(8) * 4)).sum(-1)
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    return packed.t().contiguous() if dim == 0 else packed


def q_int4(w, g, sym):
    out, inn = w.shape
    g = g or inn
    wg = w.reshape(out, inn // g, g)
    if sym:
        s = wg.abs().amax(-1) / 7.5
        zp = torch.zeros_like(s)
    else:
        mn, mx = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = (mx - mn) / 15
        zp = (-8 - torch.round(mn / s)).clamp(-8, 7)
    s = s.bfloat16()
    q = (torch.round(wg / s.float().unsqueeze(-1)) + zp.unsqueeze(-1)).clamp(-8, 7).reshape(out, inn)
    t = {"weight_packed": pack_nibbles(q), "weight_scale": s,
         "weight_shape": torch.tensor([out, inn], dtype=torch.int64)}
    if not sym:
        t["weight_zero_point"] = pack_nibbles(zp, dim=0)
    deq = ((q.reshape(out, inn // g, g) - zp.unsqueeze(-1)) * s.float().unsqueeze(-1)).reshape(out, inn)
    return t, deq


def dequant(t, fmt):
    """Reference dequantization of one shard's checkpoint tensors -> fp32 [out, in]."""
    w = t["weight"].float()
    if fmt.startswith("fp8_block") or fmt == "ds_block":
        s = t.get("weight_scale_inv", t.get("weight_scale")).float()
        b = FORMATS[fmt]["block"]
        return w * s.repeat_interleave(b, 0).repeat_interleave(b, 1)[:w.shape[0], :w.shape[1]]
    return w * t["weight_scale"].float()


def fq_fp8(x, s):
    return (x / s).clamp(-448, 448).to(FP8).float() * s


def act_ref(x, act, group=None, static=None):
    """Fake quantized activations (fp32) the way each format defines them."""
    x = x.float()
    if act == "none":
        return x
    if act == "int8_token":  # compressed-tensors: half the integer range, 255 / 2
        s = x.abs().amax(-1, keepdim=True) / 127.5
        return torch.round(x / s).clamp(-128, 127) * s
    if act == "fp8_static":
        return fq_fp8(x, static)
    if act == "fp8_tensor":
        return fq_fp8(x, x.abs().amax() / 448)
    if act == "fp8_token":
        return fq_fp8(x, x.abs().amax(-1, keepdim=True) / 448)
    xg = x.unflatten(-1, (-1, group))
    return fq_fp8(xg, xg.abs().amax(-1, keepdim=True) / 448).flatten(-2)


def spec(qt, dtype, dyn, method, **kw):
    return LayerQuantConfig(qt, dtype, dyn, method, **kw)


FORMATS = {
    "fp8_tensor_static": dict(spec=spec(QuantType.per_Tensor, FP8, False, "compressed-tensors", act_scheme="tensor"),
                              quant=q_fp8_tensor, act="fp8_static", fmt="fp8 per-tensor, act static per-tensor"),
    "fp8_tensor_dynamic": dict(spec=spec(QuantType.per_Tensor, FP8, True, "fp8"), quant=q_fp8_tensor,
                               act="fp8_tensor", fmt="fp8 per-tensor, act dynamic per-tensor"),
    "fp8_channel": dict(spec=spec(QuantType.per_Token, FP8, True, "compressed-tensors", act_scheme="token"),
                        quant=q_fp8_channel, act="fp8_token", fmt="fp8 per-channel, act dynamic per-token"),
    "ds_block": dict(spec=spec(QuantType.per_1x128, FP8, True, "fp8", block_size=(128, 128), act_scheme="group",
                               act_group_size=128), block=128,
                     quant=lambda w: q_fp8_block(w, 128, "weight_scale_inv"), act="fp8_group", group=128,
                     fmt="fp8 block 128x128, act dynamic 1x128"),
    "fp8_block32": dict(spec=spec(QuantType.per_1x32, FP8, True, "compressed-tensors", block_size=(32, 32),
                                  act_scheme="group", act_group_size=32), block=32,
                        quant=lambda w: q_fp8_block(w, 32, "weight_scale"), act="fp8_group", group=32,
                        fmt="fp8 block 32x32, act dynamic 1x32"),
    "int8": dict(spec=spec(QuantType.per_Token, torch.int8, True, "compressed-tensors", act_scheme="token"),
                 quant=q_int8_channel, act="int8_token", fmt="int8 per-channel, act dynamic per-token"),
    "int4_g32_sym": dict(spec=spec(QuantType.per_1x32, torch.uint8, True, "compressed-tensors", group_size=32,
                                   symmetric=True, act_scheme="none"), int4=(32, True), act="none",
                         fmt="int4 g32 sym"),
    "int4_g64_asym": dict(spec=spec(QuantType.per_Token, torch.uint8, True, "compressed-tensors", group_size=64,
                                    symmetric=False, act_scheme="none"), int4=(64, False), act="none",
                          fmt="int4 g64 asym"),
    "int4_channel_asym": dict(spec=spec(QuantType.per_Token, torch.uint8, True, "compressed-tensors",
                                        symmetric=False, act_scheme="none"), int4=(None, False), act="none",
                              fmt="int4 per-channel asym"),
}


class OneSpec:
    """A stand-in quantization config: the same spec for every layer."""

    def __init__(self, s):
        self.s = s

    def get_layer_quant_config(self, prefix):
        return self.s


def build(kind, s):
    qc = OneSpec(s)
    if kind == "linear":
        return Linear(256, 192, bias=True, quant_config=qc, prefix="t.proj")
    if kind == "linear_odd":
        return Linear(128, 40, quant_config=qc, prefix="t.proj")
    if kind == "qkv":
        return QKVLinear(128, 32, 4, 2, quant_config=qc, prefix="t.qkv_proj")
    return MergedLinear(128, [96, 160], quant_config=qc, prefix="t.gate_up_proj")


def fill(layer, name, tensor, shard):
    p = getattr(layer, name)
    p.weight_loader(p, tensor, shard)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["linear", "linear_odd", "qkv", "merged"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_method_matches_dequantize_then_matmul(fmt, kind, dtype):
    f = FORMATS[fmt]
    torch.manual_seed(0)
    layer = build(kind, f["spec"])
    assert layer.method.format(layer) == f["fmt"]
    shard_ids = layer.shard_ids()
    deqs, statics = [], []
    for i, sid in enumerate(shard_ids):
        rows = layer.shard_range(sid)[1]
        w = torch.randn(rows, layer.in_features) * 0.1
        w[0, :7] *= 20  # outliers
        if "int4" in f:
            t, deq = q_int4(w, *f["int4"])
        else:
            t = f["quant"](w)
            deq = dequant(t, fmt)
        if f["act"] == "fp8_static":
            t["input_scale"] = torch.tensor([0.002 * (i + 1)], dtype=torch.bfloat16)
            statics.append(t["input_scale"].float())
        for name, tensor in t.items():
            fill(layer, name, tensor, sid)
        deqs.append(deq)
    if layer.bias is not None:
        fill(layer, "bias", torch.randn(layer.out_features), None)
    layer.method.process_weights_after_loading(layer)
    w_ref = torch.cat(deqs)
    static = torch.stack(statics).max() if statics else None
    for shape in [(5, layer.in_features), (2, 3, layer.in_features), (1, layer.in_features)]:
        x = (torch.randn(shape) * 0.5).to(dtype)
        y = layer(x)
        assert y.dtype == dtype and y.shape == (*shape[:-1], layer.out_features)
        ref = F.linear(act_ref(x, f["act"], f.get("group"), static), w_ref,
                       layer.bias.float() if layer.bias is not None else None).to(dtype)
        torch.testing.assert_close(y, ref)
    dense_bytes = layer.out_features * layer.in_features * 2
    assert layer.method.weight_bytes(layer) < (0.4 if "int4" in f else 0.6) * dense_bytes + 4096


def test_activation_quantization_is_exact():
    """fp8 activations round to e4m3 (448 max) and int8 to half-even integers: the apply path
    equals the definition bit for bit, not just within a tolerance."""
    from atom.model_ops.quant.common import fake_quant_act
    x = torch.tensor([[1.0, -3.3, 0.25, 7.0], [2.5, 0.5, -1.5, 0.0]])
    s = x.abs().amax(-1, keepdim=True) / 127
    assert torch.equal(fake_quant_act(x, "int8", "token"), torch.round(x / s).clamp(-128, 127) * s)
    q = torch.round(torch.tensor([0.5, 1.5, 2.5, -0.5]))
    assert q.tolist() == [0.0, 2.0, 2.0, -0.0]  # half to even, as torch.round does
    y = fake_quant_act(x, "fp8", "group", 2)
    assert torch.equal(y, act_ref(x, "fp8_group", 2))
    assert torch.equal(fake_quant_act(x, "fp8", "tensor"), act_ref(x, "fp8_tensor"))


def test_refusals_name_the_layer_and_the_format():
    qc = OneSpec(spec(QuantType.per_Token, torch.uint8, True, "compressed-tensors", group_size=128,
                      act_scheme="none"))
    with pytest.raises(NotImplementedError, match=r"layer 't.down'.*in_features=576 is not a multiple of "
                                                  r"group_size=128.*a group of 64 divides it"):
        Linear(576, 64, quant_config=qc, prefix="t.down")
    assert Linear(576, 64, quant_config=OneSpec(spec(QuantType.per_Token, torch.uint8, True, "compressed-tensors",
                                                     group_size=64, act_scheme="none")), prefix="t").method.groups == 9
    with pytest.raises(NotImplementedError, match=r"layer 't.x'.*in_features=48 is not a multiple of 32.*MXFP4"):
        Linear(48, 64, quant_config=OneSpec(spec(QuantType.per_1x32, torch.float4_e2m1fn_x2, True, "quark")),
               prefix="t.x")
    with pytest.raises(NotImplementedError, match=r"layer 't.x'.*torch.int16.*no linear method"):
        Linear(64, 64, quant_config=OneSpec(spec(QuantType.per_Token, torch.int16, True, "custom")), prefix="t.x")
    with pytest.raises(NotImplementedError, match=r"layer 't.x'.*in_features=64 is not a multiple of the 128-wide"):
        Linear(64, 64, quant_config=OneSpec(spec(QuantType.per_1x128, FP8, True, "fp8")), prefix="t.x")
    with pytest.raises(NotImplementedError, match=r"layer 't.x'.*static activation scales exist per tensor only"):
        Linear(128, 64, quant_config=OneSpec(spec(QuantType.per_1x128, FP8, False, "fp8")), prefix="t.x")
    with pytest.raises(NotImplementedError, match=r"layer 't.x'.*GPTQ/AWQ layouts have no method"):
        Linear(128, 64, quant_config=OneSpec(spec(QuantType.per_1x32, torch.uint8, True, "gptq", group_size=32)),
               prefix="t.x")
    with pytest.raises(NotImplementedError, match=r"layer 't.x'.*per-tensor int8"):
        Linear(128, 64, quant_config=OneSpec(spec(QuantType.per_Tensor, torch.int8, False, "quark")), prefix="t.x")


def test_loader_rejects_misfit_scales():
    layer = build("qkv", FORMATS["fp8_channel"]["spec"])
    with pytest.raises(ValueError, match=r"t.qkv_proj.weight_scale: checkpoint tensor shape \(64, 1\) \(shard 'q'\)"):
        fill(layer, "weight_scale", torch.ones(64, 1), "q")
    layer = build("qkv", FORMATS["fp8_tensor_static"]["spec"])
    with pytest.raises(ValueError, match=r"t.qkv_proj.input_scale.*does not fit one entry"):
        fill(layer, "input_scale", torch.ones(2), "k")
    layer = build("linear", FORMATS["int4_g32_sym"]["spec"])
    fill(layer, "weight_shape", torch.tensor([192, 128]), None)
    with pytest.raises(ValueError, match=r"checkpoint weight_shape \(192, 128\)"):
        layer.method.process_weights_after_loading(layer)


# ---------------------------------------------------------------------------
# parsing the producers' quantization_config blocks
# ---------------------------------------------------------------------------

def ct_config(fmt, weights, inputs, ignore=("lm_head",)):
    base = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "observer": None,
            "symmetric": True}
    return {"config_groups": {"group_0": {"format": fmt, "targets": ["Linear"], "output_activations": None,
                                          "weights": {**base, **weights},
                                          "input_activations": {**base, **inputs} if inputs else None}},
            "format": fmt, "ignore": list(ignore), "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "kv_cache_scheme": None, "sparsity_config": {}}


CT = {
    "fp8_dynamic": ct_config("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"},
                             {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}),
    "fp8_static": ct_config("float-quantized", {"num_bits": 8, "type": "float", "strategy": "tensor"},
                            {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}),
    "fp8_block": ct_config("float-quantized", {"num_bits": 8, "type": "float", "strategy": "block",
                                               "block_structure": [128, 128]},
                           {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True}),
    "w8a8": ct_config("int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"},
                      {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
    "w4a16_g32": ct_config("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}, None),
    "w4a16_g64_asym": ct_config("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group",
                                                   "group_size": 64, "symmetric": False}, None),
    "mxfp4": ct_config("mxfp4-pack-quantized", {"num_bits": 4, "type": "float", "strategy": "group",
                                                "group_size": 32, "scale_dtype": "torch.uint8"}, None),
}
DEEPSEEK = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def parsed(cfg):
    return QuantizationConfig(transformers.PretrainedConfig(quantization_config=cfg)).global_quant_config


@pytest.mark.parametrize("name, expect", [
    ("fp8_dynamic", (QuantType.per_Token, FP8, True, None, None, "token", None, "fp8 per-channel, act dynamic per-token")),
    ("fp8_static", (QuantType.per_Tensor, FP8, False, None, None, "tensor", None, "fp8 per-tensor, act static per-tensor")),
    ("fp8_block", (QuantType.per_1x128, FP8, True, None, (128, 128), "group", 128,
                   "fp8 block 128x128, act dynamic 1x128")),
    ("w8a8", (QuantType.per_Token, torch.int8, True, None, None, "token", None, "int8 per-channel, act dynamic per-token")),
    ("w4a16_g32", (QuantType.per_1x32, torch.uint8, True, 32, None, "none", None, "int4 g32 sym")),
    ("w4a16_g64_asym", (QuantType.per_Token, torch.uint8, True, 64, None, "none", None, "int4 g64 asym")),
])
def test_compressed_tensors_blocks_parse_into_methods(name, expect):
    s = parsed(CT[name])
    assert (s.quant_type, s.quant_dtype, s.is_dynamic, s.group_size, s.block_size, s.act_scheme,
            s.act_group_size) == expect[:-1]
    layer = Linear(256, 128, quant_config=OneSpec(s), prefix="p")
    assert layer.method.format(layer) == expect[-1]
    assert s.to_dict()["act_scheme"] == expect[5]


def test_deepseek_and_quark_blocks_parse_into_methods():
    s = parsed(DEEPSEEK)
    assert (s.block_size, s.act_scheme, s.act_group_size) == ((128, 128), "group", 128)
    assert Linear(256, 128, quant_config=OneSpec(s), prefix="p").method.scale_name == "weight_scale_inv"
    quark = {"quant_method": "quark", "exclude": ["lm_head"], "global_quant_config": {
        "weight": {"dtype": "fp8_e4m3", "qscheme": "per_channel", "ch_axis": 0, "is_dynamic": False, "symmetric": True},
        "input_tensors": {"dtype": "fp8_e4m3", "qscheme": "per_channel", "ch_axis": 1, "is_dynamic": True}}}
    s = parsed(quark)
    layer = Linear(128, 64, quant_config=OneSpec(s), prefix="p")
    assert layer.method.format(layer) == "fp8 per-channel, act dynamic per-token"
    fill(layer, "weight_scale", torch.full((64,), 0.5, dtype=torch.bfloat16), None)  # Quark's 1-d scale
    quark["global_quant_config"] = {"weight": {"dtype": "fp8_e4m3", "qscheme": "per_tensor"},
                                    "input_tensors": {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False}}
    layer = Linear(128, 64, quant_config=OneSpec(parsed(quark)), prefix="p")
    assert layer.method.format(layer) == "fp8 per-tensor, act static per-tensor"
    fill(layer, "weight_scale", torch.tensor(0.5, dtype=torch.bfloat16), None)  # Quark's 0-d scale
    fill(layer, "input_scale", torch.tensor(0.25, dtype=torch.bfloat16), None)
    assert layer.weight_scale.tolist() == [0.5] and layer.input_scale.tolist() == [0.25]


def test_details_enter_the_hash_but_not_equality():
    a, b = parsed(CT["w4a16_g32"]), parsed(CT["w4a16_g64_asym"])
    qa = QuantizationConfig(transformers.PretrainedConfig(quantization_config=CT["w4a16_g32"]))
    qb = QuantizationConfig(transformers.PretrainedConfig(
        quantization_config=ct_config("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group",
                                                         "group_size": 16}, None)))
    assert a.group_size == 32 and b.group_size == 64
    assert qa.compute_hash() != qb.compute_hash()
    with pytest.raises(ValueError, match="act_scheme='channel' is invalid"):
        LayerQuantConfig(QuantType.per_Token, FP8, act_scheme="channel")
    with pytest.raises(ValueError, match="group_size=0 is invalid"):
        LayerQuantConfig(QuantType.per_Token, FP8, group_size=0)


# ---------------------------------------------------------------------------
# end to end: tiny Llama checkpoints quantized here
# ---------------------------------------------------------------------------

PROJ = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
E2E = {  # scheme -> (quantization_config, per-weight quantizer -> (tensors, dequantized), activation)
    "fp8_dynamic": (CT["fp8_dynamic"], lambda w: _with_deq(q_fp8_channel(w), "fp8_channel"), "fp8_token"),
    "fp8_static": (CT["fp8_static"], lambda w: _with_deq(q_fp8_tensor(w), "fp8_tensor_static"), "fp8_static"),
    "w8a8": ({**CT["w8a8"], "ignore": ["lm_head", "model.layers.1.mlp.down_proj"]},
             lambda w: _with_deq(q_int8_channel(w), "int8"), "int8_token"),
    "w4a16_g32": (CT["w4a16_g32"], lambda w: q_int4(w, 32, True), "none"),
    "w4a16_g64_asym": (CT["w4a16_g64_asym"], lambda w: q_int4(w, 64, False), "none"),
    "deepseek_fp8_block": (DEEPSEEK, lambda w: _with_deq(q_fp8_block(w, 128, "weight_scale_inv"), "ds_block"),
                           "fp8_group"),
}
STATIC_SCALES = {"q_proj": 0.02, "k_proj": 0.03, "v_proj": 0.025, "o_proj": 0.01,
                 "gate_proj": 0.02, "up_proj": 0.015, "down_proj": 0.05}
PACKED_WITH = {"q_proj": ("q_proj", "k_proj", "v_proj"), "k_proj": ("q_proj", "k_proj", "v_proj"),
               "v_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj"),
               "up_proj": ("gate_proj", "up_proj")}


def _with_deq(t, fmt):
    return t, dequant(t, fmt)


def quantize_checkpoint(src, dst, scheme):
    """Write `src`'s weights quantized by `scheme` into `dst` (with its quantization_config);
    return {HF linear name: (dequantized weight, input scale or None)} and the activation kind."""
    cfg, quant, act = E2E[scheme]
    shutil.copytree(src, dst)
    tensors = load_file(f"{src}/model.safetensors")
    out, deq = {}, {}
    ignore = set(cfg.get("ignore", []))
    for name, t in tensors.items():
        mod = name.removesuffix(".weight")
        if not (name.endswith("_proj.weight") and ".layers." in name) or mod in ignore:
            out[name] = t
            continue
        q, d = quant(t.float())
        proj = mod.rsplit(".", 1)[1]
        static = None
        if act == "fp8_static":  # a packed layer runs its shards' largest input scale
            q["input_scale"] = torch.tensor([STATIC_SCALES[proj]], dtype=torch.bfloat16)
            static = max(STATIC_SCALES[p] for p in PACKED_WITH.get(proj, (proj,)))
        out.update({f"{mod}.{k}": v.contiguous() for k, v in q.items()})
        deq[mod] = (d, static)
    save_file(out, f"{dst}/model.safetensors")
    with open(f"{dst}/config.json") as fh:
        config = json.load(fh)
    config["quantization_config"] = cfg
    with open(f"{dst}/config.json", "w") as fh:
        json.dump(config, fh)
    return deq, act


def fake_quant_hf(src, deq, act):
    """transformers fp32 with the dequantized weights, activations fake-quantized per linear."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    mods = dict(model.named_modules())
    for name, (w, static) in deq.items():
        m = mods[name]
        m.weight.data.copy_(w)
        s = torch.tensor(static, dtype=torch.bfloat16).float() if static is not None else None
        m.forward = lambda x, m=m, s=s: F.linear(act_ref(x, act, 128, s), m.weight).to(x.dtype)
    return model


@pytest.fixture(scope="module")
def base128(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama128"), "llama", hidden_size=128,
                           intermediate_size=256, initializer_range=0.1)


E2E_FORMATS = {"fp8_dynamic": "fp8 per-channel, act dynamic per-token",
               "fp8_static": "fp8 per-tensor, act static per-tensor",
               "w8a8": "int8 per-channel, act dynamic per-token", "w4a16_g32": "int4 g32 sym",
               "w4a16_g64_asym": "int4 g64 asym", "deepseek_fp8_block": "fp8 block 128x128, act dynamic 1x128"}


@pytest.mark.parametrize("scheme", list(E2E))
def test_quantized_checkpoint_generates_like_fake_quant_transformers(base128, tmp_path, scheme):
    from atom import LLM, SamplingParams
    from atom.viz import linear_methods_frame
    path = str(tmp_path / scheme)
    deq, act = quantize_checkpoint(base128, path, scheme)
    ref_model = fake_quant_hf(base128, deq, act)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 17, 40)]
    ref = [hf_greedy(ref_model, p, 8) for p in prompts]
    llm = LLM(path, enable_log_stats=False, num_kvcache_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    frame = linear_methods_frame(llm).set_index("layer")
    quantized = frame[frame["method"] != "unquantized"]
    assert set(quantized["format"]) == {E2E_FORMATS[scheme]}
    assert len(quantized) == (7 if scheme == "w8a8" else 8)
    if scheme == "w8a8":  # excluded in the checkpoint: stays in the model's dtype
        assert frame.loc["model.layers.1.mlp.down_proj", "format"] == "float32"
    for layer, row in quantized.iterrows():
        dense = math.prod(row["shape"]) * 4  # the fp32 model's bytes for that layer
        assert row["bytes"] < (0.2 if "w4" in scheme else 0.3) * dense, (layer, row["bytes"], dense)


def test_layers_without_a_gpu_kernel_are_refused_on_a_gpu():
    """Block fp8 weights with per-token activations (a linear) and fp8 experts with static
    per-tensor activations have a method but no GPU kernel: `refuse_reference_layers` (which a
    GPU engine calls before loading) raises naming each layer and its format, unless online
    quantization re-quantizes it; formats with a kernel pass."""
    from atom.model_ops.moe import FusedMoE, TopK
    from atom.model_ops.quant import reference_only_layers, refuse_reference_layers

    class OneSpec:
        def get_layer_quant_config(self, prefix):
            return LayerQuantConfig(QuantType.per_Tensor, FP8, False, "compressed-tensors", act_scheme="tensor")

    block_token = spec(QuantType.per_1x128, FP8, True, "fp8", block_size=(128, 128), act_scheme="token")
    model = torch.nn.ModuleDict({"fast": build("linear", FORMATS["fp8_channel"]["spec"]),
                                 "slow": build("merged", block_token),
                                 "experts": FusedMoE(4, 64, 64, TopK(4, 2), quant_config=OneSpec(), prefix="experts")})
    slow_fmt, moe_fmt = model["slow"].method.format(model["slow"]), model["experts"].method.format(model["experts"])
    assert reference_only_layers(model) == [("slow", slow_fmt), ("experts", moe_fmt)]
    with pytest.raises(NotImplementedError) as err:
        refuse_reference_layers(model)
    msg = str(err.value)
    assert msg.startswith("2 quantized layer(s) have a format without a kernel on this GPU")
    assert f"slow ({slow_fmt})" in msg and f"experts ({moe_fmt})" in msg and "ignore" in msg
    with pytest.raises(NotImplementedError, match=r"^1 quantized layer\(s\).*experts"):
        refuse_reference_layers(model, skip={"slow"})  # online quantization re-quantizes it
    refuse_reference_layers(model, skip={"slow", "experts"})
    fast = torch.nn.ModuleDict({"fast": model["fast"]})
    assert reference_only_layers(fast) == []
    refuse_reference_layers(fast)
    with pytest.raises(NotImplementedError, match=r"^1 quantized layer\(s\) have a format without a kernel on ROCm"):
        refuse_reference_layers(fast, rocm=True)  # every quantized linear runs the reference there