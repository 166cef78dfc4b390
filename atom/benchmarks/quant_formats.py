"""The quantized formats the GPU benchmarks run (`--quantization FORMAT`), as one table.

Each format is a real producer's checkpoint format: the benchmark writes the model folder's
config.json with the `quantization_config` block llm-compressor 0.14 / compressed-tensors
0.19 writes for that scheme (shared/QUANT_PRODUCERS.md quotes them), and both engines load
that folder with dummy weights (ATOM `load_dummy="xavier"`, whose per-dtype rules give
valid quantized values and scales: `atom.model_loader.loader.dummy_fill`; vLLM
`load_format="dummy"`). Only the decoder's linear layers are quantized: `ignore` holds
`lm_head` as the producer writes it, and the embeddings are no Linear, so both stay bf16.

| format       | scheme (llm-compressor)       | weights                                   | activations           |
|--------------|-------------------------------|-------------------------------------------|-----------------------|
| bf16         | none                          | bf16                                      | bf16                  |
| fp8_dynamic  | FP8_DYNAMIC (the ptpc format) | fp8 e4m3 per channel (`weight_scale` [N,1]) | fp8 dynamic per token |
| fp8_block    | FP8_BLOCK                     | fp8 e4m3, one scale per 128x128 block     | fp8 dynamic 1x128     |
| w8a8_int8    | W8A8                          | int8 per channel                          | int8 dynamic per token |
| w4a16        | W4A16 (group 128, symmetric)  | int4 pack-quantized, bf16 scale per 1x128 | bf16                  |
| mxfp4_w4a16  | MXFP4A16                      | fp4 e2m1 pairs, e8m0 scale per 1x32       | bf16                  |

What vLLM runs for each on sm90 (H200), read in vLLM's source (the stored main-branch
snapshot of vllm-project/vllm around 0.26: `model_executor/kernels/linear/__init__.py`
priority lists, `compressed_tensors/schemes/*`); `VLLM_SM90` holds it:
- fp8_dynamic: CompressedTensorsW8A8Fp8, channel weights x per-token dynamic activations
  -> FP8 scaled-mm, first of FlashInfer / CUTLASS (`cutlass_scaled_mm`, sm90 kernel); the
  H200 machine has no FlashInfer, so CUTLASS.
- fp8_block: CompressedTensorsW8A8Fp8 with a block strategy -> W8A8BlockFp8LinearOp:
  DeepGEMM where installed and enabled, else CUTLASS block-scaled fp8 (sm90), else
  Triton `w8a8_block_fp8_matmul`.
- w8a8_int8: CompressedTensorsW8A8Int8 -> CutlassInt8ScaledMMLinearKernel (Triton as the fallback).
- w4a16: CompressedTensorsWNA16 (uint4b8, group 128) -> mixed-precision kernels in order
  CutlassW4A8 (needs fp8 activations: not this), Machete (sm90 only: chosen on the H200),
  AllSpark, Marlin, ...
- mxfp4_w4a16: CompressedTensorsW4A16Mxfp4 (minimum capability 80) -> FP4 Marlin
  (weight-only, `apply_fp4_marlin_linear`): runs on sm90.
A format vLLM cannot run on the machine (`VLLM_SM90[fmt].supported` False, or its child
process fails) is reported as such in the table and the JSON, and ATOM still runs.

Weight bytes (`weight_bytes(fmt, n, k)`, the roofline's count of what a decode step must
read for one [n, k] linear): the stored values plus their scales at the checkpoint's dtype
(bf16 scales, uint8 e8m0), e.g. fp8 1 B + 2/k, int4 0.5 B + 2/128, MXFP4 0.5 B + 1/32.
`matmul_peak`: the FP8 and INT8 W8A8 formats multiply on tensor cores of twice the bf16
peak (H200), so their prefill FLOP floor is half; the weight-only formats multiply in bf16.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

CT_VERSION = "0.19.0"


def _args(**kw) -> dict:
    """A compressed-tensors QuantizationArgs dict with every field, as the producer writes it."""
    base = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
            "observer": None, "observer_kwargs": {}, "scale_dtype": None, "strategy": None, "symmetric": True,
            "type": "int", "zp_dtype": None}
    base.update(kw)
    return base


def _ct_block(group_format: str, weights: dict, inputs: dict | None, ignore: list[str]) -> dict:
    """The whole `quantization_config` of a one-group compressed-tensors checkpoint."""
    return {"config_groups": {"group_0": {"format": group_format, "input_activations": inputs,
                                          "output_activations": None, "targets": ["Linear"], "weights": weights}},
            "format": group_format, "global_compression_ratio": None, "ignore": list(ignore),
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": CT_VERSION}


_W_OBS = "memoryless_minmax"


@dataclass(frozen=True)
class QuantFormat:
    name: str
    scheme: str            # the producer's scheme name
    group_format: str      # compressed-tensors `format`; "" for bf16
    weights: dict | None
    inputs: dict | None
    value_bytes: float     # bytes per stored weight value
    scale_bytes: float     # bytes per scale (checkpoint dtype)
    scale_block: tuple     # (rows, cols) one scale covers; cols 0: the whole row
    matmul_peak: float = 1.0  # the format's tensor-core peak over bf16's (fp8 / int8 on H200: 2x)

    def quantization_config(self, ignore=("lm_head",)) -> dict | None:
        if self.weights is None:
            return None
        return _ct_block(self.group_format, copy.deepcopy(self.weights), copy.deepcopy(self.inputs), list(ignore))

    def weight_bytes(self, n: int, k: int) -> float:
        """Bytes of one [n, k] linear in this format: values and scales."""
        rows, cols = self.scale_block
        scales = math.ceil(n / rows) * (1 if cols == 0 else math.ceil(k / cols)) if self.scale_bytes else 0
        return n * k * self.value_bytes + scales * self.scale_bytes


FORMATS: dict[str, QuantFormat] = {f.name: f for f in (
    QuantFormat("bf16", "none", "", None, None, 2.0, 0.0, (1, 0)),
    QuantFormat("fp8_dynamic", "FP8_DYNAMIC", "float-quantized",
                _args(type="float", strategy="channel", observer=_W_OBS),
                _args(type="float", strategy="token", dynamic=True), 1.0, 2.0, (1, 0), 2.0),
    QuantFormat("fp8_block", "FP8_BLOCK", "float-quantized",
                _args(type="float", strategy="block", block_structure=[128, 128], observer=_W_OBS),
                _args(type="float", strategy="group", group_size=128, dynamic=True), 1.0, 2.0, (128, 128), 2.0),
    QuantFormat("w8a8_int8", "W8A8", "int-quantized",
                _args(type="int", strategy="channel", observer=_W_OBS),
                _args(type="int", strategy="token", dynamic=True), 1.0, 2.0, (1, 0), 2.0),
    QuantFormat("w4a16", "W4A16", "pack-quantized",
                _args(num_bits=4, type="int", strategy="group", group_size=128, observer=_W_OBS),
                None, 0.5, 2.0, (1, 128)),
    QuantFormat("mxfp4_w4a16", "MXFP4A16", "mxfp4-pack-quantized",
                _args(num_bits=4, type="float", strategy="group", group_size=32, scale_dtype="torch.uint8",
                      observer=_W_OBS),
                None, 0.5, 1.0, (1, 32)),
)}


@dataclass(frozen=True)
class VllmSupport:
    supported: bool   # vLLM runs it on sm90 (H200)
    kernel: str       # what it runs there (module docstring)


VLLM_SM90: dict[str, VllmSupport] = {
    "bf16": VllmSupport(True, "cuBLAS / torch F.linear"),
    "fp8_dynamic": VllmSupport(True, "CompressedTensorsW8A8Fp8 -> CUTLASS fp8 scaled_mm (FlashInfer first where installed)"),
    "fp8_block": VllmSupport(True, "CompressedTensorsW8A8Fp8 block -> W8A8BlockFp8LinearOp (DeepGEMM / CUTLASS "
                                   "block fp8 / Triton)"),
    "w8a8_int8": VllmSupport(True, "CompressedTensorsW8A8Int8 -> CUTLASS int8 scaled_mm"),
    "w4a16": VllmSupport(True, "CompressedTensorsWNA16 uint4b8 g128 -> Machete (sm90), Marlin fallback"),
    "mxfp4_w4a16": VllmSupport(True, "CompressedTensorsW4A16Mxfp4 -> FP4 Marlin (weight only)"),
}


def get_format(name: str | None) -> QuantFormat:
    """The format called `name` (None: bf16); a clear error listing the allowed names otherwise."""
    fmt = FORMATS.get(name or "bf16")
    if fmt is None:
        raise ValueError(f"--quantization={name!r} is unknown: choose one of {', '.join(FORMATS)}")
    return fmt
