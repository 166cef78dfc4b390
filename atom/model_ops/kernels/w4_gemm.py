"""y = x W^T (+ b) for 4-bit weights, dequantized in registers: W4A16 int4 groups and MXFP4.

The weights stay in the bytes the checkpoint packs them in (no dequantized copy, nothing
repacked):
- int4 (`fmt="int4"`): `packed` int32 [N, ceil(K/8)], nibble i of word j holding column
  8j + i as u = q + 8 (0..15); `scales` [N, K/g] (any float dtype); `zeros` None (symmetric:
  w = (u - 8) * s) or int8 [N, K/g] of the stored zero points u_z = z + 8 (w = (u - u_z) * s).
  Any group size g that divides K works (the tile loops index the group of every column,
  so g need not divide a tile).
- MXFP4 (`fmt="mxfp4"`): `packed` uint8 [N, K/2], the low nibble the even column, e2m1
  codes (bit 3 the sign); `scales` uint8 E8M0 [N, K/32]; w = e2m1(code) * 2^(s - 127).
  The 16 code values are computed from their bits (exponent e = bits 1-2, mantissa bit 0:
  e = 0 gives 0 or 0.5, else 2^(e-1) * (1 + m/2)) as float32 bits, the scale by writing s
  into a float32's exponent field (s = 0, 2^-127, as the subnormal with bit 22 set), so both
  are exact and need no conversion instruction. Likewise int4 nibbles become floats by the
  magic-number trick (float(0x4B000000 | u) = 2^23 + u) with the group's 2^23 + zero point
  subtracted.

Two kernels, chosen by the number of rows M (`w4_config`):
- M <= 4, `_w4_gemv_kernel` (batch-1 decode): weight streaming. A program owns BLOCK_N
  output rows and walks K in chunks of BLOCK_W packed words (coalesced, vector loads of the
  packed words; each word is then split into its nibbles in registers, a [BLOCK_N, BLOCK_W,
  per-word] tile), dequantizes in fp32 and forms the dot products of all M rows with it
  (a static loop over the rows), so the weight is read once. At 0.5 byte per weight the
  Llama-3.1-8B shapes give N / BLOCK_N >= 1024 programs, enough to fill 132 SMs without
  split-K.
- M > 4, `_w4_gemm_kernel`: a tiled tl.dot GEMM. The W^T tile is loaded as packed words
  [BLOCK_K / per-word, BLOCK_N] (coalesced along K), split into nibbles, dequantized in fp32,
  reshaped to [BLOCK_K, BLOCK_N], cast to the activations' dtype and fed to tl.dot with fp32 accumulation. For 4 < M <= 16 one
  BLOCK_M=16 row tile covers every row, so this too streams the weight once with the
  tensor cores doing the multiplies (the FMA path would be compute-bound there: 16 FMAs
  per half byte). Programs run the M tiles of one weight tile next to each other, so a
  weight tile is fetched from HBM about once.

`w4_linear` (the torch custom op `atom::w4_linear`) launches them; `w4_linear_ref` is the
torch reference on the same tensors.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON, pdl_args, tl, triton

FORMATS = ("int4", "mxfp4")
MX_GROUP = 32
#: values per packed element: int4 words hold 8 nibbles, MXFP4 bytes 2
PER_ELEMENT = {"int4": 8, "mxfp4": 2}
#: the largest M that runs the weight-streaming FMA kernel
GEMV_MAX_M = 4

# Tile table per regime (fixed; no autotune at import). Columns: the largest M of the
# regime, then the tiles. Chosen from the byte and FLOP budget, not measured here:
# - GEMV (M <= 4): 4 rows x 512 columns per step (2048 fp32 weights across 128 threads,
#   16 each; 1 KB of int4 / MXFP4 per step per program, thousands of programs in flight);
# - M <= 16: one 16-row tile, K in chunks of 256 (the weight streams, the tensor cores do
#   the products), 32 output columns, 16 below N = 8192 so that N = 4096 still gives 256
#   programs (two per SM on the H200's 132) without split-K;
# - M <= 64: 64 x 64 tiles, K 64; larger M: 128 x 128 x 64 with 8 warps (compute bound:
#   the dequantization is spread over 128 rows of x).
GEMV_TILES = dict(BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=3)
GEMM_TILES = (
    (16, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3)),
    (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)),
    (None, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)),
)


def w4_config(M: int, N: int, K: int) -> tuple[str, dict]:
    """(kernel name, tile config) for an [M, K] x [N, K]^T product (the tables above)."""
    if M <= GEMV_MAX_M:
        return "w4_gemv", dict(GEMV_TILES, BLOCK_M=max(1, triton.next_power_of_2(M)) if HAS_TRITON else 1)
    for max_m, cfg in GEMM_TILES:
        if max_m is None or M <= max_m:
            cfg = dict(cfg)
            if max_m == 16 and N < 8192:
                cfg["BLOCK_N"] = 16
            return "w4_gemm", cfg
    raise AssertionError("unreachable")


def kernel_name(M: int) -> str:
    """Which kernel runs M rows (for the per-layer tables)."""
    return "w4_gemv" if M <= GEMV_MAX_M else "w4_gemm"


if HAS_TRITON:
    from atom.model_ops.kernels.triton_import import pdl_start

    @triton.jit
    def _e2m1(u):
        """fp32 values of e2m1 codes u (int32 0..15), built as float32 bits with integer ops
        only (no conversion instruction per weight): magnitude index 2..7 (e > 0) is
        exponent e + 126 with the mantissa bit on top of the fraction, 1 is 0.5 (0x3F000000),
        0 is 0; bit 3 becomes the sign bit."""
        mag = u & 7
        bits = tl.where(mag < 2, mag * 0x3F000000, (mag << 22) + 0x3F000000)
        return (bits | ((u & 8) << 28)).to(tl.float32, bitcast=True)

    @triton.jit
    def _e8m0(s):
        """fp32 2^(s - 127) of E8M0 exponents s (int32 0..255), exactly."""
        return tl.where(s == 0, 1 << 22, s << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _group_terms(s_raw, z_raw, FMT: tl.constexpr, HAS_ZP: tl.constexpr):
        """Per group (computed at the scales' shape, before broadcasting to the nibbles):
        int4 (offset, scale) with w = (float(0x4B000000 | u) - offset) * scale, offset =
        2^23 + zero point (the magic-number conversion: no int-to-float instruction per
        weight, exact for 0 <= u < 16); MXFP4 (unused, 2^(s - 127))."""
        if FMT == 0:
            if HAS_ZP:
                off = z_raw.to(tl.float32) + 8388608.0
            else:
                off = tl.zeros_like(s_raw.to(tl.float32)) + 8388616.0  # 2^23 + 8
            return off, s_raw.to(tl.float32)
        else:
            scale = _e8m0(s_raw.to(tl.int32))
            return scale, scale

    @triton.jit
    def _dequant(u, off, scale, FMT: tl.constexpr):
        """fp32 weights of nibbles u (int32 0..15) given their group's `_group_terms`."""
        if FMT == 0:
            return ((u | 0x4B000000).to(tl.float32, bitcast=True) - off) * scale
        else:
            return _e2m1(u) * scale

    @triton.jit
    def _w4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, n_words,
                        stride_xm, stride_wn, stride_sn, stride_zn, stride_ym,
                        FMT: tl.constexpr, PER: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr,
                        HAS_BIAS: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Programs own BLOCK_N rows of y for all M (<= BLOCK_M) rows of x."""
        BLOCK_W: tl.constexpr = BLOCK_K // PER
        pdl_start(PDL)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        r64 = rows.to(tl.int64)
        js = tl.arange(0, BLOCK_W)
        es = tl.arange(0, PER)
        ms = tl.arange(0, BLOCK_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc1 = tl.zeros([BLOCK_N, BLOCK_W, PER], tl.float32)
        for w0 in range(0, n_words, BLOCK_W):
            jw = w0 + js
            word = tl.load(w_ptr + r64[:, None] * stride_wn + jw[None, :],
                           mask=row_ok[:, None] & (jw < n_words)[None, :], other=0).to(tl.int32)
            ks = jw[:, None] * PER + es[None, :]  # [BLOCK_W, PER]: the column of every nibble
            k_ok = ks < K
            u = (word[:, :, None] >> (es * 4)[None, None, :]) & 0xF  # [BLOCK_N, BLOCK_W, PER]
            if GROUP % PER == 0:  # a word's nibbles share a group: one scale per word
                grp = (jw * PER) // GROUP
                g_ok = row_ok[:, None] & (jw < n_words)[None, :]
                s_raw = tl.load(s_ptr + r64[:, None] * stride_sn + grp[None, :], mask=g_ok, other=0)[:, :, None]
                z_raw = s_raw
                if HAS_ZP:
                    z_raw = tl.load(z_ptr + r64[:, None] * stride_zn + grp[None, :], mask=g_ok, other=8)[:, :, None]
            else:
                grp = ks // GROUP
                g_ok = row_ok[:, None, None] & k_ok[None, :, :]
                s_raw = tl.load(s_ptr + r64[:, None, None] * stride_sn + grp[None, :, :], mask=g_ok, other=0)
                z_raw = s_raw
                if HAS_ZP:
                    z_raw = tl.load(z_ptr + r64[:, None, None] * stride_zn + grp[None, :, :], mask=g_ok, other=8)
            off, scale = _group_terms(s_raw, z_raw, FMT, HAS_ZP)
            w = _dequant(u, off, scale, FMT)
            if BLOCK_M == 1:  # one row: accumulate elementwise, reduce once at the end
                xm = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                acc1 += w * xm[None, :, :]
            else:
                for m in tl.static_range(BLOCK_M):
                    xm = tl.load(x_ptr + m * stride_xm + ks, mask=k_ok & (ks * 0 + m < M), other=0.0)
                    d = tl.sum(tl.sum(w * xm.to(tl.float32)[None, :, :], axis=2), axis=1)  # [BLOCK_N]
                    acc = tl.where(ms[:, None] == m, acc + d[None, :], acc)
        if BLOCK_M == 1:
            acc = tl.sum(tl.sum(acc1, axis=2), axis=1)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
        y_mask = (ms < M)[:, None] & row_ok[None, :]
        tl.store(y_ptr + ms[:, None] * stride_ym + rows[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_mask)

    @triton.jit
    def _w4_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, n_words,
                        stride_xm, stride_wn, stride_sn, stride_zn, stride_ym,
                        FMT: tl.constexpr, PER: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr,
                        HAS_BIAS: tl.constexpr, PDL: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """A BLOCK_M x BLOCK_N tile of y; the M tiles of one weight tile are neighbours."""
        pdl_start(PDL)
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        pid_m = pid % num_m
        pid_n = pid // num_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        rn64 = rn.to(tl.int64)
        BLOCK_W: tl.constexpr = BLOCK_K // PER
        es = tl.arange(0, PER)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + ks[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            # W^T as packed words [BLOCK_W, BLOCK_N] (coalesced along K: a row's words are
            # contiguous), split into [BLOCK_W, PER, BLOCK_N] nibbles, dequantized, then viewed
            # as [BLOCK_K, BLOCK_N] (column k = word * PER + nibble)
            jw = k0 // PER + tl.arange(0, BLOCK_W)
            wk = (jw < n_words)[:, None] & n_ok[None, :]
            word = tl.load(w_ptr + rn64[None, :] * stride_wn + jw[:, None], mask=wk, other=0).to(tl.int32)
            u = (word[:, None, :] >> (es * 4)[None, :, None]) & 0xF
            ks3 = jw[:, None] * PER + es[None, :]  # [BLOCK_W, PER]
            k3_ok = (ks3 < K)[:, :, None] & n_ok[None, None, :]
            if GROUP % PER == 0:  # one scale per word
                grp = (jw * PER) // GROUP
                s_raw = tl.load(s_ptr + rn64[None, :] * stride_sn + grp[:, None], mask=wk, other=0)[:, None, :]
                z_raw = s_raw
                if HAS_ZP:
                    z_raw = tl.load(z_ptr + rn64[None, :] * stride_zn + grp[:, None], mask=wk, other=8)[:, None, :]
            else:
                grp = (ks3 // GROUP)[:, :, None]
                s_raw = tl.load(s_ptr + rn64[None, None, :] * stride_sn + grp, mask=k3_ok, other=0)
                z_raw = s_raw
                if HAS_ZP:
                    z_raw = tl.load(z_ptr + rn64[None, None, :] * stride_zn + grp, mask=k3_ok, other=8)
            off, scale = _group_terms(s_raw, z_raw, FMT, HAS_ZP)
            w3 = tl.where(k3_ok, _dequant(u, off, scale, FMT), 0.0)  # columns past K (padding nibbles): 0
            w = tl.reshape(w3, [BLOCK_K, BLOCK_N])
            w = w.to(a.dtype)
            if DOT_F32:  # the interpreter: same rounding of W, the product in fp32 (see _dot_f32)
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def _dot_f32(x: torch.Tensor) -> bool:
    """Whether the GEMM multiplies in fp32: only under the interpreter (TRITON_INTERPRET=1,
    CPU tensors), whose tl.dot mishandles bf16 (numpy has no bf16). The weight tile is still
    rounded to the activation dtype first, so the result is what the tensor cores compute."""
    return not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check(x, packed, scales, zeros, bias, fmt: str, group: int, k: int) -> None:
    """Shapes and dtypes of a 4-bit product; raises ValueError naming the argument."""
    if fmt not in FORMATS:
        raise ValueError(f"w4_linear: fmt={fmt!r}, allowed {FORMATS}")
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"w4_linear: x must be [M, {k}] with a contiguous last dim, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"w4_linear: x dtype {x.dtype}, allowed bfloat16, float16, float32")
    per = PER_ELEMENT[fmt]
    N = packed.shape[0]
    want_dtype = torch.int32 if fmt == "int4" else torch.uint8
    if packed.dtype != want_dtype or packed.shape[1] != -(-k // per) or packed.stride(1) != 1:
        raise ValueError(f"w4_linear: packed must be {want_dtype} [N, {-(-k // per)}] row-major for "
                         f"{fmt} with K={k}, got {packed.dtype} {tuple(packed.shape)}")
    if fmt == "mxfp4" and group != MX_GROUP:
        raise ValueError(f"w4_linear: mxfp4 has group {MX_GROUP}, got group={group}")
    if group <= 0 or k % group:
        raise ValueError(f"w4_linear: group={group} must divide K={k}")
    if tuple(scales.shape) != (N, k // group) or scales.stride(1) != 1:
        raise ValueError(f"w4_linear: scales must be [{N}, {k // group}], got {tuple(scales.shape)}")
    if zeros is not None and (fmt != "int4" or tuple(zeros.shape) != (N, k // group) or zeros.stride(1) != 1):
        raise ValueError(f"w4_linear: zeros (int4 only) must be [{N}, {k // group}], got {tuple(zeros.shape)}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"w4_linear: bias must be [{N}], got {tuple(bias.shape)}")


def w4_linear_launch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor], fmt: str, group: int, k: int,
                     config: Optional[dict] = None) -> torch.Tensor:
    """Launches the kernel `w4_config` picks for x [M, K] -> y [M, N] in x's dtype; `config`
    overrides it (tiles as in the tables, plus "kernel": "w4_gemv" or "w4_gemm")."""
    if not HAS_TRITON:
        raise RuntimeError("w4_linear needs triton; use w4_linear_ref without it")
    _check(x, packed, scales, zeros, bias, fmt, group, k)
    M, N = x.shape[0], packed.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    name, cfg = w4_config(M, N, k)
    if config is not None:
        cfg = dict(config)
        name = cfg.pop("kernel", name)
    z = zeros if zeros is not None else scales
    b = bias if bias is not None else y
    common = dict(FMT=FORMATS.index(fmt), PER=PER_ELEMENT[fmt], GROUP=group, HAS_ZP=zeros is not None,
                  HAS_BIAS=bias is not None, **pdl_args(x))
    if name == "w4_gemv":
        if cfg["BLOCK_M"] < M:
            raise ValueError(f"w4_linear: the GEMV's BLOCK_M={cfg['BLOCK_M']} must cover M={M}")
        grid = (triton.cdiv(N, cfg["BLOCK_N"]),)
        _w4_gemv_kernel[grid](x, packed, scales, z, b, y, M, N, k, packed.shape[1], x.stride(0),
                              packed.stride(0), scales.stride(0), z.stride(0), y.stride(0), **common, **cfg)
    else:
        grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
        _w4_gemm_kernel[grid](x, packed, scales, z, b, y, M, N, k, packed.shape[1], x.stride(0), packed.stride(0),
                              scales.stride(0), z.stride(0), y.stride(0),
                              DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
                              DOT_F32=_dot_f32(x), **common, **cfg)
    return y


@torch.library.custom_op("atom::w4_linear", mutates_args=())
def w4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
              bias: Optional[torch.Tensor], fmt: str, group: int, k: int) -> torch.Tensor:
    """x [M, K] W^T (+ b) -> [M, N] in x's dtype, W the 4-bit weight described in the module
    docstring; opaque to torch.compile (only its output shape is traced)."""
    return w4_linear_launch(x, packed, scales, zeros, bias, fmt, group, k)


@w4_linear.register_fake
def _(x, packed, scales, zeros, bias, fmt, group, k):
    return x.new_empty((x.shape[0], packed.shape[0]))


def dequantize_w4(packed: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], fmt: str,
                  group: int, k: int) -> torch.Tensor:
    """fp32 [N, K] of the kernels' weight tensors (torch, any device)."""
    per = PER_ELEMENT[fmt]
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * 4
    u = ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF).flatten(-2)[:, :k]
    s = scales.repeat_interleave(group, 1)
    if fmt == "int4":
        z = zeros.to(torch.int32).repeat_interleave(group, 1) if zeros is not None else 8
        return (u - z).float() * s.float()
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=packed.device)
    vals = e2m1[(u & 7).long()] * torch.where((u & 8) != 0, -1.0, 1.0)
    return vals * torch.ldexp(torch.ones_like(s, dtype=torch.float32), s.to(torch.int32) - 127)


