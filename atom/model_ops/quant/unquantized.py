"""The unquantized linear method: weights in the model's dtype, x W^T (+ b).

Where the product runs:
- CPU, fp32: oneDNN's matmul (faster than `F.linear`'s BLAS call on the embedded model's
  shapes: `python -m atom.benchmarks.cpu_gemm`; figures in docs/perf/raw).
- GPU, one row (batch-1 decode), a shape where the engine's kernel plan chose it: the Triton
  GEMV (`kernels.gemv`).
- GPU otherwise: the Triton GEMM when the plan says so (ATOM_USE_TRITON_GEMM), else the
  cuBLASLt algorithm the plan chose for this shape, else `F.linear` (cuBLAS / hipBLASLt).
  Under torch.compile (levels 1-3) the product is the `atom::plan_linear` op, which makes
  the same choice when it runs: the plan's cuBLASLt algorithms are chosen after compilation
  and hold for the compiled prefill steps too (Inductor's own product is cuBLAS's default).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from atom.model_ops.quant.base import LinearMethod
from atom.tuning.plan import plan_for

_ONEDNN = torch.backends.mkldnn.is_available()


def library_product(plan, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) where no GEMV is chosen (also the GEMV choice's unfused baseline)."""
    if x.is_cpu or torch.compiler.is_compiling() or plan is None:
        return F.linear(x, w, bias)
    if plan.triton_gemm and x.dtype == w.dtype:
        from atom.model_ops.kernels.gemm import gemm
        return gemm(x, w, bias)
    if bias is None and (y := plan.lt_product(x, w)) is not None:
        return y
    return F.linear(x, w, bias)


@torch.library.custom_op("atom::plan_linear", mutates_args=())
def plan_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plan_handle: int) -> torch.Tensor:
    """`library_product` with the plan of handle `plan_handle`, as one op in a compiled graph."""
    return library_product(plan_for(plan_handle), x, weight, bias)


@plan_linear.register_fake
def _(x, weight, bias, plan_handle):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, plan=None) -> torch.Tensor:
    """x W^T (+ b) by the rules in the module docstring; `plan`: the engine's `KernelPlan`."""
    if torch.compiler.is_compiling():
        # only what is fixed for the engine's life is read here (no guard on the plan's choices)
        if plan is not None and x.is_cuda and x.dtype == weight.dtype:
            return torch.ops.atom.plan_linear(x, weight, bias, plan.handle)
        return F.linear(x, weight, bias)
    if x.is_cpu:
        if _ONEDNN and x.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    elif plan is not None and bias is None and (cfg := plan.one_row_config(x, weight, "plain")) is not None:
        from atom.model_ops.kernels.gemv import gemv
        return gemv(x, weight, cfg)
    return library_product(plan, x, weight, bias)


class UnquantizedLinearMethod(LinearMethod):
    name = "unquantized"

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        layer.weight.output_dim, layer.weight.input_dim = 0, 1  # how it shards (model_ops.linear)
        if bias:
            layer.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            layer.bias.weight_loader = layer.weight_loader
            layer.bias.output_dim, layer.bias.input_dim = 0, None
        else:
            layer.register_parameter("bias", None)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return dense(x, layer.weight, layer.bias, layer.plan)

    def format(self, layer: nn.Module) -> str:
        return str(layer.weight.dtype).removeprefix("torch.")
