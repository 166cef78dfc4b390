"""Temperature sampling in one pass over the logits (Gumbel-max), one program per row.

``argmax(logits / T + G)`` with ``G = -log(-log(U))``, ``U ~ Uniform(0, 1)`` draws a token with
probability ``softmax(logits / T)``; a row with ``T = 0`` takes the plain argmax. The logits
are read once, in their own dtype (bf16 straight from the LM head), instead of the torch
path's float copy, softmax, noise tensor, division and argmax (six passes over a
[rows, vocab] fp32 tensor). The noise comes from Philox counters ``(seed, row * V + col)``.
Rows that need top-k / top-p or their own generator use the torch sampler.
"""

from __future__ import annotations

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit(do_not_specialize=["seed"])
    def _gumbel_argmax_kernel(logits_ptr, stride_row, temp_ptr, out_ptr, V, seed,
                              BLOCK: tl.constexpr):
        row = tl.program_id(0)
        t = tl.load(temp_ptr + row).to(tl.float32)
        inv_t = 1.0 / tl.where(t > 0, t, 1.0)
        base = logits_ptr + row.to(tl.int64) * stride_row
        best_v = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < V
            x = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32)
            u = tl.rand(seed, row * V + cols)
            g = -tl.log(-tl.log(tl.minimum(tl.maximum(u, 1e-20), 0.99999994)))
            x = tl.where(t > 0, x * inv_t + g, x)
            x = tl.where(ok, x, float("-inf"))
            better = x > best_v
            best_v = tl.where(better, x, best_v)
            best_i = tl.where(better, cols, best_i)
        top = tl.max(best_v, 0)
        idx = tl.min(tl.where(best_v == top, best_i, V), 0)  # ties: the lowest index, like argmax
        tl.store(out_ptr + row, idx.to(tl.int64))


def gumbel_sample(logits: torch.Tensor, temperatures: torch.Tensor, seed: int) -> torch.Tensor:
    """logits [S, V] (any float dtype, unit column stride), temperatures [S] (0 = greedy)
    -> sampled ids [S] int64. `seed` selects the noise (a new one per step)."""
    if not HAS_TRITON:
        raise RuntimeError("gumbel_sample needs triton; use gumbel_sample_ref without it")
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with a contiguous last dim, got {tuple(logits.shape)}")
    S, V = logits.shape
    if temperatures.shape != (S,):
        raise ValueError(f"temperatures must be [{S}], got {tuple(temperatures.shape)}")
    if S * V >= 2**31:
        raise ValueError(f"rows x vocab = {S * V} exceeds the kernel's 32-bit noise counter")
    out = torch.empty(S, dtype=torch.int64, device=logits.device)
    if S == 0:
        return out
    _gumbel_argmax_kernel[(S,)](logits, logits.stride(0), temperatures, out, V, int(seed) & 0x7FFFFFFF,
                                BLOCK=2048, num_warps=8)
    return out


def gumbel_sample_ref(logits: torch.Tensor, temperatures: torch.Tensor, generator=None) -> torch.Tensor:
    """Torch reference: the same distribution (not the same draws: torch's own noise)."""
    x = logits.float()
    u = torch.rand(x.shape, device=x.device, generator=generator).clamp_min(1e-20)
    t = temperatures.float()[:, None]
    y = x / torch.where(t > 0, t, 1.0) + torch.where(t > 0, -torch.log(-torch.log(u)), 0.0)
    return y.argmax(dim=-1)
