"""Dynamic per-token activation quantization fused into the kernel in front of an 8-bit
product, so that the row goes to the product already quantized (one launch, and one pass over
the row, fewer at every M):
- `norm_quant(x, residual, w, eps, kind, qmax)`: residual add + RMSNorm + quantization, before
  the q/k/v and gate-up projections -> (q, scales, x + residual);
- `silu_quant(x, kind, qmax)`: SiLU-and-mul + quantization, before the down projection
  -> (q, scales).
q is [M, K] float8_e4m3fn or int8 and scales [M, 1] fp32, what `act_quant(h, kind, K, qmax)`
returns for the row h that the separate kernels would have written.

Bit for bit the separate kernels (`rmsnorm.fused_add_rms_norm` / `activation.silu_and_mul`,
then `act_quant`): the row is computed by the same jit functions (`rmsnorm.add_rms_norm_row`,
`activation.silu_mul_cols`; the norm with the same block and warps, `rmsnorm.norm_row_config`,
so its sum runs in the same order), rounded to the activations' dtype as those kernels store
it, and quantized with `act_quant`'s arithmetic (scale = max(amax, 1e-12) / qmax correctly
rounded, `act_quant._quantize`). The rounded row itself is never written. One exception, the
first decoder layer of a model whose hidden size is at most `rmsnorm.SHORT_ROW` (512): with
no residual to add the unfused norm is `rms_norm`'s short-row kernel, which sums in another
order, so a normed value there can differ by one ulp of its dtype (and its quantized value
by one step).

One program per row, the whole row in registers (`silu_quant` rows wider than
`act_quant.SINGLE_PASS_MAX` are walked twice in chunks, amax then quantize, recomputing the
activation: the same values). Both take part in programmatic dependent launch.

Wide rows (`silu_quant` at M <= SPLIT_MAX_ROWS, I > SPLIT_BLOCK: Llama's 14336) leave one
program per row with the whole row's arithmetic (an exp and two IEEE divisions a value) on one
SM, at decode sizes most of the GPU idle. There the row is split over programs of SPLIT_BLOCK
columns in two launches: the first writes its columns of silu(gate) * up (as `silu_and_mul`
stores them) and their amax; the second takes the row's amax from those partials (the same
max in every program), the scale, and quantizes its columns. The same values as one program;
faster for Llama-3.1-8B's ptpc FP8 decode at batch 1 and in the workload's steps of up to 128
sequences (docs/perf). The first launch alone is `silu_amax` (its rows and partials as a
`pending_quant.PendingQuant`, which the kernel plan's "quant_on_load" hands to down's product
to quantize on load); the second is `quant_from_partials`.
"""
from __future__ import annotations

from typing import Optional

import torch

from atom.model_ops.kernels.act_quant import SINGLE_PASS_MAX, act_quant_ref
from atom.model_ops.kernels.rmsnorm import (as_rows, check_norm_args, fused_add_rms_norm_ref, norm_row_config,
                                           rms_norm_ref)
from atom.model_ops.kernels.pending_quant import PendingQuant
from atom.model_ops.kernels.split_k import PendingSum
from atom.model_ops.kernels.triton_import import HAS_TRITON, pdl_args, tl, triton

_KINDS = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32} if HAS_TRITON else {}

