"""Linear methods, one per weight format, chosen per layer from the quantization config.

    method = linear_method_for(quant_config, "model.layers.0.self_attn.qkv_proj")
    describe_layers(model)    # one row per linear layer: layer, method, format, bytes

Methods: unquantized (`unquantized.py`), fp8 per-tensor / per-channel / block (`fp8.py`),
int8 W8A8 (`int8.py`), int4 W4A16 (`int4.py`: compressed-tensors pack-quantized and Quark's
transposed int4), MXFP4 weight-only or with dynamic MXFP4 activations (`mxfp4.py`, which also
holds the MXFP4 numerics: `quantize_mxfp4`, `dequantize_mxfp4`, `fake_quant_mxfp4`); the
quantized ones run a torch reference (dequantize, fake-quantize the activations as the format
defines, F.linear) on the CPU, and their Triton / cuBLASLt kernels on an NVIDIA GPU except
for formats without one (`reference_only_layers`; the engine warns about those at load). A
layer whose spec asks for a format without a method (an unknown dtype, a layout or
granularity these files do not run) is refused when the model is built, before any weight
loads, naming the layer and the format.
"""
from __future__ import annotations

import logging

from torch import nn

from atom.model_ops.quant.base import LinearMethod
from atom.model_ops.quant.common import REFERENCE_KERNEL, method_for
from atom.model_ops.quant.fp8 import Fp8LinearMethod
from atom.model_ops.quant.int4 import Int4LinearMethod
from atom.model_ops.quant.int8 import Int8LinearMethod
from atom.model_ops.quant.mxfp4 import Mxfp4LinearMethod
from atom.model_ops.quant.unquantized import UnquantizedLinearMethod, dense, library_product

__all__ = ["LinearMethod", "UnquantizedLinearMethod", "Fp8LinearMethod", "Int8LinearMethod",
           "Int4LinearMethod", "Mxfp4LinearMethod", "linear_method_for", "describe_layers", "is_unquantized",
           "dense", "library_product", "reference_only_layers", "warn_reference_layers"]

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


def reference_only_layers(model: nn.Module) -> list[tuple[str, str]]:
    """(layer, format) of the quantized linear layers whose method has no GPU kernel for their
    format (fp8 weight-only, block weights with per-token activations, W8A16, ...): on a GPU
    they run the torch reference, dequantizing the weight at every call (correct, slow). The
    engine warns about them at load (`ModelRunner`)."""
    return [(r["layer"], r["format"]) for r in describe_layers(model) if r["kernel"] == REFERENCE_KERNEL]


def warn_reference_layers(model: nn.Module) -> None:
    """One warning naming how many layers `reference_only_layers` finds, with the first."""
    slow = reference_only_layers(model)
    if slow:
        logging.getLogger(__name__).warning(
            "%d quantized layer(s) have no GPU kernel for their format and run the torch reference "
            "(the weight dequantized at every call: correct, slow), e.g. %s (%s); "
            "atom.viz.linear_methods_frame(llm) lists each layer's kernel", len(slow), *slow[0])
