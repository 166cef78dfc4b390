"""The experts on Triton: a grouped GEMM over (token, expert) pairs sorted by expert.

    y = fused_experts(x, w13, w2, topk_weights, topk_ids, activation, tiles=table)

Two paths, both two products with the activation between (the layer's, on [pairs, 2I]; on
the sorted path SiLU-and-mul runs inside the first product, which then computes each
program's columns of the gate and the up halves and writes [pairs, I]: one launch and the
[pairs, 2I] round trip fewer):

- sorted (`moe_align` + `_moe_gemm_kernel`): the T*k pairs are grouped by expert and each
  expert's group is padded to a multiple of BLOCK_M, so that a program multiplies BLOCK_M
  rows of one expert by a BLOCK_N slice of that expert's weights (tensor-core `tl.dot`).
  The grouping runs on the device without a host sync, as three small kernels (a counting
  pass whose atomics also give each pair its place in its expert's group, the groups'
  offsets and each block's expert, the scatter) instead of a sort: the padded layout has a
  static upper bound of cdiv(pairs, BLOCK_M) + E blocks; blocks past the end hold expert -1
  and return at once. A pair's place inside its group depends on the atomics' order, which
  changes no result: each row of a tile is its own dot product. `moe_align_ref` is the
  torch version (a stable sort). For few pairs one program can build the same layout in the
  reference's order (`ONE_PROGRAM_MAX`: a decode batch of a few tokens).
- unsorted (`_moe_gemv_kernel`): one program per (pair, BLOCK_N slice), a dot product over
  K without tensor cores and without any sorting.

The small-batch rule (`skips_sorting`): sort only when T*k > E, i.e. when an expert gets
more than one pair on average. Below that nearly every BLOCK_M tile would be padding (at
least 15 of 16 rows), each expert's weights are read about once per pair either way, and the
sort's five small launches are pure overhead. A tuned tile file may replace the rule by the
measured crossover (`unsorted_max_tokens`, see `tile_configs`).

The second product multiplies each pair's row by its routing weight; the k rows of a token
are summed in fp32. fp32 inputs use full-precision dots ("ieee", no TF32).
"""
from __future__ import annotations

from typing import Callable

import torch

from atom.model_ops.activation import silu_and_mul
from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton
from atom.model_ops.moe.tile_configs import TileTable, default_config
from atom.model_ops.moe.topk_sum import topk_sum