if HAS_TRITON:
    from atom.model_ops.kernels.act_quant import _quantize
    from atom.model_ops.kernels.activation import silu_mul_cols
    from atom.model_ops.kernels.rmsnorm import add_rms_norm_row, add_rms_norm_vals
    from atom.model_ops.kernels.split_k import split_sum_cols
    from atom.model_ops.kernels.triton_import import pdl_start

    @triton.jit
    def _quantize_row(h, q_row, s_ptr, cols, mask, qmax, INT8: tl.constexpr, VEC: tl.constexpr = 0):
        """h (fp32 values of the row, zero where masked) quantized as act_quant does. VEC: the
        stores' offsets are written so that Triton's analysis finds runs of only VEC
        contiguous columns (`_runs_of`), so that it lays the row out VEC columns a thread."""
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(h), 0), 1e-12), qmax)
        tl.store(s_ptr, scale)
        at = _runs_of(cols, VEC) if VEC else cols
        tl.store(q_row + at, _quantize(h, scale, INT8).to(q_row.dtype.element_ty), mask=mask)

    @triton.jit
    def _runs_of(cols, VEC: tl.constexpr):
        """cols itself, written as (cols // VEC) VEC + cols % VEC: the axis analysis sees runs of
        VEC contiguous values, so a store through it is vectorized VEC elements a thread."""
        return cols // VEC * VEC + cols % VEC

    @triton.jit(do_not_specialize=["M", "SPLIT_K"])
    def _norm_quant_kernel(x_ptr, r_ptr, w_ptr, rout_ptr, q_ptr, s_ptr, stride_x, stride_r, stride_ro, stride_q,
                           N, eps, qmax, BLOCK: tl.constexpr, HAS_RES: tl.constexpr, INT8: tl.constexpr,
                           PDL: tl.constexpr, b_ptr=None, M=0, SPLIT_K=1, SUM: tl.constexpr = False,
                           HAS_BIAS: tl.constexpr = False, ACT: tl.constexpr = tl.bfloat16):
        """SUM: x_ptr is a split-K product's partials [SPLIT_K, M, N] (+ the bias at b_ptr),
        summed here as the reduction kernel would store them in ACT."""
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        # The norm's sum of squares runs in the order of the row's layout, which Triton takes
        # from the kernel's loads and stores: the one-byte q stores alone would spread 16
        # columns a thread where the norm kernel (`rmsnorm._rmsnorm_kernel`: loads and stores
        # of the activation dtype) has 16 bytes of it, 8 bf16 columns, and the sums would
        # differ in their last bit now and then. The q stores are cut to that run (`VEC`).
        if SUM:
            x = split_sum_cols(x_ptr, b_ptr, row, cols, cols < N, M, N, SPLIT_K, ACT, HAS_BIAS)
            h = add_rms_norm_vals(x, r_ptr, w_ptr, rout_ptr, row, cols, cols < N, stride_r, stride_ro, N, eps,
                                  HAS_RES)
            h = h.to(ACT).to(tl.float32)
            VEC: tl.constexpr = 128 // ACT.primitive_bitwidth
        else:
            h = add_rms_norm_row(x_ptr, r_ptr, w_ptr, rout_ptr, row, stride_x, stride_r, stride_ro, N, eps,
                                 BLOCK, HAS_RES)
            h = h.to(x_ptr.dtype.element_ty).to(tl.float32)  # the normed row as the norm kernel stores it
            VEC: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth
        _quantize_row(h, q_ptr + row * stride_q, s_ptr + row, cols, cols < N, qmax, INT8, VEC)

    @triton.jit
    def _silu_quant_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, I, qmax, BLOCK: tl.constexpr,
                           SINGLE: tl.constexpr, INT8: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        q_row = q_ptr + row * stride_q
        dt = x_ptr.dtype.element_ty
        if SINGLE:
            cols = tl.arange(0, BLOCK)
            ok = cols < I
            h = silu_mul_cols(x_row, cols, ok, I).to(dt).to(tl.float32)  # as silu_and_mul stores it
            _quantize_row(h, q_row, s_ptr + row, cols, ok, qmax, INT8)
        else:
            amax = tl.zeros([BLOCK], tl.float32)
            for c in range(0, I, BLOCK):
                cols = c + tl.arange(0, BLOCK)
                h = silu_mul_cols(x_row, cols, cols < I, I).to(dt).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(h))
            scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), 1e-12), qmax)
            tl.store(s_ptr + row, scale)
            for c in range(0, I, BLOCK):
                cols = c + tl.arange(0, BLOCK)
                ok = cols < I
                h = silu_mul_cols(x_row, cols, ok, I).to(dt).to(tl.float32)
                tl.store(q_row + cols, _quantize(h, scale, INT8).to(q_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_amax_kernel(x_ptr, h_ptr, pmax_ptr, stride_x, stride_h, stride_p, I, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
        """Program (row, c): h[row, columns c] = silu(gate) * up in h's dtype, and their amax."""
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        cols = c * BLOCK + tl.arange(0, BLOCK)
        ok = cols < I
        h = silu_mul_cols(x_ptr + row * stride_x, cols, ok, I).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + cols, h, mask=ok)
        tl.store(pmax_ptr + row * stride_p + c, tl.max(tl.abs(h.to(tl.float32)), 0))

    @triton.jit
    def _quant_split_kernel(h_ptr, pmax_ptr, q_ptr, s_ptr, stride_h, stride_p, stride_q, I, n_parts, qmax,
                            BLOCK: tl.constexpr, PARTS: tl.constexpr, INT8: tl.constexpr, PDL: tl.constexpr):
        """Program (row, c): the row's scale from its n_parts partial amaxes, columns c quantized."""
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        parts = tl.arange(0, PARTS)
        amax = tl.max(tl.load(pmax_ptr + row * stride_p + parts, mask=parts < n_parts, other=0.0), 0)
        cols = c * BLOCK + tl.arange(0, BLOCK)
        ok = cols < I
        h = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(amax, 1e-12), qmax)
        if c == 0:
            tl.store(s_ptr + row, scale)
        tl.store(q_ptr + row * stride_q + cols, _quantize(h, scale, INT8).to(q_ptr.dtype.element_ty), mask=ok)


#: `silu_quant` splits rows over programs of SPLIT_BLOCK columns at up to SPLIT_MAX_ROWS rows
SPLIT_MAX_ROWS = 128
SPLIT_BLOCK = 1024


def _check_kind(kind: str, qmax: float) -> None:
    if kind not in _KINDS:
        raise ValueError(f"kind={kind!r}: allowed {sorted(_KINDS)}")
    if not qmax > 0:
        raise ValueError(f"qmax={qmax}: must be > 0")


def _need_triton(name: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"{name} needs triton; use {name}_ref without it")


def norm_quant(x, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, kind: str,
               qmax: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, N] (+ residual) -> (q [M, N], scales [M, 1] fp32, x + residual): RMSNorm of the
    sum quantized per row as `act_quant` would quantize the normed row. Without a residual the
    third output is x itself (the first decoder layer, as the norm returns it). x may be a
    split-K product's `split_k.PendingSum` (with a residual): its partials are summed here as
    the reduction kernel would store them (the same bits as norm_quant of `x.result()`)."""
    _need_triton("norm_quant")
    _check_kind(kind, qmax)
    if isinstance(x, PendingSum):
        return _sum_norm_quant(x, residual, weight, eps, kind, qmax)
    check_norm_args(x, weight, residual)
    if x.dim() != 2:
        raise ValueError(f"norm_quant takes x [M, N], got shape {tuple(x.shape)}")
    M, N = x.shape
    x2 = as_rows(x)
    q = torch.empty(M, N, dtype=_KINDS[kind], device=x.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if residual is not None:
        r2 = as_rows(residual)
        rout = torch.empty(M, N, dtype=residual.dtype, device=x.device)
    else:
        r2, rout = x2, x
    if M:
        _norm_quant_kernel[(M,)](x2, r2, weight, rout, q, s, x2.stride(0), r2.stride(0), rout.stride(0), q.stride(0),
                                 N, float(eps), float(qmax), HAS_RES=residual is not None, INT8=kind == "int8",
                                 **norm_row_config(N), **pdl_args(x2))
    return q, s, rout


def _sum_norm_quant(x: PendingSum, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, kind: str,
                    qmax: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`norm_quant` of a pending split-K sum (one launch: sum, add, norm, quantize)."""
    split, M, N = x.part.shape
    if residual is None or tuple(residual.shape) != (M, N):
        raise ValueError(f"norm_quant of a pending split-K sum needs a residual [{M}, {N}], got "
                         f"{None if residual is None else tuple(residual.shape)}")
    if weight.shape != (N,):
        raise ValueError(f"norm_quant: weight shape {tuple(weight.shape)} != ({N},)")
    part = x.part.contiguous()
    r2 = as_rows(residual)
    q = torch.empty(M, N, dtype=_KINDS[kind], device=part.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=part.device)
    rout = torch.empty(M, N, dtype=residual.dtype, device=part.device)
    if M:
        _norm_quant_kernel[(M,)](part, r2, weight, rout, q, s, N, r2.stride(0), rout.stride(0), q.stride(0), N,
                                 float(eps), float(qmax), HAS_RES=True, INT8=kind == "int8",
                                 b_ptr=x.bias if x.bias is not None else part, M=M, SPLIT_K=split, SUM=True,
                                 HAS_BIAS=x.bias is not None, ACT=_TL_DTYPES[x.dtype],
                                 **norm_row_config(N), **pdl_args(part))
    return q, s, rout


def silu_quant_config(I: int, single_pass_max: int = SINGLE_PASS_MAX) -> dict:
    """BLOCK, SINGLE and warps for rows of I activations (see the module docstring)."""
    block = triton.next_power_of_2(I)
    if block <= single_pass_max:
        return dict(BLOCK=block, SINGLE=True, num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16)
    return dict(BLOCK=4096, SINGLE=False, num_warps=8)


def silu_quant(x: torch.Tensor, kind: str, qmax: float, config: Optional[dict] = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, 2I] ([gate | up]) -> (q [M, I], scales [M, 1] fp32): silu(gate) * up quantized
    per row as `act_quant` would quantize `silu_and_mul(x)`. Up to SPLIT_MAX_ROWS rows wider
    than SPLIT_BLOCK are split over programs (module docstring); `config` (overriding
    `silu_quant_config`) keeps one program a row."""
    _need_triton("silu_quant")
    _check_kind(kind, qmax)
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_quant takes x [M, 2I], got shape {tuple(x.shape)}")
    M, I = x.shape[0], x.shape[1] // 2
    x2 = as_rows(x)
    if config is None and splits_rows(M, I):
        return silu_amax(x2, kind, qmax).quantize()
    q = torch.empty(M, I, dtype=_KINDS[kind], device=x.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M and I:
        _silu_quant_kernel[(M,)](x2, q, s, x2.stride(0), q.stride(0), I, float(qmax), INT8=kind == "int8",
                                 **(config or silu_quant_config(I)), **pdl_args(x2))
    return q, s


def splits_rows(M: int, I: int) -> bool:
    """Whether `silu_quant` splits rows of I activations over programs at M rows (the module
    docstring): two launches, the first `silu_amax`."""
    return 0 < M <= SPLIT_MAX_ROWS and I > SPLIT_BLOCK


def silu_amax(x: torch.Tensor, kind: str, qmax: float, block: int = SPLIT_BLOCK) -> PendingQuant:
    """x [M, 2I] -> silu(gate) * up as `silu_and_mul` stores it, with one partial amax per
    `block` columns of a row: the first launch of `silu_quant`'s split, its rows left for the
    8-bit product to quantize on load (`pending_quant.PendingQuant`)."""
    _need_triton("silu_amax")
    _check_kind(kind, qmax)
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_amax takes x [M, 2I], got shape {tuple(x.shape)}")
    x2 = as_rows(x)
    M, I = x.shape[0], x.shape[1] // 2
    parts = triton.cdiv(I, block) if I else 0
    h = torch.empty(M, I, dtype=x2.dtype, device=x2.device)
    pmax = torch.empty(M, parts, dtype=torch.float32, device=x2.device)
    if M and I:
        _silu_amax_kernel[(M, parts)](x2, h, pmax, x2.stride(0), h.stride(0), pmax.stride(0), I, BLOCK=block,
                                      num_warps=4 if block <= 2048 else 8, **pdl_args(x2))
    return PendingQuant(h, pmax, kind, float(qmax))


def quant_from_partials(h: torch.Tensor, pmax: torch.Tensor, kind: str, qmax: float,
                        block: int = SPLIT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, I] quantized per row with the scale from its partial amaxes pmax [M, P] (the
    second launch of `silu_quant`'s split) -> (q [M, I], scales [M, 1] fp32)."""
    _need_triton("quant_from_partials")
    _check_kind(kind, qmax)
    M, I = h.shape
    q = torch.empty(M, I, dtype=_KINDS[kind], device=h.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=h.device)
    parts = pmax.shape[1]
    if M and I:
        _quant_split_kernel[(M, triton.cdiv(I, block))](
            h, pmax, q, s, h.stride(0), pmax.stride(0), q.stride(0), I, parts, float(qmax), BLOCK=block,
            PARTS=triton.next_power_of_2(parts), INT8=kind == "int8", num_warps=4 if block <= 2048 else 8,
            **pdl_args(h))
    return q, s


def norm_quant_ref(x, residual, weight, eps, kind, qmax):
    """The torch reference of `norm_quant`: the norm's reference, then `act_quant_ref`."""
    if residual is None:
        h, residual = rms_norm_ref(x, weight, eps), x
    else:
        h, residual = fused_add_rms_norm_ref(x, residual, weight, eps)
    q, s = act_quant_ref(h, kind, h.shape[-1], qmax)
    return q, s, residual


def silu_quant_ref(x, kind, qmax):
    """The torch reference of `silu_quant`: `silu_and_mul_ref`, then `act_quant_ref`."""
    from atom.model_ops.kernels.activation import silu_and_mul_ref
    h = silu_and_mul_ref(x)
    return act_quant_ref(h, kind, h.shape[-1], qmax)
