"""INT4 weight-only with groups (W4A16), as compressed-tensors' `pack-quantized` and AMD
Quark (`int4`, `per_group`, e.g. `int4_wo_32`) write it.

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
activations as they are (A16). On CUDA the Triton kernels of `kernels.w4_gemm` read these
packed words, scales and zero points as they are and dequantize in registers.

Group sizes: llm-compressor refuses a layer whose in_features is not a multiple of the
group size ("weight column counts not divisible by group_size"), and compressed-tensors'
group fake quant reshapes the columns into [-1, g], which fails there too (SmolLM2's 576
with g=128 is the known case; producers use g=64). The format has no partial group, so
such a layer is refused at build, naming it and a group size that divides.

Quark's layout (AWQ-like, everything transposed) is converted to the one above as each
shard loads, so one dequantization serves both:
- `weight` int32 [in, out/8]: W^T packed along the output dimension, nibble i of column j
  holding output 8j + [0, 2, 4, 6, 1, 3, 5, 7][i], as signed two's-complement 4-bit values;
- `weight_scale` [in/g, out] (the transpose of compressed-tensors');
- `weight_zero_point` int32 [in/g, out/8], packed like `weight` (Quark writes it, all zero,
  for symmetric checkpoints too); no `weight_shape`.
"""
from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.kernels.w4_gemm import KERNEL_DESCRIPTION, kernel_for_weight, use_w4_kernel, w4_product
from atom.model_ops.quant.common import (QuantLinearMethod, bias_param, expand_rows, per_shard_param, product,
                                         refuse, row_param, weight_param)

_SHIFTS = torch.arange(8, dtype=torch.int32) * 4
#: Quark's nibble order: nibble i of an int32 holds element _QUARK_ORDER[i] of its 8
_QUARK_ORDER = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] of 8 nibbles each -> int16 [R, 8C] of the stored values 0..15 (nibble i
    of column j is element 8j + i)."""
    shifts = _SHIFTS.to(packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).to(torch.int16).flatten(-2)


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """Stored values 0..15 [R, K] -> int32 [R, ceil(K/8)] (inverse of `unpack_int4`; zero padded)."""
    rows, cols = u.shape
    u = torch.nn.functional.pad(u.to(torch.int64), (0, (-cols) % 8)).reshape(rows, -1, 8)
    packed = (u << _SHIFTS.to(u.device).long()).sum(-1)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def unpack_quark_int4(packed: torch.Tensor) -> torch.Tensor:
    """Quark int32 [R, C] -> signed int16 [R, 8C]: nibble i of column j is element
    8j + _QUARK_ORDER[i], a two's-complement 4-bit value."""
    nib = unpack_int4(packed).unflatten(-1, (-1, 8))  # [R, C, 8] in nibble order
    out = torch.empty_like(nib)
    out[..., _QUARK_ORDER.to(packed.device)] = nib
    out = out.flatten(-2)
    return torch.where(out >= 8, out - 16, out)


