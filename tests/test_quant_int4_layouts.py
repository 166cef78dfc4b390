"""INT4 layouts beyond tests/test_quant_methods.py: Quark's transposed AWQ-like packing
(converted at load) against a packer written here from QUANT_PRODUCERS.md's description,
and compressed-tensors groups that do not divide 128."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atom.model_ops.linear import MergedLinear, QKVLinear
from atom.quant_spec import LayerQuantConfig, QuantType
from test_quant_methods import q_int4

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i holds element ORDER[i] of its 8


class OneSpec:
    def __init__(self, s):
        self.s = s

    def get_layer_quant_config(self, prefix):
        return self.s


def quark_pack(q: torch.Tensor) -> torch.Tensor:
    """Signed values [R, C] (C a multiple of 8) -> int32 [R, C/8], Quark's nibble order,
    two's complement nibbles, written with Python ints."""
    rows, cols = q.shape
    out = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for r in range(rows):
        for j in range(cols // 8):
            word = 0
            for i, e in enumerate(ORDER):
                word |= (int(q[r, 8 * j + e]) & 0xF) << (4 * i)
            out[r, j] = word - (1 << 32) if word >= 1 << 31 else word
    return out.to(torch.int32)


def quark_int4(w: torch.Tensor, g: int, zp_value: int = 0):
    """Quark int4_wo tensors of one shard w [out, in]: weight [in, out/8], scale [in/g, out],
    zero point [in/g, out/8]; and the dequantized weight."""
    out, inn = w.shape
    wg = w.reshape(out, inn // g, g)
    s = (wg.abs().amax(-1) / 7).bfloat16()
    q = (torch.round(wg / s.float().unsqueeze(-1)) + zp_value).clamp(-8, 7)
    deq = ((q - zp_value) * s.float().unsqueeze(-1)).reshape(out, inn)
    zp = torch.full((inn // g, out), zp_value)
    return {"weight": quark_pack(q.reshape(out, inn).t()), "weight_scale": s.t().contiguous(),
            "weight_zero_point": quark_pack(zp)}, deq


@pytest.mark.parametrize("g, zp", [(32, 0), (64, 0), (32, -3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quark_int4_matches_dequantize_then_matmul(g, zp, dtype):
    spec = LayerQuantConfig(QuantType.per_1x32, torch.uint8, True, "quark", group_size=g, symmetric=True,
                            act_scheme="none")
    layer = QKVLinear(128, 16, 4, 2, quant_config=OneSpec(spec), prefix="t.qkv_proj")
    assert layer.method.format(layer) == f"int4 g{g} sym"
    torch.manual_seed(0)
    deqs = []
    for sid in layer.shard_ids():
        t, deq = quark_int4(torch.randn(layer.shard_range(sid)[1], 128), g, zp)
        for n, v in t.items():
            p = getattr(layer, n)
            p.weight_loader(p, v, sid)
        deqs.append(deq)
    layer.method.process_weights_after_loading(layer)
    x = torch.randn(2, 3, 128).to(dtype)
    torch.testing.assert_close(layer(x), F.linear(x.float(), torch.cat(deqs)).to(dtype))


def test_quark_int4_in_compressed_tensors_orientation_fails_naming_the_tensor():
    spec = LayerQuantConfig(QuantType.per_1x32, torch.uint8, True, "quark", group_size=32, act_scheme="none")
    layer = QKVLinear(128, 16, 4, 2, quant_config=OneSpec(spec), prefix="t.qkv_proj")
    with pytest.raises(ValueError, match=r"t.qkv_proj.weight_scale: Quark tensor shape \(64, 4\)"):
        layer.weight_scale.weight_loader(layer.weight_scale, torch.ones(64, 4), "q")


def test_int4_group_that_does_not_divide_128():
    """g48 over K=192 (48 does not divide 128) and g32 over K=96: packed shards of their own."""
    for k, g in ((192, 48), (96, 32)):
        s = LayerQuantConfig(QuantType.per_Token, torch.uint8, True, "compressed-tensors", group_size=g,
                             symmetric=False, act_scheme="none")
        layer = MergedLinear(k, [40, 24], quant_config=OneSpec(s), prefix="t.gate_up_proj")
        deqs = []
        torch.manual_seed(1)
        for sid in layer.shard_ids():
            t, deq = q_int4(torch.randn(layer.shard_range(sid)[1], k), g, False)
            for n, v in t.items():
                p = getattr(layer, n)
                p.weight_loader(p, v, sid)
            deqs.append(deq)
        layer.method.process_weights_after_loading(layer)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(3, k).to(dtype)
            torch.testing.assert_close(layer(x), F.linear(x.float(), torch.cat(deqs)).to(dtype))


