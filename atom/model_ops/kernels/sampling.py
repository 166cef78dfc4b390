"""Temperature sampling in one pass over the logits (Gumbel-max), the vocab split over programs.

``argmax(logits / T + G)`` with ``G = -log(-log(U))``, ``U ~ Uniform(0, 1)`` draws a token with
probability ``softmax(logits / T)``; a row with ``T = 0`` takes the plain argmax. The logits
are read once, in their own dtype (bf16 straight from the LM head), instead of the torch
path's float copy, softmax, noise tensor, division and argmax (six passes over a
[rows, vocab] fp32 tensor). The noise comes from Philox (four uniforms per call, counted per
row and 2048-column block), so a draw does not depend on how the vocab is split.

Work split: each row's vocab is cut into chunks so that rows x chunks fills the GPU (one
program per row left 2 waves of 8-warp programs walking 63 blocks each at 200 rows x 128k
vocab: ~200 us, latency-bound); each program keeps its chunk's best (value, index), and a
second small kernel picks the row's winner (ties: the lowest index, like ``argmax``).
Rows that need top-k / top-p or their own generator use the torch sampler.
"""

from __future__ import annotations

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton

_BLOCK = 2048
_TARGET_PROGRAMS = 512  # ~4 per SM on an H200


if HAS_TRITON:

    @triton.jit
    def _take(base, cols, hi, u, t, inv_t, best_v, best_i, GREEDY: tl.constexpr):
        """Fold the columns `cols` (with uniforms `u`) into each lane's best (value, index)."""
        ok = cols < hi
        x = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if not GREEDY:  # Gumbel noise -ln(-ln u), through log2
            u = tl.minimum(tl.maximum(u, 1e-20), 0.99999994)
            g = -0.6931471805599453 * tl.log2(-0.6931471805599453 * tl.log2(u))
            x = tl.where(t > 0, x * inv_t + g, x)
        x = tl.where(ok, x, float("-inf"))
        better = x > best_v  # strict: among equal values the first (lowest) column stays
        return tl.where(better, x, best_v), tl.where(better, cols, best_i)

    # The split depends on the batch size; its numbers are not specialised on, so that a
    # batch size seen for the first time does not compile a new kernel variant mid-run.
    @triton.jit(do_not_specialize=["seed", "chunk", "num_chunks"])
    def _gumbel_chunk_kernel(logits_ptr, stride_row, temp_ptr, best_v_ptr, best_i_ptr, V, seed,
                             chunk, num_chunks, BLOCK: tl.constexpr, GREEDY: tl.constexpr):
        # One Philox call gives four uniforms: a BLOCK of columns is four sub-blocks of Q,
        # counter (row, start / 4 + lane) -> columns start + {0, 1, 2, 3} * Q + lane.
        Q: tl.constexpr = BLOCK // 4
        row = tl.program_id(0)
        c = tl.program_id(1)
        if GREEDY:
            t = 0.0
        else:
            t = tl.load(temp_ptr + row).to(tl.float32)
        inv_t = 1.0 / tl.where(t > 0, t, 1.0)
        base = logits_ptr + row.to(tl.int64) * stride_row
        row_counters = row * (tl.cdiv(V, BLOCK) * Q)
        lane = tl.arange(0, Q)
        best_v = tl.full([Q], float("-inf"), tl.float32)
        best_i = tl.zeros([Q], tl.int32)
        lo = c * chunk
        hi = tl.minimum(lo + chunk, V)
        for start in range(lo, hi, BLOCK):
            if GREEDY:
                u0 = tl.zeros([Q], tl.float32)
                u1 = u0
                u2 = u0
                u3 = u0
            else:
                u0, u1, u2, u3 = tl.rand4x(seed, row_counters + start // 4 + lane)
            best_v, best_i = _take(base, start + lane, hi, u0, t, inv_t, best_v, best_i, GREEDY)
            best_v, best_i = _take(base, start + Q + lane, hi, u1, t, inv_t, best_v, best_i, GREEDY)
            best_v, best_i = _take(base, start + 2 * Q + lane, hi, u2, t, inv_t, best_v, best_i, GREEDY)
            best_v, best_i = _take(base, start + 3 * Q + lane, hi, u3, t, inv_t, best_v, best_i, GREEDY)
        top = tl.max(best_v, 0)
        idx = tl.min(tl.where(best_v == top, best_i, V), 0)  # ties: the lowest index
        tl.store(best_v_ptr + row * num_chunks + c, top)
        tl.store(best_i_ptr + row * num_chunks + c, idx)

    @triton.jit(do_not_specialize=["num_chunks"])
    def _pick_chunk_kernel(best_v_ptr, best_i_ptr, out_ptr, V, num_chunks, CHUNKS_PAD: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, CHUNKS_PAD)
        ok = offs < num_chunks
        v = tl.load(best_v_ptr + row * num_chunks + offs, mask=ok, other=float("-inf"))
        i = tl.load(best_i_ptr + row * num_chunks + offs, mask=ok, other=V)
        top = tl.max(v, 0)
        idx = tl.min(tl.where(v == top, i, V), 0)
        tl.store(out_ptr + row, idx.to(tl.int64))


def split_vocab(rows: int, V: int, block: int = _BLOCK, target: int | None = None) -> tuple[int, int]:
    """(chunk, num_chunks): the vocab cut into block-aligned chunks, ~`target` programs in all."""
    target = _TARGET_PROGRAMS if target is None else target
    blocks = -(-V // block)
    want = min(blocks, max(1, -(-target // max(rows, 1))))
    chunk = -(-blocks // want) * block
    return chunk, -(-V // chunk)


def gumbel_sample(logits: torch.Tensor, temperatures: torch.Tensor | None, seed: int = 0) -> torch.Tensor:
    """logits [S, V] (any float dtype, unit column stride), temperatures [S] (0 = greedy;
    None = all greedy, no noise computed) -> sampled ids [S] int64. `seed` selects the noise
    (a new one per step). NaN logits are never chosen (torch.argmax would return a NaN's index)."""
    if not HAS_TRITON:
        raise RuntimeError("gumbel_sample needs triton; use gumbel_sample_ref without it")
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with a contiguous last dim, got {tuple(logits.shape)}")
    S, V = logits.shape
    if temperatures is not None and temperatures.shape != (S,):
        raise ValueError(f"temperatures must be [{S}], got {tuple(temperatures.shape)}")
    if temperatures is not None and S * V >= 2**31:
        raise ValueError(f"rows x vocab = {S * V} exceeds the kernel's 32-bit noise counter")
    out = torch.empty(S, dtype=torch.int64, device=logits.device)
    if S == 0:
        return out
    chunk, n = split_vocab(S, V)
    best_v = torch.empty((S, n), dtype=torch.float32, device=logits.device)
    best_i = torch.empty((S, n), dtype=torch.int32, device=logits.device)
    greedy = temperatures is None
    _gumbel_chunk_kernel[(S, n)](logits, logits.stride(0), logits if greedy else temperatures,
                                 best_v, best_i, V, int(seed) & 0x7FFFFFFF, chunk, n,
                                 BLOCK=_BLOCK, GREEDY=greedy, num_warps=8)
    _pick_chunk_kernel[(S,)](best_v, best_i, out, V, n,
                             CHUNKS_PAD=max(2, triton.next_power_of_2(-(-V // _BLOCK))), num_warps=1)
    return out


def gumbel_sample_ref(logits: torch.Tensor, temperatures: torch.Tensor, generator=None) -> torch.Tensor:
    """Torch reference: the same distribution (not the same draws: torch's own noise)."""
    x = logits.float()
    u = torch.rand(x.shape, device=x.device, generator=generator).clamp_min(1e-20)
    t = temperatures.float()[:, None]
    y = x / torch.where(t > 0, t, 1.0) + torch.where(t > 0, -torch.log(-torch.log(u)), 0.0)
    return y.argmax(dim=-1)
