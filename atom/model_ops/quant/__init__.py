"""Linear methods, one per weight format, chosen per layer from the quantization config.

    method = linear_method_for(quant_config, "model.layers.0.self_attn.qkv_proj")
    describe_layers(model)    # one row per linear layer: layer, method, format, bytes

Methods: unquantized (`unquantized.py`), fp8 per-tensor / per-channel / block (`fp8.py`),
int8 W8A8 (`int8.py`), int4 W4A16 (`int4.py`: compressed-tensors pack-quantized and Quark's
transposed int4), MXFP4 weight-only or with dynamic MXFP4 activations (`mxfp4.py`, which also
holds the MXFP4 numerics: `quantize_mxfp4`, `dequantize_mxfp4`, `fake_quant_mxfp4`); the
quantized ones run a torch reference (dequantize, fake-quantize the activations as the format
defines, F.linear) on the CPU, and their Triton / cuBLASLt kernels on an NVIDIA GPU except
for formats without one (`reference_only_layers`), which a GPU engine refuses at load. A
layer whose spec asks for a format without a method (an unknown dtype, a layout or
granularity these files do not run) is refused when the model is built, before any weight
loads, naming the layer and the format.
"""
from __future__ import annotations

from torch import nn

from atom.model_ops.quant.base import LinearMethod
from atom.model_ops.quant.common import REFERENCE_KERNEL, QuantLinearMethod, method_for
from atom.model_ops.quant.fp8 import Fp8LinearMethod
from atom.model_ops.quant.int4 import Int4LinearMethod
from atom.model_ops.quant.int8 import Int8LinearMethod
from atom.model_ops.quant.mxfp4 import Mxfp4LinearMethod
from atom.model_ops.quant.unquantized import UnquantizedLinearMethod, dense, library_product

__all__ = ["LinearMethod", "UnquantizedLinearMethod", "Fp8LinearMethod", "Int8LinearMethod",
           "Int4LinearMethod", "Mxfp4LinearMethod", "linear_method_for", "describe_layers", "is_unquantized",
           "dense", "library_product", "reference_only_layers", "refuse_reference_layers"]

#: dtype key of the stored weight -> method class
METHODS = {"fp8": Fp8LinearMethod, "i8": Int8LinearMethod, "i4x2": Int4LinearMethod,
           "fp4x2": Mxfp4LinearMethod}


def linear_method_for(quant_config, prefix: str) -> LinearMethod:
    """The method for the layer at `prefix`: its spec from `quant_config` (None, excluded or
    unquantized: the unquantized method). Raises NotImplementedError naming the layer and
    the format where no method runs it."""
    return method_for(quant_config, prefix, METHODS, UnquantizedLinearMethod, lambda spec: (
        f"no linear method stores weights as {spec.quant_dtype}: this build runs fp8 (float8_e4m3fn), "
        "int8, int4 (packed) and mxfp4 (fp4x2)"))


def is_unquantized(m: nn.Module) -> bool:
    """Whether `m` holds a plain weight matrix the unquantized product reads (a linear layer
    with the unquantized method, or the LM head)."""
    return isinstance(getattr(m, "method", None), UnquantizedLinearMethod)


def describe_layers(model: nn.Module) -> list[dict]:
    """One dict per layer with a linear method: layer, class, method, format, shape, bytes,
    kernel (what runs the product, for methods that say: `method.kernel_for(layer)` or
    `method.kernel`, else None) (`atom.viz.frames.linear_methods_frame` turns it into a DataFrame)."""
    rows = []
    for name, m in model.named_modules():
        method = getattr(m, "method", None)
        if isinstance(method, LinearMethod):
            w = getattr(m, "weight", None)
            if hasattr(m, "out_features"):  # the logical shape, also for packed weights
                shape = (m.out_features, m.in_features)
            else:
                shape = tuple(w.shape) if w is not None else None
            rows.append({"layer": name, "class": type(m).__name__, "method": method.name,
                         "format": method.format(m), "bytes": method.weight_bytes(m), "shape": shape,
                         "kernel": method.kernel_for(m) if hasattr(method, "kernel_for")
                         else getattr(method, "kernel", None)})
    return rows


def reference_only_layers(model: nn.Module, rocm: bool = False) -> list[tuple[str, str]]:
    """(layer, format) of the quantized layers whose method has no GPU kernel for their format:
    linear layers with fp8 weight-only, block weights without their own 1 x bk activation
    groups, W8A16; MoE layers whose experts' format the Triton kernel does not compute (fp8
    with static or per-tensor activations). On a GPU these would run the torch reference,
    dequantizing the weight at every call, so the engine refuses them at load
    (`refuse_reference_layers`); the CPU runs every format through its reference. `rocm`:
    every quantized linear and MoE layer (`common.use_kernels`: the kernels read NVIDIA's
    e4m3fn and never ran on ROCm)."""
    modules = dict(model.named_modules())
    slow = [(r["layer"], r["format"]) for r in describe_layers(model) if r["kernel"] == REFERENCE_KERNEL
            or (rocm and isinstance(modules[r["layer"]].method, QuantLinearMethod))]
    from atom.model_ops.moe import FusedMoE  # (moe imports this package)
    slow += [(name, m.method.format(m)) for name, m in modules.items()
             if isinstance(m, FusedMoE) and (not getattr(m.method, "triton_fits", True)
                                             or (rocm and m.method.name != "unquantized"))]
    return slow


def refuse_reference_layers(model: nn.Module, skip=(), rocm: bool = False) -> None:
    """Raises NotImplementedError naming the layers `reference_only_layers` finds (how many,
    the first few, each with its format), but those in `skip` (what online quantization
    re-quantizes): a format without a kernel on the platform fails at load instead of running
    slowly through the reference. Called before any weight loads."""
    skip = set(skip)
    slow = [(name, fmt) for name, fmt in reference_only_layers(model, rocm) if name not in skip]
    platform = "ROCm" if rocm else "this GPU"
    if slow:
        shown = "; ".join(f"{name} ({fmt})" for name, fmt in slow[:3]) + ("; ..." if len(slow) > 3 else "")
        raise NotImplementedError(
            f"{len(slow)} quantized layer(s) have a format without a kernel on {platform}: {shown}. "
            + ("ROCm runs no quantized linear kernel yet. " if rocm else
               "On a GPU, fp8 linears need dynamic per-token / per-tensor activations (block weights: "
               "1 x block-width groups), int8 needs W8A8 per-token activations, fp8 experts need dynamic "
               "per-token or group activations. ")
            + "Exclude these layers in the quantization config "
            "('ignore' / 'exclude'), use a format with a kernel, or run on the CPU (CUDA_VISIBLE_DEVICES=''), "
            "where every format runs its torch reference")
