"""What the quantized linear methods share: refusals, parameters with loaders that know the
packed shards, activation fake quantization and the product.

Scales of a packed layer (q/k/v, gate/up) are kept the way the checkpoint writes them:
- one value per shard (per-tensor scales, `input_scale`, `weight_shape`): a tensor with a
  leading dimension of one entry per shard (`per_shard_param`);
- rows (per-channel scales, group scales, block scales, int4 zero points packed along the
  output dimension): concatenated along rows like the weight, each shard taking
  ceil(rows / rows_per_entry) entries (`row_param`), so that a shard whose size is not a
  multiple of a 128-row block keeps its own blocks.

The reference product dequantizes the weight to fp32, fake-quantizes the activations as the
format defines (scale = amax / qmax, fp8 by `.to(torch.float8_e4m3fn)`, int8 by
`torch.round` + clamp), multiplies in fp32 and returns the activations' dtype.
"""
from __future__ import annotations

import logging
import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from atom.model_ops.attention.metadata import current_forward_context
from atom.model_ops.quant.base import LinearMethod
from atom.tuning.plan import plan_for

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
INT8_MAX = 127.0
_AMAX_MIN = 1e-12  # an all-zero row / tensor / group gets a tiny scale, not a division by 0


def refuse(prefix: str, spec, reason: str) -> NotImplementedError:
    """The error a layer raises at model build for a format it cannot run."""
    return NotImplementedError(
        f"layer '{prefix}' asks for quant_type={spec.quant_type.name} ({spec.quant_dtype}, "
        f"quant_method={spec.quant_method!r}): {reason}")


def method_for(quant_config, prefix: str, methods: dict, unquantized: type, refusal):
    """The method of the layer at `prefix`, linear or MoE alike: its spec from `quant_config`
    (None, excluded or unquantized: `unquantized()`), else `methods[dtype key](spec, prefix)`;
    a dtype without a method raises NotImplementedError naming the layer, the format and
    `refusal(spec)`."""
    from atom.quant_spec import key_from_dtype
    spec = quant_config.get_layer_quant_config(prefix) if quant_config is not None else None
    if spec is None or not spec.is_quantized:
        return unquantized()
    key = key_from_dtype(spec.quant_dtype)
    if key not in methods:
        raise refuse(prefix, spec, refusal(spec))
    method = methods[key](spec, prefix)
    logging.getLogger("atom.model_ops.quant").debug("%s: %s", prefix, method)
    return method


def shards(layer: nn.Module) -> list[tuple[object, int, int]]:
    """(shard_id, first row, rows) of each checkpoint shard packed into `layer`."""
    return [(sid, *layer.shard_range(sid)) for sid in layer.shard_ids()]


def _register(layer: nn.Module, name: str, data: torch.Tensor, loader, output_dim=None, rows_per_entry=1,
              input_dim=None, input_pack=1) -> nn.Parameter:
    """A parameter with its loader and how it shards across tensor-parallel ranks
    (`atom.model_ops.linear`): `output_dim` / `input_dim` (None: the same on every rank), each
    entry along them covering `rows_per_entry` output rows / `input_pack` input columns."""
    p = nn.Parameter(data, requires_grad=False)
    p.weight_loader = loader
    p.output_dim, p.rows_per_entry, p.input_dim, p.input_pack = output_dim, rows_per_entry, input_dim, input_pack
    layer.register_parameter(name, p)
    return p


def weight_param(layer: nn.Module, name: str, shape: tuple, dtype: torch.dtype, input_pack: int = 1) -> nn.Parameter:
    """A weight-like parameter (rows = output features, columns = input features, `input_pack`
    of them per stored element) filled by the layer's loader."""
    return _register(layer, name, torch.empty(shape, dtype=dtype), layer.weight_loader, output_dim=0,
                     input_dim=1 if len(shape) > 1 else None, input_pack=input_pack)


def bias_param(layer: nn.Module, out_features: int, bias: bool) -> None:
    if bias:
        weight_param(layer, "bias", (out_features,), torch.get_default_dtype())
    else:
        layer.register_parameter("bias", None)