def w4_linear_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                  bias: Optional[torch.Tensor], fmt: str, group: int, k: int) -> torch.Tensor:
    """The torch reference: dequantize to fp32, multiply in fp32, return x's dtype."""
    w = dequantize_w4(packed, scales, zeros, fmt, group, k)
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


#: what the 4-bit methods report as their GPU kernel (`kernel` attribute, `format(layer)`)
KERNEL_DESCRIPTION = f"atom::w4_linear (triton w4_gemv for M<={GEMV_MAX_M}, w4_gemm above)"


def use_w4_kernel(x: torch.Tensor) -> bool:
    """The 4-bit methods run the Triton kernels for CUDA inputs when Triton is there; CPU
    keeps the torch reference."""
    return HAS_TRITON and x.is_cuda


def with_kernel(spec: str, weight: torch.Tensor) -> str:
    """A method's format string, with the kernel named where the layer's weights are on CUDA."""
    return f"{spec}; kernel {KERNEL_DESCRIPTION}" if HAS_TRITON and weight.is_cuda else spec


def w4_product(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
               bias: Optional[torch.Tensor], fmt: str, group: int, k: int) -> torch.Tensor:
    """x [..., K] W^T (+ b) -> [..., N] through `atom::w4_linear` (leading dims flattened)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.ops.atom.w4_linear(x2, packed, scales, zeros, bias, fmt, group, k)
    return y.reshape(*lead, packed.shape[0])
