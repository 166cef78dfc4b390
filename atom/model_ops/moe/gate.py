"""`Fp32Gate`: a router projection whose logits are fp32 (DeepSeek keeps its gate in fp32).

The reference is an fp32 product: `F.linear(x.float(), weight)`, which on a GPU casts the
activations and runs an fp32 GEMM. Where the weight's values are exactly those of the model
dtype (a checkpoint saved in bf16 holds nothing finer) the same logits come from one bf16
GEMM with fp32 accumulation and fp32 output: a product of two bf16 numbers is exact in fp32,
so only the order of the fp32 sums differs. `finish_loading` keeps that bf16 copy when it is
exact; the forward uses it on GPUs where the engine's plan runs kernels, outside
torch.compile (Inductor fuses the reference's cast itself).
"""
from __future__ import annotations

import torch
from torch import nn

from atom.model_ops import kernel_backend


class Fp32Gate(nn.Module):
    """weight [num_experts, hidden] in fp32; forward(x [T, hidden]) -> logits [T, num_experts] fp32."""

    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.lowp_weight: torch.Tensor | None = None  # the exact copy in the model dtype, if any

    def finish_loading(self, dtype: torch.dtype) -> None:
        """Keep the weight in `dtype` (bf16 / fp16) where that copy holds exactly its values."""
        self.lowp_weight = None
        if dtype in (torch.bfloat16, torch.float16):
            lowp = self.weight.detach().to(dtype)
            if torch.equal(lowp.float(), self.weight.detach().float()):
                self.lowp_weight = lowp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.lowp_weight
        if (w is not None and x.dtype == w.dtype and x.is_cuda and x.dim() == 2
                and kernel_backend.get(x) is not None):
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        return nn.functional.linear(x.float(), self.weight.float())

    def extra_repr(self) -> str:
        e, h = self.weight.shape
        lowp = f", {str(self.lowp_weight.dtype).removeprefix('torch.')} GEMM" if self.lowp_weight is not None else ""
        return f"experts={e}, hidden={h}, fp32 logits{lowp}"
