"""The kernels the layers call on ROCm when `aiter` imports (`atom.platform` chose "aiter").

AITER's own kernels serve RMSNorm, the fused residual-add + RMSNorm and SiLU-and-mul; every
other name (attention over the paged cache, rotary with the K/V write, GEMVs, sampling)
resolves to the Triton kernels of `atom.model_ops.kernels`, which run on ROCm as they are.
The functions here keep the Triton kernels' signatures and results, so a layer does not
know which library served it.

AITER's calling conventions used (its Python API, `aiter/ops/rmsnorm.py` and
`aiter/ops/activation.py`): `rmsnorm2d_fwd(input, weight, epsilon) -> out` on 2-D input;
`rmsnorm2d_fwd_with_add(out, input, residual_in, residual_out, weight, epsilon)` writes
`out = rmsnorm(input + residual_in) * weight` and `residual_out = input + residual_in`;
`silu_and_mul(out, input)` writes `silu(input[..., :d]) * input[..., d:]`. Arguments after
`epsilon` are left to their defaults (their order changed between AITER releases).
Not run on AMD hardware in this repository's CI: the tests drive these functions through
a stand-in `aiter` module with those conventions.
"""
from __future__ import annotations

import aiter
import torch

from atom.model_ops import kernels as _triton
from atom.model_ops.kernels.rmsnorm import as_rows, check_norm_args


def _weight(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The norm weight as AITER wants it: contiguous, in the activations' dtype."""
    return weight.to(x.dtype).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, inplace: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (any leading shape), as `kernels.rms_norm`."""
    check_norm_args(x, weight)
    if x.numel() == 0:
        return x if inplace else torch.empty_like(x)
    out = aiter.rmsnorm2d_fwd(as_rows(x).contiguous(), _weight(weight, x), eps).view(x.shape)  # (rows of a wider tensor)
    return x.copy_(out) if inplace else out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       inplace: bool = False):
    """(RMSNorm(x + residual), x + residual), as `kernels.fused_add_rms_norm`. A residual in
    another dtype than x (AITER requires the same) goes to the Triton kernel."""
    if residual.dtype != x.dtype:
        return _triton.fused_add_rms_norm(x, residual, weight, eps, inplace)
    check_norm_args(x, weight, residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rout = torch.empty_like(out)
    if x.numel():
        aiter.rmsnorm2d_fwd_with_add(as_rows(out), as_rows(x), as_rows(residual).contiguous(), as_rows(rout),
                                     _weight(weight, x), eps)
    if inplace:
        return x.copy_(out), residual.copy_(rout)
    return out, rout


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:], as `kernels.silu_and_mul` (an `out`
    that is not contiguous is filled through a contiguous buffer: AITER writes rows densely)."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension, got {x.shape[-1]}")
    shape = (*x.shape[:-1], x.shape[-1] // 2)
    dense = out if out is not None and out.is_contiguous() else torch.empty(shape, dtype=x.dtype, device=x.device)
    if dense.numel():
        aiter.silu_and_mul(dense, x.contiguous())
    if out is None or out is dense:
        return dense
    return out.copy_(dense)


def __getattr__(name: str):
    """Everything AITER does not serve here: the Triton kernel of that name."""
    return getattr(_triton, name)
