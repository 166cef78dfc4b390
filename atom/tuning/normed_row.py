"""`NormedRow`: a decoder layer's output whose residual add and the next layer's RMSNorm input
were written by the layer's last product (the kernel plan's "w4_down_add_norm").

At one row the next layer's norm only needs h = down(y) + residual, which down's epilogue
has in registers: the 4-bit one-row GEMV adds the residual there and writes h w (w the next
layer's `input_layernorm` weight) as a plain 16-bit row with each program's sum of h^2
(`w4_gemv1.w4_gemv1_add_row`, EPI_ROW). The next q/k/v product is then the plain one-row GEMV
on that row, scaled by 1 / rms at its end (`w4_gemv1_rsq`, RSQ), instead of the GEMV with the
norm inside (`w4_gemv1_fused`), whose loop also adds, squares and weights x column by column.
The layer returns (NormedRow, h): h is the residual stream as the unfused add rounds it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class NormedRow:
    """h w [1, H] in the activations' dtype, the programs' sums of h^2 (float32), and the eps
    of the norm whose weight w is."""
    hw: torch.Tensor
    sums: torch.Tensor
    eps: float

    @property
    def shape(self) -> torch.Size:
        return self.hw.shape

    def as_input(self, residual: torch.Tensor) -> torch.Tensor:
        """A hidden state for a layer that cannot take the row: zeros, so that its norm of
        hidden + residual is the norm of h itself (residual is h; x + 0 = x in any float)."""
        return torch.zeros_like(residual)

    def __repr__(self) -> str:
        return (f"NormedRow(shape={tuple(self.hw.shape)}, dtype={self.hw.dtype}, sums={self.sums.numel()}, "
                f"eps={self.eps})")
