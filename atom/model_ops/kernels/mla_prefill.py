"""Triton kernel of MLA's expanded prefill: causal attention of every prefill chunk of a step
over its sequence's whole context (cached prefix + the chunk), all sequences in one launch.

Inputs as the layer has them, never concatenated: queries q_nope [T, H, nope] and q_pe
[T, H, rope] (views of the query projection), keys k_nope [L, H, nope] and values v [L, H, v]
(views of `kv_b_proj`'s output over the gathered contexts) and the shared rope key k_pe [L, rope]
(one per token for all heads, straight from the latent). A score is q_nope . k_nope + q_pe . k_pe,
two dots per tile, which is also how the 192-wide head splits into power-of-two parts (other
widths are padded to a power of two >= 16 under masks).

Work list (`prefill_tiles`, built once per step from the spans of `MLABackend._prefill_plan`):
`seqs` [S, 4] = (first query row, query rows n, first context row, context length L) per prefill
sequence, `tiles` [N, 2] = (sequence, first query row in it) per BLOCK_M query rows. Program
(tile, head) runs a flash-attention loop (online softmax in fp32, base-2 exponentials) over the
context keys its rows may see: query i of a chunk sits at position L - n + i and sees keys 0..it.

The torch reference is `mla_torch.expanded_prefill_ref`, one sequence at a time.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton

_LOG2E = 1.4426950408889634
#: query rows a program, context keys a step (tl.dot's tiles), warps, stages
PREFILL_TILE = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)

if HAS_TRITON:

    @triton.jit
    def _mla_prefill_kernel(
        qn_ptr, qp_ptr, kn_ptr, kp_ptr, v_ptr, out_ptr, tiles_ptr, seqs_ptr, scale_log2,
        s_qn_t, s_qn_h, s_qp_t, s_qp_h, s_kn_t, s_kn_h, s_kp_t, s_v_t, s_v_h, s_o_t, s_o_h,
        NOPE: tl.constexpr, ROPE: tl.constexpr, VD: tl.constexpr,
        NOPE_PAD: tl.constexpr, ROPE_PAD: tl.constexpr, VD_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    ):
        tile = tl.program_id(0)
        h = tl.program_id(1)
        seq = tl.load(tiles_ptr + 2 * tile)
        m0 = tl.load(tiles_ptr + 2 * tile + 1)
        q0 = tl.load(seqs_ptr + 4 * seq)
        n = tl.load(seqs_ptr + 4 * seq + 1)
        k0 = tl.load(seqs_ptr + 4 * seq + 2)
        L = tl.load(seqs_ptr + 4 * seq + 3)
        rows = m0 + tl.arange(0, BLOCK_M)
        r_ok = rows < n
        t = (q0 + rows).to(tl.int64)
        dn = tl.arange(0, NOPE_PAD)
        dp = tl.arange(0, ROPE_PAD)
        dv = tl.arange(0, VD_PAD)
        n_ok, p_ok, v_ok = dn < NOPE, dp < ROPE, dv < VD  # (dims padded to tl.dot's 16 / a power of two)
        qn = tl.load(qn_ptr + t[:, None] * s_qn_t + h * s_qn_h + dn[None, :], mask=r_ok[:, None] & n_ok[None, :],
                     other=0.0)
        qp = tl.load(qp_ptr + t[:, None] * s_qp_t + h * s_qp_h + dp[None, :], mask=r_ok[:, None] & p_ok[None, :],
                     other=0.0)
        pos = L - n + rows  # each query row's position in its context
        hi = tl.minimum(L, L - n + m0 + BLOCK_M)  # keys past the tile's last row are never seen
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, VD_PAD], tl.float32)
        for j0 in range(0, hi, BLOCK_N):
            cols = j0 + tl.arange(0, BLOCK_N)
            c_ok = cols < hi
            kr = (k0 + cols).to(tl.int64)
            kn = tl.load(kn_ptr + kr[:, None] * s_kn_t + h * s_kn_h + dn[None, :],
                         mask=c_ok[:, None] & n_ok[None, :], other=0.0)
            kp = tl.load(kp_ptr + kr[:, None] * s_kp_t + dp[None, :], mask=c_ok[:, None] & p_ok[None, :], other=0.0)
            s = tl.dot(qn, tl.trans(kn.to(qn.dtype)), input_precision=DOT_PREC)
            s += tl.dot(qp, tl.trans(kp.to(qp.dtype)), input_precision=DOT_PREC)
            seen = (cols[None, :] <= pos[:, None]) & c_ok[None, :]
            s = tl.where(seen, s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # (padding rows: nothing seen)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kr[:, None] * s_v_t + h * s_v_h + dv[None, :], mask=c_ok[:, None] & v_ok[None, :],
                        other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + t[:, None] * s_o_t + h * s_o_h + dv[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & v_ok[None, :])


def _pad(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


class PrefillWork(NamedTuple):
    """The kernel's work list (module docstring) and the query rows a tile that it was cut for."""
    tiles: torch.Tensor  # int32 [N, 2]
    seqs: torch.Tensor  # int32 [S, 4]
    block_m: int


