"""Dynamic (and static) activation quantization for the FP8 and INT8 linears, in Triton:
x [M, K] -> (q [M, K] float8_e4m3fn or int8, scales [M, K / group] fp32).

Exactly the reference's arithmetic (`atom.model_ops.quant.common.fake_quant_act`): per row
(`group` = K, per-token) or per `group` columns (FP8 block's 1 x 128), scale = max(amax,
1e-12) / qmax, q = x / scale rounded to nearest (correctly rounded divisions: Triton's plain
fp32 `/` is approximate on NVIDIA; `div_by` gets `div_rn`'s quotient from one reciprocal a
scale and two FMAs a value), fp8 clamped to +-448 then rounded to
e4m3 (nearest, ties to even) in fp32 arithmetic before the cast, which is then exact (the
same result as the hardware conversion; Triton's interpreter rounds fp8 casts wrongly, so
the explicit rounding also keeps the CPU tests meaningful), int8 rounded half to even (the 1.5 * 2^23 trick, exact for |v| < 2^22) then
clamped to [-128, 127]. With a `static_scale` (one value: a checkpoint's `input_scale`, or a
per-tensor amax computed by torch before) that scale is used for every row and the scales
output is that value.

One program per (row, group). A group of up to 16384 columns (every Llama-3.1-8B input
width) is loaded once into registers (8 warps from 4096 columns: at most 64 values a
thread), its amax taken and quantized from there: one read, one write, the least latency
in front of the decode GEMV, which waits for it. Wider groups walk their columns twice in
chunks (amax, then quantize; the second read from L2). The kernel takes part in
programmatic dependent launch (`triton_import.pdl_args`), so that its launch overlaps the
tail of the kernel in front.
"""
from __future__ import annotations

from typing import Optional

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, pdl_args, tl, triton

AMAX_MIN = 1e-12  # the reference's floor (quant.common._AMAX_MIN)
_KINDS = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}

SINGLE_PASS_MAX = 16384

if HAS_TRITON:
    from atom.model_ops.kernels.triton_import import pdl_start

    @triton.jit
    def _rint(v):
        """Round to nearest, ties to even, for |v| < 2^22 (fp32 adds round that way)."""
        return (v + 12582912.0) - 12582912.0

    @triton.jit
    def _round_e4m3(v):
        """fp32 v (|v| <= 448) rounded to the nearest e4m3 value (ties to even), still fp32:
        the step of e4m3 around v is 2^(max(e, -6) - 3) for v's exponent e (-6: subnormals)."""
        e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        step = tl.maximum(e, -6) - 3
        up = ((127 - step) << 23).to(tl.float32, bitcast=True)  # 2^-step
        down = ((127 + step) << 23).to(tl.float32, bitcast=True)  # 2^step
        return _rint(v * up) * down

    @triton.jit
    def div_by(v, scale):
        """v / scale correctly rounded (`div_rn`'s quotient) at the cost of a product and two
        FMAs a value: r = 1 / scale correctly rounded (once per scale), q0 = v r, then
        Markstein's correction q0 + (v - q0 scale) r, whose remainder the FMA computes exactly;
        the quotient is the correctly rounded one wherever it is a normal float (Markstein's
        theorem). A quotient below the normal range may be a step off in its last bit, far
        below any grid it is rounded to next (e4m3's least step is 2^-9, int8's 1). Where q0
        is not finite (v / scale overflows, scale is zero, v is not finite) or the remainder is
        NaN (an infinite scale: q0 is 0), q0 itself, which is then `div_rn`'s quotient."""
        r = tl.math.div_rn(tl.where(scale == scale, 1.0, 1.0), scale)  # (1.0 in scale's shape)
        q0 = v * r
        rem = tl.fma(-q0, scale, v)
        return tl.where((tl.abs(q0) < float("inf")) & (rem == rem), tl.fma(rem, r, q0), q0)

    @triton.jit
    def _quantize(v, scale, INT8: tl.constexpr):
        """v / scale rounded to the target's grid, still fp32 (its cast is then exact)."""
        v = div_by(v, scale)
        if INT8:
            v = tl.minimum(tl.maximum(_rint(v), -128.0), 127.0)
        else:
            v = _round_e4m3(tl.minimum(tl.maximum(v, -448.0), 448.0))
        return v

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, static_ptr, stride_xm, stride_qm, group, n_groups, qmax,
                          STATIC: tl.constexpr, INT8: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr,
                          PDL: tl.constexpr):
        """SINGLE: the group fits one BLOCK (loaded once); else chunks of BLOCK, read twice."""
        pdl_start(PDL)
        m = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        start = g * group
        x_row = x_ptr + m * stride_xm + start
        q_row = q_ptr + m * stride_qm + start
        if SINGLE:
            cols = tl.arange(0, BLOCK)
            ok = cols < group
            v = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
            if STATIC:
                scale = tl.load(static_ptr).to(tl.float32)
            else:
                scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), 0), 1e-12), qmax)
            tl.store(s_ptr + m * n_groups + g, scale)
            tl.store(q_row + cols, _quantize(v, scale, INT8).to(q_ptr.dtype.element_ty), mask=ok)
        else:
            if STATIC:
                scale = tl.load(static_ptr).to(tl.float32)
            else:
                amax = tl.zeros([BLOCK], tl.float32)
                for c in range(0, group, BLOCK):
                    cols = c + tl.arange(0, BLOCK)
                    v = tl.load(x_row + cols, mask=cols < group, other=0.0).to(tl.float32)
                    amax = tl.maximum(amax, tl.abs(v))
                scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), 1e-12), qmax)
            tl.store(s_ptr + m * n_groups + g, scale)
            for c in range(0, group, BLOCK):
                cols = c + tl.arange(0, BLOCK)
                ok = cols < group
                v = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
                tl.store(q_row + cols, _quantize(v, scale, INT8).to(q_ptr.dtype.element_ty), mask=ok)


