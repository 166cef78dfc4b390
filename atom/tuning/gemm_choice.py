"""Which cuBLASLt algorithm each linear product runs at the row counts the engine repeats:
a start-up choice per captured batch size and for the row count of a full prefill step.

A CUDA graph replays the products of one batch size (a capture size) every decode step, so
the product's kernel can be chosen once for that exact shape. torch's `F.linear` takes the
BLAS heuristic's first pick; `choose_lt_algos` times it against cuBLASLt's other candidates
(`cublaslt.LtProduct.candidates`) for every (rows, N, K) of the model's bias-free,
contiguous bf16/fp16 linear layers at the capture sizes, in CUDA graphs cycling through
enough of the layers' weights of the shape to miss L2 (three times its size), and keeps a
candidate where it is at least `min_gain` times faster and gives the same product. Chunked
prefill fills `max_num_batched_tokens` in a prefill step unless the sequence limit, the free
KV blocks or the requests waiting cut it short (in the nano-vllm workload: every prefill step
but the last), so that row count is chosen for too (on the H200, Llama-3.1-8B at 16,384 rows:
o, gate-up and down 1.6-2.9% faster in a probe, 4.8-11% in one engine's start-up; docs/perf,
eighth session).
The row-wise (ptpc) FP8 layers' products are chosen the same way from
`quant.common.SCALED_MM_MIN_M` rows: where they run torch._scaled_mm, whose cuBLASLt call
takes the heuristic's first pick (one 128 x 128 tile at every decode row count, so the
4096-wide products at up to 256 rows run 32-64 programs on 132 SMs: docs/perf), and where the
swap-AB kernel's 128-row tile runs them (o_proj and down at 65-128 rows), timed against that
kernel. Their candidates keep the same scales, and the sums' promotion to fp32 unless the plan
asks for fast accumulation (`KernelPlan.fp8_fast_accum`, the default: then the candidates and
torch._scaled_mm, the baseline, both run it), and must agree with the engine's product
as the bf16 ones with F.linear (within 1e-2 of the largest output: both are rounded to bf16,
whose step is up to 3.9e-3 of it).
The choices go into the engine's `KernelPlan` (`plan.lt`, timings in `plan.lt_timings`),
whose `lt_product` (`lt_scaled` for fp8) then serves those shapes (eager or captured alike:
the choice depends on the shape only); every other product stays on the library's call.
Asked to (`wide_rows`), it also searches beyond the heuristic at decode row counts
(`_wide_candidates`: other tilings, custom options and cluster shapes of the same kernels),
at about ten times the start-up cost.

With a `cache_dir` (the guide's `CompilationConfig.cache_dir`, "directory for compilation
caches") the choices are kept in a `gemm_algorithms-<tag>.json` there, one per GPU kind,
cuBLASLt and torch version; a later start-up takes them from the file (each chosen algorithm
checked by cuBLASLt for the shape, run once and compared with the library's product) and
times only the shapes the file lacks.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from atom.model_ops import cublaslt
from atom.utils.cuda_timing import graph_time

logger = logging.getLogger(__name__)


def timed_layer(m: nn.Module) -> bool:
    """Whether the choice serves linear layer `m`'s products (wherever its weight lies):
    bias-free contiguous bf16 / fp16 weights of the unquantized method, and e4m3 weights of
    row-wise scaled fp8 layers (`Fp8LinearMethod.rowwise_scaled`; on torch._scaled_mm's route
    a bias is added after the chosen product, on the swap-AB kernel's only bias-free layers
    take it). Not the LM head, whose rows are the sampled ones."""
    from atom.model_ops.linear import Linear
    from atom.model_ops.quant import is_unquantized
    weight = getattr(m, "weight", None)  # 4-bit methods keep their packed words under other names
    if not isinstance(m, Linear) or not isinstance(weight, torch.Tensor) or not weight.is_contiguous():
        return False
    if is_unquantized(m):
        return m.bias is None and weight.dtype in (torch.bfloat16, torch.float16)
    rowwise = getattr(m.method, "rowwise_scaled", None)
    return rowwise is not None and rowwise() and weight.dtype == torch.float8_e4m3fn


def _layer_weights(model: nn.Module) -> dict[tuple, list[torch.Tensor]]:
    """The GPU weights of the layers `timed_layer` takes, by (N, K, dtype)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for m in model.modules():
        if timed_layer(m) and m.weight.is_cuda:
            groups.setdefault((m.weight.shape[0], m.weight.shape[1], m.weight.dtype), []).append(m.weight)
    return groups


