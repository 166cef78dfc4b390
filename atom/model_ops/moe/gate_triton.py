"""Router logits in fp32 from bf16 activations and an fp32 gate weight, in one Triton kernel:
what DeepSeek's gate computes (`F.linear(x.float(), W)`, the gate kept in fp32).

Why: in torch that is the cast of x to fp32, then cuBLAS's fp32 GEMM, which at a decode batch
picks a split-K kernel and its reduction: three launches, ~12 us of a MoE layer on an H200.
A program owns BLOCK_T tokens x BLOCK_E experts and walks the hidden size on bf16 tensor
cores: each fp32 weight tile is split into three bf16 parts (w = w1 + w2 + w3: 24 bits of
significand, w up to ~1 ulp), and bf16 x times a bf16 part is exact in fp32, so three bf16 dots
with fp32 accumulation give the fp32 GEMM's logits up to the order of the sums. (`tl.dot` in
"ieee" fp32 precision, the first version, took ~44 us at a 130-token batch: CUDA-core FMAs.)

    logits = router_logits_fp32(x, weight)   # x [T, H] bf16 (other dtypes: the reference), weight [E, H] fp32
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from atom.model_ops import kernel_backend
from atom.model_ops.kernels.kv_cache import interpreted
from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton

#: tile of a program: 16 tokens (tl.dot's smallest rows) x 16 experts, 64 of the hidden size a step
TILE = dict(BLOCK_T=16, BLOCK_E=16, BLOCK_K=64, num_warps=4)

if HAS_TRITON:

    @triton.jit
    def _gate_kernel(x_ptr, w_ptr, out_ptr, T, E, K, stride_xt, stride_we, stride_ot,
                     BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr):
        rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        re = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        t_ok = rt < T
        e_ok = re < E
        acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            x = tl.load(x_ptr + rt.to(tl.int64)[:, None] * stride_xt + rk[None, :],
                        mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + re[:, None] * stride_we + rk[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
            w1 = w.to(tl.bfloat16)
            r = w - w1.to(tl.float32)
            w2 = r.to(tl.bfloat16)
            w3 = (r - w2.to(tl.float32)).to(tl.bfloat16)
            if F32_DOT:  # the interpreter (numpy has no bf16): the same exact operands in fp32
                xf = x.to(tl.float32)
                acc += tl.dot(xf, tl.trans(w1.to(tl.float32)), input_precision="ieee")
                acc += tl.dot(xf, tl.trans(w2.to(tl.float32)), input_precision="ieee")
                acc += tl.dot(xf, tl.trans(w3.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w1))
                acc += tl.dot(x, tl.trans(w2))
                acc += tl.dot(x, tl.trans(w3))
        tl.store(out_ptr + rt.to(tl.int64)[:, None] * stride_ot + re[None, :], acc,
                 mask=t_ok[:, None] & e_ok[None, :])


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The reference: x and the weight in fp32, one fp32 GEMM."""
    return F.linear(x.float(), weight.float())


def router_logits_triton(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """fp32 logits [T, E] of x [T, H] (bf16) and weight [E, H] (fp32) by `_gate_kernel`;
    `config` overrides keys of `TILE` (a sweep's)."""
    if not HAS_TRITON:
        raise RuntimeError("router_logits_triton needs triton; use router_logits_ref without it")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router logits: x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [T, H] and "
                         "[experts, H]")
    if weight.dtype != torch.float32 or x.dtype != torch.bfloat16:
        raise ValueError(f"router logits: weight dtype {weight.dtype} must be torch.float32 and x dtype "
                         f"{x.dtype} torch.bfloat16")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    T, K = x.shape
    E = weight.shape[0]
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    if T == 0:
        return out
    cfg = {**TILE, **(config or {})}
    grid = (triton.cdiv(T, cfg["BLOCK_T"]), triton.cdiv(E, cfg["BLOCK_E"]))
    _gate_kernel[grid](x, weight, out, T, E, K, x.stride(0), weight.stride(0), out.stride(0),
                       F32_DOT=interpreted(), **cfg)
    return out


def router_logits_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 router logits: the Triton kernel for bf16 x where the engine's plan runs kernels for
    x (outside torch.compile, whose graphs keep the torch ops for Inductor), else the reference."""
    if (HAS_TRITON and x.dim() == 2 and x.dtype == torch.bfloat16 and weight.dtype == torch.float32
            and kernel_backend.get(x) is not None):
        return router_logits_triton(x, weight)
    return router_logits_ref(x, weight)
