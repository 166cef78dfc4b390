"""One Triton attention kernel for a whole batch over the paged KV cache.

A single launch serves prefills, chunked-prefill continuations (cached context
plus several new tokens) and decodes.  The batch is described by tensors only:

* ``cu_seqlens_q`` int32 [B+1]: query token offsets of each sequence in ``q``;
* ``seq_lens``     int32 [B]:   total context of each sequence, this step's
  tokens included (their K/V are already in the cache);
* ``block_tables`` int32 [B, max_blocks]: physical block of each logical block.

The i-th new token of sequence b sits at absolute position
``seq_len - query_len + i`` and attends keys ``0 .. position`` (causal).

Work split: a program owns (query block, kv head[, kv segment]).  A query block
packs ``BLOCK_Q`` query tokens times all ``QPKV`` query heads that share the kv
head into the M dimension of the tile, so ``tl.dot`` has M >= 16 even when a
decode brings one token.  The program walks the context ``TILE_N`` keys at a
time through the block table (online softmax, fp32 accumulators, exp2).

Query blocks are numbered ``cu_seqlens_q[b] // BLOCK_Q + b + j``; that bounds
their count by ``T // BLOCK_Q + B`` so the grid depends only on shapes (and on
``max_query_len``, which picks the tile), never on data: the launch can be
captured in a CUDA graph.  A program finds its sequence by binary search.

Order of work: programs are numbered kv head fastest, so the programs of one
sequence start together, in batch order.  The scheduler puts a decode batch's
sequences longest context first (`ScheduledBatch.sort_longest_first`): the long
ones start first and the short ones fill the tail.  On an H200, at 128-256
sequences of ragged contexts (100-2048 tokens), the two together took the kernel
from 3.7-3.9 to 4.0-4.2 TB/s of KV reads (6-11% less time; no change at 64
sequences of 900-2048; `scripts/attention_order.py`).

Split-KV: for small decode batches (``max_query_len == 1``) a 3-D grid cuts each
sequence's context into ``NUM_SPLITS`` segments; each writes a normalised
partial output and its log-sum-exp, and ``_merge_kernel`` combines them (or, with
``merge_in_kernel``, the segment that finishes last: `split_merge`).  The scratch buffers
come from an :class:`AttentionWorkspace` allocated once.

Per layer (:class:`AttentionOptions`): a sliding window W narrows each row to keys
``position - W < j <= position`` (tiles wholly before every row's window are skipped, the
tiles across its lower edge are masked like the diagonal ones); attention sinks (a logit
per query head in the softmax denominator, no value) start each row's online softmax at
``m = sink, l = 1`` (in the first KV segment only, so the split-KV merge counts it once);
an FP8 cache (e4m3 of x / scale) is read as fp8 and converted to the query dtype, with
``k_scale`` folded into the softmax scale and ``v_scale`` into the output; decode batches of
`FP8_WIDE_TILE_MIN_SEQS` sequences or more read it 128 keys a tile.

Decode steps may fold the rotary embedding in (:class:`DecodeRope`): q arrives unrotated
and is rotated in registers (after Qwen3's per-head q norm), and the one program of each
(sequence, kv head) whose tiles end with this step's token rotates that token's key and
writes it and the value into the cache before reading its tiles; the rotary kernel with
its cache write then does not run.

With programmatic dependent launch a program reads the batch description (host-copied) and
prefetches its first K / V tile into L2 before it waits for the kernel in front (the q/k/v
product), so that at small batches, where a program has one or two tiles, the cache's HBM
latency overlaps that kernel's tail; q and every write come after the wait. The merge loads
the partial outputs beside their log-sum-exps.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch

from atom.model_ops.attention.options import AttentionOptions
from atom.model_ops.attention.split_merge import merge_chunk
from atom.model_ops.kernels.kv_cache import FP8_CACHE_DTYPES
from atom.model_ops.kernels.triton_import import HAS_TRITON, pdl_args, tl, triton  # None without triton
from atom.utils.pow2 import next_pow2

if HAS_TRITON:
    from atom.model_ops.attention.split_merge import arrive_last, merge_heads
    from atom.model_ops.kernels.kv_cache import fp8_saturate, interpreted, slot_offset
    from atom.model_ops.kernels.split_k import split_sum_at
    from atom.model_ops.kernels.triton_import import pdl_launch, pdl_wait, prefetch_l2

__all__ = [
    "AttentionOptions",
    "AttentionWorkspace",
    "DecodeRope",
    "unified_attention",
    "paged_attention_ref",
    "pick_attention_config",
]

_LOG2E = 1.4426950408889634

#: Opt-in: under the in-kernel merge, the segments a short context leaves without keys store
#: no partial and do not count themselves in, and the merge reads only the others
#: (`split_merge`). A `config` may set "skip_empty" for one call (refused where no in-kernel
#: merge runs). Not a default: a form whose empty segments returned at once was faster alone at
#: 128-512 tokens of context but slower in batch-1 decode, and this form (with its register cap)
#: is slower alone from 256 tokens on (docs/perf).
SKIP_EMPTY_SEGMENTS = False
#: Registers a thread at most for a launch with SKIP_EMPTY_SEGMENTS (NVIDIA; 0: no cap). Its
#: masks take the Llama-shape decode tile from 115 to 149 registers as compiled for sm90
#: (Triton 3.6; both forms above), 3 programs an SM instead of 4 beside the kernel in front
#: under PDL; at 128 ptxas spills nothing. A `config`'s "maxnreg" wins.
SKIP_EMPTY_MAXNREG = 128

if HAS_TRITON:

    @triton.jit
    def _find_seq(cu_ptr, num_seqs, qblock, BLOCK_Q: tl.constexpr):
        """Largest b with cu[b] // BLOCK_Q + b <= qblock (binary search)."""
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            first = tl.load(cu_ptr + mid) // BLOCK_Q + mid
            if first <= qblock:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _tile_blocks(bt_row, t, kv_end, offs_n, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
        """Block-table entries (int64 [TILE_N]) of tile t's keys; 0 past kv_end (never read
        past the sequence's blocks)."""
        kpos = t * TILE_N + offs_n
        return tl.load(bt_row + kpos // BLOCK_SIZE, mask=kpos < kv_end, other=0).to(tl.int64)

    @triton.jit
    def _prefetch_tile(bt_row, t, kv_end, k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs,
                       HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
        """Tile t's keys and values (those before kv_end: none for a segment past the
        context) into L2: one prefetch per 128-byte line of each row. Issued before the kernel
        waits for the one in front (the block table is host-copied; a line of the cache fetched
        early is never stale, see `prefetch_l2`), so that the tile's loads after the wait find
        it in L2 instead of HBM."""
        BITS: tl.constexpr = k_head.dtype.element_ty.primitive_bitwidth
        LINES: tl.constexpr = (HEAD_PAD * BITS + 1023) // 1024  # 128-byte lines a row (a power of two)
        offs_n = tl.arange(0, TILE_N)
        kpos = t * TILE_N + offs_n
        ok = kpos < kv_end
        blk = _tile_blocks(bt_row, t, kv_end, offs_n, BLOCK_SIZE, TILE_N)
        slot = kpos % BLOCK_SIZE
        line = (tl.arange(0, LINES) * (1024 // BITS))[None, :]
        m = ok[:, None] & (line >= 0)
        prefetch_l2(k_head + (blk * stride_kb + slot * stride_ks)[:, None] + line, m)
        prefetch_l2(v_head + (blk * stride_vb + slot * stride_vs)[:, None] + line, m)

    @triton.jit
    def _tile_step(
        acc, m_i, l_i, q, t, kv_end, q_pos, row_ok, bt_row, k_head, v_head,
        offs_n, offs_d, d_ok, stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, window, blk_ahead,
        BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, PAD_D: tl.constexpr,
        DOT_PREC: tl.constexpr, MASKED: tl.constexpr, SLIDING: tl.constexpr, KV_FP8: tl.constexpr,
        ROWS_AHEAD: tl.constexpr,
    ):
        """One KV tile of online softmax. MASKED: tile crosses the diagonal, kv_end or (SLIDING)
        the lower edge of a row's window. KV_FP8: the cache holds fp8, converted to q's dtype
        (fp16 for bf16 models: the kernel's KV_F16).
        ROWS_AHEAD: `blk_ahead` holds this tile's block-table entries, and the step returns the
        next tile's (loaded here, one iteration before their use), so the K / V loads' addresses
        do not depend on a load of their own iteration: with num_stages >= 3 Triton's pipeliner
        then multi-buffers them (with the block-table load in the same iteration it keeps one
        buffer whatever num_stages, the sm90 TTGIR shows). Otherwise `blk_ahead` is returned
        unchanged."""
        kpos = t * TILE_N + offs_n
        k_ok = kpos < kv_end
        slot = kpos % BLOCK_SIZE
        k_ptrs = k_head + (slot * stride_ks)[None, :] + offs_d[:, None]
        v_ptrs = v_head + (slot * stride_vs)[:, None] + offs_d[None, :]
        if ROWS_AHEAD:
            blk = blk_ahead
            blk_ahead = _tile_blocks(bt_row, t + 1, kv_end, offs_n, BLOCK_SIZE, TILE_N)
        elif MASKED:  # never read block-table entries past the sequence's blocks
            blk = _tile_blocks(bt_row, t, kv_end, offs_n, BLOCK_SIZE, TILE_N)
        else:
            blk = tl.load(bt_row + kpos // BLOCK_SIZE).to(tl.int64)
        if MASKED:
            k = tl.load(k_ptrs + blk[None, :] * stride_kb,
                        mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        else:
            if PAD_D:
                k = tl.load(k_ptrs + blk[None, :] * stride_kb, mask=d_ok[:, None], other=0.0)
            else:
                k = tl.load(k_ptrs + blk[None, :] * stride_kb)  # [HEAD_PAD, TILE_N]
        if KV_FP8:
            k = k.to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PREC) * scale_log2
        if MASKED:
            keep = row_ok[:, None] & k_ok[None, :] & (kpos[None, :] <= q_pos[:, None])
            if SLIDING:
                keep = keep & (kpos[None, :] > q_pos[:, None] - window)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs + blk[:, None] * stride_vb,
                        mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        elif PAD_D:
            v = tl.load(v_ptrs + blk[:, None] * stride_vb, mask=d_ok[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs + blk[:, None] * stride_vb)  # [TILE_N, HEAD_PAD]
        if KV_FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        return acc, m_new, l_i, blk_ahead

    @triton.jit
    def _load_sum(ptrs, mask, SPLITS: tl.constexpr, split_stride, OUT: tl.constexpr):
        """The values at `ptrs`; with SPLITS > 0 those are a split-K product's fp32 partials,
        `split_stride` apart: their sum rounded to OUT, by the reduction's own arithmetic
        (`split_k.split_sum_at`, no bias), so the bits the reduction kernel would store."""
        if SPLITS > 0:  # (one return: Triton 3.6 cannot inline two under a run-time branch)
            x = split_sum_at(ptrs, ptrs, 0, 0, mask, split_stride, SPLITS, False).to(OUT)
        else:
            x = tl.load(ptrs, mask=mask, other=0.0)
        return x

    @triton.jit
    def _rope_rows(row_ptrs, x, pos, mask, offs_d, cs_ptr, stride_cs, w_ptr, eps,
                   HEAD_DIM: tl.constexpr, NORM: tl.constexpr, SPLITS: tl.constexpr, split_stride,
                   OUT: tl.constexpr):
        """Rows x [R, HEAD_PAD] of heads (read at `row_ptrs` [R, 1], through `_load_sum`)
        rotated at positions `pos` [R] (NeoX halves, fp32), after a per-head RMSNorm with
        weight `w_ptr` when NORM: the rotary kernel's math, so both paths give the same values."""
        HALF: tl.constexpr = HEAD_DIM // 2
        low = offs_d < HALF
        partner = tl.where(low, offs_d + HALF, offs_d - HALF)
        x = x.to(tl.float32)
        xp = _load_sum(row_ptrs + partner[None, :], mask, SPLITS, split_stride, OUT).to(tl.float32)
        if NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)
            d_ok = offs_d < HEAD_DIM
            x = x * rstd[:, None] * tl.load(w_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
            xp = xp * rstd[:, None] * tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        half_d = tl.where(low, offs_d, offs_d - HALF)
        cs = cs_ptr + pos.to(tl.int64)[:, None] * stride_cs + half_d[None, :]
        c = tl.load(cs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(cs + HALF, mask=mask, other=0.0).to(tl.float32)
        return tl.where(low[None, :], x * c - xp * s, x * c + xp * s)

    @triton.jit
    def _write_new_kv(kn_ptr, vn_ptr, slot_ptr, tok, pos, k_head, v_head,
                      stride_knt, stride_vnt, stride_kb, stride_ks, stride_vb, stride_vs,
                      offs_d, cs_ptr, stride_cs, kw_ptr, eps, ks_ptr, vs_ptr, split_stride,
                      HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NORM: tl.constexpr,
                      KV_FP8: tl.constexpr, EXACT_ROUND: tl.constexpr, SPLITS: tl.constexpr, OUT: tl.constexpr):
        """Decode with the rotary embedding folded in: this step's key (rotated) and value of
        token `tok` (at `kn_ptr` / `vn_ptr` for this kv head; with SPLITS, a split-K product's
        partials summed on load), into the paged caches at the token's slot (none if < 0);
        into an FP8 cache as x / scale, saturated at +-448."""
        d_ok = (offs_d < HEAD_DIM)[None, :]
        k_row = kn_ptr + tok * stride_knt + tl.zeros([1, 1], tl.int64)
        k = _load_sum(k_row + offs_d[None, :], d_ok, SPLITS, split_stride, OUT)
        k = _rope_rows(k_row, k, tl.zeros([1], tl.int32) + pos, d_ok, offs_d, cs_ptr, stride_cs, kw_ptr, eps,
                       HEAD_DIM, NORM, SPLITS, split_stride, OUT)
        v = _load_sum(vn_ptr + tok * stride_vnt + offs_d[None, :], d_ok, SPLITS, split_stride, OUT).to(tl.float32)
        if KV_FP8:
            k = fp8_saturate(k, ks_ptr, EXACT_ROUND)
            v = fp8_saturate(v, vs_ptr, EXACT_ROUND)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        ok = d_ok & (offs_d * 0 + slot >= 0)[None, :]  # (a vector compare: the interpreter's masks)
        slot = tl.maximum(slot, 0)
        k_dst = k_head + slot_offset(slot, stride_kb, stride_ks, BLOCK_SIZE) + offs_d[None, :]
        v_dst = v_head + slot_offset(slot, stride_vb, stride_vs, BLOCK_SIZE) + offs_d[None, :]
        tl.store(k_dst, k.to(k_head.dtype.element_ty), mask=ok)
        tl.store(v_dst, v.to(v_head.dtype.element_ty), mask=ok)

    @triton.jit
    def _unified_attn_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, po_ptr, plse_ptr,
        cu_ptr, seq_lens_ptr, bt_ptr,
        scale_log2, num_seqs,
        stride_qt, stride_qh,
        stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        stride_bt,
        stride_pot, stride_poh, stride_pos,
        stride_plt, stride_plh,
        cs_ptr, kn_ptr, vn_ptr, slot_ptr, qw_ptr, kw_ptr, norm_eps,
        stride_cs, stride_knt, stride_knh, stride_vnt, stride_vnh,
        sinks_ptr, ks_ptr, vs_ptr, window,
        amax_ptr, stride_am, qkv_split_stride, cnt_ptr,
        QPKV: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        TILE_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        DOT_PREC: tl.constexpr,
        PDL: tl.constexpr,
        ROPE: tl.constexpr,
        QK_NORM: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        SLIDING: tl.constexpr,
        KV_FP8: tl.constexpr,
        EXACT_ROUND: tl.constexpr,
        ROWS_AHEAD: tl.constexpr = False,
        KV_F16: tl.constexpr = False,
        HAS_AMAX: tl.constexpr = False,
        QKV_SPLITS: tl.constexpr = 0,
        MERGE_LAST: tl.constexpr = False,
        SKIP_EMPTY: tl.constexpr = False,
        QPAD: tl.constexpr = 1,
        S_CHUNK: tl.constexpr = 1,
    ):
        # Before the wait (PDL): only the host-copied batch description (cu_seqlens, seq_lens,
        # block table) is read, and the first tile of the cache prefetched into L2; q, this
        # step's k / v and every write come after it.
        pdl_launch(PDL)
        # (kv head, query block) flattened on axis 0, kv head fastest; axis 0 has no 65535 cap
        kvh = tl.program_id(0) % NUM_KV_HEADS
        qblock = tl.program_id(0) // NUM_KV_HEADS
        split = tl.program_id(1)

        b = _find_seq(cu_ptr, num_seqs, qblock, BLOCK_Q)
        q_start = tl.load(cu_ptr + b)
        q_len = tl.load(cu_ptr + b + 1) - q_start
        local = qblock - (q_start // BLOCK_Q + b)
        if local * BLOCK_Q >= q_len:
            return  # spare program (the grid is an upper bound)

        seq_len = tl.load(seq_lens_ptr + b)
        ctx_len = seq_len - q_len

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_PAD)
        offs_n = tl.arange(0, TILE_N)
        q_idx = local * BLOCK_Q + offs_m // QPKV
        head = kvh * QPKV + offs_m % QPKV
        row_ok = (offs_m < BLOCK_Q * QPKV) & (q_idx < q_len)
        d_ok = offs_d < HEAD_DIM
        tok = (q_start + q_idx).to(tl.int64)
        q_pos = ctx_len + q_idx

        # keys this query block needs: [0, kv_end), from tile t_first with a window
        kv_end = ctx_len + tl.minimum(q_len, (local + 1) * BLOCK_Q)
        n_tiles = tl.cdiv(kv_end, TILE_N)
        t_first = 0
        lo_full = 0  # tiles from lo_full on are inside every row's window (its lower edge)
        if SLIDING:
            t_first = tl.maximum(ctx_len + local * BLOCK_Q - window + 1, 0) // TILE_N
            lo_full = tl.cdiv(tl.maximum(kv_end - window, 0), TILE_N)
        if NUM_SPLITS > 1:
            per_split = tl.cdiv(n_tiles - t_first, NUM_SPLITS)
            n_seg = NUM_SPLITS
            if SKIP_EMPTY:  # (in-kernel merge only) segments 0 .. n_seg - 1 have keys
                n_seg = tl.cdiv(n_tiles - t_first, per_split)
            t_lo = t_first + split * per_split
            t_hi = tl.minimum(t_lo + per_split, n_tiles)
        else:
            t_lo = t_first
            t_hi = n_tiles
        bt_row = bt_ptr + b * stride_bt
        k_head = k_ptr + kvh * stride_kh
        v_head = v_ptr + kvh * stride_vh
        if PDL:
            _prefetch_tile(bt_row, t_lo, kv_end, k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs,
                           HEAD_PAD, BLOCK_SIZE, TILE_N)
        pdl_wait(PDL)
        # (QKV_SPLITS: q, k and v are a split-K product's partials, summed here as they load)
        act = out_ptr.dtype.element_ty
        q = _load_sum(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                      row_ok[:, None] & d_ok[None, :], QKV_SPLITS, qkv_split_stride, act)
        if ROPE:  # decode (one token per sequence): q arrives unrotated, k / v not yet cached
            q_rows = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
            q = _rope_rows(q_rows, q, q_pos, row_ok[:, None] & d_ok[None, :], offs_d, cs_ptr, stride_cs,
                           qw_ptr, norm_eps, HEAD_DIM, QK_NORM, QKV_SPLITS, qkv_split_stride, act).to(q.dtype)
            # the one program of (sequence, kv head) whose tiles end with the token writes it
            if (t_lo < n_tiles) & (t_hi == n_tiles):
                _write_new_kv(kn_ptr + kvh * stride_knh, vn_ptr + kvh * stride_vnh, slot_ptr,
                              q_start.to(tl.int64), seq_len - 1, k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh,
                              stride_knt, stride_vnt, stride_kb, stride_ks, stride_vb, stride_vs,
                              offs_d, cs_ptr, stride_cs, kw_ptr, norm_eps, ks_ptr, vs_ptr, qkv_split_stride,
                              HEAD_DIM, BLOCK_SIZE, QK_NORM, KV_FP8, EXACT_ROUND, QKV_SPLITS, act)
                tl.debug_barrier()  # the block's stores are visible to its loads below

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        if HAS_SINKS:  # the sink's exp joins the denominator once: in the first segment
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            first = (tl.zeros([BLOCK_M], tl.int32) + split) == 0
            m_i = tl.where(first, sink, m_i)
            l_i = tl.where(first, 1.0, l_i)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        if KV_FP8:
            scale_log2 = scale_log2 * tl.load(ks_ptr)
        if KV_F16:
            # bf16 queries over an FP8 cache: the dots run in fp16, whose e4m3 -> fp16
            # conversion is one instruction per two values (e4m3 -> bf16 goes through fp16,
            # plus a conversion per value); every e4m3 value is exact in fp16, q and p
            # (softmax weights in [0, 1]) keep 3 more mantissa bits than in bf16; q saturates at
            # fp16's largest value instead of becoming inf (once per program, not per tile)
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

        # Tiles wholly below the causal diagonal of every row in the block (and, with a
        # window, wholly inside every row's window) need no masks at all; only the tiles
        # across the window's lower edge [t_lo, edge_hi) and the diagonal [full_hi, t_hi) do.
        n_full = (ctx_len + local * BLOCK_Q + 1) // TILE_N
        edge_hi = tl.minimum(tl.maximum(lo_full, t_lo), t_hi)
        full_hi = tl.minimum(tl.maximum(n_full, edge_hi), t_hi)
        blk = tl.zeros([TILE_N], tl.int64)  # the first tile's block-table entries (ROWS_AHEAD)
        if ROWS_AHEAD:
            blk = _tile_blocks(bt_row, t_lo, kv_end, offs_n, BLOCK_SIZE, TILE_N)
        for t in range(t_lo, edge_hi):
            acc, m_i, l_i, blk = _tile_step(
                acc, m_i, l_i, q, t, kv_end, q_pos, row_ok, bt_row, k_head, v_head,
                offs_n, offs_d, d_ok, stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, window, blk,
                BLOCK_SIZE, TILE_N, HEAD_DIM != HEAD_PAD, DOT_PREC, True, SLIDING, KV_FP8, ROWS_AHEAD)
        for t in range(edge_hi, full_hi):
            acc, m_i, l_i, blk = _tile_step(
                acc, m_i, l_i, q, t, kv_end, q_pos, row_ok, bt_row, k_head, v_head,
                offs_n, offs_d, d_ok, stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, window, blk,
                BLOCK_SIZE, TILE_N, HEAD_DIM != HEAD_PAD, DOT_PREC, False, SLIDING, KV_FP8, ROWS_AHEAD)
        for t in range(full_hi, t_hi):
            acc, m_i, l_i, blk = _tile_step(
                acc, m_i, l_i, q, t, kv_end, q_pos, row_ok, bt_row, k_head, v_head,
                offs_n, offs_d, d_ok, stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, window, blk,
                BLOCK_SIZE, TILE_N, HEAD_DIM != HEAD_PAD, DOT_PREC, True, SLIDING, KV_FP8, ROWS_AHEAD)

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        if KV_FP8:
            o = o * tl.load(vs_ptr)
        st_mask = row_ok[:, None] & d_ok[None, :]
        if NUM_SPLITS == 1:
            tl.store(
                out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=st_mask,
            )
            if HAS_AMAX:  # each (token, head) row's amax as stored, for a product quantizing on load
                stored = tl.where(st_mask, tl.abs(o.to(out_ptr.dtype.element_ty).to(tl.float32)), 0.0)
                tl.store(amax_ptr + tok * stride_am + head, tl.max(stored, 1), mask=row_ok)
        else:
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            base = tok * stride_pot + head * stride_poh + split * stride_pos
            lse_ok = row_ok
            if SKIP_EMPTY:  # a segment without keys stores nothing and does not count itself in
                lse_ok = row_ok & ((tl.zeros([BLOCK_M], tl.int32) + split) < n_seg)
                st_mask = st_mask & lse_ok[:, None]
            tl.store(po_ptr + base[:, None] + offs_d[None, :], o, mask=st_mask)
            tl.store(plse_ptr + tok * stride_plt + head * stride_plh + split, lse, mask=lse_ok)
            if MERGE_LAST:  # decode: the segment that finishes last merges (`split_merge`)
                counted = True
                if SKIP_EMPTY:
                    counted = split < n_seg
                if counted:
                    if arrive_last(cnt_ptr + tl.program_id(0), n_seg):
                        merge_heads(out_ptr, po_ptr, plse_ptr, amax_ptr, q_start.to(tl.int64), kvh * QPKV,
                                    stride_ot, stride_oh, stride_pot, stride_poh, stride_pos, stride_plt,
                                    stride_plh, stride_am, n_seg, QPKV, QPAD, HEAD_DIM, HEAD_PAD, NUM_SPLITS,
                                    S_CHUNK, HAS_AMAX, SKIP_EMPTY)

    @triton.jit
    def _merge_kernel(
        out_ptr, po_ptr, plse_ptr, cu_ptr, num_seqs,
        stride_ot, stride_oh,
        stride_pot, stride_poh, stride_pos,
        stride_plt, stride_plh,
        amax_ptr, stride_am,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        PDL: tl.constexpr,
        HAS_AMAX: tl.constexpr = False,
    ):
        pdl_launch(PDL)
        t = tl.program_id(0)
        h = tl.program_id(1)
        if t >= tl.load(cu_ptr + num_seqs):  # (host-copied: read before the wait)
            return  # padding token, left untouched like the one-pass path
        pdl_wait(PDL)
        offs_s = tl.arange(0, NUM_SPLITS)
        offs_d = tl.arange(0, HEAD_PAD)
        d_ok = offs_d < HEAD_DIM
        t64 = t.to(tl.int64)
        lse = tl.load(plse_ptr + t64 * stride_plt + h * stride_plh + offs_s)
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)  # empty segments: exp2(-inf) = 0
        denom = tl.sum(w, 0)
        denom = tl.where(denom == 0.0, 1.0, denom)
        # every segment of a real token wrote its partial (an empty one zeros), so the partials
        # load beside the log-sum-exps, not after them; the where keeps an empty one out
        po = tl.load(
            po_ptr + t64 * stride_pot + h * stride_poh
            + offs_s[:, None] * stride_pos + offs_d[None, :],
            mask=d_ok[None, :],
            other=0.0,
        )
        o = tl.sum(tl.where((w > 0.0)[:, None], po * w[:, None], 0.0), 0) / denom
        o = o.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t64 * stride_ot + h * stride_oh + offs_d, o, mask=d_ok)
        if HAS_AMAX:  # the head's amax as stored, for a product quantizing on load
            tl.store(amax_ptr + t64 * stride_am + h, tl.max(tl.where(d_ok, tl.abs(o.to(tl.float32)), 0.0), 0))


_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H200 (only matters for the interpreter's choice)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


#: decode batches of at least this many sequences over an FP8 KV cache read 128-key tiles (the
#: bytes a tile of bf16's 64 keys): a program's tiles run one after another, each waiting on
#: memory, so with 64-key tiles the 1-byte cache halves the bytes a wait and gains little over
#: bf16 at long contexts. Short contexts at few sequences (batch-1 decode) are faster with 64,
#: hence the floor. Timings (`scripts/attention_long_sweep.py`, the long-context workload): docs/perf.
FP8_WIDE_TILE_MIN_SEQS = 17


@functools.lru_cache(maxsize=512)
def _cached_config(*args, **kwargs) -> dict:
    return pick_attention_config(*args, **kwargs)


def pick_attention_config(
    num_tokens: int,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_query_len: int,
    device: torch.device,
    max_splits: int = 16,
    kv_fp8: bool = False,
) -> dict:
    """Tile sizes, warps and number of KV splits. Depends on shapes (and, `kv_fp8`, on the
    cache holding FP8: `FP8_WIDE_TILE_MIN_SEQS`) only."""
    qpkv = num_q_heads // num_kv_heads
    if max_query_len <= 1:
        block_m = max(16, next_pow2(qpkv))
    else:
        block_m = max(16, next_pow2(qpkv), min(64, next_pow2(max_query_len * qpkv)))
    block_q = max(1, block_m // qpkv)
    head_pad = max(16, next_pow2(head_dim))
    tile_n = 64 if head_pad <= 128 else 32
    if kv_fp8 and max_query_len <= 1 and num_seqs >= FP8_WIDE_TILE_MIN_SEQS and head_pad <= 128:
        tile_n = 128
    num_q_blocks = num_tokens // block_q + num_seqs
    num_splits = 1
    if max_query_len <= 1 and num_seqs > 0:
        progs = num_q_blocks * num_kv_heads
        sms = _sm_count(device)
        # Few programs leave SMs idle or end in a ragged last wave: cut the context into
        # segments, for about four programs per SM (`progs` counts the grid, which for a
        # decode batch holds 1 + 1 / BLOCK_Q programs per sequence and KV head, the extra
        # ones exiting at once: 1.25 for Llama's four query heads per KV head). H200,
        # Llama-3.1-8B decode batches of the nano-vllm workload (scripts/attention_sweep.py
        # --splits): 23 and 37 sequences (224 / 368 programs) took 52.2 (2 segments) / 53.6
        # (4, the rule's pick) and 68.3 (2) us against 65.6 / 74.3 unsplit; at 48, 59 and 101
        # sequences 2 segments were 1-10% slower, at 77 1.2% faster. Other shapes untested.
        if progs < 3 * sms:
            num_splits = min(max_splits, next_pow2(math.ceil(4 * sms / progs)))
    # H200, Qwen3-0.6B shape, CUDA-graph timing: TILE_N 64 / 4 warps / 2 stages was
    # best or within 3% for decode at batch 1-256 and for a 4x2048 prefill; splits of
    # 16 (batch 1) and 8 (batch 8) were best, none at batch 64.
    num_warps = 4 if block_m <= 64 else 8
    num_stages = 2
    if device.type != "cuda":
        num_stages = 1
    return dict(
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n, HEAD_PAD=head_pad,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
        num_q_blocks=num_q_blocks,
    )


class AttentionWorkspace:
    """Scratch for the split-KV path, allocated once and reused (CUDA-graph safe).

    ``max_num_tokens`` bounds the tokens of a batch that may take the split path;
    a batch with more tokens (or more splits than ``max_splits``) runs unsplit,
    which is again a decision on shapes only.
    """

    def __init__(self, max_num_tokens: int, num_q_heads: int, head_dim: int,
                 max_splits: int = 16, device=None):
        if max_splits < 1 or max_splits & (max_splits - 1):
            raise ValueError(f"max_splits must be a power of two >= 1, got {max_splits}")
        self.max_num_tokens = int(max_num_tokens)
        self.num_q_heads = int(num_q_heads)
        self.head_dim = int(head_dim)
        self.max_splits = int(max_splits)
        self.partial_out = torch.empty(
            (self.max_num_tokens, num_q_heads, max_splits, head_dim),
            dtype=torch.float32, device=device)
        self.partial_lse = torch.empty(
            (self.max_num_tokens, num_q_heads, max_splits), dtype=torch.float32, device=device)
        # the in-kernel merge's arrival counters, one a program of axis 0 (at most
        # 2 x tokens x kv heads: a decode batch's query blocks, spare ones included); each
        # launch leaves them at 0
        self.arrival_counts = torch.zeros(2 * self.max_num_tokens * num_q_heads, dtype=torch.int32, device=device)

    def arrivals(self, programs: int):
        """The first `programs` arrival counters (zero between launches), or None if too few."""
        return self.arrival_counts[:programs] if programs <= self.arrival_counts.numel() else None

    def buffers(self, num_tokens: int, num_q_heads: int, head_dim: int, num_splits: int):
        """Views for this batch, or ``None`` if it does not fit."""
        if (num_tokens > self.max_num_tokens or num_q_heads != self.num_q_heads
                or head_dim != self.head_dim or num_splits > self.max_splits):
            return None
        return self.partial_out[:num_tokens], self.partial_lse[:num_tokens]

    @property
    def nbytes(self) -> int:
        return (self.partial_out.numel() + self.partial_lse.numel() + self.arrival_counts.numel()) * 4

    def __repr__(self) -> str:
        return (f"AttentionWorkspace(max_num_tokens={self.max_num_tokens}, "
                f"num_q_heads={self.num_q_heads}, head_dim={self.head_dim}, "
                f"max_splits={self.max_splits}, {self.nbytes / 2**20:.1f} MiB, "
                f"device={self.partial_out.device})")


def _check(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables):
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if out.shape != q.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache/v_cache must both be [num_blocks, block_size, Hkv, D]; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    T, Hq, D = q.shape
    _, _, Hkv, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"head_dim of q ({D}) and kv cache ({Dk}) differ")
    if Hq % Hkv:
        raise ValueError(f"num q heads {Hq} is not a multiple of num kv heads {Hkv}")
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError("cu_seqlens_q must have len(seq_lens) + 1 entries")
    if block_tables.dim() != 2 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError("block_tables must be [B, max_blocks]")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens),
                    ("block_tables", block_tables)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables must have a contiguous last dimension")


def _check_options(opts, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    Hq = q.shape[1]
    if opts.sinks is not None and (tuple(opts.sinks.shape) != (Hq,) or opts.sinks.stride(0) != 1):
        raise ValueError(f"sinks must be a contiguous [{Hq}] tensor, got {tuple(opts.sinks.shape)}")
    W = opts.sliding_window
    if W is not None and int(W) < 1:
        raise ValueError(f"sliding_window={W} is invalid: must be >= 1 (or None for full attention)")
    fp8 = k_cache.dtype in FP8_CACHE_DTYPES
    for name in ("k_scale", "v_scale"):
        t = getattr(opts, name)
        if fp8 and t is not None and t.numel() != 1:
            raise ValueError(f"{name} must hold one value (a per-layer scale), got {tuple(t.shape)}")


def _options_args(opts, q: torch.Tensor, k_cache: torch.Tensor) -> tuple:
    """(sinks, k_scale, v_scale pointers, window) for the kernel; placeholders where unused."""
    ks, vs = opts.k_scale, opts.v_scale
    if k_cache.dtype in FP8_CACHE_DTYPES and (ks is None or vs is None):
        one = torch.ones((), dtype=torch.float32, device=q.device)
        ks, vs = (one if ks is None else ks), (one if vs is None else vs)
    return (q if opts.sinks is None else opts.sinks, q if ks is None else ks, q if vs is None else vs,
            int(opts.sliding_window or 0))


class DecodeRope(NamedTuple):
    """Decode steps with the rotary embedding folded into the attention kernel: q comes
    unrotated, and the kernel rotates it, rotates this step's keys `k` [T, Hkv, D] and writes
    them and the values `v` into the caches at `slot_mapping` (what the rotary kernel with its
    cache write does otherwise), with Qwen3's per-head q/k RMSNorm first when its weights are
    given. `cos_sin_cache` [max_pos, D]: cos in the first D/2 columns, sin in the last."""
    cos_sin_cache: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor
    q_norm_weight: Optional[torch.Tensor] = None
    k_norm_weight: Optional[torch.Tensor] = None
    eps: float = 1e-6


def _check_rope(rope: DecodeRope, q: torch.Tensor, k_cache: torch.Tensor, max_query_len: int) -> None:
    T, _, D = q.shape
    Hkv = k_cache.shape[2]
    if max_query_len != 1:
        raise ValueError(f"the rotary embedding folds into decode steps only (max_query_len 1), got {max_query_len}")
    if D % 2 or rope.cos_sin_cache.dim() != 2 or rope.cos_sin_cache.shape[1] != D \
            or rope.cos_sin_cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache must be [max_pos, {D}] with a contiguous last dim and an even head_dim, "
                         f"got {tuple(rope.cos_sin_cache.shape)}")
    for name, t in (("k", rope.k), ("v", rope.v)):
        if t.shape != (T, Hkv, D) or t.stride(-1) != 1:
            raise ValueError(f"rope.{name} must be [{T}, {Hkv}, {D}] with a contiguous last dim, got {tuple(t.shape)}")
    if rope.slot_mapping.dim() != 1 or rope.slot_mapping.shape[0] < T:
        raise ValueError(f"rope.slot_mapping needs {T} entries, got {tuple(rope.slot_mapping.shape)}")
    for name in ("q_norm_weight", "k_norm_weight"):
        w = getattr(rope, name)
        if w is not None and w.shape != (D,):
            raise ValueError(f"rope.{name} must be [{D}], got {tuple(w.shape)}")
    if (rope.q_norm_weight is None) != (rope.k_norm_weight is None):
        raise ValueError("rope: give both q_norm_weight and k_norm_weight, or neither")


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    softmax_scale: float,
    max_query_len: int,
    workspace: Optional[AttentionWorkspace] = None,
    *,
    num_kv_splits: Optional[int] = None,
    config: Optional[dict] = None,
    rope: Optional[DecodeRope] = None,
    options: Optional[AttentionOptions] = None,
    amax: Optional[torch.Tensor] = None,
    qkv_sum: Optional[tuple[int, int]] = None,
    merge_in_kernel: bool = False,
) -> torch.Tensor:
    """Causal paged attention for a mixed batch; writes ``out`` in place and returns it.
    ``amax`` (fp32 [T, Hq]): also each token's and head's largest |value| of ``out`` as
    stored, written by whichever kernel stores that row (the one-pass kernel or the merge):
    the partial amaxes of a product that quantizes ``out`` on load (`pending_quant`).
    ``qkv_sum`` = (splits, split_stride) (decode with ``rope``): q, ``rope.k`` and ``rope.v``
    are fp32 views into split 0 of a split-K q/k/v product's partials (`split_k.PendingSum`),
    the others ``split_stride`` elements on; the kernel sums them as it loads them, rounded to
    ``out``'s dtype as the reduction would store them.
    With ``rope`` (decode steps only) q is unrotated and this step's k / v are not in the
    cache yet: the kernel rotates and writes them (:class:`DecodeRope`). ``options``: the
    layer's sinks, sliding window and FP8 scales (:class:`AttentionOptions`); an FP8 cache
    is recognised by its dtype.

    ``num_kv_splits``: None picks by shape (split only for decode-only batches
    with few programs); 1 forces one pass; a power of two forces that many
    segments (any ``max_query_len``).  ``config`` overrides tile choices
    (``TILE_N``, ``BLOCK_M``, ``num_warps``, ``num_stages``; ``maxnreg`` caps the registers
    per thread, so that more programs fit on an SM; ``rows_ahead`` loads each tile's
    block-table entries one tile ahead, which lets ``num_stages`` >= 3 keep several K / V
    tiles in flight) for tuning.
    ``merge_in_kernel``: a split decode step (``max_query_len`` 1) merges its segments in the
    attention kernel, in the program of each token and kv head that finishes last
    (`split_merge`, counters from ``workspace.arrivals``), instead of a second launch.
    Tokens past ``cu_seqlens_q[-1]`` (graph padding) are left untouched.
    """
    if not HAS_TRITON:
        raise RuntimeError("unified_attention needs triton; use paged_attention_ref on CPU")
    _check(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables)
    if amax is not None and (amax.dtype != torch.float32 or tuple(amax.shape) != tuple(q.shape[:2])
                             or amax.stride(1) != 1):
        raise ValueError(f"amax must be fp32 [T, Hq] = {tuple(q.shape[:2])} with unit column stride, got "
                         f"{amax.dtype} {tuple(amax.shape)}")
    if qkv_sum is not None:
        splits_qkv, split_stride = (int(v) for v in qkv_sum)
        if rope is None or splits_qkv < 2 or split_stride < 1 or q.dtype != torch.float32 \
                or rope.k.dtype != torch.float32 or rope.v.dtype != torch.float32:
            raise ValueError(f"qkv_sum={qkv_sum!r} is invalid: a decode step's (rope given) fp32 partials of >= 2 "
                             f"splits with a positive stride, got q {q.dtype} and rope "
                             f"{'given' if rope is not None else 'None'}")
    options = AttentionOptions() if options is None else options
    _check_options(options, q, k_cache)
    if rope is not None:
        _check_rope(rope, q, k_cache, max(1, int(max_query_len)))
    T, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    B = seq_lens.shape[0]
    if T == 0 or B == 0:
        return out
    max_query_len = max(1, int(max_query_len))
    cfg = _cached_config(T, B, Hq, Hkv, D, max_query_len, q.device,
                         workspace.max_splits if workspace else 16, kv_fp8=k_cache.dtype in FP8_CACHE_DTYPES)
    if config:
        cfg = dict(cfg, **config)
        if "BLOCK_M" in config and "BLOCK_Q" not in config:
            cfg["BLOCK_Q"] = max(1, cfg["BLOCK_M"] // (Hq // Hkv))
        cfg["num_q_blocks"] = T // cfg["BLOCK_Q"] + B
    splits = cfg["num_splits"] if num_kv_splits is None else int(num_kv_splits)
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"num_kv_splits must be a power of two >= 1, got {splits}")

    bufs = None
    if splits > 1:
        if workspace is not None:
            bufs = workspace.buffers(T, Hq, D, splits)
        else:
            bufs = (torch.empty((T, Hq, splits, D), dtype=torch.float32, device=q.device),
                    torch.empty((T, Hq, splits), dtype=torch.float32, device=q.device))
        if bufs is None:
            splits = 1
    if splits > 1:
        po, plse = bufs
    else:
        po = plse = out  # unused placeholders
    act_dtype = out.dtype if qkv_sum is not None else q.dtype  # q's values as the kernel holds them
    dot_prec = "ieee" if act_dtype == torch.float32 else "tf32"

    grid = (Hkv * cfg["num_q_blocks"], splits)
    arrivals = None  # the in-kernel merge's counters (`split_merge`): decode steps only
    if merge_in_kernel and splits > 1 and max_query_len == 1:
        arrivals = (workspace.arrivals(grid[0]) if workspace is not None
                    else torch.zeros(grid[0], dtype=torch.int32, device=q.device))
    qpad = next_pow2(Hq // Hkv)
    if config and config.get("skip_empty") and arrivals is None:
        raise ValueError(f"config['skip_empty']={config['skip_empty']!r} needs the in-kernel merge of a split decode "
                         f"step (merge_in_kernel=True, max_query_len 1, more than one split); this call has "
                         f"merge_in_kernel={merge_in_kernel}, max_query_len={max_query_len}, {splits} split(s)")
    skip_empty = arrivals is not None and bool(cfg.get("skip_empty", SKIP_EMPTY_SEGMENTS))
    maxnreg = cfg.get("maxnreg")
    if not maxnreg and skip_empty and q.device.type == "cuda" and torch.version.hip is None:
        maxnreg = SKIP_EMPTY_MAXNREG
    _unified_attn_kernel[grid](
        q, k_cache, v_cache, out, po, plse,
        cu_seqlens_q, seq_lens, block_tables,
        float(softmax_scale) * _LOG2E, B,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        po.stride(0), po.stride(1), po.stride(2) if splits > 1 else 0,
        plse.stride(0), plse.stride(1),
        *_rope_args(rope, q), *_options_args(options, q, k_cache),
        amax if amax is not None else out, amax.stride(0) if amax is not None else 0,
        split_stride if qkv_sum is not None else 0, arrivals if arrivals is not None else seq_lens,
        QPKV=Hq // Hkv, NUM_KV_HEADS=Hkv, HEAD_DIM=D, HEAD_PAD=cfg["HEAD_PAD"], BLOCK_SIZE=block_size,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_Q=cfg["BLOCK_Q"], TILE_N=cfg["TILE_N"],
        NUM_SPLITS=splits, DOT_PREC=dot_prec,
        ROPE=rope is not None, QK_NORM=rope is not None and rope.q_norm_weight is not None,
        HAS_SINKS=options.sinks is not None, SLIDING=options.sliding_window is not None,
        KV_FP8=k_cache.dtype in FP8_CACHE_DTYPES, EXACT_ROUND=k_cache.dtype in FP8_CACHE_DTYPES and interpreted(),
        ROWS_AHEAD=bool(cfg.get("rows_ahead", False)),
        KV_F16=k_cache.dtype in FP8_CACHE_DTYPES and act_dtype == torch.bfloat16,
        HAS_AMAX=amax is not None and (splits == 1 or arrivals is not None),
        QKV_SPLITS=splits_qkv if qkv_sum is not None else 0,
        MERGE_LAST=arrivals is not None, QPAD=qpad, S_CHUNK=merge_chunk(Hq // Hkv, splits, cfg["HEAD_PAD"]),
        SKIP_EMPTY=skip_empty, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_args(q),
        **({"maxnreg": int(maxnreg)} if maxnreg else {}),
    )
    if splits > 1 and arrivals is None:
        _merge_kernel[(T, Hq)](
            out, po, plse, cu_seqlens_q, B,
            out.stride(0), out.stride(1),
            po.stride(0), po.stride(1), po.stride(2),
            plse.stride(0), plse.stride(1),
            amax if amax is not None else out, amax.stride(0) if amax is not None else 0,
            HEAD_DIM=D, HEAD_PAD=cfg["HEAD_PAD"], NUM_SPLITS=splits, HAS_AMAX=amax is not None,
            num_warps=4 if cfg["HEAD_PAD"] >= 128 else 2, **pdl_args(q),
        )
    return out


def _rope_args(rope: Optional[DecodeRope], q: torch.Tensor) -> tuple:
    """The kernel's rotary arguments: pointers (cos/sin, new k, new v, slots, q / k norm
    weights), eps and strides; placeholders without `rope`."""
    if rope is None:
        return (q,) * 6 + (1e-6,) + (0,) * 5
    qw = rope.q_norm_weight if rope.q_norm_weight is not None else q
    kw = rope.k_norm_weight if rope.k_norm_weight is not None else q
    return (rope.cos_sin_cache, rope.k, rope.v, rope.slot_mapping, qw, kw, float(rope.eps),
            rope.cos_sin_cache.stride(0), rope.k.stride(0), rope.k.stride(1), rope.v.stride(0), rope.v.stride(1))


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    softmax_scale: float,
    max_query_len: int,
    workspace=None,
    *,
    sinks: Optional[torch.Tensor] = None,
    sliding_window: Optional[int] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Torch reference of :func:`unified_attention` (per-sequence loop, dense fp32 softmax).

    ``sinks`` [Hq]: one more softmax column per head, with no value; ``sliding_window`` W:
    a query at position p sees keys p - W < j <= p; an FP8 cache reads as fp8 * scale.
    Works on any device; writes ``out`` in place and returns it.
    """
    _, block_size, Hkv, D = k_cache.shape
    Hq = q.shape[1]
    qpkv = Hq // Hkv
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, L in enumerate(lens):
        qs, qe = cu[b], cu[b + 1]
        n = qe - qs
        if n == 0:
            continue
        nblk = -(-L // block_size)
        blocks = block_tables[b, :nblk].long()
        k = k_cache[blocks].reshape(-1, Hkv, D)[:L].float()
        v = v_cache[blocks].reshape(-1, Hkv, D)[:L].float()
        if k_cache.dtype in FP8_CACHE_DTYPES:
            k = k * (1.0 if k_scale is None else k_scale.float())
            v = v * (1.0 if v_scale is None else v_scale.float())
        k = k.repeat_interleave(qpkv, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(qpkv, dim=1)
        qq = q[qs:qe].float()  # [n, Hq, D]
        s = torch.einsum("qhd,khd->hqk", qq, k) * softmax_scale
        qpos = torch.arange(L - n, L, device=q.device)[:, None]
        kpos = torch.arange(L, device=q.device)[None, :]
        hide = kpos > qpos
        if sliding_window is not None:
            hide = hide | (kpos <= qpos - sliding_window)
        s = s.masked_fill(hide[None], float("-inf"))
        if sinks is not None:  # the sink column joins the denominator, then is dropped
            s = torch.cat([s, sinks.float().view(Hq, 1, 1).expand(Hq, n, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :L]
        o = torch.einsum("hqk,khd->qhd", p, v)
        out[qs:qe] = o.to(out.dtype)
    return out