if HAS_TRITON:
    from atom.model_ops.kernels.triton_import import grouped_tile

    @triton.jit
    def sorted_tile(block_expert_ptr, sorted_ptr, num_pairs, num_m_blocks, N, a_div,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """What program `program_id(0)` of a sorted-path grouped GEMM computes: (expert e, -1
        for a block past the end; its BLOCK_M pairs, which of them are real, the rows of the
        input they read, and the BLOCK_N output columns)."""
        pid_m, pid_n = grouped_tile(tl.program_id(0), num_m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
        e = tl.load(block_expert_ptr + pid_m)
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        return e, pairs, valid, (pairs // a_div).to(tl.int64), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)

    @triton.jit
    def store_tile(acc, b_ptr, rw_ptr, out_ptr, e, pairs, valid, rn, N, stride_be, stride_om,
                   HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr):
        """acc (+ expert e's bias) (* each pair's routing weight) into the pairs' output rows."""
        if HAS_BIAS:
            acc += tl.load(b_ptr + e.to(tl.int64) * stride_be + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if MUL_WEIGHT:
            acc *= tl.load(rw_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & (rn[None, :] < N))

    @triton.jit
    def _moe_gemm_kernel(a_ptr, w_ptr, b_ptr, out_ptr, sorted_ptr, block_expert_ptr, rw_ptr,
                         N, K, num_pairs, num_m_blocks, a_div, stride_am, stride_we, stride_wn, stride_be, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_PREC: tl.constexpr,
                         GATED: tl.constexpr):
        """out[p] = a[p // a_div] @ w[e]^T (+ b[e]) (* rw[p]) for the BLOCK_M pairs p of one
        expert e in the sorted order. GATED (the SiLU-gated first product, no bias or weight):
        w[e] is [gate | up] of N rows each and out[p] = silu(gate) * up, N wide; the gate and up
        products are rounded to out's dtype first, as the separate SiLU-and-mul kernel reads them."""
        e, pairs, valid, a_rows, rn = sorted_tile(block_expert_ptr, sorted_ptr, num_pairs, num_m_blocks, N, a_div,
                                                  BLOCK_M, BLOCK_N, GROUP_M)
        if e < 0:
            return
        rk = tl.arange(0, BLOCK_K)
        ap = a_ptr + a_rows[:, None] * stride_am + rk[None, :]
        wp = w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if GATED:
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            up_offset = N.to(tl.int64) * stride_wn
        for k in range(0, K, BLOCK_K):
            a = tl.load(ap, mask=valid[:, None] & (rk[None, :] + k < K), other=0.0)
            w = tl.load(wp, mask=(rn[None, :] < N) & (rk[:, None] + k < K), other=0.0)
            acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
            if GATED:
                wu = tl.load(wp + up_offset, mask=(rn[None, :] < N) & (rk[:, None] + k < K), other=0.0)
                acc_up = tl.dot(a, wu, acc_up, input_precision=DOT_PREC)
            ap += BLOCK_K
            wp += BLOCK_K
        if GATED:
            g = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            acc = g / (1.0 + tl.exp(-g)) * acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        store_tile(acc, b_ptr, rw_ptr, out_ptr, e, pairs, valid, rn, N, stride_be, stride_om, HAS_BIAS, MUL_WEIGHT)

    @triton.jit
    def _moe_gemv_kernel(a_ptr, w_ptr, b_ptr, out_ptr, ids_ptr, rw_ptr, N, K, a_div,
                         stride_am, stride_we, stride_wn, stride_be, stride_om,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                         MUL_WEIGHT: tl.constexpr):
        """out[p] = a[p // a_div] @ w[ids[p]]^T (+ b) (* rw[p]) for one pair p, one BLOCK_N slice."""
        p = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(ids_ptr + p).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        ap = a_ptr + (p // a_div).to(tl.int64) * stride_am + rk
        wp = w_ptr + e * stride_we + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k in range(0, K, BLOCK_K):
            a = tl.load(ap, mask=rk + k < K, other=0.0).to(tl.float32)
            w = tl.load(wp, mask=(rn[:, None] < N) & (rk[None, :] + k < K), other=0.0).to(tl.float32)
            acc += tl.sum(w * a[None, :], axis=1)
            ap += BLOCK_K
            wp += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + e * stride_be + rn, mask=rn < N, other=0.0).to(tl.float32)
        if MUL_WEIGHT:
            acc *= tl.load(rw_ptr + p).to(tl.float32)
        tl.store(out_ptr + p.to(tl.int64) * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=rn < N)


if HAS_TRITON:

    @triton.jit
    def _moe_count_kernel(ids_ptr, counts_ptr, rank_ptr, P, BLOCK: tl.constexpr):
        """counts[e] += 1 per pair of expert e; rank[p] = the pair's place among its expert's pairs."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < P
        e = tl.load(ids_ptr + offs, mask=ok, other=0)
        r = tl.atomic_add(counts_ptr + e, tl.full([BLOCK], 1, tl.int32), mask=ok)
        tl.store(rank_ptr + offs, r, mask=ok)

    @triton.jit
    def _store_block_experts(ends, padded, e_ok, block_expert_ptr, num_blocks, BLOCK_M: tl.constexpr,
                             E_PAD: tl.constexpr, CH: tl.constexpr):
        """The expert of every block (-1 past the end), from the experts' padded row ends: each
        expert writes its own blocks, CH a step (a decode batch's experts have one or two
        blocks each: one step), then the blocks past the last expert's get -1."""
        ex = tl.arange(0, E_PAD)
        first = (ends - padded) // BLOCK_M
        nblk = tl.where(e_ok, padded // BLOCK_M, 0)
        for i0 in range(0, tl.max(nblk, 0), CH):
            i = i0 + tl.arange(0, CH)
            tl.store(block_expert_ptr + first[:, None] + i[None, :], tl.broadcast_to(ex[:, None], [E_PAD, CH]),
                     mask=i[None, :] < nblk[:, None])
        for j0 in range(tl.sum(nblk, 0), num_blocks, 128):
            j = j0 + tl.arange(0, 128)
            tl.store(block_expert_ptr + j, tl.full([128], -1, tl.int32), mask=j < num_blocks)

    @triton.jit
    def _moe_offsets_kernel(counts_ptr, starts_ptr, sorted_ptr, block_expert_ptr, E, P, num_blocks,
                            BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CH: tl.constexpr, PAD_CH: tl.constexpr):
        """One program: each expert's first padded row, the padding rows (the pair count P: no
        pair; an expert's last block and every block past the end), and the expert of every
        block (-1 past the end). The scatter writes the other rows."""
        ex = tl.arange(0, E_PAD)
        e_ok = ex < E
        c = tl.load(counts_ptr + ex, mask=e_ok, other=0)
        padded = (c + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        starts = ends - padded
        tl.store(starts_ptr + ex, starts, mask=e_ok)
        for i0 in tl.static_range(0, BLOCK_M, PAD_CH):  # at most BLOCK_M - 1 padding rows an expert
            i = i0 + tl.arange(0, PAD_CH)
            tl.store(sorted_ptr + (starts + c)[:, None] + i[None, :], tl.full([E_PAD, PAD_CH], 0, tl.int32) + P,
                     mask=e_ok[:, None] & (i[None, :] < (padded - c)[:, None]))
        total = num_blocks * BLOCK_M
        for r0 in range(tl.sum(tl.where(e_ok, padded, 0), 0), total, 1024):
            r = r0 + tl.arange(0, 1024)
            tl.store(sorted_ptr + r, tl.full([1024], 0, tl.int32) + P, mask=r < total)
        _store_block_experts(ends, padded, e_ok, block_expert_ptr, num_blocks, BLOCK_M, E_PAD, CH)

    @triton.jit
    def _moe_align_one_program_kernel(ids_ptr, sorted_ptr, block_expert_ptr, P, E, num_blocks,
                                      BLOCK_M: tl.constexpr, P_PAD: tl.constexpr, E_PAD: tl.constexpr,
                                      CH: tl.constexpr, FILL: tl.constexpr):
        """The whole layout in one program, for few pairs: a [pairs, experts] match table gives
        the counts (column sums) and each pair's rank among its expert's pairs (earlier matches,
        a running sum down the column), so the order is `moe_align_ref`'s, by pair index."""
        p = tl.arange(0, P_PAD)
        ok = p < P
        e_of = tl.load(ids_ptr + p, mask=ok, other=-1).to(tl.int32)
        ex = tl.arange(0, E_PAD)
        e_ok = ex < E
        hits = (e_of[:, None] == ex[None, :]).to(tl.int32)  # one 1 per real pair's row
        counts = tl.sum(hits, 0)
        rank = tl.sum((tl.cumsum(hits, 0) - hits) * hits, 1)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        first_row = tl.sum((ends - padded)[None, :] * hits, 1)
        total = num_blocks * BLOCK_M
        for i0 in range(0, total, FILL):  # padding rows hold the pair count
            i = i0 + tl.arange(0, FILL)
            tl.store(sorted_ptr + i, tl.zeros([FILL], tl.int32) + P, mask=i < total)
        tl.debug_barrier()  # the fill lands before the pairs overwrite their rows
        tl.store(sorted_ptr + first_row + rank, p, mask=ok)
        _store_block_experts(ends, padded, e_ok, block_expert_ptr, num_blocks, BLOCK_M, E_PAD, CH)

    @triton.jit
    def _moe_scatter_kernel(ids_ptr, rank_ptr, starts_ptr, sorted_ptr, P, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < P
        e = tl.load(ids_ptr + offs, mask=ok, other=0)
        dest = tl.load(starts_ptr + e, mask=ok, other=0) + tl.load(rank_ptr + offs, mask=ok, other=0)
        tl.store(sorted_ptr + dest, offs, mask=ok)


# Up to this many (pairs x experts, both padded to powers of two) the layout is built by one
# program (`_moe_align_one_program_kernel`) instead of a fill and three kernels. Written
# for 8192 (decode batches of a few tokens: 64 experts up to 128 pairs, 128 up to 64, 256 up
# to 32; the match table 32 values a thread at 8 warps), where the five launches cost more
# than the work: `scripts/moe_align_sweep.py` finds it the faster up to this size and the
# slower past it (timings in docs/perf).
ONE_PROGRAM_SIZE = 8192
ONE_PROGRAM_MAX = ONE_PROGRAM_SIZE


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              one_program: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout of `moe_align_ref`: for few pairs (`ONE_PROGRAM_MAX`; `one_program` forces
    a path) from one program, in the reference's order; else from the three kernels of the
    module docstring (the order inside an expert's group is then the atomics')."""
    ids = topk_ids.reshape(-1)  # (int64 or int32: the kernels read either, no conversion launch)
    P, dev = ids.numel(), ids.device
    num_blocks = -(-P // block_m) + num_experts
    e_pad = triton.next_power_of_2(num_experts)
    if one_program is None:
        one_program = 0 < P and triton.next_power_of_2(P) * e_pad <= ONE_PROGRAM_MAX
    if one_program and P:
        sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
        block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
        _moe_align_one_program_kernel[(1,)](ids, sorted_pairs, block_expert, P, num_experts, num_blocks,
                                            BLOCK_M=block_m, P_PAD=triton.next_power_of_2(P), E_PAD=e_pad,
                                            CH=4, FILL=1024, num_warps=8)
        return sorted_pairs, block_expert
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    starts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    rank = torch.empty(max(P, 1), dtype=torch.int32, device=dev)
    block = 256
    if P:
        _moe_count_kernel[(triton.cdiv(P, block),)](ids, counts, rank, P, BLOCK=block, num_warps=4)
    # one program: vectors of E_PAD (an expert's blocks CH at a time; decode batches give each
    # expert one or two blocks), not a [blocks, experts] comparison table (5.5 us a layer for
    # 128 experts at ~250 tokens); it also writes the padding rows (no fill launch)
    _moe_offsets_kernel[(1,)](counts, starts, sorted_pairs, block_expert, num_experts, P, num_blocks,
                              BLOCK_M=block_m, E_PAD=e_pad, CH=4, PAD_CH=min(block_m, 16),
                              num_warps=1 if e_pad <= 128 else 4)
    if P:
        _moe_scatter_kernel[(triton.cdiv(P, block),)](ids, rank, starts, sorted_pairs, P, BLOCK=block, num_warps=4)
    return sorted_pairs, block_expert


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert, each expert padded to a multiple of `block_m`.

    Returns `sorted_pairs` [num_blocks * block_m] int32 (pair index t*k + j, or the pair count
    as padding) and `block_expert` [num_blocks] int32 (the expert of each block, -1 past the
    end). num_blocks = cdiv(pairs, block_m) + E, a bound that needs no host sync."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    P = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    first_of_expert = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    dest = (ends - padded)[experts_sorted] + torch.arange(P, device=dev) - first_of_expert[experts_sorted]
    num_blocks = -(-P // block_m) + num_experts
    sorted_pairs = torch.full((num_blocks * block_m,), P, dtype=torch.int32, device=dev)
    sorted_pairs[dest] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


def skips_sorting(tokens: int, top_k: int, num_experts: int, tiles: TileTable | None = None) -> bool:
    """The small-batch rule of the module docstring (or the tuned crossover)."""
    if tiles is not None and tiles.unsorted_max_tokens is not None:
        return tokens <= tiles.unsorted_max_tokens
    return tokens * top_k <= num_experts


def _dot_prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def expert_product(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, topk_ids: torch.Tensor,
                   a_div: int, weights: torch.Tensor | None, cfg: dict, sorted_layout=None,
                   gated: bool = False) -> torch.Tensor:
    """[pairs, N]: row p = a[p // a_div] @ w[ids[p]]^T (+ bias) (* weights[p]); through the
    sorted layout (`moe_align`) when given, else the unsorted per-pair kernel. `gated` (sorted
    layout, no bias or weights): w is [gate | up] and the result silu(gate) * up, [pairs, N/2],
    each program computing BLOCK_N / 2 columns of both halves (the bytes a program reads and
    the program count stay those of the plain product)."""
    P = topk_ids.numel()
    E, N, K = w.shape
    if gated:
        if sorted_layout is None or bias is not None or weights is not None or N % 2:
            raise ValueError("the gated product runs on the sorted layout without bias or routing weights, "
                             f"over an even width (got {N})")
        N //= 2
    out = torch.empty(P, N, dtype=a.dtype, device=a.device)
    if P == 0:
        return out
    ids = topk_ids.reshape(-1)
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = bias if bias is not None else out
    rw = weights.reshape(-1) if weights is not None else out
    common = dict(HAS_BIAS=bias is not None, MUL_WEIGHT=weights is not None)
    sb = bias.stride(0) if bias is not None else 0
    if sorted_layout is None:
        bn = min(cfg.get("BLOCK_N", 64), triton.next_power_of_2(N))
        grid = (P, triton.cdiv(N, bn))
        _moe_gemv_kernel[grid](a, w, b, out, ids, rw, N, K, a_div, a.stride(0), w.stride(0), w.stride(1), sb,
                               out.stride(0), BLOCK_N=bn, BLOCK_K=min(128, triton.next_power_of_2(K)),
                               num_warps=4, **common)
        return out
    sorted_pairs, block_expert = sorted_layout
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if gated:
        bn = max(16, bn // 2)
    num_m = block_expert.numel()
    grid = (num_m * triton.cdiv(N, bn),)
    _moe_gemm_kernel[grid](a, w, b, out, sorted_pairs, block_expert, rw, N, K, P, num_m, a_div,
                           a.stride(0), w.stride(0), w.stride(1), sb, out.stride(0),
                           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.get("GROUP_M", 1),
                           DOT_PREC=_dot_prec(a.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                           GATED=gated, **common)
    return out


def check_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> int:
    """The expert count of unpacked w13 [E, 2I, H] / w2 [E, H, I] that fit x [T, H]; else ValueError."""
    H = x.shape[1]
    E, two_i, _ = w13.shape
    if w13.shape[2] != H or w2.shape != (E, H, two_i // 2):
        raise ValueError(f"experts weights w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit hidden {H}")
    return E


def pair_layout(topk_ids: torch.Tensor, num_experts: int, tiles: TileTable | None, config: dict | None,
                sort: bool = True) -> tuple[dict, tuple | None]:
    """(tile config, `moe_align` layout or None) for one call over these routed pairs:
    `config` if given, else the tile table's choice for this batch, else `default_config`."""
    T, k = topk_ids.shape
    cfg = dict(config or (tiles.config_for(T, k) if tiles is not None else default_config(T, k, num_experts)))
    return cfg, (moe_align(topk_ids, num_experts, cfg["BLOCK_M"]) if sort else None)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor],
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  tiles: TileTable | None = None, config: dict | None = None, sort: bool | None = None,
                  fuse_activation: bool | None = None) -> torch.Tensor:
    """The routed sum of the experts, [T, H] (see the module docstring). `config` overrides
    the tile table's choice; `sort` forces a path (None: the small-batch rule). On the sorted
    path SiLU-and-mul runs inside the first product wherever the activation is `silu_and_mul`
    and w13 has no bias (`fuse_activation=False` keeps the separate kernel)."""
    if not HAS_TRITON:
        raise RuntimeError("fused_experts needs triton; the torch reference is experts_reference")
    T, H = x.shape
    E = check_shapes(x, w13, w2)
    k = topk_ids.shape[1]
    if T == 0:
        return torch.zeros_like(x)
    if sort is None:
        sort = not skips_sorting(T, k, E, tiles)
    cfg, layout = pair_layout(topk_ids, E, tiles, config, sort)
    if fuse_activation is not False and activation is silu_and_mul and w13_bias is None and layout is not None:
        act = expert_product(x, w13, None, topk_ids, k, None, cfg, layout, gated=True)
    else:
        act = activation(expert_product(x, w13, w13_bias, topk_ids, k, None, cfg, layout))
    y = expert_product(act, w2, w2_bias, topk_ids, 1, topk_weights, cfg, layout)
    return topk_sum(y, k)  # (summed in fp32 and rounded once, in one kernel)