def act_quant_config(group: int, single_pass_max: int = SINGLE_PASS_MAX) -> dict:
    """BLOCK, SINGLE and warps for a group width (see the module docstring)."""
    block = triton.next_power_of_2(group)
    if block <= single_pass_max:
        return dict(BLOCK=block, SINGLE=True, num_warps=8 if block >= 4096 else 4)
    return dict(BLOCK=4096, SINGLE=False, num_warps=8)


def _check(x: torch.Tensor, kind: str, group: int) -> None:
    if kind not in _KINDS:
        raise ValueError(f"act_quant kind={kind!r}: allowed {sorted(_KINDS)}")
    if x.dim() != 2:
        raise ValueError(f"act_quant takes x [M, K], got shape {tuple(x.shape)}")
    if group <= 0 or x.shape[1] % group:
        raise ValueError(f"act_quant group={group} must divide K={x.shape[1]}")


def act_quant_launch(x: torch.Tensor, kind: str, group: int, qmax: float,
                     static_scale: Optional[torch.Tensor] = None, config: Optional[dict] = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel launch behind `act_quant` (no custom-op wrapper); `config` overrides
    `act_quant_config`."""
    if not HAS_TRITON:
        raise RuntimeError("act_quant needs triton; use act_quant_ref without it")
    _check(x, kind, group)
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    n_groups = K // group if K else 0
    q = torch.empty(M, K, dtype=_KINDS[kind], device=x.device)
    s = torch.empty(M, n_groups, dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, s
    static = static_scale.reshape(1).float() if static_scale is not None else s
    _act_quant_kernel[(M, n_groups)](x, q, s, static, x.stride(0), q.stride(0), group, n_groups, float(qmax),
                                     STATIC=static_scale is not None, INT8=kind == "int8",
                                     **(config or act_quant_config(group)), **pdl_args(x))
    return q, s


@torch.library.custom_op("atom::act_quant", mutates_args=())
def act_quant(x: torch.Tensor, kind: str, group: int, qmax: float,
              static_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] in `kind` ("fp8" e4m3 / "int8"), scales [M, K // group] fp32).
    `group`: K for one scale per row; `static_scale` (one value): that scale everywhere."""
    return act_quant_launch(x, kind, group, qmax, static_scale)


@act_quant.register_fake
def _(x, kind, group, qmax, static_scale=None):
    _check(x, kind, group)
    M, K = x.shape
    return (x.new_empty(M, K, dtype=_KINDS[kind]),
            x.new_empty(M, K // group if K else 0, dtype=torch.float32))


def act_quant_ref(x: torch.Tensor, kind: str, group: int, qmax: float,
                  static_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of `act_quant` (the arithmetic of `quant.common.fake_quant_act`)."""
    _check(x, kind, group)
    M, K = x.shape
    g = x.float().reshape(M, -1, group)
    if static_scale is not None:
        s = static_scale.float().reshape(1, 1, 1).expand(M, g.shape[1], 1)
    else:
        s = g.abs().amax(-1, keepdim=True).clamp(min=AMAX_MIN) / qmax
    v = g / s
    if kind == "fp8":
        q = v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    else:
        q = torch.round(v).clamp(-128, 127).to(torch.int8)
    return q.reshape(M, K), s.reshape(M, -1).contiguous()