def _agree(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within 1e-2 of the largest output (both sides rounded to bf16 / fp16)."""
    return bool((got.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max() + 1e-6)


class _Dense:
    """One timing's input for a bf16 / fp16 shape: x [rows, K]; the library's product is
    `F.linear`."""

    def __init__(self, rows: int, w: torch.Tensor):
        self.x = torch.randn(rows, w.shape[1], device=w.device, dtype=w.dtype)

    def library(self, w: torch.Tensor) -> torch.Tensor:
        return F.linear(self.x, w)

    def lt(self, prod, w: torch.Tensor, algo, out=None) -> functools.partial:
        """The candidate's product as a call (for graph_time)."""
        return functools.partial(prod, self.x, w, algo, out)


class _ScaledFp8(_Dense):
    """One timing's input for a row-wise fp8 shape: e4m3 x [rows, K] with a scale a row, and a
    scale a weight row; the library's product is the engine's own for these rows, without a
    plan: torch._scaled_mm (with fast accumulation where `fast_accum`), or the swap-AB kernel
    where its table takes the rows (`route`)."""

    def __init__(self, rows: int, w: torch.Tensor, fast_accum: bool = False):
        # (x made in bf16 first: `_fits` counts 2 bytes an element)
        from atom.model_ops.quant.common import route_for
        x = torch.randn(rows, w.shape[1], device=w.device, dtype=torch.bfloat16)
        self.x = x.mul_(64).clamp_(-448, 448).to(torch.float8_e4m3fn)
        self.xs = torch.rand(rows, device=w.device).add_(0.5).div_(64)
        self.ws = torch.rand(w.shape[0], device=w.device).add_(0.5).div_(64)
        self.route = route_for("fp8", rows, w.shape[1], w.shape[0], torch.bfloat16, w.device)
        self.fast_accum = fast_accum

    def library(self, w: torch.Tensor) -> torch.Tensor:
        from atom.model_ops.quant.common import _product_on_route
        return _product_on_route(self.route, self.x, self.xs, w, self.ws, None, torch.bfloat16, 0, None,
                                 fast_accum=self.fast_accum)

    def lt(self, prod, w: torch.Tensor, algo, out=None) -> functools.partial:
        return functools.partial(prod, self.x, w, algo, out, x_scale=self.xs, w_scale=self.ws)


def baseline(rows: int, w: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, fast_accum: bool = False) -> str:
    """The product a choice for `rows` rows of `w` is timed against (`timing_case`'s
    library): "F.linear", or "fp8 <route>" (`quant.common.route_for`), " fast-accum" after it
    where the candidates ran so. A cached choice is taken only where it was timed against the
    product that runs now, and ran as it would now."""
    if w.dtype != torch.float8_e4m3fn:
        return "F.linear"
    from atom.model_ops.quant.common import route_for
    route = route_for('fp8', rows, w.shape[1], w.shape[0], out_dtype, w.device)
    return f"fp8 {route}" + (" fast-accum" if fast_accum else "")


def timing_case(rows: int, w: torch.Tensor, fast_accum: bool = False) -> _Dense:
    """The inputs and library product to time `rows` rows against weights shaped like `w`
    (fp8: torch._scaled_mm with fast accumulation where `fast_accum`)."""
    if w.dtype == torch.float8_e4m3fn:
        return _ScaledFp8(rows, w, fast_accum)
    return _Dense(rows, w)


def _out(prod, rows: int, w: torch.Tensor) -> torch.Tensor:
    return torch.empty(rows, w.shape[0], device=w.device, dtype=getattr(prod, "out_dtype", w.dtype))


def _enough_weights(ws: list[torch.Tensor]) -> list[torch.Tensor]:
    """The first of a shape's weights that together are three times the L2 cache: cycling
    through them, each product reads its weight from HBM, as in a forward."""
    l2 = getattr(torch.cuda.get_device_properties(ws[0].device), "L2_cache_size", 0) or 50 << 20
    each = ws[0].numel() * ws[0].element_size()
    return ws[:max(1, -(-3 * l2 // each))]


def _fits(rows: int, w: torch.Tensor) -> bool:
    """Whether the GPU has the memory to time `rows` rows against `w` (the input, the
    reference, the graph's output and the candidates' output, with a quarter to spare)."""
    size = max(w.element_size(), 2)  # fp8: x made in bf16, bf16 out
    need = rows * (w.shape[1] + 3 * w.shape[0]) * size * 5 // 4
    free = torch.cuda.mem_get_info(w.device)[0]
    if free < need:
        logger.info("rows %d, %dx%d: %.1f GB free, timing needs %.1f GB: stays on the library's product",
                    rows, *w.shape, free / 1e9, need / 1e9)
    return free >= need


def is_timed(rows: int, w: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a choice for `rows` rows would serve `w`'s products: every row count for
    bf16 / fp16 weights; for e4m3 weights (bf16 out) those where the fp8 product runs
    torch._scaled_mm, and the swap-AB kernel's from SCALED_MM_MIN_M rows (its 128-row tile
    into narrow outputs: o_proj and down at 65-128 rows), timed against that kernel
    (`quant.common.route_for`). Below, the swap-AB kernel reads the weights at their pace
    and nothing is timed."""
    if w.dtype != torch.float8_e4m3fn:
        return True
    from atom.model_ops.quant.common import SCALED_MM_MIN_M, route_for
    route = route_for("fp8", rows, w.shape[1], w.shape[0], out_dtype, w.device)
    return route == "scaled_mm" or (route == "dot" and rows >= SCALED_MM_MIN_M and out_dtype == torch.bfloat16)


def _screen(prod, case: _Dense, ws: list[torch.Tensor], out: torch.Tensor, algos: list, reps: int = 3) -> list:
    """A first cut: each algorithm's rough time (after one untimed launch, `reps` launches
    cycling the weights between two events, no graph), as (us, algo) fastest first. The GPU
    first sleeps about as long as the host takes to launch them all, so that products shorter
    than a launch from Python still run back to back and are timed, not the host."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None and algos:
        sleep(int(len(algos) * (reps + 1) * 15e-6 * 2e9))  # ~15 us a launch, ~2 GHz
    timed = []
    for algo in algos:
        try:
            case.lt(prod, ws[-1], algo, out)()  # the timed launches start from another weight
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(reps):
                case.lt(prod, ws[i % len(ws)], algo, out)()
            end.record()
        except RuntimeError:
            continue
        timed.append((start, end, algo))
    torch.cuda.synchronize()
    return sorted(((s.elapsed_time(e) * 1e3 / reps, a) for s, e, a in timed), key=lambda p: p[0])


def _accepted(plan, prod, key: tuple, build) -> list:
    """`build()`'s configurations, built once per `key` (enumerating them asks cuBLASLt to
    check tens of thousands: seconds) and afterwards only re-checked for `prod`'s rows."""
    if key not in plan.lt_configs:
        plan.lt_configs[key] = build()
        return plan.lt_configs[key]
    return [a for a in plan.lt_configs[key] if prod.check(a)]


def _wide_candidates(plan, prod, case, ws, out, heuristic: list, tiles: int = 4, keep: int = 6) -> list:
    """Configurations cuBLASLt's heuristic does not offer: one per tiling of the heuristic's
    algorithm ids (`LtProduct.tilings`), screened; the custom options x cluster shapes of the
    `tiles` fastest (`LtProduct.variants`), screened; the `keep` fastest of all. H200, Llama-
    3.1-8B at 192 rows (docs/perf, tenth session): gate-up 76.2 -> 70.4 us, down 44.5 -> 39.7
    against the heuristic's best, with tilings it never proposed. The tilings and variants of
    a weight shape are enumerated at its first row count and re-checked at the others (a
    tiling whose kept configuration cuBLASLt refuses at another row count drops out there)."""
    shape = (prod.n, prod.k, prod.dtype)
    ids = tuple(sorted({cublaslt.describe(a)["id"] for a in heuristic}))
    ranked = _screen(prod, case, ws, out, _accepted(plan, prod, shape + ids, lambda: prod.tilings(ids)))
    seen = {bytes(a) for a in heuristic}
    for _, algo in ranked[:tiles]:
        variants = _accepted(plan, prod, shape + (bytes(algo),), lambda: prod.variants(algo))
        ranked += _screen(prod, case, ws, out, [v for v in variants if bytes(v) != bytes(algo)])
    picked = []
    for _, algo in sorted(ranked, key=lambda p: p[0]):
        if bytes(algo) not in seen and len(picked) < keep:
            seen.add(bytes(algo))
            picked.append(algo)
    return picked


def _choose_one(plan, rows: int, ws: list[torch.Tensor], min_gain: float, iters: int, max_candidates: int,
                wide: bool = False):
    n, k, dtype = ws[0].shape[0], ws[0].shape[1], ws[0].dtype
    try:  # first: where cuBLASLt offers nothing (or refuses the fp8 mode) the library is not timed
        prod = cublaslt.LtProduct(rows, n, k, dtype, **plan.lt_args(dtype))
        algos = prod.candidates()[:max_candidates]
    except RuntimeError as err:  # e.g. no heuristic for this shape: it stays on the library's call
        logger.info("rows %d, %dx%d %s: no cuBLASLt candidates (%s)", rows, n, k, dtype, err)
        return
    case = timing_case(rows, ws[0], plan.fp8_fast_accum)
    ref = case.library(ws[0])
    base = graph_time([functools.partial(case.library, w) for w in ws], iters) * 1e6
    out = _out(prod, rows, ws[0])
    if wide and algos:
        try:
            algos += _wide_candidates(plan, prod, case, ws, out, algos)
        except RuntimeError as err:  # the heuristic's candidates still run
            logger.warning("rows %d, %dx%d %s: the search beyond cuBLASLt's heuristic failed (%s)",
                           rows, n, k, dtype, err)
    best, tried = None, 0
    for algo in algos:
        try:
            if not _agree(case.lt(prod, ws[0], algo, out)(), ref):
                continue
            t = graph_time([case.lt(prod, w, algo, out) for w in ws], iters) * 1e6
        except RuntimeError:  # an algorithm offered for other row counts that does not run here
            continue
        tried += 1
        if best is None or t < best[0]:
            best = (t, algo)
    key = (rows, n, k, dtype)
    if best is None:
        return
    plan.lt_timings[key] = (base, best[0], tried)
    if base >= min_gain * best[0]:
        plan.lt[key] = (prod, best[1])
    else:
        plan.lt.pop(key, None)


def _fingerprint(wide_rows=None) -> dict:
    """What a choice depends on: the GPU kind, cuBLASLt and torch, and how widely it searched
    (a file of narrower choices is not taken for a wider search)."""
    return {"device": torch.cuda.get_device_name(), "cublaslt": cublaslt.version(), "torch": torch.__version__,
            "wide_rows": list(wide_rows) if wide_rows else None}


def cache_path(cache_dir: str | Path, fingerprint: dict) -> Path:
    """The choices file of one GPU kind, cuBLASLt and torch in `cache_dir`: one file each, so
    machines sharing the directory do not overwrite each other's."""
    tag = hashlib.sha1(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:10]
    return Path(cache_dir).expanduser() / f"gemm_algorithms-{tag}.json"


def _entry_name(key: tuple) -> str:
    rows, n, k, dtype = key
    return f"{rows} {n} {k} {str(dtype).removeprefix('torch.')}"


def _load_cached(plan, path: Path, work: list, fingerprint: dict, baselines: dict) -> list:
    """Takes the choices `path` holds for `work`'s shapes (a chosen algorithm only if it runs
    and agrees with the library's product here, and was timed against the product that runs
    now: `baselines`, by key); returns the work items left to time."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return work
    if not isinstance(data, dict) or not isinstance(data.get("choices"), dict):
        logger.warning("GEMM algorithm cache %s is not a choices file: timing again", path)
        return work
    if data.get("fingerprint") != fingerprint:
        logger.info("GEMM algorithm cache %s is for %s, not %s: timing again", path, data.get("fingerprint"), fingerprint)
        return work
    entries, left, stale = data["choices"], [], 0
    for rows, ws in work:
        w = ws[0]
        key = (rows, w.shape[0], w.shape[1], w.dtype)
        e = entries.get(_entry_name(key))
        if isinstance(e, dict) and e.get("baseline") != baselines[key]:  # (files before it was recorded: none)
            stale += 1
            left.append((rows, ws))
            continue
        try:
            if e is not None and e["algo"] is not None:
                prod = cublaslt.LtProduct(rows, w.shape[0], w.shape[1], w.dtype, **plan.lt_args(w.dtype))
                algo = cublaslt.algo_from_bytes(bytes.fromhex(e["algo"]))
                if not prod.check(algo):
                    raise ValueError("cuBLASLt refuses it for this shape")
                case = timing_case(rows, w, plan.fp8_fast_accum)
                if not _agree(case.lt(prod, w, algo)(), case.library(w)):
                    raise ValueError("disagrees with the library's product")
                plan.lt[key] = (prod, algo)
            if e is not None:
                plan.lt_timings[key] = (float(e["base_us"]), float(e["best_us"]), int(e["tried"]))
                continue
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            logger.warning("GEMM algorithm cache %s: entry %s not used (%s)", path, _entry_name(key), err)
        left.append((rows, ws))
    if stale:
        logger.info("GEMM algorithm cache %s: %d choices were timed against another product than the one that "
                    "runs now: timing them again", path, stale)
    return left


def _save(plan, path: Path, fingerprint: dict, baselines: dict) -> None:
    """Writes this run's choices into the file, each with the product it was timed against
    (`baselines`, by key), keeping the entries it has for other shapes (other models, other
    capture sizes)."""
    choices = {}
    try:
        old = json.loads(path.read_text())
        if isinstance(old, dict) and old.get("fingerprint") == fingerprint and isinstance(old.get("choices"), dict):
            choices = old["choices"]
    except (OSError, ValueError):
        pass
    choices.update({_entry_name(k): {"base_us": round(b, 3), "best_us": round(t, 3), "tried": n,
                                     "algo": bytes(plan.lt[k][1]).hex() if k in plan.lt else None,
                                     "baseline": baselines[k]}
                    for k, (b, t, n) in plan.lt_timings.items() if k in baselines})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"fingerprint": fingerprint, "choices": choices}, indent=1))
        tmp.replace(path)
    except OSError as err:
        logger.warning("GEMM algorithm cache %s not written: %s", path, err)


def choose_lt_algos(plan, model: nn.Module, sizes: list[int], min_gain: float = 1.02, min_rows: int = 2,
                    iters: int = 10, max_candidates: int = 24, cache_dir: str = "",
                    prefill_rows: int = 0, wide_rows: tuple[int, int] | None = None,
                    out_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Into `plan` (a `KernelPlan`): times the model's products at each capture size >= `min_rows` (batch 1 has the GEMV
    choice; the row-wise fp8 ones from 65 rows, `is_timed`, for the
    model's activations in `out_dtype`) and keeps the cuBLASLt candidate that wins by `min_gain` (2%: above the spread of
    repeated timings), trying at most `max_candidates` of the heuristic's per shape; with
    `cache_dir`, through the cache file there. `prefill_rows` (the engine passes `max_num_batched_tokens`): also every
    shape at the row count of a full prefill step, timed on one weight (its input alone is
    larger than L2) and skipped where the GPU lacks the memory for the input and three outputs
    (the KV cache is allocated by then). Capture sizes within `wide_rows` (lowest, highest;
    where decode products stop being bound by the weights' bytes and the tiling decides) also
    try six configurations beyond the heuristic's (`_wide_candidates`; about 1 s per product:
    the engine asks for it only with a cache dir). Returns {key: (library us, best candidate us,
    candidates run)}; an empty dict where cuBLASLt is not available (CPU, ROCm)."""
    if not cublaslt.available():
        return {}
    groups = _layer_weights(model)
    rows_list = sorted(s for s in set(sizes) if s >= min_rows)
    if not groups or not (rows_list or prefill_rows):
        return {}
    from tqdm.auto import tqdm
    t0 = time.perf_counter()
    timed_weights = [_enough_weights(ws) for ws in groups.values()]  # once per shape, not per size
    work = [(r, ws) for r in rows_list for ws in timed_weights if is_timed(r, ws[0], out_dtype)]
    wide = {r for r in rows_list if wide_rows and wide_rows[0] <= r <= wide_rows[1]}  # capture sizes only
    if prefill_rows and prefill_rows not in rows_list:
        work += [(prefill_rows, ws[:1]) for ws in groups.values()
                 if is_timed(prefill_rows, ws[0], out_dtype) and _fits(prefill_rows, ws[0])]
    path, fingerprint, todo = None, None, work
    if cache_dir:
        fingerprint = _fingerprint(wide_rows if wide else None)
        path = cache_path(cache_dir, fingerprint)
        baselines = {(r, ws[0].shape[0], ws[0].shape[1], ws[0].dtype):
                     baseline(r, ws[0], out_dtype, plan.fp8_fast_accum)
                     for r, ws in work}
        todo = _load_cached(plan, path, work, fingerprint, baselines)
    for rows, ws in tqdm(todo, desc="Choosing GEMM algorithms", unit="shape", disable=not todo):
        try:
            _choose_one(plan, rows, ws, min_gain, iters, max_candidates, wide=rows in wide)
        except torch.cuda.OutOfMemoryError:
            logger.warning("rows %d, %dx%d: out of GPU memory while timing: stays on the library's product",
                           rows, *ws[0].shape)
    if prefill_rows and todo:
        torch.cuda.empty_cache()  # the large timing buffers and graph pools
    if path is not None and todo:
        _save(plan, path, fingerprint, baselines)
    for key, (base, best, tried) in plan.lt_timings.items():
        logger.debug("rows %d, %dx%d %s: the library %.1f us, best of %d cuBLASLt candidates %.1f us -> %s",
                     *key, base, tried, best, "cuBLASLt" if key in plan.lt else "the library")
    logger.info("GEMM algorithms: a cuBLASLt candidate chosen for %d of %d (rows, N, K) products "
                "(%d timed, %.1f s)", len(plan.lt), len(work), len(todo), time.perf_counter() - t0)
    return dict(plan.lt_timings)
