"""Linear layers, with the packed (fused) variants the models load into.

Every layer asks the quantization dispatcher for its `LayerQuantConfig` by its module
prefix. This build runs unquantized weights; a layer whose spec asks for a quantized
format is refused at build time, before any weight loads.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from atom.model_ops.activation import silu_and_mul
from atom.model_ops.gemm_tuning import lt_product
from atom.model_ops.norm import RMSNorm
from atom.quant_spec import LayerQuantConfig, QuantType
from atom.utils.cuda_timing import graph_time


logger = logging.getLogger(__name__)
_ONEDNN = torch.backends.mkldnn.is_available()
# One-row (batch-1 decode) products on a GPU: the keys (N, K, dtype, variant) that run a
# Triton GEMV with the kernel configuration chosen for them, and the timings that chose it
# ({key: (unfused us, Triton us)}), filled by `choose_gemv_shapes`. Variants: "plain"
# (x W^T), "norm" (RMSNorm of x + residual first), "norm+silu" (the same, then SiLU-and-mul
# of a [gate | up] product), "norm+rope" (RMSNorm, a packed q/k/v product, then the rotary
# embedding and the KV-cache write: `norm_linear_rope`).
GEMV_CHOICES: dict[tuple, tuple[float, float]] = {}
_GEMV_SHAPES: dict[tuple, dict] = {}
VARIANTS = ("plain", "norm", "norm+silu", "norm+rope")
# ATOM_USE_TRITON_GEMM, read once by the GPU engine's setup (`use_triton_gemm`): products on
# a GPU outside torch.compile go to the Triton GEMM (`kernels.gemm`) instead of cuBLAS.
TRITON_GEMM = False


def use_triton_gemm(enabled: bool) -> None:
    global TRITON_GEMM
    TRITON_GEMM = bool(enabled)


def _one_row_config(x: torch.Tensor, weight: torch.Tensor, variant: str):
    """The GEMV configuration chosen for this product when `x` is one row on a GPU outside
    torch.compile and the Triton GEMV was measured faster for it, else None."""
    if not _GEMV_SHAPES or x.dim() != 2 or x.shape[0] != 1 or x.is_cpu or torch.compiler.is_compiling():
        return None
    return _GEMV_SHAPES.get((weight.shape[0], weight.shape[1], weight.dtype, variant))


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b). fp32 on the CPU goes to oneDNN's matmul: on the 2-core machine, over the
    embedded model's layers, it took 0.54x the time of `F.linear`'s BLAS call at one row,
    0.72x at 32 rows, the same at 8 and 0.92x at 256 (`python -m atom.benchmarks.cpu_gemm`).
    On a GPU, a single row (batch-1 decode) of a weight shape where it measured faster goes
    to the Triton GEMV, and with `ATOM_USE_TRITON_GEMM=1` every other product to the Triton
    GEMM (not under torch.compile, which generates its own)."""
    if x.is_cpu:
        if _ONEDNN and x.dtype == torch.float32 and not torch.compiler.is_compiling():
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    elif bias is None and (cfg := _one_row_config(x, weight, "plain")) is not None:
        from atom.model_ops.kernels.gemv import gemv
        return gemv(x, weight, cfg)
    return _library_product(x, weight, bias)


def norm_linear(norm: RMSNorm, linear: "Linear", x: torch.Tensor, residual: torch.Tensor | None,
                gated: bool = False):
    """`linear(norm(x + residual))`, then SiLU-and-mul when `gated`; returns (y, x + residual)
    like the norm (no add when `residual` is None: the residual is then x). One row on a GPU,
    where `choose_gemv_shapes` measured it faster, runs as one fused Triton GEMV."""
    cfg = _one_row_config(x, linear.weight, "norm+silu" if gated else "norm") if linear.bias is None else None
    if cfg is not None:
        from atom.model_ops.kernels.gemv import gemv_fused
        return gemv_fused(x, residual, norm.weight, norm.eps, linear.weight, gated, cfg)
    if residual is None:
        h, residual = norm(x), x
    else:
        h, residual = norm(x, residual)
    y = linear(h)
    return (silu_and_mul(y) if gated else y), residual


