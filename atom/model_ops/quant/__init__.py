"""Linear methods, one per weight format, chosen per layer from the quantization config.

    method = linear_method_for(quant_config, "model.layers.0.self_attn.qkv_proj")
    describe_layers(model)    # one row per linear layer: layer, method, format, bytes

This build has the unquantized method; a layer whose spec asks for a quantized format is
refused when the model is built, before any weight loads, naming the layer and the format.
"""
from __future__ import annotations

from torch import nn

from atom.model_ops.quant.base import LinearMethod
from atom.model_ops.quant.unquantized import UnquantizedLinearMethod, dense, library_product

__all__ = ["LinearMethod", "UnquantizedLinearMethod", "linear_method_for", "describe_layers",
           "is_unquantized", "dense", "library_product"]


def linear_method_for(quant_config, prefix: str) -> LinearMethod:
    """The method for the layer at `prefix`: its spec from `quant_config` (None: unquantized)."""
    spec = quant_config.get_layer_quant_config(prefix) if quant_config is not None else None
    if spec is None or not spec.is_quantized:
        return UnquantizedLinearMethod()
    raise NotImplementedError(
        f"layer '{prefix}' asks for quant_type={spec.quant_type.name} ({spec.quant_dtype}); "
        "quantized kernels are not in this build: use an unquantized checkpoint")


def is_unquantized(m: nn.Module) -> bool:
    """Whether `m` holds a plain weight matrix the unquantized product reads (a linear layer
    with the unquantized method, or the LM head)."""
    return isinstance(getattr(m, "method", None), UnquantizedLinearMethod)


def describe_layers(model: nn.Module) -> list[dict]:
    """One dict per layer with a linear method: layer, class, method, format, shape, bytes
    (`atom.viz.frames.linear_methods_frame` turns it into a DataFrame)."""
    rows = []
    for name, m in model.named_modules():
        method = getattr(m, "method", None)
        if isinstance(method, LinearMethod):
            w = getattr(m, "weight", None)
            rows.append({"layer": name, "class": type(m).__name__, "method": method.name,
                         "format": method.format(m), "bytes": method.weight_bytes(m),
                         "shape": tuple(w.shape) if w is not None else None})
    return rows
