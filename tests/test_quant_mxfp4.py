"""MXFP4: the numerics (`atom.model_ops.quant.mxfp4`) against a reference written here from
the OCP MX definition (e2m1 bit fields, frexp-based shared exponent), the linear method
against dequantize-then-matmul for several shapes and activation dtypes, and refusals / load
errors naming the layer and the format."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from atom.model_ops.linear import Linear, MergedLinear, QKVLinear
from atom.model_ops.quant.mxfp4 import (dequantize_mxfp4, e8m0_from_amax, e8m0_to_float, fake_quant_mxfp4, fp4_codes,
                                        fp4_round, fp4_to_float, pack_fp4, quantize_mxfp4, unpack_fp4)
from atom.quant_spec import LayerQuantConfig, QuantType

FP4 = torch.float4_e2m1fn_x2


# --- reference (independent of atom's code) -------------------------------------------------
def ref_fp4_value(code: int) -> float:
    """OCP e2m1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -mag if s else mag


GRID = torch.tensor([ref_fp4_value(c) for c in range(8)])


def ref_round_fp4(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 magnitude, ties to the even code, clamped to 6, sign kept."""
    dist = (v.double().abs().clamp(max=6).unsqueeze(-1) - GRID.double()).abs() + 1e-12 * (torch.arange(8) % 2)
    return torch.where(v < 0, -1.0, 1.0) * GRID[dist.argmin(-1)]


def ref_scale(amax: torch.Tensor) -> torch.Tensor:
    """2^(e - 2), e the exponent of amax rounded to a power of two (up from mantissa 1.75)."""
    f, e = torch.frexp(amax.float())  # amax = f 2^e, f in [0.5, 1)
    e = (e - 1) + (2 * f >= 1.75).int()
    out = torch.pow(2.0, (e - 2).clamp(min=-127).float())
    return torch.where(amax == 0, torch.tensor(2.0 ** -127), out)


def ref_fake_quant(x: torch.Tensor) -> torch.Tensor:
    g = x.float().unflatten(-1, (-1, 32))
    s = ref_scale(g.abs().amax(-1, keepdim=True))
    return (ref_round_fp4(g / s) * s).flatten(-2)


# --- numerics ----------------------------------------------------------------------------
def test_fp4_codes_values_and_ties():
    assert fp4_to_float(torch.arange(16, dtype=torch.uint8)).tolist() == [ref_fp4_value(c) for c in range(16)]
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 9.0, 0.26, 2.6, -0.1, -5.1, 0.0])
    assert fp4_to_float(fp4_codes(x)).tolist() == [0, 1, 1, 2, 2, 4, 4, 6, 0.5, 3, -0.0, -6, 0]
    assert fp4_codes(torch.tensor([-0.1, 0.0])).tolist() == [8, 0]  # negative zero keeps its sign bit
    v = torch.randn(4, 64) * 4
    assert torch.equal(fp4_to_float(fp4_codes(v)), ref_round_fp4(v))


def test_fp4_round_is_the_code_tables_value_everywhere():
    """The table-free rounding the activations take (graph-capturable) against the code tables:
    every tie, both sides of every bound, +-0, past 6 and inf, and a dense sweep over [-8, 8]."""
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0])
    x = torch.cat([bounds, torch.nextafter(bounds, torch.zeros(())), torch.nextafter(bounds, bounds * 2),
                   torch.tensor([0.0, 7.0, 1e30, float("inf")]), torch.linspace(0, 8, 80001)])
    x = torch.cat([x, -x])
    want = fp4_to_float(fp4_codes(x))
    got = fp4_round(x)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    v = torch.randn(64, 512) * 3
    assert torch.equal(fp4_round(v), fp4_to_float(fp4_codes(v)))


def test_pack_order_low_nibble_is_the_even_column():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_fp4(codes).tolist() == [[0x21, 0x0F]]
    c = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    assert torch.equal(unpack_fp4(pack_fp4(c)), c)


def test_e8m0_scale_rule():
    amax = torch.tensor([6.0, 1.0, 1.74, 1.75, 0.0, 3e-3, 448.0, 1.5 * 2.0 ** 100])
    s = e8m0_from_amax(amax)
    assert s.dtype == torch.uint8
    assert e8m0_to_float(s).tolist() == ref_scale(amax).tolist()
    assert s.tolist()[:5] == [127, 125, 125, 126, 0]  # 6 -> 2^0 (6 is e2m1's max), 1 -> 2^-2
    r = torch.rand(1000) * torch.pow(2.0, torch.randint(-30, 30, (1000,)).float())
    assert torch.equal(e8m0_to_float(e8m0_from_amax(r)), ref_scale(r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_dequantize_and_fake_quant(dtype):
    torch.manual_seed(0)
    w = (torch.randn(48, 256) * torch.rand(48, 1) * 3).to(dtype)
    w[0, :32] = 0
    packed, scales = quantize_mxfp4(w)
    assert packed.shape == (48, 128) and scales.shape == (48, 8) and packed.dtype == scales.dtype == torch.uint8
    deq = dequantize_mxfp4(packed, scales)
    assert torch.equal(deq, ref_fake_quant(w)) and torch.equal(fake_quant_mxfp4(w), deq)
    assert torch.equal(deq[0, :32], torch.zeros(32))
    again = quantize_mxfp4(deq)  # values already on the grid quantize to themselves
    assert torch.equal(dequantize_mxfp4(*again), deq)
    x = torch.randn(2, 3, 64).to(dtype)
    assert torch.equal(fake_quant_mxfp4(x), ref_fake_quant(x))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(4, 48))


# --- the linear method -----------------------------------------------------------------------
class OneSpec:
    def __init__(self, s):
        self.s = s

    def get_layer_quant_config(self, prefix):
        return self.s


def mx_spec(method="compressed-tensors", act="none", **kw):
    extra = dict(act_scheme="group", act_group_size=32, act_dtype="fp4x2") if act == "mxfp4" else dict(act_scheme="none")
    return LayerQuantConfig(QuantType.per_1x32, FP4, True, method, **{"group_size": 32, "symmetric": True, **extra, **kw})


def build(kind, s):
    qc = OneSpec(s)
    if kind == "linear":
        return Linear(256, 192, bias=True, quant_config=qc, prefix="t.proj")
    if kind == "linear_odd":
        return Linear(96, 40, quant_config=qc, prefix="t.proj")
    if kind == "qkv":
        return QKVLinear(128, 32, 4, 2, quant_config=qc, prefix="t.qkv_proj")
    return MergedLinear(160, [96, 72], quant_config=qc, prefix="t.gate_up_proj")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["linear", "linear_odd", "qkv", "merged"])
@pytest.mark.parametrize("method, act", [("compressed-tensors", "none"), ("compressed-tensors", "mxfp4"),
                                         ("quark", "none"), ("quark", "mxfp4")])
def test_mxfp4_method_matches_dequantize_then_matmul(method, act, kind, dtype):
    torch.manual_seed(0)
    layer = build(kind, mx_spec(method, act))
    name = "weight_packed" if method == "compressed-tensors" else "weight"
    assert layer.method.format(layer) == ("mxfp4 1x32 e8m0, weight only" if act == "none"
                                          else "mxfp4 1x32 e8m0, act dynamic mxfp4 1x32")
    deqs = []
    for sid in layer.shard_ids():
        rows = layer.shard_range(sid)[1]
        w = torch.randn(rows, layer.in_features) * 0.1 * (1 + torch.arange(rows).unsqueeze(1) % 5)
        packed, scales = quantize_mxfp4(w)
        for n, t in ((name, packed), ("weight_scale", scales)):
            p = getattr(layer, n)
            p.weight_loader(p, t, sid)
        deqs.append(ref_fake_quant(w))  # each shard its own scales
    if layer.bias is not None:
        layer.bias.weight_loader(layer.bias, torch.randn(layer.out_features), None)
    layer.method.process_weights_after_loading(layer)
    w_ref = torch.cat(deqs)
    for shape in [(5, layer.in_features), (2, 3, layer.in_features), (1, layer.in_features)]:
        x = (torch.randn(shape) * 0.5).to(dtype)
        y = layer(x)
        assert y.dtype == dtype and y.shape == (*shape[:-1], layer.out_features)
        x32 = ref_fake_quant(x) if act == "mxfp4" else x.float()
        ref = F.linear(x32, w_ref, layer.bias.float() if layer.bias is not None else None).to(dtype)
        torch.testing.assert_close(y, ref)
    dense = layer.out_features * layer.in_features * 2
    assert layer.method.weight_bytes(layer) <= 0.29 * dense + 4 * layer.out_features  # 4.25 bits a weight


def test_refusals_name_the_layer_and_the_format():
    with pytest.raises(NotImplementedError, match=r"layer 't.x'.*in_features=80 is not a multiple of 32"):
        Linear(80, 64, quant_config=OneSpec(mx_spec()), prefix="t.x")
    with pytest.raises(NotImplementedError, match=r"layer 't.x'.*group_size=16 is another format \(NVFP4"):
        Linear(64, 64, quant_config=OneSpec(mx_spec(group_size=16)), prefix="t.x")
    with pytest.raises(NotImplementedError, match=r"layer 't.x'.*MXFP4 weights with fp8 'group' activations"):
        Linear(64, 64, quant_config=OneSpec(mx_spec(act="mxfp4", act_dtype="fp8")), prefix="t.x")
    with pytest.raises(NotImplementedError, match=r"layer 't.x'.*dynamic"):
        Linear(64, 64, quant_config=OneSpec(LayerQuantConfig(QuantType.per_1x32, FP4, False, "quark", act_scheme="group",
                                                             act_group_size=32)), prefix="t.x")
    from atom.quant_config import QuantizationConfig
    import transformers
    quark_uint4 = {"quant_method": "quark", "exclude": [], "global_quant_config": {
        "weight": {"dtype": "uint4", "qscheme": "per_group", "ch_axis": -1, "group_size": 64, "symmetric": False}}}
    qc = QuantizationConfig(transformers.PretrainedConfig(quantization_config=quark_uint4))
    with pytest.raises(NotImplementedError, match=r"layer 'm.down'.*torch.uint4.*no linear method"):
        Linear(128, 64, quant_config=qc, prefix="m.down")


# --- checkpoints: wrong layouts fail or are caught -------------------------------------------
def _copy(src, dst, edit_tensors=None, edit_config=None):
    shutil.copytree(src, dst)
    if edit_tensors:
        t = load_file(f"{dst}/model.safetensors")
        edit_tensors(t)
        save_file(t, f"{dst}/model.safetensors")
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.fixture(scope="module")
def ckpts():
    from quant_producers import make_checkpoints, producer_python
    if producer_python() is None:
        pytest.skip("the producers' venv (.venv-prod, or $ATOM_PRODUCER_PYTHON) is absent: `make producers`")
    return make_checkpoints(["ct_mxfp4a16", "quark_int4_wo_32"])


def test_wrong_layouts_fail_at_load_naming_the_layer(ckpts, tmp_path):
    from atom import LLM
    name = "model.layers.0.self_attn.q_proj.weight_scale"

    def untranspose(t):  # Quark's int4 scale written the compressed-tensors way round
        t[name] = t[name].t().contiguous()
    bad = _copy(ckpts / "quark_int4_wo_32", tmp_path / "q", untranspose)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.qkv_proj.weight_scale: Quark tensor shape "
                                         r"\(64, 2\)"):
        LLM(bad, dtype="float32", enable_log_stats=False, num_kvcache_blocks=16)

    def nvfp4_config(cfg):  # same tensors declared as NVFP4 (fp4, group 16)
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16
    bad = _copy(ckpts / "ct_mxfp4a16", tmp_path / "nv", None, nvfp4_config)
    with pytest.raises(NotImplementedError, match=r"layer 'model.layers.0.self_attn.qkv_proj'.*group_size=16"):
        LLM(bad, dtype="float32", enable_log_stats=False, num_kvcache_blocks=16)


def test_swapped_nibbles_change_the_output(ckpts, tmp_path):
    """The negative control for the producer tests' tolerance: reading MXFP4 bytes with the
    nibble order reversed moves log-probs far beyond 5e-3."""
    from atom import LLM, SamplingParams
    from quant_producers import reference
    ref = reference(ckpts / "ct_mxfp4a16")

    def swap(t):
        for k in t:
            if k.endswith("weight_packed"):
                t[k] = (t[k] >> 4) | (t[k] << 4)
    bad = _copy(ckpts / "ct_mxfp4a16", tmp_path / "sw", swap)
    llm = LLM(bad, dtype="float32", enable_log_stats=False, num_kvcache_blocks=64)
    p, g, want = ref["prompts"][1], ref["greedy"][1], ref["logprobs"][1]
    o = llm.generate([p + g], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    got = [o.prompt_logprobs[len(p) + i][t].logprob for i, t in enumerate(g)]
    assert max(abs(a - b) for a, b in zip(got, want)) > 0.2