def norm_linear_rope(norm: RMSNorm, linear: "QKVLinear", x: torch.Tensor, residual: torch.Tensor | None,
                     positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor):
    """One row on a GPU, where `choose_gemv_shapes` measured it faster: RMSNorm, the packed
    q/k/v product, the rotary embedding of q and k and the write of k and v into the caches,
    as one Triton GEMV (`kernels.gemv_rope`). Returns (qkv with q rotated, x + residual), or
    None where that does not apply (the caller then runs `norm_linear` and its rotary)."""
    cfg = _one_row_config(x, linear.weight, "norm+rope") if linear.bias is None else None
    if cfg is None:
        return None
    from atom.model_ops.kernels.gemv_rope import gemv_norm_rope
    return gemv_norm_rope(x, residual, norm.weight, norm.eps, linear.weight, linear.head_dim, linear.q_size,
                          positions, cos_sin_cache, k_cache, v_cache, slot_mapping, cfg)


def gemv_choices() -> dict[str, dict]:
    """The start-up choices so far, for reports: {"NxK variant": unfused us, Triton us, used?}."""
    return {f"{n}x{k} {v}": {"unfused_us": round(a, 2), "triton_us": round(b, 2),
                             "uses_triton": (n, k, dt, v) in _GEMV_SHAPES}
            for (n, k, dt, v), (a, b) in GEMV_CHOICES.items()}


