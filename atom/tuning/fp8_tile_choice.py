"""The start-up choice of the one-row ptpc FP8 product's tile per weight shape, into a plan.

At one row (batch-1 decode) the row-wise scaled fp8 layers run `kernels.fp8_gemv1` (CUDA
cores, fp16 pairs), whose tile (rows a program, loads a step, warps, words a load) decides how
many weight bytes each SM keeps in flight. Its table (`fp8_gemv1.tile_for`) comes from one
GPU's probe; a GPU with another memory bandwidth or SM count can prefer another tile, and
the products are most of a batch-1 FP8 step. `choose_fp8_tiles` times, for each (N, K) of
the model's layers that take the kernel, the table's tile and each of `CANDIDATES` that
covers the shape, inside CUDA graphs cycling through the shape's weights (so that they come
from HBM, as in a forward), and records a candidate in the engine's `KernelPlan`
(`plan.fp8_tiles`) where it is at least `min_gain` times faster than the table's tile and
agrees with it; the one-row route (`quant.common`) then launches that tile for rows quantized
in front (rows quantized on load, the opt-in "quant_on_load", keep the table's). Every tile
computes the same sums in another order (fp16 chains of one load's words), so results
differ by rounding only.

    plan.fp8_tiles            # (N, K) -> the chosen tile, where one beat the table's
    plan.fp8_tile_timings     # (N, K) -> (the table's tile, {tile: us}), every tile timed
    plan.to_frame()           # rows of kind "fp8_gemv1": the table's tile, the best, which runs
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from atom.tuning.gemm_choice import _agree, _enough_weights
from atom.utils.cuda_timing import graph_time

logger = logging.getLogger(__name__)

#: tiles timed beside the table's (BLOCK_N, BLOCK_W, num_warps, DW, AHEAD): the ones the H100
#: probe (`scripts/fp8_h2_probe.py`) found best or within ~3% at one of Llama-3.1-8B's shapes, and
#: the 8-row tile of 8 warps (variant `quant_on_load_8rows`'s; not in the probe's grid)
CANDIDATES = ((4, 256, 8, 2, True), (4, 128, 4, 2, True), (8, 128, 4, 2, True), (2, 128, 4, 2, True),
              (4, 64, 2, 2, True), (8, 256, 8, 2, True))
MIN_GAIN = 1.02  # a candidate replaces the table's tile where it is this much faster


def one_row_layers(model: nn.Module, gpu_only: bool = True) -> dict[tuple[int, int], list[nn.Module]]:
    """The layers whose one-row product can run `fp8_gemv1`, by weight shape (N, K): row-wise
    scaled fp8 (`Fp8LinearMethod.rowwise_scaled`: e4m3 weights with a scale a row, dynamic
    per-token activations) with a contiguous weight, on a GPU (`gpu_only`)."""
    groups: dict[tuple[int, int], list[nn.Module]] = {}
    for m in model.modules():
        w = getattr(m, "weight", None)
        rowwise = getattr(getattr(m, "method", None), "rowwise_scaled", None)
        if not isinstance(w, torch.Tensor) or rowwise is None or not rowwise() or w.dtype != torch.float8_e4m3fn:
            continue
        if (w.is_cuda or not gpu_only) and w.is_contiguous() and hasattr(m, "row_scale"):
            groups.setdefault((w.shape[0], w.shape[1]), []).append(m)
    return groups


def pick(timings: dict[tuple, float], table_tile: tuple, min_gain: float = MIN_GAIN) -> tuple | None:
    """The fastest of `timings` (tile -> us) where it is at least `min_gain` times faster than
    `table_tile`'s time, else None (the table's tile stays)."""
    if table_tile not in timings:
        raise ValueError(f"pick: the table's tile {table_tile} was not timed (timed: {list(timings)})")
    best = min(timings, key=timings.get)
    return best if best != table_tile and timings[table_tile] >= min_gain * timings[best] else None


def choose_fp8_tiles(plan, model: nn.Module, min_gain: float = MIN_GAIN, candidates=CANDIDATES,
                     iters: int = 25) -> dict:
    """Into `plan.fp8_tiles` / `plan.fp8_tile_timings` (module docstring). Returns
    {(N, K): {tile: us}}; an empty dict where no layer takes the kernel (off the GPU, other
    formats)."""
    from atom.model_ops.kernels.fp8_gemv1 import fp8_gemv1_launch, takes, tile_for, tile_problem
    out = {}
    for (n, k), layers in one_row_layers(model).items():
        ops = [(m.weight, m.row_scale.reshape(-1)) for m in layers]
        dev = ops[0][0].device
        xq = (torch.randn(1, k, device=dev) * 64).to(torch.float8_e4m3fn)
        xs = torch.full((1,), 0.01, device=dev)
        if not takes(xq, xs, *ops[0]):
            plan.fp8_tiles.pop((n, k), None)
            continue
        ops = ops[:len(_enough_weights([w for w, _ in ops]))]  # cycled through: read from HBM, not L2
        ys = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        table_tile = tile_for(n, k)
        ref = fp8_gemv1_launch(xq, xs, *ops[0], tile=table_tile)
        timings = {}
        for tile in dict.fromkeys((table_tile, *candidates)):
            if tile_problem(n, k, tile):  # a candidate that cannot run this shape
                continue
            if tile != table_tile and not _agree(fp8_gemv1_launch(xq, xs, *ops[0], tile=tile), ref):
                logger.warning("fp8_gemv1 tile %s disagrees with the table's %s on %dx%d: not used",
                               tile, table_tile, n, k)
                continue
            calls = [functools.partial(fp8_gemv1_launch, xq, xs, w, ws, None, ys, tile=tile) for w, ws in ops]
            timings[tile] = graph_time(calls, iters) * 1e6
        best = pick(timings, table_tile, min_gain)
        if best is None:
            plan.fp8_tiles.pop((n, k), None)
        else:
            plan.fp8_tiles[(n, k)] = best
        plan.fp8_tile_timings[(n, k)] = (table_tile, timings)
        out[(n, k)] = timings
        logger.info("one-row ptpc fp8 %dx%d: the table's tile %s %.1f us, the fastest %s %.1f us -> %s", n, k,
                    table_tile, timings[table_tile], min(timings, key=timings.get), min(timings.values()),
                    best or "the table's")
    return out
