"""Small-M (M <= 64) 8-bit products on the tensor cores, "swap-AB": y = (xq xs)(wq ws)^T (+ b).

Why: at decode sizes the CUDA-core GEMV (`quant_gemm._qgemv_kernel`) converts every weight
byte to fp32 and multiply-adds it (~3 instructions a byte), which keeps it instruction-bound,
below the HBM rate the bf16 GEMV reaches (docs/perf/raw/history.md). Here the weight tile is the first
operand of tl.dot: a program owns BLOCK_N weight rows, reads them [BLOCK_N, BLOCK_K] straight
from the row-major (K-major) weight, and multiplies them by the activation rows transposed,
xq^T [BLOCK_K, M_PAD] (M_PAD >= 16, tl.dot's smallest size; the padding rows are masked to
zero and never stored). The accumulator is [BLOCK_N, M_PAD]: fp32 for fp8, int32 for int8
(exact, `out_dtype=tl.int32`). The instructions a weight byte costs drop to a fraction of
one, so the loop is bound by the weight loads, which the compiler pipelines over
`num_stages` K steps.

Scales, as in `quant_gemm` (same operand layouts and `_check`):
- row / column (`block_k` = 0): acc * ws[n] * xs[m] once at the end (xs one value or [M]);
- blocks (`block_k` > 0): BLOCK_K = block_k, each step's product scaled by ws[n, kb] xs[m, kb]
  before it is added (fp32).

SPLIT_K: layers with few output rows (4096 / 64 = 64 programs against 132 SMs) split K over
SPLIT_K programs per row tile. Each split writes its scaled fp32 partial to a buffer
[SPLIT_K, M, N] and `split_k.split_k_sum` sums the splits in a fixed order, adds the bias
and casts. Chosen over fp32 atomics into a zeroed buffer because (a) atomics need that
buffer zeroed (a memset launch) and still a cast pass for 16-bit outputs, so they save no
launch; (b) the fixed-order sum is deterministic (replays give the same bits); (c) the
partials are small (SPLIT_K * M * N * 4 bytes: 64 KiB for 4096 rows at M = 1, SPLIT_K = 4,
against 16 MiB of weights). Both launches have fixed shapes (no host sync, no
data-dependent sizes): CUDA-graph safe. Both take part in programmatic dependent launch.

Folded split-K (a `lock` given, `split_k_lock`; the kernel plan's "split_k_fold"): no second
launch. Each split stores its partial as above, then counts itself on its n tile's int32
counter (a block barrier, then one acq_rel atomic at GPU scope); the program that counts
last, whichever it is, reads the SPLIT_K partials of its tile back in split order, adds the
bias, stores y and sets the counter back to zero. The same fixed-order sum as the separate
reduction (the same bits, deterministic); what it costs is one atomic a program and the last
program's read of SPLIT_K small tiles, against a launch. The counters are a buffer of the
layer's, zero between launches, used by one launch at a time (launches in one stream; the
next kernel's PDL wait comes before it touches them).

Fused activation quantization (`quant_gemv_dot_fused`): the kernel reads x (bf16 / fp16 /
fp32) instead of xq and quantizes each chunk on the fly with exactly `act_quant`'s arithmetic
(`act_quant._quantize`, the same scale formula max(amax, 1e-12) / qmax with a correctly
rounded division), so one launch replaces two:
- per token: a prologue walks the whole K of the program's M_PAD rows (a row's scale needs
  the amax of the full row, also under SPLIT_K), then the main loop quantizes each chunk;
- per 1 x block_k group (FP8 block): the chunk is the group, its amax taken from the chunk
  itself: no prologue;
- static / per-tensor: the one scale is read from memory.
Every program re-reads x (from L2): M * K * 2 bytes a program; measured slower than the
separate quantizer at every M, so the table does not fuse (`FUSE_MAX_M`).

Rows quantized on load (`quant_gemv_dot_pending_launch`, a `pending_quant.PendingQuant`): the
kernel in front stored x unquantized with partial amaxes of each row, so the per-token scale
is the max of a few partials (PARTS), not a walk over K, and each K step is quantized as it
is loaded (the kernel plan's "quant_on_load": SiLU-and-mul's split kernel in front of down).
With one row (X1) a step quantizes the row's BLOCK_K values alone and places them in row 0 of
the zero-padded operand instead of quantizing all M_PAD rows (also the fused quantizer's case).

Weight tiles through TMA (`TMA_WEIGHTS`, opt-in, NVIDIA sm90+ where the weight's base and rows are
16-byte aligned): the weight is passed as a tensor descriptor of [BLOCK_N, BLOCK_K] blocks and
each K step is one bulk copy into shared memory, which the compiler pipelines with mbarriers,
instead of every thread issuing 16-byte asynchronous copies; rows and columns past the weight
come back as zeros, as the masks gave them, so the sums are the same. `TMA_EARLY` (fp8,
pre-quantized x, row / column scales): each program's first weight tile is copied before its
PDL wait, while the kernel in front finishes, and multiplied ahead of the loop. A config's
"TMA" / "EARLY" keys override both (`scripts/qdot_tma_sweep.py` times them). Both are off by
default: neither was faster than the pointer loads at the Llama-3.1-8B shapes, alone or in
batch-1 decode (docs/perf/raw/history.md).

`small_m_config(M, N, K, block_k, kind, act)` is the dispatch table `quant.common` consults
(None keeps the older kernels for that case), set from the H200 sweeps
(`scripts/quant_gemv_sweep.py --kinds fp8dot int8dot fp8blockdot` up to 64 rows,
`scripts/fp8_gemm_sweep.py` above).
"""
from __future__ import annotations

