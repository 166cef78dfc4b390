"""Rows whose per-row quantization has not run yet: the kernel in front stored them in the
activations' dtype beside partial amaxes, and the 8-bit product that reads them quantizes
each K step where it loads it (`quant_gemv_dot`'s QUANT_X with PARTS), with the row's scale
taken from the partials: no quantizer launch in between (the kernel plan's "quant_on_load":
SiLU-and-mul's split kernel in front of down, `act_quant_fused.silu_amax`).

The invariant: the largest partial of a row is the amax of its values as stored, so that
scale = max(amax, 1e-12) / qmax and the quantized values are `act_quant`'s, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PendingQuant:
    """`h` [M, K] (contiguous rows, the activations' dtype) and `pmax` fp32 [M, P], whose
    max over P is each row's amax; `kind` "fp8" / "int8" and `qmax` as `act_quant` takes
    them. `quantize()` runs the quantizer ((q [M, K], scales [M, 1])); a swap-AB product
    reads it as it is."""
    h: torch.Tensor
    pmax: torch.Tensor
    kind: str
    qmax: float

    @property
    def shape(self) -> torch.Size:
        return self.h.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.h.dtype

    @property
    def device(self) -> torch.device:
        return self.h.device

    @property
    def is_cuda(self) -> bool:
        return self.h.is_cuda

    def quantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        from atom.model_ops.kernels.act_quant_fused import quant_from_partials
        return quant_from_partials(self.h, self.pmax, self.kind, self.qmax)

    def __repr__(self) -> str:
        return (f"PendingQuant({self.kind}, rows={tuple(self.h.shape)} {str(self.h.dtype)[6:]}, "
                f"partials={self.pmax.shape[-1]})")