def per_shard_param(layer: nn.Module, name: str, tail: tuple = (), dtype=torch.float32) -> nn.Parameter:
    """One entry of shape `tail` per shard; a checkpoint tensor of `prod(tail)` values
    (0-d, [1], [2] ...) lands in its shard's entry."""
    ids = layer.shard_ids()

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.numel() != max(1, math.prod(tail)) or shard_id not in ids:
            raise ValueError(f"{layer.prefix}.{name}: checkpoint tensor shape {tuple(loaded.shape)} "
                             f"(shard {shard_id!r}) does not fit one entry of shape {tail} per shard {ids}")
        param.data[ids.index(shard_id)].copy_(loaded.reshape(tail))

    return _register(layer, name, torch.ones((len(ids), *tail), dtype=dtype), load)


def row_ranges(layer: nn.Module, rows_per_entry: int) -> dict:
    """shard_id -> (first entry, entries) when each shard's rows take
    ceil(rows / rows_per_entry) entries of a row-concatenated tensor."""
    out, start = {}, 0
    for sid, _, size in shards(layer):
        n = -(-size // rows_per_entry)
        out[sid] = (start, n)
        start += n
    return out


def row_param(layer: nn.Module, name: str, cols: int, dtype=torch.float32, rows_per_entry: int = 1,
              fill: float = 1.0, input_pack: int | None = None) -> nn.Parameter:
    """[sum of entries over shards, cols]; a checkpoint tensor [entries, cols] (or [entries]
    when cols is 1, as Quark writes per-channel scales) lands in its shard's entries.
    `input_pack`: input columns per column (a block or group scale); None: cols do not
    follow the input (per-channel)."""
    ranges = row_ranges(layer, rows_per_entry)
    total = sum(n for _, n in ranges.values())

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        start, n = ranges[shard_id] if shard_id is not None else (0, total)
        if loaded.dim() == 1 and cols == 1:
            loaded = loaded.reshape(-1, 1)
        if tuple(loaded.shape) != (n, cols):
            raise ValueError(f"{layer.prefix}.{name}: checkpoint tensor shape {tuple(loaded.shape)} "
                             f"(shard {shard_id!r}) != expected {(n, cols)}")
        param.data[start:start + n].copy_(loaded)

    return _register(layer, name, torch.full((total, cols), fill, dtype=dtype), load, output_dim=0,
                     rows_per_entry=rows_per_entry, input_dim=None if input_pack is None else 1,
                     input_pack=input_pack or 1)


def expand_rows(layer: nn.Module, t: torch.Tensor, rows_per_entry: int, unpack=None) -> torch.Tensor:
    """A row-concatenated tensor (see `row_param`) -> one row per output feature: each
    shard's entries repeated (or `unpack`ed) to rows_per_entry rows, cut to the shard."""
    if rows_per_entry == 1 and unpack is None:
        return t
    parts = []
    for sid, _, size in shards(layer):
        start, n = row_ranges(layer, rows_per_entry)[sid]
        chunk = t[start:start + n]
        chunk = unpack(chunk) if unpack is not None else chunk.repeat_interleave(rows_per_entry, 0)
        parts.append(chunk[:size])
    return torch.cat(parts, 0)


def per_row_from_shards(layer: nn.Module, values: torch.Tensor) -> torch.Tensor:
    """[shards] (one value per shard) -> [out, 1] (each row its shard's value)."""
    sizes = torch.tensor([size for _, _, size in shards(layer)], device=values.device)
    return values.float().repeat_interleave(sizes).reshape(-1, 1)


def _amax_scale(x: torch.Tensor, qmax: float, dim=None) -> torch.Tensor:
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    return amax.clamp(min=_AMAX_MIN) / qmax


def tensor_scale(x2: torch.Tensor, qmax: float) -> torch.Tensor:
    """The dynamic per-tensor scale of activations x2 [M, K]: their amax over the step's real
    tokens. In a CUDA graph's padded step (`AttentionMetadata.padded`) the rows past
    cu_seqlens_q[-1] hold whatever memory was there (even inf / NaN) and are left out, on the
    device (a graph cannot read the count on the host)."""
    meta = current_forward_context()
    if meta is None or not meta.padded or x2.shape[0] != meta.slot_mapping.shape[0]:
        return _amax_scale(x2.float(), qmax)
    real = torch.arange(x2.shape[0], device=x2.device) < meta.cu_seqlens_q[-1]
    amax = torch.where(real, x2.float().abs().amax(-1), 0.0).amax()
    return amax.clamp(min=_AMAX_MIN) / qmax


def _round(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "fp8":
        return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return torch.round(x).clamp(-128, 127)


def fake_quant_act(x: torch.Tensor, kind: str, scheme: str, group: int | None = None,
                   static_scale: torch.Tensor | None = None, qmax: float | None = None) -> torch.Tensor:
    """Activations quantized then dequantized (fp32) as the format defines. `kind`: "fp8"
    (e4m3, qmax 448) or "int8" (symmetric, qmax 127 unless given, round half to even, clamp
    to [-128, 127]); `scheme`: "none", "tensor" (one scale for the whole input:
    `static_scale` or amax / qmax), "token" (one per row) or "group" (one per row and
    `group` columns)."""
    x = x.float()
    if scheme == "none":
        return x
    qmax = qmax or (FP8_MAX if kind == "fp8" else INT8_MAX)
    if static_scale is not None:
        s = static_scale.float()
    elif scheme == "tensor":
        s = _amax_scale(x, qmax)
    elif scheme == "token":
        s = _amax_scale(x, qmax, dim=-1)
    else:
        g = x.unflatten(-1, (-1, group))
        s = _amax_scale(g, qmax, dim=-1)
        return (_round(g / s, kind) * s).flatten(-2)
    return _round(x / s, kind) * s


def product(x: torch.Tensor, x32: torch.Tensor, w32: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x32 W32^T (+ b) in fp32, returned in x's dtype."""
    return F.linear(x32, w32, bias.float() if bias is not None else None).to(x.dtype)


class QuantLinearMethod(LinearMethod):
    """A quantized method: `spec` (the layer's LayerQuantConfig), `prefix` (for errors).

    Torch reference on every device: the weight is dequantized to fp32 at each call and
    multiplied by F.linear (a GPU runs the same dequantize-then-F.linear until a fused kernel
    lands: correct, not fast). Nothing is ever left dequantized in the layer. `kernel`
    says what runs the product (the per-layer table's column); methods with GPU kernels
    replace it."""

    kernel = "torch reference (dequantize + F.linear) on every device"

    def __init__(self, spec, prefix: str):
        self.spec, self.prefix = spec, prefix

    def weight_bytes(self, layer: nn.Module) -> int:
        """Everything the layer stores: checkpoint tensors and the buffers derived from them."""
        seen, total = set(), 0
        for t in list(layer.parameters(recurse=False)) + list(layer.buffers(recurse=False)):
            key = (t.data_ptr(), t.numel())
            if key not in seen:  # a buffer that is its parameter is stored once
                seen.add(key)
                total += t.numel() * t.element_size()
        return total

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.format_spec()})"

    def format_spec(self) -> str:
        raise NotImplementedError

    def format(self, layer: nn.Module) -> str:
        return self.format_spec()


# ---------------------------------------------------------------------------
# The GPU product of the 8-bit methods (fp8, int8): at small M the tensor-core swap-AB
# kernel (`kernels.quant_gemv_dot`, the activation quantizer folded in where its table says
# so), else activation quantization by `kernels.act_quant` and `kernels.quant_gemm`'s GEMM,
# or torch._scaled_mm for fp8 row / column scales where cuBLASLt takes the case (`product_route`).
# `prequantized_product` runs the same routes on an input a kernel in front already quantized
# (the kernel plan's "norm+quant" / "silu+quant"; the methods' `apply_quantized`).
# ---------------------------------------------------------------------------

SCALED_MM_MIN_M = 65  # from here fp8 row / column scaled products go to cuBLASLt when it takes them
# (below it the swap-AB kernel of `kernels.quant_gemv_dot` was faster at every Llama shape)
# One row of per-token fp8 (batch-1 decode) into an e4m3 weight with a scale a row: the CUDA-core
# product in fp16 pairs (`kernels.fp8_gemv1`) instead of the swap-AB kernel, where it takes the
# shape (faster at three of Llama-3.1-8B's four shapes and level at down: docs/perf)
ONE_ROW_FP8 = True


def use_kernels(x: torch.Tensor) -> bool:
    """Whether a quantized method runs its Triton / cuBLASLt path for `x`: an NVIDIA CUDA
    tensor with Triton installed. The CPU keeps the torch reference, and so does ROCm for
    now (its fp8 is the fnuz variant, which these kernels do not read)."""
    from atom.model_ops.kernels.triton_import import HAS_TRITON
    return x.is_cuda and HAS_TRITON and torch.version.hip is None


def scaled_mm_problem(x2: torch.Tensor, N: int, rowwise: bool, bias: torch.Tensor | None = None) -> str | None:
    """Why torch._scaled_mm cannot run this fp8 product of x2 [M, K] (its dtype the output's)
    (None: it can): `scaled_mm_problem_for`."""
    return scaled_mm_problem_for(x2.shape[1], N, x2.dtype, x2.device, rowwise)


def scaled_mm_problem_for(K: int, N: int, out_dtype: torch.dtype, device, rowwise: bool) -> str | None:
    """Why torch._scaled_mm cannot run an fp8 product [M, K] x [K, N] -> `out_dtype` on
    `device` (None: it can): cuBLASLt's rules as torch 2.11 checks them. K and N multiples
    of 16; tensor-wise scales on sm89+, any of bf16 / fp16 / fp32 out; row-wise scales
    ([M, 1] x [1, N]) on sm90+ with bf16 out only; not on ROCm (its fp8 is the fnuz variant)."""
    if K % 16 or N % 16:
        return f"K={K} and N={N} must be multiples of 16"
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"out dtype {out_dtype}"
    if rowwise and out_dtype != torch.bfloat16:
        return f"row-wise scales need a bfloat16 output, not {out_dtype}"
    device = torch.device(device)
    if device.type == "cuda":
        if torch.version.hip is not None:
            return "ROCm"
        cap = torch.cuda.get_device_capability(device)
        if cap < ((9, 0) if rowwise else (8, 9)):
            return f"compute capability {cap}"
    return None


def _scaled_mm(xq, xs, w, ws_row, bias, out_dtype, w_scalar, plan=None, fast_accum=False):
    """torch._scaled_mm with tensor-wise (one x scale, one weight scale) or row-wise scales;
    a bias goes into the call where cuBLASLt takes it (tensor-wise, 16-bit out), else is
    added after. `plan`: the engine's `KernelPlan`, whose start-up cuBLASLt choice for the
    shape (`tuning.gemm_choice`, `KernelPlan.lt_scaled`) runs the row-wise bf16 product
    where it has one, and whose `fp8_fast_accum` (or `fast_accum` without a plan) asks
    torch for fast accumulation."""
    M, N = xq.shape[0], w.shape[0]
    fast = bool(plan.fp8_fast_accum) if plan is not None else fast_accum
    if xs.numel() == 1 and w_scalar is not None:
        fuse = bias is not None and out_dtype != torch.float32
        y = torch._scaled_mm(xq, w.t(), xs.reshape(()).float(), w_scalar.reshape(()).float(),
                             bias=bias.to(out_dtype) if fuse else None, out_dtype=out_dtype, use_fast_accum=fast)
    else:
        fuse = False
        y = plan.lt_scaled(xq, xs, w, ws_row) if plan is not None and out_dtype == torch.bfloat16 else None
        if y is None:
            y = torch._scaled_mm(xq, w.t(), xs.float().reshape(-1, 1).expand(M, 1).contiguous(),
                                 ws_row.float().reshape(1, N).contiguous(), out_dtype=out_dtype,
                                 use_fast_accum=fast)
    if bias is not None and not fuse:
        y = (y.float() + bias.float()).to(out_dtype)
    return y


def product_route(kind: str, M: int, x2: torch.Tensor | None = None, N: int = 0, block_k: int = 0,
                  rowwise: bool = True, bias: torch.Tensor | None = None, act: str = "token") -> str:
    """Which kernel the 8-bit GPU product runs for M rows:
    - "dot_fused" / "dot": the tensor-core swap-AB kernel (`kernels.quant_gemv_dot`) where its
      table `small_m_config(M, N, K, block_k, kind, act)` has an entry (up to 64 rows, and
      ptpc fp8 into narrow outputs up to 128), with the activation quantizer folded in
      ("dot_fused") or in front (`act_quant`, "dot"); one row of per-token fp8 into a weight
      with a scale a row runs the CUDA-core `kernels.fp8_gemv1` on that route instead, where it
      takes the shape (`ONE_ROW_FP8`; `_product_on_route`);
    - "scaled_mm": else fp8 row / column scales from SCALED_MM_MIN_M rows where cuBLASLt takes them;
    - else "gemv" (the CUDA-core GEMV, M <= GEMV_MAX_M) or "gemm" (tl.dot tiles)."""
    if x2 is None:
        return route_for(kind, M, 0, N, None, None, block_k, rowwise, act)
    return route_for(kind, M, x2.shape[-1], N, x2.dtype, x2.device, block_k, rowwise, act)


def route_for(kind: str, M: int, K: int, N: int, out_dtype: torch.dtype | None, device, block_k: int = 0,
              rowwise: bool = True, act: str = "token") -> str:
    """`product_route` for a product [M, K] x [K, N] -> `out_dtype` on `device` (None: no
    torch._scaled_mm)."""
    from atom.model_ops.kernels.quant_gemm import GEMV_MAX_M
    from atom.model_ops.kernels.quant_gemv_dot import _big_smem, small_m_config
    big = _big_smem(torch.device(device)) if device is not None else True  # (the table's widest tiles)
    cfg = small_m_config(M, N, K, block_k, kind, act, big_smem=big)
    if cfg is not None:
        return "dot_fused" if cfg.get("FUSE") else "dot"
    if kind == "fp8" and not block_k and M >= SCALED_MM_MIN_M and out_dtype is not None \
            and scaled_mm_problem_for(K, N, out_dtype, device, rowwise) is None:
        return "scaled_mm"
    return "gemv" if M <= GEMV_MAX_M else "gemm"


@torch.library.custom_op("atom::quant_linear", mutates_args=())
def quantized_product(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bias: Optional[torch.Tensor], kind: str,
                      act: str, qmax: float, group: int = 0, static_scale: Optional[torch.Tensor] = None,
                      w_scalar: Optional[torch.Tensor] = None, plan_handle: int = 0) -> torch.Tensor:
    """x [..., K] times an 8-bit weight w [N, K] (kind "fp8" / "int8") with its scales `ws`:
    [N, 1] per row, or [N, K / group] per block (act "group"), on the GPU kernels; the
    activations quantized as `fake_quant_act(x, kind, act, group, static_scale, qmax)` does.
    `w_scalar`: the weight's single scale when it has one (per-tensor, one shard), which
    lets cuBLASLt run tensor-wise scales. `plan_handle`: the engine's `KernelPlan` (its
    `handle`; 0: none), whose start-up choice of cuBLASLt algorithm serves the row-wise fp8
    products of the shapes it timed. Returns x's dtype.

    One custom op around the whole product (its own kernels are custom ops too): the route
    depends on M and on the device's capability, which torch.compile should not trace."""
    from atom.model_ops.kernels.act_quant import act_quant
    from atom.model_ops.kernels.quant_gemv_dot import quant_gemv_dot_fused
    K, N = x.shape[-1], w.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    block_k = group if act == "group" else 0
    if act == "tensor" and static_scale is None:
        static_scale = tensor_scale(x2, qmax)
    one_scale = act == "tensor" and w_scalar is not None  # both scales single: cuBLASLt's tensor-wise
    route = product_route(kind, M, x2, N, block_k, rowwise=not one_scale, bias=bias, act=act)
    if route == "dot_fused":  # one launch: the activations are quantized inside the product
        ws_k = ws if block_k else ws.reshape(-1)
        y = quant_gemv_dot_fused(x2, w, ws_k, bias, kind, qmax, block_k, static_scale if act == "tensor" else None)
        return y.reshape(*lead, N)
    xq, xs = act_quant(x2, kind, block_k or K, qmax, static_scale if act == "tensor" else None)
    if act != "group":
        xs = xs.reshape(-1)[:1] if act == "tensor" else xs.reshape(-1)
    plan = plan_for(plan_handle) if plan_handle else None
    return _product_on_route(route, xq, xs, w, ws, bias, x.dtype, block_k, w_scalar, plan=plan).reshape(*lead, N)


def _product_on_route(route: str, xq, xs, w, ws, bias, out_dtype, block_k, w_scalar, lock=None, defer_sum=False,
                      plan=None, fast_accum=False):
    """The product of quantized activations (`act_quant`'s layouts) on `route`
    (`product_route`; "dot_fused" runs "dot": x is quantized already). `lock`: the swap-AB
    kernel folds a split K into itself (`quant_gemv_dot.split_k_lock`); `defer_sum`: its split
    K comes back unsummed (`split_k.PendingSum`; other routes return the product). `plan`:
    the engine's `KernelPlan`, whose cuBLASLt choice serves "scaled_mm" where it has one,
    and "dot" (without a bias) where the start-up timing found one faster than the swap-AB
    kernel (row-wise fp8 from SCALED_MM_MIN_M rows: `tuning.gemm_choice.is_timed`), and
    whose one-row `fp8_gemv1` tile (`plan.fp8_tile`, chosen at start-up) serves one row
    (quantized rows only: a pending row quantized on load keeps the kernel's table tile, since
    the choice times the plain kernel).
    `fast_accum`: "scaled_mm" with fast accumulation where no plan says (`_scaled_mm`)."""
    from atom.model_ops.kernels import fp8_gemv1
    from atom.model_ops.kernels.quant_gemm import quant_gemm, quant_gemv
    from atom.model_ops.kernels.quant_gemv_dot import quant_gemv_dot, quant_gemv_dot_launch
    ws_k = ws if block_k else ws.reshape(-1)
    if route == "dot" and plan is not None and bias is None and lock is None and not defer_sum and not block_k \
            and out_dtype == torch.bfloat16 and (y := plan.lt_scaled(xq, xs, w, ws)) is not None:
        return y  # (timed without a bias: the swap-AB kernel adds one inside its split-K sum)
    if route in ("dot", "dot_fused"):
        if lock is None and not defer_sum and not block_k and ONE_ROW_FP8 and fp8_gemv1.takes(xq, xs, w, ws_k):
            return fp8_gemv1.fp8_gemv1_launch(xq, xs, w, ws_k, bias, out_dtype=out_dtype,
                                              tile=plan.fp8_tile(w) if plan is not None else None)
        if lock is not None or defer_sum:  # the launch itself (the custom op returns a tensor, mutates nothing)
            return quant_gemv_dot_launch(xq, xs, w, ws_k, bias, out_dtype, block_k, lock=lock, defer_sum=defer_sum)
        return quant_gemv_dot(xq, xs, w, ws_k, bias, out_dtype, block_k)
    if route == "gemv":
        return quant_gemv(xq, xs, w, ws_k, bias, out_dtype, block_k)
    if route == "scaled_mm":
        return _scaled_mm(xq, xs, w, ws, bias, out_dtype, w_scalar, plan, fast_accum)
    return quant_gemm(xq, xs, w, ws_k, bias, out_dtype, block_k)


class InputQuant(NamedTuple):
    """How a method takes its input already quantized (`apply_quantized`): `kind` "fp8"
    (e4m3) / "int8", quantized as `act_quant(x, kind, K, qmax)` does, one scale a row.
    `per_token` False: the format's scale is one for the whole input (dynamic per-tensor),
    which a per-row quantizer gives only for one row."""
    kind: str
    qmax: float
    per_token: bool = True


def _check_prequantized(xq: torch.Tensor, xs: torch.Tensor, K: int) -> None:
    if xq.dim() != 2 or xq.shape[1] != K:
        raise ValueError(f"pre-quantized x must be [M, K={K}], got shape {tuple(xq.shape)}")
    if xq.dtype not in (torch.float8_e4m3fn, torch.int8):
        raise ValueError(f"pre-quantized x dtype {xq.dtype}: float8_e4m3fn or int8 wanted")
    if xs.numel() not in (1, xq.shape[0]):
        raise ValueError(f"pre-quantized x scales: one a row ({xq.shape[0]}) or one in all, got shape "
                         f"{tuple(xs.shape)}")


def prequantized_product(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                         bias: Optional[torch.Tensor], out_dtype: torch.dtype, w_scalar: Optional[torch.Tensor] = None,
                         lock: Optional[torch.Tensor] = None, defer_sum: bool = False, plan=None):
    """xq [M, K] already quantized (float8_e4m3fn / int8 like w, by a kernel in front: one
    scale a row, xs [M] or [M, 1] fp32, or one scale for every row) times the 8-bit weight
    w [N, K] with its row scales ws [N, 1] -> [M, N] in `out_dtype`: `quantized_product`'s
    routes for M rows (the same table: swap-AB to 64 rows, then torch._scaled_mm or the
    Triton GEMM), without its quantizer. `lock`: the split-K sum folded into the swap-AB
    kernel; `defer_sum`: a split K's partials returned unsummed, a `split_k.PendingSum` (for
    the kernel after the product to add). Eager only (the fused decoder forward; under
    torch.compile the layers run `quantized_product`).

    xq may be a `kernels.pending_quant.PendingQuant` (xs None): rows whose quantization has
    not run; the swap-AB route quantizes them on load (one launch; at one row `fp8_gemv1` where
    it takes the product, as for quantized rows), the others quantize first.
    `plan`: as for `quantized_product` (the `KernelPlan` itself)."""
    from atom.model_ops.kernels.pending_quant import PendingQuant
    if isinstance(xq, PendingQuant):
        M, K = xq.shape
        route = route_for(xq.kind, M, K, w.shape[0], out_dtype, xq.device)
        if route in ("dot", "dot_fused"):
            from atom.model_ops.kernels import fp8_gemv1
            ws_n = ws.reshape(-1)
            if lock is None and not defer_sum and ONE_ROW_FP8 and fp8_gemv1.takes_pending(xq, w, ws_n):
                return fp8_gemv1.fp8_gemv1_pending_launch(xq, w, ws_n, bias, out_dtype=out_dtype)
            from atom.model_ops.kernels.quant_gemv_dot import quant_gemv_dot_pending_launch
            return quant_gemv_dot_pending_launch(xq, w, ws_n, bias, out_dtype, lock=lock, defer_sum=defer_sum)
        xq, xs = xq.quantize()
    _check_prequantized(xq, xs, w.shape[1])
    if xq.dtype != w.dtype:
        raise ValueError(f"pre-quantized x dtype {xq.dtype} != the weight's {w.dtype}")
    M, K = xq.shape
    N = w.shape[0]
    xs = xs.reshape(-1).float()
    one_scale = xs.numel() == 1 and w_scalar is not None  # both single: cuBLASLt's tensor-wise scales
    route = route_for("int8" if xq.dtype == torch.int8 else "fp8", M, K, N, out_dtype, xq.device,
                      rowwise=not one_scale)
    return _product_on_route(route, xq, xs, w, ws, bias, out_dtype, 0, w_scalar, lock, defer_sum, plan)


def prequantized_ref(xq: torch.Tensor, xs: torch.Tensor, w32: torch.Tensor, bias: Optional[torch.Tensor],
                     out_dtype: torch.dtype) -> torch.Tensor:
    """The torch reference of `prequantized_product` with the weight dequantized to fp32
    (w32): x = q * scale exactly (what `fake_quant_act` gives for the same q and scale),
    times w32 in fp32. A `PendingQuant` xq is quantized first (its kernel)."""
    from atom.model_ops.kernels.pending_quant import PendingQuant
    if isinstance(xq, PendingQuant):
        xq, xs = xq.quantize()
    _check_prequantized(xq, xs, w32.shape[1])
    x32 = xq.float() * xs.float().reshape(-1, 1)
    return F.linear(x32, w32, bias.float() if bias is not None else None).to(out_dtype)


@quantized_product.register_fake
def _(x, w, ws, bias, kind, act, qmax, group=0, static_scale=None, w_scalar=None, plan_handle=0):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def kernel_summary(kind: str, act: str, block_k: int = 0, tensorwise: bool = False) -> str:
    """What `quantized_product` runs, for the per-layer table (`kernel` of a method); the
    small-M part follows the swap-AB kernel's table (`quant_gemv_dot.table_summary`)."""
    from atom.model_ops.kernels.quant_gemv_dot import table_summary
    head = f"act_quant + {table_summary()} / quant_gemm"
    if kind == "fp8" and not block_k:
        mm = "tensor-wise" if tensorwise else "row-wise, bf16 out"
        if ONE_ROW_FP8 and act == "token":
            head += "; fp8_gemv1 (CUDA-core fp16 pairs) at M=1 where it takes the shape"
        head += f"; torch._scaled_mm {mm} from M={SCALED_MM_MIN_M}"
    return f"GPU: {head}; CPU: torch reference"


REFERENCE_KERNEL = QuantLinearMethod.kernel
