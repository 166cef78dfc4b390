"""Temperature sampling over the logits on the GPU in two levels: a vocab block by its mass,
then a token inside that block (Gumbel-max at both levels).

``argmax(logits / T + G)``, ``G = -ln(-ln U)`` with ``U ~ Uniform(0, 1)`` per column, draws
a token with probability ``softmax(logits / T)``, but needs a uniform (and two logarithms)
for every column: at 200 rows of a 128k vocab that noise was two thirds of the kernel's time
(docs/perf). Drawing the token in two levels gives the same distribution with ~2k uniforms a
row: the vocab is cut into blocks of 2048 columns; a first pass reads the logits once and
keeps each block's max and sum of ``exp(logits / T - max)``, so ``log S_b`` (the log of the
block's unnormalised mass); the second picks a block by Gumbel-max over ``log S_b`` (block b
with probability ``S_b / Z``) and then a column inside it by Gumbel-max over its logits
(column i with probability ``exp(x_i / T) / S_b``): ``S_b / Z * exp(x_i / T) / S_b`` is
softmax. A row with ``T = 0`` takes the argmax (each block's first maximum, then the first
block holding the row's maximum: ties go to the lowest index, like ``argmax``; a batch with no
temperatures at all keeps one running best per lane over each program's chunk instead, with no
per-block reductions). NaN logits are never chosen (read as -inf); a sampled row takes its
first +inf logit (read as the largest float).

Work split: the first pass cuts each row's vocab into chunks of whole blocks so that rows x
chunks fills the GPU (one program per row left 2 waves of programs walking 63 blocks each at
200 rows x 128k vocab, latency-bound); the second is one program per row. The noise comes from
Philox counted per (row, block) and per (row, column), so a draw does not depend on how the
vocab is split over programs. Rows that need top-k / top-p or their own generator use the
torch sampler.
"""

from __future__ import annotations

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton

_BLOCK = 2048
_TARGET_PROGRAMS = 512  # ~4 per SM on an H200


