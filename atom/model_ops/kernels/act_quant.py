"""Dynamic (and static) activation quantization for the FP8 and INT8 linears, in Triton:
x [M, K] -> (q [M, K] float8_e4m3fn or int8, scales [M, K / group] fp32).

Exactly the reference's arithmetic (`atom.model_ops.quant.common.fake_quant_act`): per row
(`group` = K, per-token) or per `group` columns (FP8 block's 1 x 128), scale = max(amax,
1e-12) / qmax, q = x / scale rounded to nearest (correctly rounded divisions, `div_rn`:
Triton's plain fp32 `/` is approximate on NVIDIA), fp8 clamped to +-448 then rounded to
e4m3 (nearest, ties to even) in fp32 arithmetic before the cast, which is then exact (the
same result as the hardware conversion; Triton's interpreter rounds fp8 casts wrongly, so
the explicit rounding also keeps the CPU tests meaningful), int8 rounded half to even (the 1.5 * 2^23 trick, exact for |v| < 2^22) then
clamped to [-128, 127]. With a `static_scale` (one value: a checkpoint's `input_scale`, or a
per-tensor amax computed by torch before) that scale is used for every row and the scales
output is that value.

One program per (row, group) walks its columns twice in BLOCK chunks (amax, then quantize):
the activations of a decode step are a few KB to a few hundred KB, read from L2 the second
time; the launch costs more than the work.
"""
from __future__ import annotations

from typing import Optional

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, tl, triton

AMAX_MIN = 1e-12  # the reference's floor (quant.common._AMAX_MIN)
_KINDS = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}

if HAS_TRITON:

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
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, static_ptr, stride_xm, stride_qm, group, n_groups, qmax,
                          STATIC: tl.constexpr, INT8: tl.constexpr, BLOCK: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        start = g * group
        x_row = x_ptr + m * stride_xm + start
        q_row = q_ptr + m * stride_qm + start
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
            v = tl.math.div_rn(tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32), scale)
            if INT8:
                q = tl.minimum(tl.maximum(_rint(v), -128.0), 127.0).to(tl.int8)
            else:
                q = _round_e4m3(tl.minimum(tl.maximum(v, -448.0), 448.0)).to(tl.float8e4nv)
            tl.store(q_row + cols, q, mask=ok)


def _check(x: torch.Tensor, kind: str, group: int) -> None:
    if kind not in _KINDS:
        raise ValueError(f"act_quant kind={kind!r}: allowed {sorted(_KINDS)}")
    if x.dim() != 2:
        raise ValueError(f"act_quant takes x [M, K], got shape {tuple(x.shape)}")
    if group <= 0 or x.shape[1] % group:
        raise ValueError(f"act_quant group={group} must divide K={x.shape[1]}")


def act_quant_launch(x: torch.Tensor, kind: str, group: int, qmax: float,
                     static_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel launch behind `act_quant` (no custom-op wrapper)."""
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
                                     BLOCK=min(1024, triton.next_power_of_2(group)), num_warps=4)
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