from typing import Optional

import torch

from atom.model_ops.kernels.pending_quant import PendingQuant
from atom.model_ops.kernels.quant_gemm import _check, check_weight_scales
from atom.model_ops.kernels.split_k import PendingSum, split_k_sum
from atom.model_ops.kernels.triton_import import HAS_TRITON, compiled_for_sm90, pdl_args, tl, triton
from atom.utils.pow2 import next_pow2

DOT_MAX_M = 64  # the largest M this kernel takes for every 8-bit format
MID_MAX_M = 128  # and for ptpc fp8 into narrow outputs with long rows (MID_MAX_N, MID_MIN_K)
MID_MAX_N = 4096
MID_MIN_K = 4096
FUSE_MAX_M = 0  # up to here the table folds the activation quantizer in (0: never; see small_m_config)
TARGET_PROGRAMS = 264  # ~2 programs per SM of an H200 (132 SMs): SPLIT_K grows until reached
LONG_K = 8192  # rows at least this long take 128-row tiles at decode sizes (small_m_config)
LONG_K_PROGRAMS = 128  # and split K only to about one program per SM (a power of two of programs)
TMA_WEIGHTS = False  # weight tiles through TMA on NVIDIA sm90+ (a config's "TMA" overrides; module docstring)
TMA_EARLY = False  # with TMA, each program's first weight tile loaded before the PDL wait ("EARLY" overrides)
_KINDS = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}

