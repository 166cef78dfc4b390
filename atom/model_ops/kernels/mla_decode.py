"""Triton kernels of MLA over the latent cache: the absorbed decode (split-KV) and the cache write.

Latent cache: [num_blocks, block_size, R + P] (R = kv_lora_rank values of the normalised
compressed KV, then P = qk_rope_head_dim of the rotated rope key). A decode query of head h
is already in the latent space: q_lat [B, H, R] (q_nope W_UK) and q_pe [B, H, P].

`mla_decode` : out_lat[b, h] = softmax_j(scale * (q_lat[b,h] . c_j + q_pe[b,h] . pe_j)) . c_j over
the `seq_lens[b]` latents of sequence b. Programs map to (sequence, block of BLOCK_H heads,
KV segment): all heads read the same latent rows (one shared "KV head"), so a program packs
16+ heads into the rows of `tl.dot`. Each sequence's context is split into up to `num_splits`
segments (a sequence uses ceil(length / `min_split_tokens`) of them, at most all) whose partial results
(normalised output and log-sum-exp, in preallocated `MLAWorkspace` buffers, so the launch can
live in a CUDA graph) a second kernel merges exactly (log-sum-exp weights, empty segments
weight 0). Why split at every batch size, not only below one program per SM: a decode step is
a read of the latent cache, and the bandwidth it gets depends on the loads in flight, i.e. on
programs per SM x tiles each keeps in flight (`num_stages` pipelines them); one long loop per
SM with a ragged last wave reads at a fraction of the HBM rate. The launch choice
(`pick_mla_config`, a small table) depends on shapes only. Tiles find their cache rows with one
block-table entry per token (one per page is a config option, measured slower).

The torch references: `atom.model_ops.attention.mla_torch.latent_decode_ref` and
`write_latent_cache`. `scripts/mla_decode_sweep.py` times the configurations on a GPU.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from atom.model_ops.kernels.kv_cache import FP8_CACHE_DTYPES, fp8_saturate, interpreted, slot_offset
from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton
from atom.utils.pow2 import is_pow2, next_pow2

_LOG2E = 1.4426950408889634

if HAS_TRITON:

    @triton.jit
    def _tile_rows(bt_row, n0, end, stride_cb, stride_cs, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   PAGE_MODE: tl.constexpr):
        """Element offsets (int64 [TILE_N]) of the cache rows of the tile starting at token n0;
        tokens at or past `end` read block-table entry 0 (their loads are masked). Segments
        start on whole tiles, so a tile never straddles a page where TILE_N divides the block
        size."""
        offs_n = n0 + tl.arange(0, TILE_N)
        if PAGE_MODE == 1:  # the tile lies in one page: one block-table entry
            blk = tl.load(bt_row + n0 // BLOCK_SIZE, mask=n0 < end, other=0).to(tl.int64)
            row = blk * stride_cb + ((n0 % BLOCK_SIZE) + tl.arange(0, TILE_N)).to(tl.int64) * stride_cs
        elif PAGE_MODE == 2:  # TILE_N // BLOCK_SIZE whole pages: one entry per page
            pg = n0 // BLOCK_SIZE + tl.arange(0, TILE_N // BLOCK_SIZE)
            blks = tl.load(bt_row + pg, mask=pg * BLOCK_SIZE < end, other=0).to(tl.int64)
            row = tl.reshape(blks[:, None] * stride_cb
                             + tl.arange(0, BLOCK_SIZE).to(tl.int64)[None, :] * stride_cs, [TILE_N])
        else:  # one entry per token
            blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=offs_n < end, other=0).to(tl.int64)
            row = blk * stride_cb + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_cs
        return row

    @triton.jit
    def _mla_decode_kernel(
        ql_ptr, qp_ptr, cache_ptr, bt_ptr, seq_lens_ptr, out_ptr, po_ptr, plse_ptr, kvs_ptr,
        scale_log2, min_split_tokens,
        stride_qlb, stride_qlh, stride_qpb, stride_qph,
        stride_cb, stride_cs, stride_btb,
        stride_ob, stride_oh,
        stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
        NUM_HEADS: tl.constexpr, R: tl.constexpr, P: tl.constexpr, R_PAD: tl.constexpr, P_PAD: tl.constexpr,
        BLOCK_H: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr, DOT_PREC: tl.constexpr, PAGE_MODE: tl.constexpr, SPLITS_FIRST: tl.constexpr,
        KV_FP8: tl.constexpr, LAZY_RESCALE: tl.constexpr, KV_F16: tl.constexpr = False,
    ):
        if SPLITS_FIRST:  # a sequence's segments are neighbours in launch order
            split = tl.program_id(0)
            b = tl.program_id(2)
        else:
            b = tl.program_id(0)
            split = tl.program_id(2)
        hb = tl.program_id(1)
        b64 = b.to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + b)
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = heads < NUM_HEADS
        offs_r = tl.arange(0, R_PAD)
        offs_p = tl.arange(0, P_PAD)
        r_ok = offs_r < R
        p_ok = offs_p < P
        ql = tl.load(ql_ptr + b64 * stride_qlb + heads[:, None] * stride_qlh + offs_r[None, :],
                     mask=h_ok[:, None] & r_ok[None, :], other=0.0)
        qp = tl.load(qp_ptr + b64 * stride_qpb + heads[:, None] * stride_qph + offs_p[None, :],
                     mask=h_ok[:, None] & p_ok[None, :], other=0.0)
        # this program's segment of the context, in whole tiles: a sequence uses only
        # ceil(seq_len / min_split_tokens) of the NUM_SPLITS segments (the rest are empty), so short
        # sequences do not pay partial-result traffic for segments of a few tiles
        # (segment k of `active` gets tiles [k n / active, (k + 1) n / active): sizes differ by <= 1)
        n_tiles = tl.cdiv(seq_len, TILE_N)
        active = tl.maximum(1, tl.minimum(NUM_SPLITS, tl.cdiv(seq_len, min_split_tokens)))
        start = (split * n_tiles // active) * TILE_N
        end = tl.minimum(((split + 1) * n_tiles // active) * TILE_N, seq_len)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)
        if KV_FP8:  # fp8 * kv_scale: the scale folds into the scores' scale and the output
            kv_scale = tl.load(kvs_ptr)
            scale_log2 = scale_log2 * kv_scale
        if KV_F16:
            # bf16 queries over an FP8 latent cache: the dots run in fp16 (e4m3 -> fp16 is one
            # conversion per pair and exact; e4m3 -> bf16 adds one per value), the queries
            # converted once here, saturated at fp16's largest value
            ql = tl.clamp(ql.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
            qp = tl.clamp(qp.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        bt_row = bt_ptr + b64 * stride_btb
        # the cache rows of the next tile are found one iteration ahead (loop-carried), so that
        # the tile loads' addresses do not depend on a load of the same iteration: Triton's
        # pipeliner then multi-buffers them (num_stages - 1 tiles in flight during the dots);
        # with the block-table load inside the iteration it kept one buffer and every tile
        # waited for its own load (the sm90 TTGIR: a 1 x TILE_N x R buffer at any num_stages)
        row = _tile_rows(bt_row, start, end, stride_cb, stride_cs, TILE_N, BLOCK_SIZE, PAGE_MODE)
        for n0 in range(start, end, TILE_N):
            offs_n = n0 + tl.arange(0, TILE_N)
            n_ok = offs_n < end
            c = tl.load(cache_ptr + row[:, None] + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
            pe = tl.load(cache_ptr + row[:, None] + R + offs_p[None, :], mask=n_ok[:, None] & p_ok[None, :],
                         other=0.0)
            if KV_FP8:
                c = c.to(ql.dtype)
                pe = pe.to(qp.dtype)
            s = tl.dot(ql.to(c.dtype), tl.trans(c), input_precision=DOT_PREC)
            s += tl.dot(qp.to(pe.dtype), tl.trans(pe), input_precision=DOT_PREC)
            s = tl.where(n_ok[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if LAZY_RESCALE:
                # the running max moves (and the [BLOCK_H, R] accumulator is rescaled) only when
                # a row's max grew by more than 2^8: p <= 256 then, exact in fp32 and as exact
                # relative to itself in bf16 as any p <= 1; the first tile always sets it
                if tl.max(m_new - m_i, 0) > 8.0:
                    alpha = tl.exp2(m_i - m_new)
                    acc = acc * alpha[:, None]
                    l_i = l_i * alpha
                    m_i = m_new
                p = tl.exp2(s - m_i[:, None])
                l_i = l_i + tl.sum(p, 1)
                acc = acc + tl.dot(p.to(c.dtype), c, input_precision=DOT_PREC)
            else:
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PREC)
                m_i = m_new
            row = _tile_rows(bt_row, n0 + TILE_N, end, stride_cb, stride_cs, TILE_N, BLOCK_SIZE, PAGE_MODE)
        st_mask = h_ok[:, None] & r_ok[None, :]
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        if KV_FP8:
            o = o * kv_scale
        if NUM_SPLITS == 1:
            tl.store(out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_r[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=st_mask)
        else:
            # an empty segment writes only its lse (-inf): the merge never reads its output rows
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            base = b64 * stride_pob + heads * stride_poh + split * stride_pos
            tl.store(po_ptr + base[:, None] + offs_r[None, :], o, mask=st_mask & (l_i > 0.0)[:, None])
            tl.store(plse_ptr + b64 * stride_plb + heads * stride_plh + split, lse, mask=h_ok)

    @triton.jit
    def _mla_merge_kernel(
        out_ptr, po_ptr, plse_ptr,
        stride_ob, stride_oh, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
        R: tl.constexpr, R_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs_s = tl.arange(0, NUM_SPLITS)
        offs_r = tl.arange(0, R_PAD)
        r_ok = offs_r < R
        lse = tl.load(plse_ptr + b * stride_plb + h * stride_plh + offs_s)
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)  # empty segments: 0
        denom = tl.sum(w, 0)
        denom = tl.where(denom == 0.0, 1.0, denom)
        po = tl.load(po_ptr + b * stride_pob + h * stride_poh + offs_s[:, None] * stride_pos + offs_r[None, :],
                     mask=(w > 0.0)[:, None] & r_ok[None, :], other=0.0)
        o = tl.sum(po * w[:, None], 0) / denom
        tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_r, o.to(out_ptr.dtype.element_ty), mask=r_ok)

    @triton.jit
    def _write_latent_kernel(
        c_ptr, pe_ptr, cache_ptr, slot_ptr, kvs_ptr, stride_ct, stride_pt, stride_cb, stride_cs,
        R: tl.constexpr, P: tl.constexpr, R_PAD: tl.constexpr, P_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        KV_FP8: tl.constexpr, EXACT_ROUND: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:
            return
        row = slot_offset(slot, stride_cb, stride_cs, BLOCK_SIZE)
        offs_r = tl.arange(0, R_PAD)
        offs_p = tl.arange(0, P_PAD)
        c = tl.load(c_ptr + t * stride_ct + offs_r, mask=offs_r < R)
        pe = tl.load(pe_ptr + t * stride_pt + offs_p, mask=offs_p < P)
        if KV_FP8:
            c = fp8_saturate(c, kvs_ptr, EXACT_ROUND)
            pe = fp8_saturate(pe, kvs_ptr, EXACT_ROUND)
        tl.store(cache_ptr + row + offs_r, c.to(cache_ptr.dtype.element_ty), mask=offs_r < R)
        tl.store(cache_ptr + row + R + offs_p, pe.to(cache_ptr.dtype.element_ty), mask=offs_p < P)


class MLAWorkspace:
    """Split-KV scratch, allocated once (CUDA-graph safe): room for `slots` (sequence, segment)
    pairs of partial outputs [H, R] and log-sum-exps [H], viewed per batch as [B, H, S, R] and
    [B, H, S] (B * S <= slots, S <= max_splits). By default slots = max_num_seqs * max_splits;
    `workspace_slots` sizes it for the splits `pick_mla_config` chooses. A batch whose split
    count does not fit runs with the largest power of two that does."""

    def __init__(self, max_num_seqs: int, num_heads: int, kv_lora_rank: int, max_splits: int = 8, device=None,
                 slots: Optional[int] = None):
        if max_splits < 1 or max_splits & (max_splits - 1):
            raise ValueError(f"max_splits={max_splits} is invalid: must be a power of two >= 1")
        slots = int(max_num_seqs) * int(max_splits) if slots is None else int(slots)
        if slots < 1:
            raise ValueError(f"slots={slots} is invalid: must be >= 1")
        self.max_num_seqs, self.num_heads, self.kv_lora_rank, self.max_splits, self.slots = \
            int(max_num_seqs), int(num_heads), int(kv_lora_rank), int(max_splits), slots
        self.partial_out = torch.empty(slots * num_heads * kv_lora_rank, dtype=torch.float32, device=device)
        self.partial_lse = torch.empty(slots * num_heads, dtype=torch.float32, device=device)

    def fits(self, num_seqs: int, num_heads: int, kv_lora_rank: int, num_splits: int) -> bool:
        return (num_seqs <= self.max_num_seqs and num_heads == self.num_heads and kv_lora_rank == self.kv_lora_rank
                and num_splits <= self.max_splits and num_seqs * num_splits <= self.slots)

    def buffers(self, num_seqs: int, num_heads: int, kv_lora_rank: int, num_splits: int):
        """Views [B, H, S, R] and [B, H, S] for this batch, or None where it does not fit."""
        if not self.fits(num_seqs, num_heads, kv_lora_rank, num_splits):
            return None
        n = num_seqs * num_heads * num_splits
        return (self.partial_out[:n * kv_lora_rank].view(num_seqs, num_heads, num_splits, kv_lora_rank),
                self.partial_lse[:n].view(num_seqs, num_heads, num_splits))

    @property
    def nbytes(self) -> int:
        return (self.partial_out.numel() + self.partial_lse.numel()) * 4

    def __repr__(self) -> str:
        return (f"MLAWorkspace(max_num_seqs={self.max_num_seqs}, heads={self.num_heads}, "
                f"kv_lora_rank={self.kv_lora_rank}, max_splits={self.max_splits}, slots={self.slots}, "
                f"{self.nbytes / 2**20:.1f} MiB)")


# The launch choice, from shapes only (a CUDA graph replays it for any context lengths).
# `scripts/mla_decode_sweep.py` timed the alternatives on the H200 at DeepSeek-V2-Lite's shape
# (batches 1-256; contexts 850 / 1024 and mixed 100-4096; figures in docs/perf/raw/history.md).
#
# Splits: the first row whose bound the programs before splitting (sequences x head blocks)
# do not exceed, as a multiple of the SMs. The target is a few programs per SM whatever the
# batch: the old rule (split only below one program per SM) left a batch of ~130 sequences one
# long sequential loop per SM with a ragged last wave. Inside the kernel a sequence uses only
# ceil(length / MIN_SPLIT_TOKENS) segments (at most the split count), so a split count chosen
# for long contexts costs short ones little. 4 splits beat 2 at 128 mixed-length sequences (the
# longest set the step's time), 2 beat 4 at 256 (122 against 134 us at 1024 tokens).
_SPLIT_ROWS = ((1 / 16, 32), (1 / 8, 16), (1 / 2, 8), (1.5, 4), (4.0, 2), (float("inf"), 1))
MIN_SPLIT_TOKENS = 128  # 128 against 256: 13 against 25 us for one 1024-token sequence, equal from ~128
# Tiles for a 512-wide latent: a [16, 512] fp32 accumulator is 64 registers a thread at 4 warps
# (8 warps halve it but spread the 16-row dots thinly). Stages: with num_stages >= 2 Triton turns
# the tile loads into cp.async copies; since the next tile's rows are found one iteration ahead
# (`_tile_rows`), num_stages = 3 keeps two 32-token tiles in flight (93 KB of shared memory, two
# programs an SM at ~200 registers). From 8 sequences up, 32-token tiles over 4 warps with 3
# stages were the fastest in the sweep (at 64-256 sequences 12-25% faster than 2 stages, e.g.
# 256 sequences of 1024 tokens 99 against 126 us, ~3.0 TB/s of latent cache); a batch of a few
# sequences (programs before splitting <= SMs / 32) keeps 64-token tiles over 8 warps.
# With the deeper pipeline 8 splits beat 4 up to ~half a program per SM (64 mixed-length
# sequences 69 against 88 us).
# Rows: one block-table entry per token (page_loads False), not one per page / tile: with the
# per-page addresses (a reshape of [pages, page tokens]) the same tiles ran 1.3-1.9x slower at
# every batch (e.g. 128 mixed sequences 198 against 130 us), the per-token entries being L1 hits.
_TILES_WIDE = dict(TILE_N=32, num_warps=4, num_stages=3)
_TILES_WIDE_FEW = dict(TILE_N=64, num_warps=8, num_stages=2)
_TILES_NARROW = dict(TILE_N=64, num_warps=4, num_stages=3)  # R_PAD <= 256
CONFIG_KEYS = ("BLOCK_H", "TILE_N", "num_warps", "num_stages", "num_splits", "min_split_tokens",
               "page_loads", "splits_first", "lazy_rescale")


def pick_mla_config(num_seqs: int, num_heads: int, kv_lora_rank: int, num_sms: int = 132,
                    max_splits: int = 32) -> dict:
    """The launch configuration for a batch shape (see the tables above):
    BLOCK_H / TILE_N / num_warps / num_stages (tiles), num_splits (segments per sequence, a
    power of two), min_split_tokens (a sequence uses ceil(length / it) segments), page_loads (one
    block-table entry per page instead of per token: off, see above), splits_first (a
    sequence's segments launch next to each other: the longest-first batch order then starts
    the longest work first), lazy_rescale (the accumulator is rescaled only when a row's
    running max grows by more than 2^8, not at every tile)."""
    block_h = max(16, min(64, next_pow2(num_heads)))
    r_pad = max(16, next_pow2(kv_lora_rank))
    progs = num_seqs * -(-num_heads // block_h)
    splits = 1
    if progs > 0:
        splits = next(n for bound, n in _SPLIT_ROWS if progs <= bound * num_sms)
        splits = max(1, min(splits, 1 << (max(1, int(max_splits)).bit_length() - 1)))
    tiles = _TILES_NARROW if r_pad <= 256 else (_TILES_WIDE_FEW if 0 < progs <= num_sms / 32 else _TILES_WIDE)
    return dict(BLOCK_H=block_h, **tiles, num_splits=splits, min_split_tokens=MIN_SPLIT_TOKENS,
                page_loads=False, splits_first=True, lazy_rescale=False)


def workspace_slots(max_num_seqs: int, num_heads: int, kv_lora_rank: int, num_sms: int = 132,
                    max_splits: int = 32) -> int:
    """(sequence, segment) pairs an `MLAWorkspace` needs so that every batch of up to
    `max_num_seqs` sequences runs with the split count `pick_mla_config` gives it (unsplit
    batches need none)."""
    return max([b * s for b in range(1, int(max_num_seqs) + 1)
                if (s := pick_mla_config(b, num_heads, kv_lora_rank, num_sms, max_splits)["num_splits"]) > 1]
               + [1])


def num_sms(device) -> int:
    """SMs of a CUDA device (1 elsewhere: the interpreter runs programs one after another, so
    it splits little: at most 4 segments a sequence)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _num_sms(device)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the Triton interpreter on a CPU: few programs keep tests fast
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_config(cfg: dict) -> None:
    """Bad overrides fail here, naming the field, the value and what is allowed."""
    unknown = sorted(set(cfg) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"mla_decode config has unknown keys {unknown}: allowed {list(CONFIG_KEYS)}")
    for key in ("BLOCK_H", "TILE_N", "num_warps", "num_splits"):
        v = cfg[key]
        if not is_pow2(v) or (key in ("BLOCK_H", "TILE_N") and v < 16):
            lo = 16 if key in ("BLOCK_H", "TILE_N") else 1
            raise ValueError(f"mla_decode config {key}={v!r} is invalid: must be a power of two >= {lo}")
    if not isinstance(cfg["num_stages"], int) or cfg["num_stages"] < 1:
        raise ValueError(f"mla_decode config num_stages={cfg['num_stages']!r} is invalid: must be an int >= 1")
    for key in ("page_loads", "splits_first", "lazy_rescale"):
        if not isinstance(cfg.get(key, False), bool):
            raise ValueError(f"mla_decode config {key}={cfg[key]!r} is invalid: must be True or False")
    if not isinstance(cfg["min_split_tokens"], int) or cfg["min_split_tokens"] < 1:
        raise ValueError(f"mla_decode config min_split_tokens={cfg['min_split_tokens']!r} is invalid: "
                         "must be an int >= 1")


