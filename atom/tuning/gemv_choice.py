"""The start-up choice of the one-row (batch-1 decode) GEMV per weight shape, into a plan.

Each bf16/fp16 unquantized linear layer (and the LM head) declares how a decoder layer calls
it at batch 1 (`one_row_variants`, set by `fusions.install`): "plain" (x W^T), "norm"
(RMSNorm of x + residual first), "norm+silu" (then SiLU-and-mul of a [gate | up] product),
"norm+rope" (RMSNorm, a packed q/k/v product, the rotary embedding and the KV-cache write).
`choose_gemv_shapes` times each (N, K, dtype, variant) unfused against the Triton GEMV in
its candidate configurations and records the faster in the engine's `KernelPlan`.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from atom.tuning.plan import VARIANTS
from atom.utils.cuda_timing import graph_time

logger = logging.getLogger(__name__)


def one_row_calls(plan, variant: str, x: torch.Tensor, w: torch.Tensor, config: dict | None = None,
                  layer: nn.Module | None = None):
    """(unfused, Triton) callables of one variant on one row, for timing and checking
    (`layer`: the module, for the head layout of "norm+rope")."""
    from atom.model_ops.kernels import fused_add_rms_norm, gemv, gemv_fused
    from atom.model_ops.kernels import silu_and_mul as silu_mul
    from atom.model_ops.quant.unquantized import library_product
    if variant == "plain":
        return functools.partial(library_product, plan, x, w), functools.partial(gemv, x, w, config)
    gated = variant == "norm+silu"
    res, nw = torch.randn_like(x), torch.rand(x.shape[1], device=x.device, dtype=x.dtype) + 0.5
    if variant == "norm+rope":
        return _rope_calls(plan, x, res, nw, w, layer, config)

    def unfused():
        h, _ = fused_add_rms_norm(x, res, nw, 1e-6)
        y = library_product(plan, h, w)
        return silu_mul(y) if gated else y

    return unfused, lambda: gemv_fused(x, res, nw, 1e-6, w, gated, config)[0]


def _rope_calls(plan, x, res, nw, w, layer, config):
    """"norm+rope" against what the layer runs without it: the "norm" product as chosen
    before it (the fused GEMV, or the add + RMSNorm kernel and the library product), then the
    rotary kernel with the cache write (a one-block cache, the row at position 7, slot 3).
    Each callable returns the row and views of the cached k and v at that slot (no extra
    kernel), so that the check covers the write."""
    from atom.model_ops.kernels import fused_add_rms_norm, gemv_fused, rotary_embedding
    from atom.model_ops.kernels.gemv_rope import gemv_norm_rope
    from atom.model_ops.quant.unquantized import library_product
    D, qs, kvs = layer.head_dim, layer.q_size, layer.kv_size
    dev = x.device
    pos, slot = torch.tensor([7], device=dev), torch.tensor([3], device=dev)
    cs = torch.rand(16, D, device=dev)
    caches = [torch.zeros(1, 16, kvs // D, D, dtype=x.dtype, device=dev) for _ in range(4)]
    norm_cfg = plan.gemv.get((w.shape[0], w.shape[1], w.dtype, "norm"))

    def without():
        if norm_cfg is not None:
            y = gemv_fused(x, res, nw, 1e-6, w, False, norm_cfg)[0]
        else:
            y = library_product(plan, fused_add_rms_norm(x, res, nw, 1e-6)[0], w)
        q, k, v = y.split([qs, kvs, kvs], dim=-1)
        rotary_embedding(pos, q, k, cs, D, kv_cache=(v, caches[0], caches[1], slot))
        return y, caches[0][0, 3], caches[1][0, 3]

    def fused():
        y = gemv_norm_rope(x, res, nw, 1e-6, w, D, qs, pos, cs, caches[2], caches[3], slot, config)[0]
        return y, caches[2][0, 3], caches[3][0, 3]

    return without, fused


def agree(got, ref) -> bool:
    """The Triton result matches the unfused one (tensors, or tuples of them) to bf16 rounding."""
    if isinstance(ref, torch.Tensor):
        got, ref = (got,), (ref,)
    return all(torch.allclose(g.float(), r.float(), rtol=2e-2, atol=2e-2 * float(r.abs().max()))
               for g, r in zip(got, ref))


def one_row_variants(m: nn.Module) -> tuple:
    v = getattr(m, "one_row", None)
    return tuple(x for x in (v if isinstance(v, tuple) else (v,)) if x in VARIANTS)


def choose_gemv_shapes(plan, model: nn.Module, min_gain: float = 1.02, fused_min_gain: float = 0.97) -> dict:
    """Into `plan`: times each one-row product of the model's bf16/fp16 unquantized linear
    layers and LM head, as the layer runs it (`one_row`: plain, or with the norm before /
    SiLU-and-mul after), unfused (the library product and the separate kernels) against the
    Triton GEMV in each of its candidate configurations, inside CUDA graphs and cycling
    through all the layers' weights of the shape so that they come from HBM, not L2; a key
    (N, K, dtype, variant) goes to the GEMV's fastest configuration where that is at least
    `min_gain` times faster than unfused and gives the same result (1.02: the Llama-3.1-8B LM
    head's GEMV measured 2.5-4.8% faster than cuBLAS in all eight start-ups on the H200, where
    1.05 left it on cuBLAS). A fused variant (norm before, SiLU or rotary after) needs only
    `fused_min_gain`: in a layer it also saves the launches and ramps of the separate kernels
    around it, which a graph of the same call repeated does not show (Llama-3.1-8B batch 1:
    the gated gate-up GEMV forced 4.205-4.214 ms/step, the unfused layers forced 4.316, while
    the start-up timings of the two differ by 0.3-4 us between start-ups). "norm+rope" is
    timed against what the layer runs without it: the "norm" product as chosen just before
    (the variants of a layer are timed in their tuple order) and the rotary kernel.
    Returns {key: (unfused us, Triton us)}; an empty dict off the GPU."""
    from atom.model_ops.kernels.gemv import gemv_candidates
    from atom.model_ops.quant import is_unquantized
    groups: dict[tuple, tuple[nn.Module, list[torch.Tensor]]] = {}  # key -> (first layer, weights)
    for m in model.modules():
        w = getattr(m, "weight", None)
        if is_unquantized(m) and getattr(m, "bias", None) is None and w is not None and w.is_cuda \
                and w.dtype in (torch.bfloat16, torch.float16):
            for variant in one_row_variants(m):
                groups.setdefault((w.shape[0], w.shape[1], w.dtype, variant), (m, []))[1].append(w)
    out = {}
    for key, (layer, ws) in groups.items():
        x = torch.randn(1, key[1], device=ws[0].device, dtype=key[2])
        gated = key[3] == "norm+silu"
        base = graph_time([one_row_calls(plan, key[3], x, w, None, layer)[0] for w in ws]) * 1e6
        best = None
        for cfg in gemv_candidates(key[0] // 2 if gated else key[0], key[1], gated):
            if key[3] == "norm+rope" and cfg["BLOCK_N"] % 2:
                continue  # row pairs
            unfused, fused = one_row_calls(plan, key[3], x, ws[0], cfg, layer)
            if not agree(fused(), unfused()):
                logger.warning("Triton GEMV %s disagrees with the unfused layers on %s: not used", cfg, key)
                continue
            t = graph_time([one_row_calls(plan, key[3], x, w, cfg, layer)[1] for w in ws]) * 1e6
            if best is None or t < best[0]:
                best = (t, cfg)
        if best is None:
            continue
        out[key] = (base, best[0])
        if base >= (min_gain if key[3] == "plain" else fused_min_gain) * best[0]:
            plan.gemv[key] = best[1]
        else:
            plan.gemv.pop(key, None)
        logger.info("one-row %s %dx%d %s: unfused %.1f us, Triton GEMV %.1f us (%s) -> %s", key[3], key[0],
                    key[1], key[2], base, best[0], best[1], "Triton" if key in plan.gemv else "unfused")
    plan.gemv_timings.update(out)
    return out
