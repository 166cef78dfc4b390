"""Tune the experts' grouped-GEMM tiles for one MoE shape on this GPU and write the file.

    python -m atom.tuning.moe_tune --model <folder with config.json> [--dtype bfloat16]
    python -m atom.tuning.moe_tune --experts 128 --width 768 --hidden 2048 --top-k 8 \
        [--tokens 1,2,4,...] [--out atom/model_ops/moe/configs]

For each token count T it times the sorted path (`fused_experts(sort=True)`) under every
tile of `search_space()` that is not too tall for T (`fits_tokens`) and the unsorted
small-batch path, on random inputs routed by a random softmax top-k, checks the winner
against the torch reference, and writes a
`TileTable` (`atom.model_ops.moe.tile_configs`): the best tile per T, the timings, and
`unsorted_max_tokens`, the largest T of the leading run of counts at which the unsorted
path beat the best tile (0 when it lost at the smallest count: sorted everywhere). Runs on a GPU only (the timings mean
nothing elsewhere); `tune()` takes the timer as an argument so its search and bookkeeping
can be exercised without one.

The default timer replays the layer from a CUDA graph (`gpu_time_us`), as the engine's decode
steps do: timed from Python, a few-token layer (two GEMMs and the sort's small launches)
measures the host's launch rate, not the kernels, and the tiles picked that way are noise.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
from typing import Callable

import torch

from atom.model_ops.moe.tile_configs import CONFIG_DIR, TileTable, check_tile
from atom.utils.pow2 import next_pow2

logger = logging.getLogger(__name__)

# decode batches in finer steps (the tile that wins changes with the rows per expert there)
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048, 4096, 8192)


SPACES = {
    # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) choices
    "full": ((16, 32, 64, 128), (32, 64, 128, 256), (64, 128, 256), (1, 8), (4, 8), (2, 3, 4)),
    # about a quarter of it (the neighbourhood Hopper's winners come from): minutes, not an hour.
    # Narrow (32) and deep (256) tiles are for the few-token counts, where a layer has few
    # (expert, N-slice) programs to spread over the SMs and each streams a long K
    "quick": ((16, 32, 64, 128), (32, 64, 128), (64, 128, 256), (8,), (4, 8), (3, 4)),
}


def search_space(name: str = "full") -> list[dict]:
    """Tiles tried per token count (powers of two; warps and stages as Hopper likes them)."""
    if name not in SPACES:
        raise ValueError(f"space={name!r} is invalid: choose one of {', '.join(SPACES)}")
    out = []
    for bm, bn, bk, gm, w, s in itertools.product(*SPACES[name]):
        if bm * bn >= 128 * 256 and w == 4:
            continue  # too many accumulators per thread
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=w, num_stages=s))
    return out


def fits_tokens(cfg: dict, tokens: int, top_k: int, experts: int) -> bool:
    """Whether a tile is worth timing at `tokens`: its BLOCK_M is at most twice the power of two
    (>= 16) covering an expert's average rows (tokens * top_k / experts). A taller tile is
    mostly padding rows, which cost tensor-core time and never read less weight."""
    rows = -(-tokens * top_k // max(experts, 1))
    return cfg["BLOCK_M"] <= 2 * max(16, next_pow2(rows))


def gpu_time_us(fn) -> float:
    """Microseconds a call of `fn` takes on the GPU, replayed from a CUDA graph (Triton's
    `do_bench_cudagraph`, median); a call that cannot be captured is timed eagerly. Triton times
    on a side stream that does not wait for the default one: the synchronize lets the inputs
    made there be finished first (routed ids read before their kernel wrote them index past
    the weights)."""
    import triton.testing
    torch.cuda.synchronize()
    try:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=10, return_mode="median")
    except RuntimeError as e:  # eager timing also counts launch overhead: the warning says so
        logger.warning("graph capture failed (%s): timed eagerly", str(e).splitlines()[0] if str(e) else e)
        torch.cuda.synchronize()
        return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def shape_of_model(folder: str) -> dict:
    """experts, width, hidden, top_k from a HF config.json (Qwen3-MoE, Mixtral, DeepSeek, GPT-OSS names)."""
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    experts = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts")
    width = c.get("moe_intermediate_size") or c.get("intermediate_size")
    if not experts or not width:
        raise ValueError(f"{folder}/config.json names no experts (num_experts / num_local_experts / "
                         "n_routed_experts) or width (moe_intermediate_size / intermediate_size)")
    return dict(experts=int(experts), width=int(width), hidden=int(c["hidden_size"]),
                top_k=int(c.get("num_experts_per_tok") or c.get("experts_per_token") or 1))


def make_case(experts: int, width: int, hidden: int, top_k: int, tokens: int, dtype, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    w13 = (torch.randn(experts, 2 * width, hidden, generator=g, device=device) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, width, generator=g, device=device) * width ** -0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g, device=device)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return x, w13, w2, weights, ids


def tune(experts: int, width: int, hidden: int, top_k: int, dtype: torch.dtype, tokens=DEFAULT_TOKENS,
         device: str = "cuda", device_name: str | None = None, bench: Callable | None = None,
         space: list[dict] | None = None, check: bool = True, prune: bool = True,
         on_count: Callable | None = None) -> tuple[TileTable, dict]:
    """(table, timings in us per T). `bench(fn, case) -> microseconds`, `case` naming what `fn`
    runs ({"tokens", "config", "sort"}); default: `gpu_time_us`. `prune` times only the tiles
    `fits_tokens` keeps at each T. `on_count(table, timings)` runs after each T (the command
    saves the file there, so a run cut short keeps the counts it finished)."""
    from atom.model_ops.activation import silu_and_mul
    from atom.model_ops.moe.experts_ref import experts_reference
    from atom.model_ops.moe.experts_triton import fused_experts
    if bench is None:
        bench = lambda fn, case: gpu_time_us(fn)  # noqa: E731
    space = space or search_space()
    name = device_name or (torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu")
    table = TileTable(experts, width, hidden, str(dtype).removeprefix("torch."), name)
    timings: dict[str, dict] = {}
    unsorted_wins = []
    for T in sorted(tokens):
        x, w13, w2, weights, ids = make_case(experts, width, hidden, top_k, T, dtype, device)
        best, best_us, tried = None, float("inf"), 0
        for cfg in space:
            if prune and not fits_tokens(cfg, T, top_k, experts):
                continue
            try:
                us = bench(lambda: fused_experts(x, w13, w2, weights, ids, silu_and_mul, config=cfg, sort=True),
                           {"tokens": T, "config": cfg, "sort": True})
            except Exception as e:  # a tile that does not compile / fit here
                logger.debug("T=%d %s failed: %s", T, cfg, str(e).splitlines()[0] if str(e) else type(e).__name__)
                continue
            tried += 1
            if us < best_us:
                best, best_us = cfg, us
        if best is None:
            why = "ran" if any(fits_tokens(c, T, top_k, experts) for c in space) or not prune else \
                "is short enough (fits_tokens; prune=False times them all)"
            raise RuntimeError(f"no tile of the search space {why} at T={T} for E={experts} I={width} H={hidden}")
        unsorted_us = bench(lambda: fused_experts(x, w13, w2, weights, ids, silu_and_mul, config=best, sort=False),
                            {"tokens": T, "config": best, "sort": False})
        if check:
            ref = experts_reference(x, w13, w2, weights, ids, silu_and_mul).float()
            got = fused_experts(x, w13, w2, weights, ids, silu_and_mul, config=best, sort=True).float()
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
            if err > tol:
                raise RuntimeError(f"T={T}: the best tile {best} is off the reference by {err:.2e} (> {tol})")
        table.configs[T] = check_tile(best, f"T={T}")
        timings[str(T)] = {"sorted_us": round(best_us, 2), "unsorted_us": round(unsorted_us, 2), "tried": tried}
        unsorted_wins.append((T, unsorted_us < best_us))
        logger.info("T=%d: %s %.1f us (unsorted %.1f us, %d tiles ran)", T, best, best_us, unsorted_us, tried)
        lead = list(itertools.takewhile(lambda tw: tw[1], unsorted_wins))
        table.unsorted_max_tokens = lead[-1][0] if lead else 0  # 0: the sorted path at every count
        if on_count is not None:
            on_count(table, timings)
    return table, timings


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a folder with config.json (instead of the shape flags)")
    ap.add_argument("--experts", type=int)
    ap.add_argument("--width", type=int, help="the expert's intermediate size I")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="comma-separated token counts")
    ap.add_argument("--out", default=str(CONFIG_DIR), help="folder for the tile file")
    ap.add_argument("--space", default="full", choices=sorted(SPACES), help="the tiles tried per token count")
    ap.add_argument("--no-prune", action="store_true", help="also time tiles taller than `fits_tokens` allows")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.model:
        shape = shape_of_model(args.model)
    elif None in (args.experts, args.width, args.hidden, args.top_k):
        ap.error("give --model, or all of --experts, --width, --hidden, --top-k")
    else:
        shape = dict(experts=args.experts, width=args.width, hidden=args.hidden, top_k=args.top_k)
    if not torch.cuda.is_available():
        print("no CUDA device: moe_tune times kernels on a GPU and must run there", file=sys.stderr)
        return 2
    tokens = tuple(int(t) for t in args.tokens.split(",") if t)
    saved = []  # the file, written after each count
    tune(**shape, dtype=getattr(torch, args.dtype), tokens=tokens, space=search_space(args.space),
         prune=not args.no_prune, on_count=lambda t, tm: saved.append(t.save(args.out, tm)))
    print(f"wrote {saved[-1]}" if saved else "no token counts given: nothing written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