def _page_mode(tile_n: int, block_size: int, page_loads: bool) -> int:
    """How the kernel finds a tile's cache rows: 1 one block-table entry a tile (TILE_N divides
    the block size), 2 one a page (the block size, a power of two, divides TILE_N), 0 one a token."""
    if not page_loads:
        return 0
    if block_size % tile_n == 0:
        return 1
    if tile_n % block_size == 0 and block_size & (block_size - 1) == 0:
        return 2
    return 0


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, kv_lora_rank: int, scale: float, out: Optional[torch.Tensor] = None,
               workspace: Optional[MLAWorkspace] = None, *, num_kv_splits: Optional[int] = None,
               config: Optional[dict] = None, kv_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Absorbed MLA decode: q_lat [B, H, R], q_pe [B, H, P], kv_cache [blocks, bs, R + P] ->
    out [B, H, R]. `num_kv_splits` None picks by shape (then lowered to what the workspace
    holds), a power of two forces it; `config` overrides any of `CONFIG_KEYS` (see
    `pick_mla_config`), e.g. dict(TILE_N=64, num_warps=8, num_stages=3, num_splits=4). An FP8
    cache is read as fp8 * `kv_scale` (a one-element fp32 tensor on the device; 1.0 if None)."""
    if not HAS_TRITON:
        raise RuntimeError("mla_decode needs triton; use mla_torch.latent_decode_ref without it")
    B, H, R = q_lat.shape
    P = kv_cache.shape[-1] - R
    if R != kv_lora_rank or P < 1 or q_pe.shape != (B, H, P):
        raise ValueError(f"q_lat {tuple(q_lat.shape)}, q_pe {tuple(q_pe.shape)} do not fit a latent cache "
                         f"{tuple(kv_cache.shape)} with kv_lora_rank={kv_lora_rank}")
    if seq_lens.shape[0] != B or block_tables.shape[0] != B:
        raise ValueError(f"seq_lens / block_tables have {seq_lens.shape[0]} / {block_tables.shape[0]} rows for "
                         f"{B} queries")
    for name, x in (("q_lat", q_lat), ("q_pe", q_pe), ("kv_cache", kv_cache), ("block_tables", block_tables)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if num_kv_splits is not None:
        n = int(num_kv_splits)
        if n < 1 or n & (n - 1):
            raise ValueError(f"num_kv_splits={num_kv_splits} is invalid: must be a power of two >= 1")
        config = dict(config or {}, num_splits=n)
    block_size = kv_cache.shape[1]
    if block_size < 1:
        raise ValueError(f"kv_cache block size {block_size} is invalid: must be >= 1")
    cfg = pick_mla_config(B, H, R, _num_sms(q_lat.device), workspace.max_splits if workspace else 32)
    if config:  # the table's own rows are valid: only overrides are checked (not per decode call)
        cfg = dict(cfg, **config)
        _check_config(cfg)
    if out is None:
        out = torch.empty_like(q_lat)
    if B == 0:
        return out
    splits = cfg["num_splits"]
    bufs = None
    if splits > 1:
        if workspace is None:
            bufs = (torch.empty((B, H, splits, R), dtype=torch.float32, device=q_lat.device),
                    torch.empty((B, H, splits), dtype=torch.float32, device=q_lat.device))
        else:  # the largest split count the preallocated scratch holds (shapes only)
            while splits > 1 and not workspace.fits(B, H, R, splits):
                splits //= 2
            bufs = workspace.buffers(B, H, R, splits) if splits > 1 else None
    po, plse = bufs if splits > 1 else (out, out)
    fp8 = kv_cache.dtype in FP8_CACHE_DTYPES
    if fp8 and kv_scale is None:
        kv_scale = torch.ones((), dtype=torch.float32, device=q_lat.device)
    r_pad, p_pad = max(16, next_pow2(R)), max(16, next_pow2(P))
    dot_prec = "ieee" if q_lat.dtype == torch.float32 else "tf32"
    nhb = triton.cdiv(H, cfg["BLOCK_H"])
    grid = (splits, nhb, B) if cfg["splits_first"] else (B, nhb, splits)
    _mla_decode_kernel[grid](
        q_lat, q_pe, kv_cache, block_tables, seq_lens, out, po, plse, kv_scale if fp8 else out,
        float(scale) * _LOG2E, cfg["min_split_tokens"],
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        po.stride(0), po.stride(1), po.stride(2) if splits > 1 else 0, plse.stride(0), plse.stride(1),
        NUM_HEADS=H, R=R, P=P, R_PAD=r_pad, P_PAD=p_pad, BLOCK_H=cfg["BLOCK_H"], TILE_N=cfg["TILE_N"],
        BLOCK_SIZE=block_size, NUM_SPLITS=splits, DOT_PREC=dot_prec,
        PAGE_MODE=_page_mode(cfg["TILE_N"], block_size, bool(cfg["page_loads"])),
        SPLITS_FIRST=bool(cfg["splits_first"]), KV_FP8=fp8, LAZY_RESCALE=bool(cfg.get("lazy_rescale", False)),
        KV_F16=fp8 and q_lat.dtype == torch.bfloat16,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if splits > 1:
        _mla_merge_kernel[(B, H)](
            out, po, plse, out.stride(0), out.stride(1), po.stride(0), po.stride(1), po.stride(2),
            plse.stride(0), plse.stride(1), R=R, R_PAD=r_pad, NUM_SPLITS=splits,
            num_warps=4 if splits <= 8 else 8)
    return out


def write_latent(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scale: Optional[torch.Tensor] = None) -> None:
    """[kv_c | k_pe] ([T, R], [T, P], contiguous last dims) into kv_cache [blocks, bs, R + P];
    slots < 0 (padding) are skipped. An FP8 cache stores latent / `kv_scale` (a one-element
    fp32 tensor; 1.0 if None), saturated at +-448."""
    if not HAS_TRITON:
        raise RuntimeError("write_latent needs triton; use mla_torch.write_latent_cache without it")
    T, R = kv_c.shape
    P = k_pe.shape[-1]
    if k_pe.shape[0] != T or kv_cache.shape[-1] != R + P or kv_cache.dim() != 3:
        raise ValueError(f"kv_c {tuple(kv_c.shape)} / k_pe {tuple(k_pe.shape)} do not fit the latent cache "
                         f"{tuple(kv_cache.shape)}")
    if slot_mapping.shape[0] < T:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {T} tokens")
    for name, x in (("kv_c", kv_c), ("k_pe", k_pe), ("kv_cache", kv_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if T == 0:
        return
    fp8 = kv_cache.dtype in FP8_CACHE_DTYPES
    if fp8 and kv_scale is None:
        kv_scale = torch.ones((), dtype=torch.float32, device=kv_c.device)
    _write_latent_kernel[(T,)](
        kv_c, k_pe, kv_cache, slot_mapping, kv_scale if fp8 else kv_c, kv_c.stride(0), k_pe.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), R=R, P=P, R_PAD=next_pow2(R), P_PAD=next_pow2(P),
        BLOCK_SIZE=kv_cache.shape[1], KV_FP8=fp8, EXACT_ROUND=fp8 and interpreted(), num_warps=1)