def prefill_tiles(spans: list[tuple[int, int, int, int]], block_m: int, device) -> PrefillWork:
    """The work list for spans [(first query row, query rows, first context row, context
    length)] cut into tiles of `block_m` query rows."""
    seqs = torch.tensor(spans, dtype=torch.int32).view(-1, 4)
    tiles = torch.tensor([(j, m0) for j, (_, n, _, _) in enumerate(spans) for m0 in range(0, n, block_m)],
                         dtype=torch.int32).view(-1, 2)
    return PrefillWork(tiles.to(device, non_blocking=True), seqs.to(device, non_blocking=True), int(block_m))


def mla_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                v: torch.Tensor, work: PrefillWork, scale: float, out: torch.Tensor,
                config: dict | None = None) -> torch.Tensor:
    """Writes out[t, h] (out [T, H, v]) for every query row t of the spans in `work` (other rows
    untouched): q_nope [T, H, nope], q_pe [T, H, rope], k_nope [L, H, nope], k_pe [L, rope],
    v [L, H, v], any strides with a contiguous last dim; `work` from `prefill_tiles`, whose
    tile height is the kernel's BLOCK_M (`config` may set the other keys of `PREFILL_TILE`)."""
    if not HAS_TRITON:
        raise RuntimeError("mla_prefill needs triton; use mla_torch.expanded_prefill_ref without it")
    T, H, nope = q_nope.shape
    rope, vd = q_pe.shape[-1], v.shape[-1]
    if (q_pe.shape[:2] != (T, H) or k_nope.shape[1:] != (H, nope) or k_pe.shape[1:] != (rope,)
            or v.shape[:2] != (k_nope.shape[0], H) or k_pe.shape[0] != k_nope.shape[0] or out.shape != (T, H, vd)):
        raise ValueError(f"mla_prefill: q_nope {tuple(q_nope.shape)}, q_pe {tuple(q_pe.shape)}, k_nope "
                         f"{tuple(k_nope.shape)}, k_pe {tuple(k_pe.shape)}, v {tuple(v.shape)}, out "
                         f"{tuple(out.shape)} do not fit one another")
    for name, x in (("q_nope", q_nope), ("q_pe", q_pe), ("k_nope", k_nope), ("k_pe", k_pe), ("v", v), ("out", out)):
        if x.stride(-1) != 1:
            raise ValueError(f"mla_prefill: {name} must have a contiguous last dimension")
    cfg = {**PREFILL_TILE, "BLOCK_M": work.block_m, **(config or {})}
    if cfg["BLOCK_M"] != work.block_m:
        raise ValueError(f"mla_prefill: config BLOCK_M={cfg['BLOCK_M']} differs from the {work.block_m} query rows "
                         "a tile its work list was cut for (prefill_tiles)")
    tiles, seqs = work.tiles, work.seqs
    if tiles.device != out.device or seqs.device != out.device:
        raise ValueError(f"mla_prefill: the work list is on {tiles.device}, the tensors on {out.device}")
    if tiles.numel() == 0:
        return out
    dot_prec = "ieee" if q_nope.dtype == torch.float32 else "tf32"
    _mla_prefill_kernel[(tiles.shape[0], H)](
        q_nope, q_pe, k_nope, k_pe, v, out, tiles, seqs, float(scale) * _LOG2E,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), k_nope.stride(0), k_nope.stride(1),
        k_pe.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        NOPE=nope, ROPE=rope, VD=vd, NOPE_PAD=_pad(nope), ROPE_PAD=_pad(rope), VD_PAD=_pad(vd),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], DOT_PREC=dot_prec,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