if HAS_TRITON:
    from atom.model_ops.kernels.act_quant import _quantize
    from atom.model_ops.kernels.gemm import TensorDescriptor
    from atom.model_ops.kernels.triton_import import FP8_PROMOTE, pdl_start

    # M and SPLIT_K are run-time values (M = 1 not specialized apart): fewer compiled variants
    # for a sweep over M and SPLIT_K; SPLIT (SPLIT_K > 1) picks the store.
    @triton.jit(do_not_specialize=["M", "SPLIT_K"])
    def _qdot_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, p_ptr, lock_ptr, M, N, K, stride_xm, stride_wn,
                     stride_ym, stride_xs, stride_ws, qmax, SPLIT_K, n_parts, M_PAD: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, BLOCKS: tl.constexpr,
                     INT: tl.constexpr, HAS_BIAS: tl.constexpr, QUANT_X: tl.constexpr, STATIC: tl.constexpr,
                     PARTS: tl.constexpr, X1: tl.constexpr, FOLD: tl.constexpr, PDL: tl.constexpr,
                     TMA: tl.constexpr = False, EARLY: tl.constexpr = False):
        """Program (n tile, K split). QUANT_X: x is unquantized and quantized here (STATIC: the
        scale is xs_ptr[0], row / column scales only; PARTS > 0: each row's amax is the max of
        its n_parts partials xs_ptr[m, :] (`pending_quant`); else per row over K, or per chunk
        with BLOCKS). X1 (QUANT_X, one row, no BLOCKS): each step quantizes the row's BLOCK_K
        values alone and places them in row 0 of the zero-padded operand, rather than
        quantizing all M_PAD rows of it (the same values). FOLD (with SPLIT): the last split
        of each n tile to finish sums the partials (see the module docstring); lock_ptr: one
        int32 counter per n tile, zero on entry and left zero. TMA: w_ptr is a tensor
        descriptor of the weight, block [BLOCK_N, BLOCK_K]. EARLY (TMA, fp8, pre-quantized x,
        row / column scales): the split's first weight tile is loaded before the PDL wait and
        multiplied ahead of the loop."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        ms = tl.arange(0, M_PAD)
        m_ok = ms < M
        rk = tl.arange(0, BLOCK_K)
        steps = tl.cdiv(K, BLOCK_K)
        per_split = tl.cdiv(steps, SPLIT_K)
        first = pid_k * per_split
        last = tl.minimum(first + per_split, steps)
        if not TMA:
            w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
        x_ptrs = x_ptr + ms.to(tl.int64)[:, None] * stride_xm + rk[None, :]
        if EARLY:  # the first weight tile before the wait: weights never depend on the kernel in front
            w_first = w_ptr.load([pid_n * BLOCK_N, first * BLOCK_K])
        pdl_start(PDL)
        if TMA:
            qdt = w_ptr.dtype
        else:
            qdt = w_ptr.dtype.element_ty
        if QUANT_X and not BLOCKS:
            if STATIC:
                xsc = tl.load(xs_ptr).to(tl.float32) + tl.zeros([M_PAD], tl.float32)
            elif PARTS > 0:  # the amax from the kernel in front's partials (act_quant's formula)
                parts = tl.arange(0, PARTS)
                pm = tl.load(xs_ptr + ms[:, None] * stride_xs + parts[None, :],
                             mask=m_ok[:, None] & (parts[None, :] < n_parts), other=0.0)
                xsc = tl.math.div_rn(tl.maximum(tl.max(pm, 1), 1e-12), qmax)
            else:  # per-token scale: the amax over the whole row (act_quant's formula)
                amax = tl.zeros([M_PAD, BLOCK_K], tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    v = tl.load(x_ptrs + k0, mask=m_ok[:, None] & (rk[None, :] + k0 < K), other=0.0)
                    amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
                xsc = tl.math.div_rn(tl.maximum(tl.max(amax, 1), 1e-12), qmax)
            if X1:
                xsc1 = tl.max(tl.where(ms == 0, xsc, 0.0), 0)  # row 0's scale (every scale is > 0)
        if INT:
            acc = tl.zeros([BLOCK_N, M_PAD], tl.int32)
        else:
            acc = tl.zeros([BLOCK_N, M_PAD], tl.float32)
        lo = first
        if EARLY:  # that tile's product (past the split's end or K: zeros, as TMA fills them)
            k_ok = rk + first * BLOCK_K < K
            x = tl.load(x_ptrs + first * BLOCK_K, mask=m_ok[:, None] & k_ok[None, :] & (first < last), other=0.0)
            acc = tl.dot(w_first, tl.trans(x), acc,
                         max_num_imprecise_acc=FP8_PROMOTE if BLOCK_K > FP8_PROMOTE else BLOCK_K)
            lo = first + 1
        for step in range(lo, last):
            k0 = step * BLOCK_K
            k_ok = rk + k0 < K
            if TMA:  # the copy engine fills shared memory (rows and columns past the weight: zeros)
                w = w_ptr.load([pid_n * BLOCK_N, k0])
            else:
                w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if X1:
                xr = _quantize(tl.load(x_ptr + k0 + rk, mask=k_ok, other=0.0).to(tl.float32), xsc1, INT)
                x = tl.where(ms[:, None] == 0, xr[None, :], 0.0).to(qdt)
            else:
                x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if BLOCKS:
                if QUANT_X:  # the chunk is the 1 x block_k group: its scale from its own amax
                    xf = x.to(tl.float32)
                    xsb = tl.math.div_rn(tl.maximum(tl.max(tl.abs(xf), 1), 1e-12), qmax)
                    x = _quantize(xf, xsb[:, None], INT).to(qdt)
                else:
                    xsb = tl.load(xs_ptr + ms * stride_xs + step, mask=m_ok, other=0.0)
                wsb = tl.load(ws_ptr + rn * stride_ws + step, mask=n_ok, other=0.0)
                acc += tl.dot(w, tl.trans(x)) * wsb[:, None] * xsb[None, :]
            else:
                if QUANT_X and not X1:
                    x = _quantize(x.to(tl.float32), xsc[:, None], INT).to(qdt)
                if INT:  # int8 x int8 accumulates exactly in int32 (tl.dot's default is fp32)
                    acc = tl.dot(w, tl.trans(x), acc, out_dtype=tl.int32)
                else:  # partial sums carried into fp32 every FP8_PROMOTE products (triton_import)
                    acc = tl.dot(w, tl.trans(x), acc,
                                 max_num_imprecise_acc=FP8_PROMOTE if BLOCK_K > FP8_PROMOTE else BLOCK_K)
        if BLOCKS:
            out = acc
        else:
            if not QUANT_X:
                xsc = tl.load(xs_ptr + ms * stride_xs, mask=m_ok, other=0.0)
            ws = tl.load(ws_ptr + rn * stride_ws, mask=n_ok, other=0.0)
            out = acc.to(tl.float32) * ws[:, None] * xsc[None, :]
        mask = n_ok[:, None] & m_ok[None, :]
        if not SPLIT:
            if HAS_BIAS:
                out += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptr + ms.to(tl.int64)[None, :] * stride_ym + rn[:, None], out.to(y_ptr.dtype.element_ty),
                     mask=mask)
        else:  # partial [SPLIT_K, M, N] fp32, contiguous
            tile = p_ptr + ms.to(tl.int64)[None, :] * N + rn[:, None]
            tl.store(tile + pid_k.to(tl.int64) * M * N, out, mask=mask)
            if FOLD:
                # every thread's partial is stored before the counter's release (bar.sync, then
                # one thread's acq_rel atomic at GPU scope); the program that counts last reads
                # all splits from L2 (.cg), in split order: split_k_sum's sum, bit for bit
                tl.debug_barrier()
                arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
                if arrived == SPLIT_K - 1:
                    total = tl.load(tile, mask=mask, other=0.0, cache_modifier=".cg")
                    for s in range(1, SPLIT_K):
                        total += tl.load(tile + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
                    if HAS_BIAS:
                        total += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
                    tl.store(y_ptr + ms.to(tl.int64)[None, :] * stride_ym + rn[:, None],
                             total.to(y_ptr.dtype.element_ty), mask=mask)
                    tl.atomic_xchg(lock_ptr + pid_n, 0)  # ready for the next launch (a graph replay)


def small_m_config(M: int, N: int, K: int, block_k: int = 0, kind: str = "fp8", act: str = "token",
                   big_smem: bool = True) -> Optional[dict]:
    """The swap-AB kernel's tiles for one product, or None where the older kernels run.

    From the H200 sweep (`scripts/quant_gemv_sweep.py --kinds fp8dot int8dot fp8blockdot
    --quick`, Llama-3.1-8B shapes; figures in docs/perf/raw/history.md), where these tiles were
    the best of the grid at every shape and M in 1-64:
    - M <= DOT_MAX_M (64) for every 8-bit format; M_PAD = max(16, next power of two of M);
      faster there than the CUDA-core GEMV, the tl.dot GEMM and torch._scaled_mm (which from
      M = 65 takes fp8 row / column products);
    - BLOCK_N 64 weight rows a program (one warpgroup's wgmma height); BLOCK_K 256 (a 16 KiB
      fp8 weight tile a stage, 4 stages), or the scale block with block scales;
    - SPLIT_K: the smallest power of two that gives >= TARGET_PROGRAMS programs, keeping
      >= 4 K steps a split (at BLOCK_K 256: 4096 x 4096 and 6144 x 4096: 4, 28672 x 4096: 1,
      4096 x 14336: 8);
    - one 16-row tile (M <= 16) with row / column scales, from the wider M = 1 sweep
      (`--wide`, BLOCK_N 16-128 x BLOCK_K 128-512 x SPLIT_K 1-16): rows of K >= LONG_K
      (down_proj, 4096 x 14336) take 128-row tiles over 8 warps and split K only to about one
      program per SM (LONG_K_PROGRAMS: SPLIT_K 4), 23.8 against 26.3 us; 4096 < N <= 8192
      (6144 x 4096, q/k/v) takes BLOCK_K 128 over 6 stages, 11.1 against 12.8 us (each with
      the quantizer in front); the other two shapes were within 0.3 us of the tiles above.
      fp8 only (int8 was not swept so) and only with `big_smem` (sm90's ~227 KiB a block: the
      K >= LONG_K tile needs ~144 KiB, over the ~99 KiB of sm86 / sm89; `_big_smem`);
    - FUSE (activation quantizer folded in) only up to FUSE_MAX_M, now 0: every program
      re-reading and reducing its rows of x cost more than the separate quantizer launch
      plus the unfused kernel, so the table never fuses (the fused kernel stays callable
      with `FUSE=True` in a config);
    - 65-128 rows (MID_MAX_M) of ptpc fp8 (row / column scales, per-token activations) into at
      most MID_MAX_N outputs from rows of at least MID_MIN_K (Llama-3.1-8B's o_proj and down):
      one 128-row tile, 64 weight rows, BLOCK_K 128, SPLIT_K 4 (`scripts/fp8_gemm_sweep.py`:
      at 80 / 128 rows 4096 x 4096 11.1 / 11.8 us and 4096 x 14336 24.1 / 25.5 us against
      torch._scaled_mm's 13.8 / 14.0 and 38.1 / 38.0, whose 128 x 128 tiles give such outputs
      32 programs; q/k/v and gate-up, and 192-256 rows, stayed faster there)."""
    if DOT_MAX_M < M <= MID_MAX_M and kind == "fp8" and not block_k and act == "token" and big_smem \
            and N <= MID_MAX_N and K >= MID_MIN_K:
        return dict(M_PAD=MID_MAX_M, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=4, FUSE=False)
    if M < 1 or M > DOT_MAX_M:
        return None
    bn, bk, warps, stages, target = 64, block_k or 256, 4, 4, TARGET_PROGRAMS
    if M <= 16 and not block_k and kind == "fp8" and big_smem:  # one 16-row tile: the wide sweep's decode rows
        if K >= LONG_K:
            bn, warps, target = 128, 8, LONG_K_PROGRAMS
        elif 4096 < N <= 8192:
            bk, stages = 128, 6
    steps = -(-K // bk)
    split = 1
    while -(-N // bn) * split < target and steps // (split * 2) >= 4:
        split *= 2
    m_pad = max(16, next_pow2(M))
    return dict(M_PAD=m_pad, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages,
                FUSE=M <= FUSE_MAX_M and act in ("token", "tensor", "group"))


def table_summary() -> str:
    """What `small_m_config` routes here, in words (the per-layer `kernel` column): edit it
    with the table."""
    fused = f"; activation quantizer folded in for M<={FUSE_MAX_M}" if FUSE_MAX_M else ""
    return (f"quant_gemv_dot (tensor-core swap-AB, M<={DOT_MAX_M}; ptpc fp8 M<={MID_MAX_M} into N<={MID_MAX_N} "
            f"with K>={MID_MIN_K}{fused})")


def _big_smem(device: torch.device) -> bool:
    """Whether `device` gives a block sm90's shared memory (the table's widest decode tiles):
    anything but a CUDA device before sm90 (`compiled_for_sm90`, cached per device)."""
    return device.type != "cuda" or compiled_for_sm90(
        device.index if device.index is not None else torch.cuda.current_device())


def _cfg(M, N, K, block_k, config, kind, device):
    cfg = dict(config or small_m_config(M, N, K, block_k, kind, big_smem=_big_smem(device)) or {})
    if not cfg:
        raise ValueError(f"quant_gemv_dot takes M <= {DOT_MAX_M} rows (ptpc fp8: M <= {MID_MAX_M} into N <= "
                         f"{MID_MAX_N} with K >= {MID_MIN_K}), got M={M}, N={N}, K={K}")
    cfg.pop("FUSE", None)
    if block_k:  # a K step is one scale block
        cfg["BLOCK_K"] = block_k
    if cfg["M_PAD"] < max(16, M) or cfg["M_PAD"] & (cfg["M_PAD"] - 1):
        raise ValueError(f"M_PAD={cfg['M_PAD']} must be a power of two >= max(16, M={M})")
    if cfg["SPLIT_K"] < 1:
        raise ValueError(f"SPLIT_K={cfg['SPLIT_K']} must be >= 1")
    return cfg


def _run(x, xs, w, ws, bias, out_dtype, block_k, cfg, quant_x, static, qmax, lock=None, defer_sum=False,
         parts=False):
    """Both launches (the product, then the split reduction when SPLIT_K > 1 and no `lock`
    folds it into the product); `defer_sum`: a split K's partials returned unsummed, as a
    `split_k.PendingSum` (the kernel after the product adds them). `parts` (with `quant_x`):
    xs is [M, P] partial amaxes of x's rows."""
    M, K = x.shape
    N = w.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    ws = ws.float().contiguous()
    xs = xs.float().contiguous()
    stride_xs = (xs.shape[-1] if (block_k and not quant_x) or parts else (0 if xs.numel() == 1 else 1))
    stride_ws = ws.shape[-1] if block_k else 1
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    cfg = dict(cfg)
    split = cfg.pop("SPLIT_K")
    part = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else y
    b = bias.contiguous() if bias is not None else y
    tiles = triton.cdiv(N, cfg["BLOCK_N"])
    fold = split > 1 and lock is not None
    if fold:
        check_lock(lock, tiles, x.device)
    tma = _weights_through_tma(w, cfg.pop("TMA", None))
    early = cfg.pop("EARLY", TMA_EARLY) and tma and not quant_x and not block_k and w.dtype != torch.int8
    wa = TensorDescriptor.from_tensor(w, [cfg["BLOCK_N"], cfg["BLOCK_K"]]) if tma else w
    pdl = pdl_args(x)
    _qdot_kernel[(tiles, split)](
        x, xs, wa, ws, b, y, part, lock if fold else part, M, N, K, x.stride(0), w.stride(0), y.stride(0),
        stride_xs, stride_ws, float(qmax), split, xs.shape[-1] if parts else 0, SPLIT=split > 1,
        BLOCKS=bool(block_k), INT=w.dtype == torch.int8, HAS_BIAS=bias is not None, QUANT_X=quant_x, STATIC=static,
        PARTS=triton.next_power_of_2(xs.shape[-1]) if parts else 0, X1=quant_x and not block_k and M == 1,
        FOLD=fold, TMA=tma, EARLY=bool(early), **pdl, **cfg)
    if split > 1 and not fold:
        if defer_sum:
            return PendingSum(part, bias, out_dtype)
        split_k_sum(part, bias, y, pdl)
    return y


