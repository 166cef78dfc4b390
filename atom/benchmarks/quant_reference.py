"""The numerics reference of `quant_accuracy`: a plain round-to-nearest fake-quantized copy
of a transformers model, written here from the formats' definitions and sharing no code
with the engine's methods or producers.

Every `nn.Linear` except the LM head gets its weight replaced by quantize-then-dequantize
and, for the formats with quantized activations, a forward pre-hook that does the same to
its input:

| format | weight | activations |
|---|---|---|
| ptpc_fp8 | e4m3, one scale per output row (amax / 448) | e4m3, one scale per token |
| fp8_block | e4m3, one scale per 128x128 block | e4m3, one scale per 1x128 group |
| w8a8_int8 | int8, one scale per output row (amax / 127) | int8, one scale per token |
| w4a16_gN | int4 [-8, 7], one scale per N inputs (amax / 7) | as they are |
| mxfp4 | e2m1 values, a power-of-two scale per 32 inputs (OCP MX) | as they are |
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

E4M3_MAX = 448.0
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _floor(a: torch.Tensor) -> torch.Tensor:
    return torch.clamp(a, min=1e-12)


def fq_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32) * scale


def fq_int(x: torch.Tensor, scale: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return torch.clamp(torch.round(x / scale), lo, hi) * scale


def per_row(x: torch.Tensor, qmax: float) -> torch.Tensor:
    return _floor(x.abs().amax(dim=-1, keepdim=True)) / qmax


def grouped(x: torch.Tensor, g: int, fn) -> torch.Tensor:
    """Apply `fn` to groups of `g` consecutive entries of the last dimension (zero-padded)."""
    n = x.shape[-1]
    pad = (-n) % g
    xp = F.pad(x, (0, pad)) if pad else x
    out = fn(xp.reshape(*xp.shape[:-1], -1, g)).reshape(xp.shape)
    return out[..., :n]


def fq_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """OCP MXFP4 per 32 as llm-compressor and Quark compute it: amax rounded to a power of two
    (up when its mantissa is >= 1.75, so the group's largest value stays near the e2m1 top
    instead of clipping), shared exponent that power - 2 (the e2m1 maximum's exponent); e2m1
    magnitudes rounded to the nearest grid point (clamped at 6)."""
    def one(g: torch.Tensor) -> torch.Tensor:
        amax = _floor(g.abs().amax(dim=-1, keepdim=True))
        exp = torch.floor(torch.log2(amax))
        exp = exp + (amax / torch.pow(2.0, exp) >= 1.75).float() - 2
        s = torch.pow(2.0, exp)
        mag = (g.abs() / s).clamp(max=6.0)
        grid = E2M1_GRID.to(g.device)
        q = grid[(mag.unsqueeze(-1) - grid).abs().argmin(-1)]
        return torch.sign(g) * q * s
    return grouped(x, 32, one)


def fake_weight(w: torch.Tensor, fmt: str) -> torch.Tensor:
    w = w.float()
    if fmt in ("ptpc_fp8",):
        return fq_e4m3(w, per_row(w, E4M3_MAX))
    if fmt == "w8a8_int8":
        return fq_int(w, per_row(w, 127.0), -128, 127)
    if fmt.startswith("w4a16_g"):
        g = int(fmt.removeprefix("w4a16_g"))
        return grouped(w, g, lambda t: fq_int(t, per_row(t, 7.0), -8, 7))
    if fmt == "fp8_block":
        rows, cols = w.shape
        pr, pc = -(-rows // 128) * 128, -(-cols // 128) * 128
        wp = F.pad(w, (0, pc - cols, 0, pr - rows)).reshape(pr // 128, 128, pc // 128, 128)
        s = _floor(wp.abs().amax(dim=(1, 3), keepdim=True)) / E4M3_MAX
        return fq_e4m3(wp, s).reshape(pr, pc)[:rows, :cols]
    if fmt == "mxfp4":
        return fq_mxfp4(w)
    raise ValueError(f"format={fmt!r} is invalid: the reference knows ptpc_fp8, fp8_block, w8a8_int8, "
                     "w4a16_g<N>, mxfp4")


def fake_act(x: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "ptpc_fp8":
        y = fq_e4m3(x.float(), per_row(x.float(), E4M3_MAX))
    elif fmt == "w8a8_int8":
        y = fq_int(x.float(), per_row(x.float(), 127.0), -128, 127)
    elif fmt == "fp8_block":
        y = grouped(x.float(), 128, lambda t: fq_e4m3(t, per_row(t, E4M3_MAX)))
    else:
        return x
    return y.to(x.dtype)


def fake_quantized_copy(model: nn.Module, fmt: str, skip: tuple[str, ...] = ("lm_head",),
                        only=None) -> nn.Module:
    """A deep copy of `model` with every nn.Linear (but `skip`, and only those `only(name,
    module)` accepts when given) fake-quantized to `fmt`."""
    out = copy.deepcopy(model)
    for name, m in out.named_modules():
        if not isinstance(m, nn.Linear) or name.split(".")[-1] in skip:
            continue
        if only is not None and not only(name, m):
            continue
        with torch.no_grad():
            m.weight.copy_(fake_weight(m.weight, fmt).to(m.weight.dtype))
        if fmt in ("ptpc_fp8", "w8a8_int8", "fp8_block"):
            m.register_forward_pre_hook(lambda _m, args, f=fmt: (fake_act(args[0], f),) + tuple(args[1:]))
    return out
