"""Which cuBLASLt algorithm each decode-batch product runs: a start-up choice per captured
batch size.

A CUDA graph replays the products of one batch size (a capture size) every decode step, so
the product's kernel can be chosen once for that exact shape. torch's `F.linear` takes the
BLAS heuristic's first pick; `choose_lt_algos` times it against cuBLASLt's other candidates
(`cublaslt.LtProduct.candidates`) for every (rows, N, K) of the model's bf16/fp16 linear
layers at the capture sizes, in CUDA graphs cycling through all the layers' weights of the
shape (so they come from HBM, not L2), and keeps a candidate where it is at least `min_gain`
times faster and gives the same product. `lt_product` then serves those shapes (eager or
captured alike: the choice depends on the shape only); every other product stays on
`F.linear`.
"""
from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from atom.model_ops import cublaslt
from atom.utils.cuda_timing import graph_time

logger = logging.getLogger(__name__)
# (rows, N, K, dtype) -> (LtProduct, algorithm); and the timings that chose them:
# (rows, N, K, dtype) -> (F.linear us, best candidate us, candidates tried)
_CHOSEN: dict[tuple, tuple] = {}
LT_CHOICES: dict[tuple, tuple[float, float, int]] = {}


def lt_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x W^T with the algorithm chosen for this shape, or None where none was (the caller
    then runs `F.linear`)."""
    if not _CHOSEN or x.dim() != 2:
        return None
    hit = _CHOSEN.get((x.shape[0], w.shape[0], w.shape[1], w.dtype))
    if hit is None or x.dtype != w.dtype or not (x.is_contiguous() and w.is_contiguous()):
        return None
    prod, algo = hit
    return prod(x, w, algo)


def clear() -> None:
    _CHOSEN.clear()
    LT_CHOICES.clear()


def _layer_weights(model: nn.Module) -> dict[tuple, list[torch.Tensor]]:
    from atom.model_ops.linear import Linear
    groups: dict[tuple, list[torch.Tensor]] = {}
    for m in model.modules():
        if isinstance(m, Linear) and m.bias is None and m.weight.is_cuda \
                and m.weight.dtype in (torch.bfloat16, torch.float16) and m.weight.is_contiguous():
            groups.setdefault((m.weight.shape[0], m.weight.shape[1], m.weight.dtype), []).append(m.weight)
    return groups


def _agree(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool((got.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max() + 1e-6)


def _enough_weights(ws: list[torch.Tensor]) -> list[torch.Tensor]:
    """The first of a shape's weights that together are three times the L2 cache: cycling
    through them, each product reads its weight from HBM, as in a forward."""
    l2 = getattr(torch.cuda.get_device_properties(ws[0].device), "L2_cache_size", 0) or 50 << 20
    each = ws[0].numel() * ws[0].element_size()
    return ws[:max(1, -(-3 * l2 // each))]


def _choose_one(rows: int, ws: list[torch.Tensor], min_gain: float, iters: int, max_candidates: int):
    n, k, dtype = ws[0].shape[0], ws[0].shape[1], ws[0].dtype
    x = torch.randn(rows, k, device=ws[0].device, dtype=dtype)
    ref = F.linear(x, ws[0])
    base = graph_time([functools.partial(F.linear, x, w) for w in ws], iters) * 1e6
    prod = cublaslt.LtProduct(rows, n, k, dtype)
    out = torch.empty(rows, n, device=x.device, dtype=dtype)
    best, tried = None, 0
    for algo in prod.candidates()[:max_candidates]:
        try:
            if not _agree(prod(x, ws[0], algo, out), ref):
                continue
            t = graph_time([functools.partial(prod, x, w, algo, out) for w in ws], iters) * 1e6
        except RuntimeError:  # an algorithm offered for other row counts that does not run here
            continue
        tried += 1
        if best is None or t < best[0]:
            best = (t, algo)
    key = (rows, n, k, dtype)
    if best is None:
        return
    LT_CHOICES[key] = (base, best[0], tried)
    if base >= min_gain * best[0]:
        _CHOSEN[key] = (prod, best[1])
    else:
        _CHOSEN.pop(key, None)


def choose_lt_algos(model: nn.Module, sizes: list[int], min_gain: float = 1.02, min_rows: int = 2,
                    iters: int = 10, max_candidates: int = 24) -> dict:
    """Times the model's products at each capture size >= `min_rows` (batch 1 has the GEMV
    choice) and keeps the cuBLASLt candidate that wins by `min_gain` (2%: above the spread of
    repeated timings), trying at most `max_candidates` per shape. Returns {key: (F.linear us,
    best candidate us, candidates run)}; an empty dict where cuBLASLt is not available (CPU,
    ROCm)."""
    if not cublaslt.available():
        return {}
    groups = _layer_weights(model)
    rows_list = sorted(s for s in set(sizes) if s >= min_rows)
    if not groups or not rows_list:
        return {}
    from tqdm.auto import tqdm
    t0 = time.perf_counter()
    work = [(r, _enough_weights(ws)) for r in rows_list for ws in groups.values()]
    for rows, ws in tqdm(work, desc="Choosing GEMM algorithms", unit="shape"):
        _choose_one(rows, ws, min_gain, iters, max_candidates)
    for key, (base, best, tried) in LT_CHOICES.items():
        logger.debug("rows %d, %dx%d %s: F.linear %.1f us, best of %d cuBLASLt candidates %.1f us -> %s",
                     *key, base, tried, best, "cuBLASLt" if key in _CHOSEN else "F.linear")
    logger.info("GEMM algorithms: a cuBLASLt candidate chosen for %d of %d (rows, N, K) products (%.1f s)",
                len(_CHOSEN), len(work), time.perf_counter() - t0)
    return dict(LT_CHOICES)