class Int4LinearMethod(QuantLinearMethod):
    name = "int4"

    def __init__(self, spec, prefix: str):
        super().__init__(spec, prefix)
        if spec.quant_method not in ("compressed-tensors", "quark"):
            raise refuse(prefix, spec, "int4 runs compressed-tensors' pack-quantized and Quark's layouts in "
                         "this build; GPTQ/AWQ layouts have no method yet")
        self.quark = spec.quant_method == "quark"
        self.packed_name = "weight" if self.quark else "weight_packed"
        if spec.act_scheme not in (None, "none"):
            raise refuse(prefix, spec, f"int4 weights with {spec.act_scheme!r} activations (W4A8) have "
                         "no method yet; W4A16 runs")
        self.group = spec.group_size
        self.symmetric = spec.symmetric is not False
        self.has_zp = not self.symmetric or self.quark  # Quark stores zero points (0) either way

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        g = self.group or in_features
        if in_features % g:
            divisors = [d for d in (256, 128, 64, 32, 16, 8) if in_features % d == 0 and d < g]
            hint = f"; a group of {divisors[0]} divides it" if divisors else ""
            raise refuse(self.prefix, self.spec, f"in_features={in_features} is not a multiple of group_size={g}: "
                         f"the pack-quantized format has no partial group (llm-compressor refuses it){hint}")
        self.groups = in_features // g
        packed = weight_param(layer, self.packed_name, (out_features, -(-in_features // 8)), torch.int32,
                              input_pack=8)
        scale = row_param(layer, "weight_scale", self.groups, input_pack=g)
        zp = None
        if self.has_zp:
            zp = row_param(layer, "weight_zero_point", self.groups, dtype=torch.int32, rows_per_entry=8, fill=0,
                           input_pack=g)
        if self.quark:
            self._quark_loaders(layer, packed, scale, zp)
            bias_param(layer, out_features, bias)
            return
        shape = per_shard_param(layer, "weight_shape", (2,), dtype=torch.int64)
        shape.data.copy_(torch.tensor([layer.checkpoint_shape(sid) for sid in layer.shard_ids()]))
        shape.keep_on_dummy = True  # dummy weights leave the expected shapes in place
        bias_param(layer, out_features, bias)

    def _quark_loaders(self, layer: nn.Module, packed, scale, zp) -> None:
        """Loaders that turn each Quark shard tensor into the compressed-tensors layout."""
        load_w, load_s, load_zp = packed.weight_loader, scale.weight_loader, zp.weight_loader
        k = layer.in_features

        def check(name, loaded, shape):
            if loaded.dim() != 2 or tuple(loaded.shape[:1]) != shape:
                raise ValueError(f"{self.prefix}.{name}: Quark tensor shape {tuple(loaded.shape)} does not "
                                 f"start with {shape} (Quark writes it transposed: [in or in/group, out...])")

        def weight(param, loaded, shard_id=None):
            check("weight", loaded, (k,))
            q = unpack_quark_int4(loaded).t()  # [out_shard, in]
            load_w(param, pack_int4(q + 8), shard_id)

        def weight_scale(param, loaded, shard_id=None):
            check("weight_scale", loaded, (self.groups,))
            load_s(param, loaded.t().contiguous(), shard_id)

        def zero_point(param, loaded, shard_id=None):
            check("weight_zero_point", loaded, (self.groups,))
            z = unpack_quark_int4(loaded)  # [groups, out_shard]
            load_zp(param, pack_int4(z + 8).t().contiguous(), shard_id)

        packed.weight_loader, scale.weight_loader, zp.weight_loader = weight, weight_scale, zero_point

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Checks each shard's `weight_shape`; unpacks the zero points to one row per output
        (int8 [out, groups], what the GPU kernel reads); keeps the scales in bf16 when that is
        exact (checkpoints write bf16 scales: half the scale bytes the kernel streams)."""
        for i, sid in enumerate([] if self.quark else layer.shard_ids()):
            want = tuple(layer.checkpoint_shape(sid))  # the whole shard, before a tensor-parallel split
            got = tuple(int(v) for v in layer.weight_shape[i])
            if got != want:
                raise ValueError(f"{self.prefix}: checkpoint weight_shape {got} (shard {sid!r}) != {want}")
        if self.has_zp:
            zp = expand_rows(layer, layer.weight_zero_point.data, 8, unpack=lambda c: unpack_int4(c.t()).t())
            layer.register_buffer("zero_point", zp.to(torch.int8).contiguous(), persistent=False)
        s = layer.weight_scale.data
        if s.dtype == torch.float32 and torch.equal(s.to(torch.bfloat16).float(), s):
            layer.weight_scale.data = s.to(torch.bfloat16)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        k = layer.in_features
        q = unpack_int4(getattr(layer, self.packed_name))[:, :k]
        if self.has_zp:
            q = q - layer.zero_point.to(torch.int16).repeat_interleave(k // self.groups, 1)
        else:
            q = q - 8
        return q.float() * layer.weight_scale.float().repeat_interleave(k // self.groups, 1)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """CUDA (with Triton): the fused kernel on the packed weight (`kernels.w4_gemm`);
        elsewhere the torch reference (dequantize to fp32, F.linear)."""
        if use_w4_kernel(x):
            packed, scales, zeros, fmt, group, k = self.w4_operands(layer)
            return w4_product(x, packed, scales, zeros, layer.bias, fmt, group, k)
        return product(x, x.float(), self.dequantized_weight(layer), layer.bias)

    def w4_operands(self, layer: nn.Module) -> tuple:
        """The 4-bit kernels' operands of this layer: (packed, scales, zeros, "int4", group, K)."""
        k = layer.in_features
        return (getattr(layer, self.packed_name), layer.weight_scale, layer.zero_point if self.has_zp else None,
                "int4", k // self.groups, k)

    def one_row_operands(self, layer: nn.Module) -> tuple | None:
        """What the one-row GEMV's fused entry (`kernels.w4_gemv1.w4_gemv1_fused`: the norm
        before, SiLU-and-mul after) takes for this layer: `w4_operands`, or None where it does
        not run the layer's groups."""
        from atom.model_ops.kernels.w4_gemv1 import supports
        ops = self.w4_operands(layer)
        return ops if supports("int4", ops[4], ops[5]) else None

    #: the GPU kernel (CPU runs the torch reference)
    kernel = KERNEL_DESCRIPTION

    def format_spec(self) -> str:
        g = f"g{self.group}" if self.group else "per-channel"
        return f"int4 {g} {'sym' if self.symmetric else 'asym'}"

    def kernel_for(self, layer: nn.Module) -> str:
        """What runs this layer's product (the per-layer table's `kernel` column)."""
        return kernel_for_weight(getattr(layer, self.packed_name))
