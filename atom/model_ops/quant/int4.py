"""INT4 weight-only with groups (W4A16), as compressed-tensors' `pack-quantized` writes it.

Checkpoint tensors per layer (W is [out, in], g the group size, G = in / g; per-channel:
one group of the whole row):
- `weight_packed` int32 [out, ceil(in/8)]: nibble i (bits 4i..4i+3) of column j holds input
  column 8j + i, stored as q + 8 (q in [-8, 7]); the last int32 is zero-padded;
- `weight_scale` [out, G] (bf16 in the file);
- `weight_zero_point` int32 [ceil(out/8), G] when asymmetric: the zero points (in [-8, 7],
  stored + 8) packed the same way along the output dimension; a packed layer has each
  shard's rows packed on their own;
- `weight_shape` int64 [2]: (out, in) of the shard, checked after loading.
w = (q - zero_point) * scale, per group of g input columns; the product runs in fp32 on the
activations as they are (A16).

Group sizes: llm-compressor refuses a layer whose in_features is not a multiple of the
group size ("weight column counts not divisible by group_size"), and compressed-tensors'
group fake quant reshapes the columns into [-1, g], which fails there too (SmolLM2's 576
with g=128 is the known case; producers use g=64). The format has no partial group, so
such a layer is refused at build, naming it and a group size that divides.
"""
from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.quant.common import (QuantLinearMethod, bias_param, expand_rows, per_shard_param, product,
                                         refuse, row_param, weight_param)

_SHIFTS = torch.arange(8, dtype=torch.int32) * 4


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] of 8 nibbles each -> int16 [R, 8C] of the stored values 0..15 (nibble i
    of column j is element 8j + i)."""
    shifts = _SHIFTS.to(packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).to(torch.int16).flatten(-2)


class Int4LinearMethod(QuantLinearMethod):
    name = "int4"

    def __init__(self, spec, prefix: str):
        super().__init__(spec, prefix)
        if spec.quant_method != "compressed-tensors":
            raise refuse(prefix, spec, "int4 runs compressed-tensors' pack-quantized layout in this build; "
                         "Quark's int4 (W^T packed along out) and GPTQ/AWQ layouts have no method yet")
        if spec.act_scheme not in (None, "none"):
            raise refuse(prefix, spec, f"int4 weights with {spec.act_scheme!r} activations (W4A8) have "
                         "no method yet; W4A16 runs")
        self.group = spec.group_size
        self.symmetric = spec.symmetric is not False

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        g = self.group or in_features
        if in_features % g:
            divisors = [d for d in (256, 128, 64, 32, 16, 8) if in_features % d == 0 and d < g]
            hint = f"; a group of {divisors[0]} divides it" if divisors else ""
            raise refuse(self.prefix, self.spec, f"in_features={in_features} is not a multiple of group_size={g}: "
                         f"the pack-quantized format has no partial group (llm-compressor refuses it){hint}")
        self.groups = in_features // g
        weight_param(layer, "weight_packed", (out_features, -(-in_features // 8)), torch.int32, input_pack=8)
        row_param(layer, "weight_scale", self.groups, input_pack=g)
        if not self.symmetric:
            row_param(layer, "weight_zero_point", self.groups, dtype=torch.int32, rows_per_entry=8, fill=0,
                      input_pack=g)
        shape = per_shard_param(layer, "weight_shape", (2,), dtype=torch.int64)
        shape.data.copy_(torch.tensor([layer.checkpoint_shape(sid) for sid in layer.shard_ids()]))
        shape.keep_on_dummy = True  # dummy weights leave the expected shapes in place
        bias_param(layer, out_features, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Checks each shard's `weight_shape`; unpacks the zero points to one row per output."""
        for i, sid in enumerate(layer.shard_ids()):
            want = tuple(layer.checkpoint_shape(sid))  # the whole shard, before a tensor-parallel split
            got = tuple(int(v) for v in layer.weight_shape[i])
            if got != want:
                raise ValueError(f"{self.prefix}: checkpoint weight_shape {got} (shard {sid!r}) != {want}")
        if not self.symmetric:
            zp = expand_rows(layer, layer.weight_zero_point.data, 8, unpack=lambda c: unpack_int4(c.t()).t())
            layer.register_buffer("zero_point", zp.to(torch.int8).contiguous(), persistent=False)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        k = layer.in_features
        q = unpack_int4(layer.weight_packed)[:, :k]
        if not self.symmetric:
            q = q - layer.zero_point.to(torch.int16).repeat_interleave(k // self.groups, 1)
        else:
            q = q - 8
        return q.float() * layer.weight_scale.float().repeat_interleave(k // self.groups, 1)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return product(x, x.float(), self.dequantized_weight(layer), layer.bias)

    def format_spec(self) -> str:
        g = f"g{self.group}" if self.group else "per-channel"
        return f"int4 {g} {'sym' if self.symmetric else 'asym'}"
