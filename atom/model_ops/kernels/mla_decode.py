"""Triton kernels of MLA over the latent cache: the absorbed decode (split-KV) and the cache write.

Latent cache: [num_blocks, block_size, R + P] (R = kv_lora_rank values of the normalised
compressed KV, then P = qk_rope_head_dim of the rotated rope key). A decode query of head h
is already in the latent space: q_lat [B, H, R] (q_nope W_UK) and q_pe [B, H, P].

`mla_decode` : out_lat[b, h] = softmax_j(scale * (q_lat[b,h] . c_j + q_pe[b,h] . pe_j)) . c_j over
the `seq_lens[b]` latents of sequence b. Programs map to (sequence, block of BLOCK_H heads,
KV segment): all heads read the same latent rows (one shared "KV head"), so a program packs
16+ heads into the rows of `tl.dot`. Few programs (small batches) split each sequence's
context into `num_kv_splits` segments whose partial results (unnormalised output and
log-sum-exp, in preallocated `MLAWorkspace` buffers, so the launch can live in a CUDA graph)
a second kernel merges. The split count depends on shapes only.

The torch references: `atom.model_ops.attention.mla_torch.latent_decode_ref` and
`write_latent_cache`.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from atom.model_ops.kernels.kv_cache import slot_offset
from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton

_LOG2E = 1.4426950408889634

if HAS_TRITON:

    @triton.jit
    def _mla_decode_kernel(
        ql_ptr, qp_ptr, cache_ptr, bt_ptr, seq_lens_ptr, out_ptr, po_ptr, plse_ptr,
        scale_log2,
        stride_qlb, stride_qlh, stride_qpb, stride_qph,
        stride_cb, stride_cs, stride_btb,
        stride_ob, stride_oh,
        stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
        NUM_HEADS: tl.constexpr, R: tl.constexpr, P: tl.constexpr, R_PAD: tl.constexpr, P_PAD: tl.constexpr,
        BLOCK_H: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr, DOT_PREC: tl.constexpr,
    ):
        b = tl.program_id(0)
        hb = tl.program_id(1)
        split = tl.program_id(2)
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
        # this program's segment of the context, in whole tiles
        per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N
        start = split * per_split
        end = tl.minimum(start + per_split, seq_len)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)
        for n0 in range(start, end, TILE_N):
            offs_n = n0 + tl.arange(0, TILE_N)
            n_ok = offs_n < end
            blk = tl.load(bt_ptr + b64 * stride_btb + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            row = blk * stride_cb + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_cs
            c = tl.load(cache_ptr + row[:, None] + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
            pe = tl.load(cache_ptr + row[:, None] + R + offs_p[None, :], mask=n_ok[:, None] & p_ok[None, :],
                         other=0.0)
            s = tl.dot(ql.to(c.dtype), tl.trans(c), input_precision=DOT_PREC)
            s += tl.dot(qp.to(pe.dtype), tl.trans(pe), input_precision=DOT_PREC)
            s = tl.where(n_ok[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PREC)
            m_i = m_new
        st_mask = h_ok[:, None] & r_ok[None, :]
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        if NUM_SPLITS == 1:
            tl.store(out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_r[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=st_mask)
        else:
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            base = b64 * stride_pob + heads * stride_poh + split * stride_pos
            tl.store(po_ptr + base[:, None] + offs_r[None, :], o, mask=st_mask)
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
        c_ptr, pe_ptr, cache_ptr, slot_ptr, stride_ct, stride_pt, stride_cb, stride_cs,
        R: tl.constexpr, P: tl.constexpr, R_PAD: tl.constexpr, P_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
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
        tl.store(cache_ptr + row + offs_r, c.to(cache_ptr.dtype.element_ty), mask=offs_r < R)
        tl.store(cache_ptr + row + R + offs_p, pe.to(cache_ptr.dtype.element_ty), mask=offs_p < P)


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


class MLAWorkspace:
    """Split-KV scratch, allocated once (CUDA-graph safe): partial outputs [B, H, S, R] and
    log-sum-exps [B, H, S] for up to `max_num_seqs` sequences; a bigger batch runs unsplit."""

    def __init__(self, max_num_seqs: int, num_heads: int, kv_lora_rank: int, max_splits: int = 8, device=None):
        if max_splits < 1 or max_splits & (max_splits - 1):
            raise ValueError(f"max_splits={max_splits} is invalid: must be a power of two >= 1")
        self.max_num_seqs, self.num_heads, self.kv_lora_rank, self.max_splits = \
            int(max_num_seqs), int(num_heads), int(kv_lora_rank), int(max_splits)
        self.partial_out = torch.empty((self.max_num_seqs, num_heads, max_splits, kv_lora_rank),
                                       dtype=torch.float32, device=device)
        self.partial_lse = torch.empty((self.max_num_seqs, num_heads, max_splits), dtype=torch.float32, device=device)

    def buffers(self, num_seqs: int, num_heads: int, kv_lora_rank: int, num_splits: int):
        """Views for this batch, or None where it does not fit."""
        if (num_seqs > self.max_num_seqs or num_heads != self.num_heads or kv_lora_rank != self.kv_lora_rank
                or num_splits > self.max_splits):
            return None
        return self.partial_out[:num_seqs], self.partial_lse[:num_seqs]

    @property
    def nbytes(self) -> int:
        return (self.partial_out.numel() + self.partial_lse.numel()) * 4

    def __repr__(self) -> str:
        return (f"MLAWorkspace(max_num_seqs={self.max_num_seqs}, heads={self.num_heads}, "
                f"kv_lora_rank={self.kv_lora_rank}, max_splits={self.max_splits}, {self.nbytes / 2**20:.1f} MiB)")


def pick_mla_config(num_seqs: int, num_heads: int, kv_lora_rank: int, num_sms: int = 132,
                    max_splits: int = 8) -> dict:
    """Tiles and the split count, from shapes only: split while the grid has fewer programs
    than SMs (about two programs per SM after splitting)."""
    block_h = max(16, min(64, _next_pow2(num_heads)))
    r_pad = max(16, _next_pow2(kv_lora_rank))
    tile_n = 64 if r_pad <= 128 else 32
    progs = num_seqs * -(-num_heads // block_h)
    splits = 1
    if 0 < progs < num_sms:
        splits = min(max_splits, _next_pow2(math.ceil(2 * num_sms / progs)))
    return dict(BLOCK_H=block_h, TILE_N=tile_n, num_splits=splits, num_warps=4 if r_pad <= 256 else 8)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H200: only the interpreter's choice depends on it
    return torch.cuda.get_device_properties(device).multi_processor_count


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, kv_lora_rank: int, scale: float, out: Optional[torch.Tensor] = None,
               workspace: Optional[MLAWorkspace] = None, *, num_kv_splits: Optional[int] = None,
               config: Optional[dict] = None) -> torch.Tensor:
    """Absorbed MLA decode: q_lat [B, H, R], q_pe [B, H, P], kv_cache [blocks, bs, R + P] ->
    out [B, H, R]. `num_kv_splits` None picks by shape (then capped by the workspace), a power
    of two forces it; `config` overrides tiles (BLOCK_H, TILE_N, num_warps)."""
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
    if out is None:
        out = torch.empty_like(q_lat)
    if B == 0:
        return out
    cfg = pick_mla_config(B, H, R, _num_sms(q_lat.device), workspace.max_splits if workspace else 8)
    if config:
        cfg = dict(cfg, **config)
    splits = cfg["num_splits"] if num_kv_splits is None else int(num_kv_splits)
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"num_kv_splits={splits} is invalid: must be a power of two >= 1")
    bufs = None
    if splits > 1:
        bufs = (workspace.buffers(B, H, R, splits) if workspace is not None else
                (torch.empty((B, H, splits, R), dtype=torch.float32, device=q_lat.device),
                 torch.empty((B, H, splits), dtype=torch.float32, device=q_lat.device)))
        if bufs is None:
            splits = 1
    po, plse = bufs if splits > 1 else (out, out)
    r_pad, p_pad = max(16, _next_pow2(R)), max(16, _next_pow2(P))
    dot_prec = "ieee" if q_lat.dtype == torch.float32 else "tf32"
    grid = (B, triton.cdiv(H, cfg["BLOCK_H"]), splits)
    _mla_decode_kernel[grid](
        q_lat, q_pe, kv_cache, block_tables, seq_lens, out, po, plse,
        float(scale) * _LOG2E,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        po.stride(0), po.stride(1), po.stride(2) if splits > 1 else 0, plse.stride(0), plse.stride(1),
        NUM_HEADS=H, R=R, P=P, R_PAD=r_pad, P_PAD=p_pad, BLOCK_H=cfg["BLOCK_H"], TILE_N=cfg["TILE_N"],
        BLOCK_SIZE=kv_cache.shape[1], NUM_SPLITS=splits, DOT_PREC=dot_prec, num_warps=cfg["num_warps"],
    )
    if splits > 1:
        _mla_merge_kernel[(B, H)](
            out, po, plse, out.stride(0), out.stride(1), po.stride(0), po.stride(1), po.stride(2),
            plse.stride(0), plse.stride(1), R=R, R_PAD=r_pad, NUM_SPLITS=splits, num_warps=4)
    return out


def write_latent(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """[kv_c | k_pe] ([T, R], [T, P], contiguous last dims) into kv_cache [blocks, bs, R + P];
    slots < 0 (padding) are skipped."""
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
    _write_latent_kernel[(T,)](
        kv_c, k_pe, kv_cache, slot_mapping, kv_c.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        R=R, P=P, R_PAD=_next_pow2(R), P_PAD=_next_pow2(P), BLOCK_SIZE=kv_cache.shape[1], num_warps=1)