def _library_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) as `dense` computes it where no GEMV is chosen (also the start-up choice's
    unfused baseline). On a GPU outside torch.compile: the Triton GEMM under
    ATOM_USE_TRITON_GEMM, else the cuBLASLt algorithm `gemm_tuning` chose for this shape where
    it chose one; otherwise `F.linear` (cuBLAS / hipBLASLt on a GPU)."""
    if x.is_cpu or torch.compiler.is_compiling():
        return F.linear(x, w, bias)
    if TRITON_GEMM and x.dtype == w.dtype:
        from atom.model_ops.kernels.gemm import gemm
        return gemm(x, w, bias)
    if bias is None and (y := lt_product(x, w)) is not None:
        return y
    return F.linear(x, w, bias)


def _one_row_calls(variant: str, x: torch.Tensor, w: torch.Tensor, config: dict | None = None,
                   layer: nn.Module | None = None):
    """(unfused, Triton) callables of one variant on one row, for timing and checking
    (`layer`: the module, for the head layout of "norm+rope")."""
    from atom.model_ops.kernels import fused_add_rms_norm, gemv, gemv_fused
    from atom.model_ops.kernels import silu_and_mul as silu_mul
    if variant == "plain":
        return functools.partial(_library_product, x, w), functools.partial(gemv, x, w, config)
    gated = variant == "norm+silu"
    res, nw = torch.randn_like(x), torch.rand(x.shape[1], device=x.device, dtype=x.dtype) + 0.5
    if variant == "norm+rope":
        return _rope_calls(x, res, nw, w, layer, config)

    def unfused():
        h, _ = fused_add_rms_norm(x, res, nw, 1e-6)
        y = _library_product(h, w)
        return silu_mul(y) if gated else y

    return unfused, lambda: gemv_fused(x, res, nw, 1e-6, w, gated, config)[0]


def _rope_calls(x, res, nw, w, layer, config):
    """"norm+rope" against what the layer runs without it: the "norm" product as chosen
    before it (the fused GEMV, or the add + RMSNorm kernel and cuBLAS), then the rotary kernel
    with the cache write (a one-block cache, the row at position 7, slot 3). Each callable
    returns the row and views of the cached k and v at that slot (no extra kernel), so that
    the check covers the write."""
    from atom.model_ops.kernels import fused_add_rms_norm, gemv_fused, rotary_embedding
    from atom.model_ops.kernels.gemv_rope import gemv_norm_rope
    D, qs, kvs = layer.head_dim, layer.q_size, layer.kv_size
    dev = x.device
    pos, slot = torch.tensor([7], device=dev), torch.tensor([3], device=dev)
    cs = torch.rand(16, D, device=dev)
    caches = [torch.zeros(1, 16, kvs // D, D, dtype=x.dtype, device=dev) for _ in range(4)]
    norm_cfg = _GEMV_SHAPES.get((w.shape[0], w.shape[1], w.dtype, "norm"))

    def without():
        if norm_cfg is not None:
            y = gemv_fused(x, res, nw, 1e-6, w, False, norm_cfg)[0]
        else:
            y = _library_product(fused_add_rms_norm(x, res, nw, 1e-6)[0], w)
        q, k, v = y.split([qs, kvs, kvs], dim=-1)
        rotary_embedding(pos, q, k, cs, D, kv_cache=(v, caches[0], caches[1], slot))
        return y, caches[0][0, 3], caches[1][0, 3]

    def fused():
        y = gemv_norm_rope(x, res, nw, 1e-6, w, D, qs, pos, cs, caches[2], caches[3], slot, config)[0]
        return y, caches[2][0, 3], caches[3][0, 3]

    return without, fused


def _agree(got, ref) -> bool:
    """The Triton result matches the unfused one (tensors, or tuples of them) to bf16 rounding."""
    if isinstance(ref, torch.Tensor):
        got, ref = (got,), (ref,)
    return all(torch.allclose(g.float(), r.float(), rtol=2e-2, atol=2e-2 * float(r.abs().max()))
               for g, r in zip(got, ref))


def _one_row_variants(m: nn.Module) -> tuple:
    v = getattr(m, "one_row", None)
    return tuple(x for x in (v if isinstance(v, tuple) else (v,)) if x in VARIANTS)


def choose_gemv_shapes(model: nn.Module, min_gain: float = 1.02, fused_min_gain: float = 0.97) -> dict:
    """Times each one-row product of the model's bf16/fp16 linear layers and LM head, as the
    layer runs it (`one_row`: plain, or with the norm before / SiLU-and-mul after), unfused
    (cuBLAS, or the Triton GEMM under ATOM_USE_TRITON_GEMM, and the separate kernels)
    against the Triton GEMV in each of its candidate configurations, inside CUDA graphs and
    cycling through all the layers' weights of the shape so that they come from HBM, not L2;
    a key (N, K, dtype, variant) goes to the GEMV's fastest configuration where that is at
    least `min_gain` times faster than unfused and gives the same result (1.02: the
    Llama-3.1-8B LM head's GEMV measured 2.5-4.8% faster than cuBLAS in all eight start-ups
    on the H200, where 1.05 left it on cuBLAS). A fused
    variant (norm before, SiLU or rotary after) needs only `fused_min_gain`: in a layer it
    also saves the launches and ramps of the separate kernels around it, which a graph of
    the same call repeated does not show (Llama-3.1-8B batch 1 on one H200 lease: the gated
    gate-up GEMV forced 4.205-4.214 ms/step, the unfused layers forced 4.316, while the
    start-up timings of the two differ by 0.3-4 us between leases). "norm+rope" is timed
    against what the layer runs without it: the "norm" product as chosen just before (the
    variants of a layer are timed in their tuple order) and the rotary kernel.
    Returns {key: (unfused us, Triton us)}; an empty dict off the GPU."""
    from atom.model_ops.kernels.gemv import gemv_candidates
    groups: dict[tuple, tuple[nn.Module, list[torch.Tensor]]] = {}  # key -> (first layer, weights)
    for m in model.modules():
        w = getattr(m, "weight", None)
        if getattr(m, "bias", None) is None and w is not None and w.is_cuda \
                and w.dtype in (torch.bfloat16, torch.float16):
            for variant in _one_row_variants(m):
                groups.setdefault((w.shape[0], w.shape[1], w.dtype, variant), (m, []))[1].append(w)
    out = {}
    for key, (layer, ws) in groups.items():
        x = torch.randn(1, key[1], device=ws[0].device, dtype=key[2])
        gated = key[3] == "norm+silu"
        base = graph_time([_one_row_calls(key[3], x, w, None, layer)[0] for w in ws]) * 1e6
        best = None
        for cfg in gemv_candidates(key[0] // 2 if gated else key[0], key[1], gated):
            if key[3] == "norm+rope" and cfg["BLOCK_N"] % 2:
                continue  # row pairs
            unfused, fused = _one_row_calls(key[3], x, ws[0], cfg, layer)
            if not _agree(fused(), unfused()):
                logger.warning("Triton GEMV %s disagrees with the unfused layers on %s: not used", cfg, key)
                continue
            t = graph_time([_one_row_calls(key[3], x, w, cfg, layer)[1] for w in ws]) * 1e6
            if best is None or t < best[0]:
                best = (t, cfg)
        if best is None:
            continue
        out[key] = (base, best[0])
        if base >= (min_gain if key[3] == "plain" else fused_min_gain) * best[0]:
            _GEMV_SHAPES[key] = best[1]
        else:
            _GEMV_SHAPES.pop(key, None)
        logger.info("one-row %s %dx%d %s: unfused %.1f us, Triton GEMV %.1f us (%s) -> %s", key[3], key[0],
                    key[1], key[2], base, best[0], best[1], "Triton" if key in _GEMV_SHAPES else "unfused")
    GEMV_CHOICES.update(out)
    return out


def _check_unquantized(spec: LayerQuantConfig | None, prefix: str) -> None:
    if spec is not None and spec.quant_type != QuantType.No:
        raise NotImplementedError(
            f"layer '{prefix}' asks for quant_type={spec.quant_type.name} ({spec.quant_dtype}); "
            "quantized kernels are not in this build: use an unquantized checkpoint")


class Linear(nn.Module):
    """y = x W^T (+ b). `weight_loader(param, tensor, shard_id)` copies a checkpoint tensor.
    `one_row` names how the model calls it at batch 1 (see `VARIANTS`), or a tuple of the ways
    it may: the model sets "norm" or "norm+silu" on a layer it calls through `norm_linear`,
    and adds "norm+rope" on a q/k/v layer it first offers to `norm_linear_rope`."""

    one_row = "plain"

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant_config=None, prefix: str = ""):
        super().__init__()
        self.prefix = prefix
        self.quant_spec = quant_config.get_layer_quant_config(prefix) if quant_config is not None else None
        _check_unquantized(self.quant_spec, prefix)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    # packed layers override these two
    def shard_range(self, shard_id) -> tuple[int, int]:
        return 0, self.out_features

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        start, size = self.shard_range(shard_id) if shard_id is not None else (0, param.shape[0])
        if loaded.shape[0] != size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"{self.prefix}: checkpoint tensor shape {tuple(loaded.shape)} does not fit "
                             f"rows [{start}, {start + size}) of {tuple(param.shape)}")
        param.data[start:start + size].copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class QKVLinear(Linear):
    """q, k and v projections in one matrix: rows [q | k | v]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, quant_config=None, prefix: str = ""):
        self.head_dim = head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, quant_config, prefix)

    def shard_range(self, shard_id) -> tuple[int, int]:
        return {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                "v": (self.q_size + self.kv_size, self.kv_size)}[shard_id]


class MergedLinear(Linear):
    """Several projections of the same input stacked by rows (gate_up: [gate | up])."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 quant_config=None, prefix: str = ""):
        self.out_sizes = list(out_sizes)
        super().__init__(in_features, sum(out_sizes), bias, quant_config, prefix)

    def shard_range(self, shard_id) -> tuple[int, int]:
        return sum(self.out_sizes[:shard_id]), self.out_sizes[shard_id]
