"""MXFP4 (OCP microscaling FP4): e2m1 values, two per byte, one E8M0 scale per 32 along K.

The format, as compressed-tensors `mxfp4-pack-quantized` and AMD Quark (`fp4`, `per_group`,
group 32, `scale_format: e8m0`) write it:
- values: FP4 E2M1 codes, bit 3 the sign, bits 0-2 the magnitude index into
  (0, 0.5, 1, 1.5, 2, 3, 4, 6); two per uint8 along K, the LOW nibble the even column
  (`weight_packed` [out, in/2] in compressed-tensors, `weight` in Quark: same bytes);
- scales: uint8 E8M0 exponents [out, in/32] (`weight_scale`), scale = 2^(s - 127);
  w = fp4(code) * scale.
- scale from a group's amax (both producers' rule, OCP section 6.3 with round-up at 1.75):
  amax is rounded to a power of two (up when its mantissa is >= 1.75), then
  s = 127 + log2(that) - 2 (2 = floor(log2(6)), the e2m1 maximum's exponent), clamped to
  [0, 254]; an all-zero group gets s = 0.
- rounding to e2m1: nearest, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
  1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), clamped to +-6; the sign bit is the input's
  (a negative value that rounds to 0 is code 8, as compressed-tensors packs it).

Functions other code may call (all torch, any device):
    quantize_mxfp4(w) -> (packed uint8 [..., K/2], scales uint8 [..., K/32])
    dequantize_mxfp4(packed, scales) -> fp32 [..., K]
    fake_quant_mxfp4(x) -> x quantized to MXFP4 and back (fp32), per 1x32 along the last dim
    e8m0_from_amax(amax) -> uint8 exponents;  e8m0_to_float(s) -> fp32 2^(s-127)
    fp4_codes(x) -> uint8 e2m1 codes of already-scaled values;  fp4_to_float(codes)
    fp4_round(x) -> fp4_to_float(fp4_codes(x)), elementwise (no table: CUDA-graph safe)
    pack_fp4(codes) -> uint8 [..., K/2];  unpack_fp4(packed) -> codes [..., K]

`Mxfp4LinearMethod` runs the fused Triton kernels on CUDA (`kernels.w4_gemm`: the packed
bytes dequantized in registers; from `W4_DEQUANT_MIN_M` rows in bf16, written out for the
library GEMM) and elsewhere the torch reference: weights dequantized to fp32, activations as
they are (MXFP4A16, `mxfp4_weight_only`) or fake-quantized per 1x32 (`mxfp4` with dynamic
MXFP4 input activations), F.linear in fp32. K must be a multiple of 32 (the producers'
requirement: compressed-tensors only packs group 32, Quark reshapes into 32-blocks).
"""
from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.kernels.w4_gemm import KERNEL_DESCRIPTION, kernel_for_weight, use_w4_kernel, w4_product
from atom.model_ops.quant.common import QuantLinearMethod, bias_param, product, refuse, row_param, weight_param

MX_GROUP = 32
FP4_MAX = 6.0
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: the 16 codes' values (8..15 the negatives)
FP4_VALUES = torch.tensor(_E2M1 + tuple(-v for v in _E2M1), dtype=torch.float32)
# magnitude thresholds between neighbouring codes, and whether a tie goes up (to the even code)
_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_TIE_UP = torch.tensor([False, True, False, True, False, True, False])


def fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes (0..15) of values already divided by their scale: nearest value,
    ties to the even code, clamped to +-6, the sign bit from the input's sign bit."""
    x = x.float()
    mag = x.abs()
    bounds, tie_up = _BOUNDS.to(x.device), _TIE_UP.to(x.device)
    code = torch.bucketize(mag, bounds)  # ties land on the lower code
    j = code.clamp(max=len(_E2M1) - 2)
    code = code + ((mag == bounds[j]) & tie_up[j]).long()
    return (code | (torch.signbit(x).long() << 3)).to(torch.uint8)


