"""The split-KV merge inside the attention kernel: the last segment of a decode token and kv
head to finish combines the segments' partials, instead of a second launch (`_merge_kernel`).

A decode step with few sequences cuts each context into `NUM_SPLITS` segments, one program
each (`triton_unified`): every program stores its normalised partial output and log-sum-exp,
then counts itself in on an int32 counter of its (query block, kv head) with one atomic add.
Before the add a block barrier orders the program's stores; the add releases them and acquires
the others' at GPU scope (the order CUTLASS's split-K semaphore relies on). The program that
reads `n_seg - 1` is the last: it sets the counter back to 0 (the next launch, graph replays
and the next layer reuse it) and merges its kv head's `QPKV` query heads, reading the partials
past L1 (`.cg`), as `_merge_kernel` does: per head, m = the largest log-sum-exp, weights
2^(lse - m) (an empty segment's -inf gives 0), the weighted partials summed and divided by the
weights' sum; the head's amax as stored too where a product quantizes on load.

`n_seg` is `NUM_SPLITS`, or with `triton_unified.SKIP_EMPTY_SEGMENTS` (opt-in) the segments
that have keys: a short context fills only the first `ceil(tiles / ceil(tiles / NUM_SPLITS))`
(whole tiles a segment), every program computes that count from the sequence's length, and
the ones past it store nothing and do not count themselves in; the merge then reads only the
first `n_seg` partials (`FEWER`).

The rows merge `S_CHUNK` segments at a time (`merge_chunk`), so that a chunk's partials stay
near 64 registers a thread; the chunks' loads do not depend on each other. Decode steps only:
a query block then holds one token, so a program merges `QPKV` rows, not `BLOCK_M`.

The counters come from the engine's `AttentionWorkspace` (`arrivals`); the kernel plan's
"merge_in_attention" asks for this path (`unified_attention(merge_in_kernel=True)`).
"""
from __future__ import annotations

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton
from atom.utils.pow2 import next_pow2

#: partial elements (fp32) a chunk of the merge loads at most: 64 a thread over 4 warps
MERGE_CHUNK_ELEMS = 8192


def merge_chunk(qpkv: int, num_splits: int, head_pad: int) -> int:
    """Segments a chunk of the in-kernel merge takes: a power of two dividing `num_splits`,
    at most `MERGE_CHUNK_ELEMS` partial values (`qpkv` heads padded to a power of two)."""
    qpad = next_pow2(qpkv)
    chunk = num_splits
    while chunk > 1 and qpad * chunk * head_pad > MERGE_CHUNK_ELEMS:
        chunk //= 2
    return chunk


if HAS_TRITON:

    @triton.jit
    def arrive_last(cnt_ptr, n_seg):
        """Count this program in on its counter; True in the last of the `n_seg` that arrive,
        which also sets the counter back to 0. The program's stores come before the count
        (block barrier, then an acq_rel atomic at GPU scope)."""
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        last = arrived == n_seg - 1
        if last:
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
        return last

    @triton.jit
    def merge_heads(out_ptr, po_ptr, plse_ptr, amax_ptr, tok, head0,
                    stride_ot, stride_oh, stride_pot, stride_poh, stride_pos, stride_plt, stride_plh, stride_am, n_seg,
                    QPKV: tl.constexpr, QPAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, S_CHUNK: tl.constexpr, HAS_AMAX: tl.constexpr,
                    FEWER: tl.constexpr = False):
        """Token `tok`'s heads head0 .. head0 + QPKV - 1: their partials combined into `out`
        (and each head's amax as stored), `_merge_kernel`'s arithmetic. FEWER: only the first
        `n_seg` segments stored theirs (the others had no keys), so only those are read."""
        offs_h = tl.arange(0, QPAD)
        offs_s = tl.arange(0, NUM_SPLITS)
        offs_d = tl.arange(0, HEAD_PAD)
        h_ok = offs_h < QPKV
        d_ok = offs_d < HEAD_DIM
        head = head0 + offs_h
        lse_row = plse_ptr + tok * stride_plt + head * stride_plh
        lse_ok = h_ok[:, None]
        if FEWER:
            lse_ok = lse_ok & (offs_s < n_seg)[None, :]
        lse = tl.load(lse_row[:, None] + offs_s[None, :], mask=lse_ok, other=float("-inf"), cache_modifier=".cg")
        m = tl.max(lse, 1)
        m = tl.where(m == float("-inf"), 0.0, m)
        denom = tl.sum(tl.exp2(lse - m[:, None]), 1)
        denom = tl.where(denom == 0.0, 1.0, denom)
        po_row = po_ptr + tok * stride_pot + head * stride_poh
        acc = tl.zeros([QPAD, HEAD_PAD], tl.float32)
        for c in tl.static_range(NUM_SPLITS // S_CHUNK):
            offs_c = c * S_CHUNK + tl.arange(0, S_CHUNK)
            w_ok = h_ok[:, None]
            po_ok = h_ok[:, None, None] & d_ok[None, None, :]
            if FEWER:
                w_ok = w_ok & (offs_c < n_seg)[None, :]
                po_ok = po_ok & (offs_c < n_seg)[None, :, None]
            w = tl.exp2(tl.load(lse_row[:, None] + offs_c[None, :], mask=w_ok, other=float("-inf"),
                                cache_modifier=".cg") - m[:, None])
            po = tl.load(po_row[:, None, None] + offs_c[None, :, None] * stride_pos + offs_d[None, None, :],
                         mask=po_ok, other=0.0, cache_modifier=".cg")
            acc += tl.sum(tl.where((w > 0.0)[:, :, None], po * w[:, :, None], 0.0), 1)
        o = (acc / denom[:, None]).to(out_ptr.dtype.element_ty)
        st = h_ok[:, None] & d_ok[None, :]
        tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + offs_d[None, :], o, mask=st)
        if HAS_AMAX:
            tl.store(amax_ptr + tok * stride_am + head, tl.max(tl.where(st, tl.abs(o.to(tl.float32)), 0.0), 1),
                     mask=h_ok)