def _weights_through_tma(w: torch.Tensor, asked: Optional[bool]) -> bool:
    """Whether the launch reads `w` through a tensor descriptor (TMA): `asked` True / False
    from a config, None for TMA_WEIGHTS where the device and w's layout allow it (NVIDIA
    sm90+, 16-byte aligned base and rows; `gemm._tma_layout_problem`)."""
    from atom.model_ops.kernels.gemm import _tma_device, _tma_layout_problem
    want = TMA_WEIGHTS if asked is None else asked
    if not want:
        return False
    ok = w.is_cuda and _tma_device(w.device.index if w.device.index is not None else torch.cuda.current_device())
    problem = _tma_layout_problem(weight=w) if ok else f"{w.device} is not an NVIDIA sm90+ GPU with TMA"
    if problem is not None and asked:
        raise ValueError(f"quant_gemv_dot config TMA=True: {problem}")
    return problem is None


def split_k_lock(N: int, device) -> torch.Tensor:
    """The counters a product of N output rows folds its split-K sum with (one per n tile of
    the smallest BLOCK_N, 16; zeros): a layer's own buffer, made once and kept (a CUDA graph
    captured with it keeps its address), used by one launch at a time."""
    return torch.zeros(-(-N // 16), dtype=torch.int32, device=device)


def check_lock(lock: torch.Tensor, tiles: int, device) -> None:
    if lock.dtype != torch.int32 or lock.dim() != 1 or lock.numel() < tiles or lock.device != torch.device(device):
        raise ValueError(f"split-K lock: int32 [>= {tiles}] on {device} wanted (one counter per n tile), got "
                         f"{lock.dtype} {tuple(lock.shape)} on {lock.device}")


def quant_gemv_dot_launch(xq, xs, w, ws, bias, out_dtype, block_k=0, config=None, lock=None, defer_sum=False):
    """Pre-quantized operands (`quant_gemm`'s layouts) -> [M, N] in `out_dtype`; `config`
    overrides `small_m_config`. `lock` (`split_k_lock(N)`): a split K is summed inside the
    product, not by the separate reduction (the same bits). `defer_sum`: a split K comes back
    as a `split_k.PendingSum` (no reduction launched)."""
    M, N, K = _check(xq, xs, w, ws, bias, block_k)
    if block_k and xq.dtype == torch.int8:
        raise ValueError("block scales are an fp8 format; int8 runs with row / column scales")
    cfg = _cfg(M, N, K, block_k, config, "int8" if xq.dtype == torch.int8 else "fp8", xq.device)
    return _run(xq, xs, w, ws, bias, out_dtype, block_k, cfg, False, False, 1.0, lock, defer_sum)


def _check_fused(x, w, ws, bias, kind, block_k, static_scale):
    if not HAS_TRITON:
        raise RuntimeError("quantized GEMM kernels need triton; use the torch reference without it")
    if kind not in _KINDS:
        raise ValueError(f"quant_gemv_dot_fused kind={kind!r}: allowed {sorted(_KINDS)}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x dtype {x.dtype}: the fused quantizer reads bfloat16, float16 or float32")
    if w.dtype != _KINDS[kind]:
        raise ValueError(f"w dtype {w.dtype}: kind={kind!r} needs {_KINDS[kind]}")
    if block_k and kind == "int8":
        raise ValueError("block scales are an fp8 format; int8 runs with row / column scales")
    if static_scale is not None and block_k:
        raise ValueError("static_scale with block_k: block activations are quantized per 1 x block_k group, "
                         "dynamically")
    if static_scale is not None and static_scale.numel() != 1:
        raise ValueError(f"static_scale must be one value, got shape {tuple(static_scale.shape)}")
    M, K = x.shape
    N = w.shape[0]
    check_weight_scales(ws, bias, N, K, block_k)
    return M, N, K


def quant_gemv_dot_fused_launch(x, w, ws, bias, kind, qmax, block_k=0, static_scale=None, config=None):
    """x [M, K] unquantized times the 8-bit w: the activations quantized inside the kernel as
    `act_quant(x, kind, block_k or K, qmax, static_scale)` would (per token, per 1 x block_k
    group, or with the one static scale) -> [M, N] in x's dtype."""
    M, N, K = _check_fused(x, w, ws, bias, kind, block_k, static_scale)
    cfg = _cfg(M, N, K, block_k, config, kind, x.device)
    static = static_scale is not None
    xs = static_scale.reshape(1) if static else ws  # unread without a static scale
    return _run(x, xs, w, ws, bias, x.dtype, block_k, cfg, True, static, qmax)


def quant_gemv_dot_pending_launch(x: PendingQuant, w, ws, bias, out_dtype, config=None, lock=None, defer_sum=False):
    """Rows waiting for their quantization (`pending_quant.PendingQuant`: x.h and its
    partial amaxes) times the 8-bit w: each K step quantized on load with the row's scale
    from the partials, as `x.quantize()` then `quant_gemv_dot_launch` would compute, in one
    launch (and the split reduction unless `lock` / `defer_sum`, as there)."""
    kind = "int8" if w.dtype == torch.int8 else "fp8"
    if x.kind != kind:
        raise ValueError(f"pending rows quantize to {x.kind}, the weight is {w.dtype}")
    M, N, K = _check_fused(x.h, w, ws, bias, kind, 0, None)
    if x.pmax.dim() != 2 or x.pmax.shape[0] != M or x.pmax.dtype != torch.float32:
        raise ValueError(f"pending rows' partial amaxes: fp32 [M={M}, P] wanted, got {x.pmax.dtype} "
                         f"{tuple(x.pmax.shape)}")
    cfg = _cfg(M, N, K, 0, config, kind, x.h.device)
    return _run(x.h, x.pmax, w, ws, bias, out_dtype, 0, cfg, True, False, x.qmax, lock, defer_sum, parts=True)


@torch.library.custom_op("atom::quant_gemv_dot", mutates_args=())
def quant_gemv_dot(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                   bias: Optional[torch.Tensor], out_dtype: torch.dtype, block_k: int = 0) -> torch.Tensor:
    """The swap-AB tensor-core product of the module docstring (pre-quantized x) -> [M, N]."""
    return quant_gemv_dot_launch(xq, xs, w, ws, bias, out_dtype, block_k)


@quant_gemv_dot.register_fake
def _(xq, xs, w, ws, bias, out_dtype, block_k=0):
    return xq.new_empty(xq.shape[0], w.shape[0], dtype=out_dtype)


@torch.library.custom_op("atom::quant_gemv_dot_fused", mutates_args=())
def quant_gemv_dot_fused(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bias: Optional[torch.Tensor], kind: str,
                         qmax: float, block_k: int = 0, static_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The swap-AB product with the activation quantizer folded in -> [M, N] in x's dtype."""
    return quant_gemv_dot_fused_launch(x, w, ws, bias, kind, qmax, block_k, static_scale)


@quant_gemv_dot_fused.register_fake
def _(x, w, ws, bias, kind, qmax, block_k=0, static_scale=None):
    return x.new_empty(x.shape[0], w.shape[0])