def fp4_to_float(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of uint8 e2m1 codes."""
    return FP4_VALUES.to(codes.device)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even) -> [..., K/2]: column 2i in the low nibble, 2i+1 in the high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: the last dimension ({codes.shape[-1]}) must be even")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> codes [..., K] (inverse of `pack_fp4`)."""
    p = packed.to(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def e8m0_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents for groups with absolute maximum `amax` (the rule in the module
    docstring: amax rounded to a power of two, up from 1.75, minus e2m1's exponent 2)."""
    a = amax.float().clone()
    bits = a.view(torch.int32)
    bits.add_(1 << 21).bitwise_and_(0x1FF << 23)  # mantissa >= 0.75: carry into the exponent
    p2 = bits.view(torch.float32)
    exp = torch.floor(torch.log2(p2)) - 2  # -inf for a zero group
    return (exp + 127).clamp(0, 254).to(torch.uint8)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """fp32 2^(s - 127) of uint8 E8M0 exponents (exact; 2^-127 is a float32 subnormal)."""
    return torch.ldexp(torch.ones_like(scales, dtype=torch.float32), scales.to(torch.int32) - 127)


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    if x.shape[-1] % group:
        raise ValueError(f"MXFP4: the last dimension ({x.shape[-1]}) must be a multiple of {group}")
    return x.float().unflatten(-1, (-1, group))


def quantize_mxfp4(w: torch.Tensor, group: int = MX_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] -> (packed uint8 [..., K/2], scales uint8 [..., K/group]): the bytes
    compressed-tensors writes as `weight_packed` / `weight_scale` (Quark: `weight` /
    `weight_scale`)."""
    g = _groups(w, group)
    scales = e8m0_from_amax(g.abs().amax(-1))
    codes = fp4_codes(g / e8m0_to_float(scales).unsqueeze(-1)).flatten(-2)
    return pack_fp4(codes), scales


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, group: int = MX_GROUP) -> torch.Tensor:
    """(packed uint8 [..., K/2], scales uint8 [..., K/group]) -> fp32 [..., K]."""
    vals = fp4_to_float(unpack_fp4(packed)).unflatten(-1, (-1, group))
    return (vals * e8m0_to_float(scales).unsqueeze(-1)).flatten(-2)


def fp4_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 values of `fp4_codes(x)` computed elementwise, without the code tables: e2m1's
    magnitudes are spaced 0.5 below 2, 1 up to 4 and 2 up to 6, so rounding each range to
    its spacing half to even (`torch.round`) lands ties on the even code as `fp4_codes` does
    (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), clamped to 6,
    with x's sign (-0.0 too). No host tensor is read, so a CUDA graph can capture it."""
    x = x.float()
    mag = x.abs()
    q = torch.where(mag < 2, torch.round(mag * 2) * 0.5,
                    torch.where(mag < 4, torch.round(mag), torch.round(mag * 0.5).clamp(max=3) * 2))
    return torch.copysign(q, x)


def fake_quant_mxfp4(x: torch.Tensor, group: int = MX_GROUP) -> torch.Tensor:
    """x quantized to MXFP4 per 1 x group along the last dim and dequantized (fp32): the
    dynamic activation quantization of the `mxfp4` formats (on CUDA inside the decode graphs,
    hence `fp4_round` rather than the code tables)."""
    g = _groups(x, group)
    s = e8m0_to_float(e8m0_from_amax(g.abs().amax(-1, keepdim=True)))
    return (fp4_round(g / s) * s).flatten(-2)


#: what `Mxfp4LinearMethod.kernel_for` adds for a layer stored as pair words
PAIR_WORDS_NOTE = "; weight as fp4 pair words"


def _has_pair_words(layer: nn.Module) -> bool:
    """Whether `Mxfp4LinearMethod.use_pair_words` repacked this layer's weight."""
    return layer.__dict__.get("fp4_layout") == "pairs"


class Mxfp4LinearMethod(QuantLinearMethod):
    """MXFP4 weights (`per_1x32`), weight only or with dynamic MXFP4 activations.

    Checkpoint names: compressed-tensors `weight_packed` + `weight_scale`, Quark `weight` +
    `weight_scale` (both uint8, the same bytes). Packed layers concatenate their shards'
    rows (values and scales alike), so each shard keeps its own scales."""

    name = "mxfp4"

    def __init__(self, spec, prefix: str):
        super().__init__(spec, prefix)
        group = spec.group_size or MX_GROUP
        if group != MX_GROUP:
            nv = " (NVFP4: fp8 scales per 16 and a global scale, which has no method yet)" if group == 16 else ""
            raise refuse(prefix, spec, f"fp4 weights run as MXFP4, one E8M0 scale per {MX_GROUP} values; "
                         f"group_size={group} is another format{nv}")
        if spec.symmetric is False:
            raise refuse(prefix, spec, "MXFP4 is symmetric; a checkpoint with zero points is not MXFP4")
        self.act = spec.act_scheme or "none"
        act_dtype = getattr(spec, "act_dtype", None)
        if self.act == "group" and (spec.act_group_size or MX_GROUP) == MX_GROUP and act_dtype in (None, "fp4x2"):
            if not spec.is_dynamic:
                raise refuse(prefix, spec, "MXFP4 activations are quantized at run time (dynamic) only")
        elif self.act != "none":
            raise refuse(prefix, spec, f"MXFP4 weights with {act_dtype or ''} {self.act!r} activations "
                         f"(group {spec.act_group_size}): this build runs weight-only MXFP4 or dynamic MXFP4 "
                         f"activations per 1x{MX_GROUP}")
        self.packed_name = "weight_packed" if spec.quant_method == "compressed-tensors" else "weight"

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        if in_features % MX_GROUP:
            raise refuse(self.prefix, self.spec, f"in_features={in_features} is not a multiple of {MX_GROUP} "
                         "(MXFP4 has no partial group; the producers refuse it too)")
        # two values per byte, one scale per 32 inputs: a row-parallel split narrows them alike
        weight_param(layer, self.packed_name, (out_features, in_features // 2), torch.uint8, input_pack=2)
        row_param(layer, "weight_scale", in_features // MX_GROUP, dtype=torch.uint8, fill=127,
                  input_pack=MX_GROUP)
        bias_param(layer, out_features, bias)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_mxfp4(self.checkpoint_bytes(layer), layer.weight_scale)

    def checkpoint_bytes(self, layer: nn.Module) -> torch.Tensor:
        """The weight's bytes in the checkpoint's layout (pair words put back: `use_pair_words`)."""
        packed = getattr(layer, self.packed_name)
        if _has_pair_words(layer):
            from atom.model_ops.kernels.fp4_pairs import standard_words
            return standard_words(packed.view(torch.int32)).view(torch.uint8)
        return packed

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """CUDA (with Triton): the fused kernel on the packed weight (`kernels.w4_gemm`), the
        dynamic MXFP4 activations fake-quantized in torch first (e2m1 x 2^k values are exact in
        bf16; in fp16 only outside its range would they round); elsewhere the torch reference."""
        if use_w4_kernel(x):
            xq = fake_quant_mxfp4(x).to(x.dtype) if self.act == "group" else x
            packed, scales, _, fmt, group, k = self.w4_operands(layer)
            return w4_product(xq, packed, scales, None, layer.bias, fmt, group, k)
        x32 = fake_quant_mxfp4(x) if self.act == "group" else x.float()
        return product(x, x32, self.dequantized_weight(layer), layer.bias)

    def w4_operands(self, layer: nn.Module) -> tuple:
        """The 4-bit kernels' operands of this layer: (packed, scales, None, "mxfp4", 32, K); pair
        words (`use_pair_words`) as int32 words with fmt "mxfp4_pairs"."""
        packed = getattr(layer, self.packed_name)
        if _has_pair_words(layer):
            return packed.view(torch.int32), layer.weight_scale, None, "mxfp4_pairs", MX_GROUP, layer.in_features
        return packed, layer.weight_scale, None, "mxfp4", MX_GROUP, layer.in_features

    def one_row_operands(self, layer: nn.Module) -> tuple | None:
        """What the one-row GEMV's fused entry (`kernels.w4_gemv1.w4_gemv1_fused`) takes for
        this layer: `w4_operands`; None with dynamic MXFP4 activations (quantized in torch
        before the product, which a norm in front cannot) or K not whole words."""
        if self.act == "group" or layer.in_features % 8:
            return None
        return self.w4_operands(layer)

    def use_pair_words(self, layer: nn.Module) -> bool:
        """The plan's "fp4_pair_words": the weight's bytes become `kernels.fp4_pairs` words in
        place (the same codes, bits placed so that the one-row GEMV decodes an fp16 pair in
        fewer instructions; the other 4-bit kernels read them too: `kernels.w4_gemm`), once:
        the layout stays when the plan is replaced, since graphs captured with it read it
        (`ModelRunner.install_plan` refuses the fusion after capture where a layer would still
        be repacked). Where `pair_words_pending` says so: only layers whose scales fold
        (`fp4_pairs.fold_scales`: all-zero blocks' scale bytes set to 127, the same values; a layer
        with other bytes outside `fp4_pairs.FOLD_SCALES` keeps the checkpoint's layout), so that the
        one-row GEMV's folded scale multiply (`w4_gemv1.FOLD_PAIR_SCALES`) is exact for every
        pair-word layer whenever the flag is read, and toggling it never changes a layer's layout;
        returns whether the layer has pair words."""
        if _has_pair_words(layer):
            return True
        if not self._repackable(layer):
            return False
        from atom.model_ops.kernels.fp4_pairs import fold_scales, pair_words
        words = getattr(layer, self.packed_name).data.view(torch.int32)
        scales = fold_scales(words, layer.weight_scale.data)  # one pass over the weight
        if scales is None:
            return False
        layer.weight_scale.data.copy_(scales)  # all-zero blocks' bytes: the same values
        words.copy_(pair_words(words))
        layer.fp4_layout = "pairs"
        return True

    def _repackable(self, layer: nn.Module) -> bool:
        """Not yet pair words, and where the 4-bit kernels run the weight (NVIDIA CUDA weights,
        Triton), contiguous and 4-byte aligned: what `use_pair_words` needs before its scales."""
        from atom.model_ops.kernels.triton_import import HAS_TRITON
        weight = getattr(layer, self.packed_name)
        return (not _has_pair_words(layer) and HAS_TRITON and weight.is_cuda and torch.version.hip is None
                and weight.is_contiguous() and weight.storage_offset() % 4 == 0)

    def pair_words_pending(self, layer: nn.Module) -> bool:
        """Whether `use_pair_words` would repack this layer's weight now: `_repackable`, with
        scales that fold (`fp4_pairs.fold_scales`), whatever `w4_gemv1.FOLD_PAIR_SCALES` says."""
        from atom.model_ops.kernels.fp4_pairs import fold_scales
        weight = getattr(layer, self.packed_name)
        return self._repackable(layer) and fold_scales(weight.view(torch.int32), layer.weight_scale) is not None

    #: the GPU kernel (CPU runs the torch reference)
    kernel = KERNEL_DESCRIPTION

    def kernel_for(self, layer: nn.Module) -> str:
        """What runs this layer's product (the per-layer table's `kernel` column), with the
        weight's layout where "fp4_pair_words" repacked it (a layer whose scale bytes do not
        fold keeps the checkpoint's, and says nothing more)."""
        kernel = kernel_for_weight(getattr(layer, self.packed_name))
        return kernel + PAIR_WORDS_NOTE if _has_pair_words(layer) else kernel

    def format_spec(self) -> str:
        if self.act == "none":
            return "mxfp4 1x32 e8m0, weight only"
        return "mxfp4 1x32 e8m0, act dynamic mxfp4 1x32"