if HAS_TRITON:

    @triton.jit
    def _gumbel_log2(seed, counters):
        """Standard Gumbel noise in log2 units (-log2(-ln U)) at Philox counters `counters`."""
        u = tl.minimum(tl.maximum(tl.rand(seed, counters), 1e-20), 0.99999994)
        return -tl.log2(-0.6931471805599453 * tl.log2(u))

    @triton.jit
    def _finite(x, scale):
        """x * scale with NaN read as -inf (never chosen) and +inf (or an x / T past the float
        range) as the largest float, so that a block's max and sum stay finite."""
        return tl.where(x == x, tl.minimum(x * scale, 3.4028234663852886e38), float("-inf"))

    # The split depends on the batch size; its numbers are not specialised on, so that a
    # batch size seen for the first time does not compile a new kernel variant mid-run.
    @triton.jit(do_not_specialize=["chunk", "num_slots"])
    def _block_stats_kernel(logits_ptr, stride_row, temp_ptr, max_ptr, sum_ptr, idx_ptr, V, chunk, num_slots,
                            BLOCK: tl.constexpr, GREEDY: tl.constexpr):
        """Per block of BLOCK columns of a row (slot = block): the max of logits / T in log2
        units (x * log2(e) / T) and the sum of 2^(that - max) (T > 0), or the max and its first
        column (T = 0). GREEDY (no temperatures: every row greedy): one slot per chunk, each
        lane keeping its running best and one reduction at the end."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        base = logits_ptr + row.to(tl.int64) * stride_row
        out = row * num_slots
        cols = tl.arange(0, BLOCK)
        lo = c * chunk
        hi = tl.minimum(lo + chunk, V)
        if GREEDY:
            best_v = tl.full([BLOCK], float("-inf"), tl.float32)
            best_i = tl.zeros([BLOCK], tl.int32)
            for start in range(lo, hi, BLOCK):
                x = tl.load(base + start + cols, mask=start + cols < hi, other=float("-inf")).to(tl.float32)
                better = x > best_v  # strict (NaN never is): among equal values the first column stays
                best_v = tl.where(better, x, best_v)
                best_i = tl.where(better, start + cols, best_i)
            top = tl.max(best_v, 0)
            tl.store(max_ptr + out + c, top)
            tl.store(idx_ptr + out + c, tl.min(tl.where(best_v == top, best_i, V), 0))
        else:
            t = tl.load(temp_ptr + row).to(tl.float32)
            sampled = t > 0
            scale = tl.where(sampled, 1.4426950408889634 / tl.where(sampled, t, 1.0), 1.0)
            for start in range(lo, hi, BLOCK):
                x = tl.load(base + start + cols, mask=start + cols < hi, other=float("-inf")).to(tl.float32)
                b = start // BLOCK
                if sampled:
                    x = _finite(x, scale)
                    m = tl.max(x, 0)
                    tl.store(max_ptr + out + b, m)
                    s = tl.sum(tl.exp2(x - m), 0)
                    tl.store(sum_ptr + out + b, tl.where(m == float("-inf"), 0.0, s))
                else:
                    x = tl.where(x == x, x, float("-inf"))
                    m = tl.max(x, 0)
                    tl.store(max_ptr + out + b, m)
                    tl.store(idx_ptr + out + b, tl.min(tl.where(x == m, start + cols, V), 0))

    @triton.jit(do_not_specialize=["seed", "num_slots"])
    def _pick_kernel(logits_ptr, stride_row, temp_ptr, max_ptr, sum_ptr, idx_ptr, out_ptr, V, seed, num_slots,
                     BLOCK: tl.constexpr, BLOCKS_PAD: tl.constexpr, GREEDY: tl.constexpr):
        """A row's token from its slots: T > 0 a block by its mass, then a column in it; T = 0
        the first slot holding the row's max, and that slot's column."""
        row = tl.program_id(0)
        if GREEDY:
            t = 0.0
        else:
            t = tl.load(temp_ptr + row).to(tl.float32)
        blocks = tl.arange(0, BLOCKS_PAD)
        ok = blocks < num_slots
        m = tl.load(max_ptr + row * num_slots + blocks, mask=ok, other=float("-inf"))
        if t > 0:
            # a block by its mass (log2 S_b = max + log2(sum)), then a column inside it
            counters = row * (BLOCKS_PAD + BLOCK)
            s = tl.load(sum_ptr + row * num_slots + blocks, mask=ok, other=0.0)
            w = tl.where(s > 0, m + tl.log2(tl.maximum(s, 1e-30)), float("-inf")) + _gumbel_log2(seed, counters + blocks)
            top = tl.max(w, 0)
            b = tl.min(tl.where(w == top, blocks, BLOCKS_PAD), 0)
            b = tl.minimum(b, num_slots - 1)  # an all -inf row: block 0's first column below
            cols = b * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < V,
                        other=float("-inf")).to(tl.float32)
            x = _finite(x, 1.4426950408889634 / t)
            y = x + _gumbel_log2(seed, counters + BLOCKS_PAD + tl.arange(0, BLOCK))
            best = tl.max(y, 0)
            idx = tl.min(tl.where(y == best, cols, V), 0)
            idx = tl.where(best == float("-inf"), b * BLOCK, idx)
        else:
            top = tl.max(m, 0)
            b = tl.min(tl.where(m == top, blocks, BLOCKS_PAD), 0)
            idx = tl.load(idx_ptr + row * num_slots + tl.minimum(b, num_slots - 1))
            idx = tl.where(top == float("-inf"), 0, idx)
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
    num_blocks = -(-V // _BLOCK)
    blocks_pad = max(2, triton.next_power_of_2(num_blocks))
    if temperatures is not None and S * (blocks_pad + _BLOCK) >= 2**31:
        raise ValueError(f"{S} rows of {V} columns exceed the kernel's 32-bit noise counter")
    out = torch.empty(S, dtype=torch.int64, device=logits.device)
    if S == 0:
        return out
    chunk, n = split_vocab(S, V)
    greedy = temperatures is None
    slots = n if greedy else num_blocks  # all greedy: one (max, column) per chunk
    slot_max = torch.empty((S, slots), dtype=torch.float32, device=logits.device)
    slot_sum = slot_max if greedy else torch.empty_like(slot_max)  # greedy: no sums (never written)
    slot_idx = torch.empty((S, slots), dtype=torch.int32, device=logits.device)
    temps = logits if greedy else temperatures
    _block_stats_kernel[(S, n)](logits, logits.stride(0), temps, slot_max, slot_sum, slot_idx, V, chunk,
                                slots, BLOCK=_BLOCK, GREEDY=greedy, num_warps=8)
    _pick_kernel[(S,)](logits, logits.stride(0), temps, slot_max, slot_sum, slot_idx, out, V,
                       int(seed) & 0x7FFFFFFF, slots, BLOCK=_BLOCK, BLOCKS_PAD=blocks_pad, GREEDY=greedy,
                       num_warps=8)
    return out


def gumbel_sample_ref(logits: torch.Tensor, temperatures: torch.Tensor, generator=None) -> torch.Tensor:
    """Torch reference: the same distribution (not the same draws: torch's own noise)."""
    x = logits.float()
    u = torch.rand(x.shape, device=x.device, generator=generator).clamp_min(1e-20)
    t = temperatures.float()[:, None]
    y = x / torch.where(t > 0, t, 1.0) + torch.where(t > 0, -torch.log(-torch.log(u)), 0.0)
    return y.argmax(dim=-1)
