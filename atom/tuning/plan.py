"""`KernelPlan`: the kernel choices of one engine, made at start-up, installed by its runner.

Which kernel library the layers call (torch references, Triton, AITER), which fusions the
runner installs on the decoder layers (see `fusions`), the one-row GEMV configuration chosen
per (N, K, dtype, variant) with the timings that chose it, and the cuBLASLt algorithm chosen
per (rows, N, K, dtype) with its timings, the one-row ptpc FP8 product's tile chosen per (N, K)
(`fp8_tile_choice`) with the timings of every tile tried, and the experts kernel of MoE layers with the tile
tables it read (`moe_tiles`, from `atom/model_ops/moe/configs/`), and whether row-wise fp8
products on cuBLASLt keep fast accumulation (`fp8_fast_accum`). Each engine owns its plan; the layers hold a
reference to it (`layer.plan`), never a module global, so two engines in one process keep
their own choices.

    plan = llm.engine.runner.plan
    print(plan)                  # what was chosen
    plan.to_frame()              # one row per choice (pandas)
    plan.save("plan.json"); KernelPlan.load("plan.json")   # same choices, no timing

A saved plan holds the GEMV configurations and the cuBLASLt algorithms as bytes; loading it
on another GPU kind or library version is the caller's choice (the file names them).
"""
from __future__ import annotations

import itertools
import json
import logging
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Live plans by handle, for the one place that needs a plan inside a compiled graph
# (`atom::plan_linear` takes the handle, an int, since a custom op takes no Python object).
# Weak: a plan lives as long as its engine; each engine's handle names its own plan only.
_HANDLES = itertools.count(1)
_LIVE: "weakref.WeakValueDictionary[int, KernelPlan]" = weakref.WeakValueDictionary()


def plan_for(handle: int) -> "KernelPlan | None":
    """The live plan with this handle (None once its engine is gone)."""
    return _LIVE.get(handle)

# Fusions the runner can install on a decoder layer (norm -> attention -> norm -> MLP):
FUSIONS = (
    "norm+gemv",         # batch 1: the RMSNorm before a projection inside its GEMV
    "norm+gemv+silu",    # batch 1: RMSNorm, gate-up GEMV and SiLU-and-mul in one kernel
    "norm+gemv+rope",    # batch 1: RMSNorm, q/k/v GEMV, rotary and the K/V cache write (no q/k norm)
    "rope+kv_write",     # prefill: the rotary kernel (after q/k norms) also writes K/V into the cache
    "rope_in_attention",  # decode: the attention kernel rotates q/k and writes K/V itself
    "norm+quant",        # 8-bit layers: add + RMSNorm + the activation quantizer in one kernel (q/k/v, gate-up)
    "silu+quant",        # 8-bit layers: SiLU-and-mul + the activation quantizer in one kernel (down)
    "sum+norm+quant",    # 8-bit o_proj's / down's split-K partials summed by the next norm-quantizer (opt-in)
    "split_k_fold",      # 8-bit small-M products sum their split K themselves (no reduction launch)
    "quant_on_load",     # batch 1, 8-bit o_proj / down: the input quantized by the product as it loads it (opt-in)
    "qkv_sum_in_attention",  # decode, 8-bit q/k/v: its split-K partials summed by the attention kernel (opt-in)
    "moe+shared",        # MoE: shared experts stacked after the routed ones, run in the grouped GEMM (opt-in)
    "shared_overlap",    # MoE: shared experts on a second CUDA stream, beside the routed experts
    "w4_norm_gemv",      # batch 1, 4-bit layers: the RMSNorm inside the q/k/v product's one-row 4-bit GEMV
    "fp4_pair_words",    # MXFP4 layers: the weight repacked in place for the one-row GEMV's decode
    "merge_in_attention",  # split decode attention: the last segment's program merges (no merge launch)
    "w4_prepared_x",     # batch 1, 4-bit gate-up / down: their input row prepared by the norm / SiLU kernel (opt-in)
    "w4_o_proj_norm",    # with w4_prepared_x: 4-bit o_proj adds the residual and prepares gate-up's input (opt-in)
    "w4_o_proj_add_norm",  # batch 1, 4-bit o_proj adds the residual and writes gate-up's normed input
    "w4_gate_up_silu",   # with w4_o_proj_add_norm: 4-bit gate-up's one-row GEMV applies SiLU-and-mul
    "w4_down_add_norm",  # with w4_o_proj_add_norm: 4-bit down adds the residual, writes the next q/k/v's input (opt-in)
    "w4_l2_next",        # with w4_norm_gemv, w4_o_proj_add_norm: 4-bit one-row GEMVs ask L2 for the next ones' weights (opt-in)
)
VARIANTS = ("plain", "norm", "norm+silu", "norm+rope")  # one-row GEMV variants
# Tokens up to which "shared_overlap" runs the shared experts on the second stream: decode
# batches; a prefill chunk's shared products fill the GPU themselves and only contend with the
# routed ones (the DeepSeek-V2-Lite block timings behind it are in docs/perf)
SHARED_OVERLAP_MAX_TOKENS = 512
# The default of `KernelPlan.fp8_fast_accum`: on, as vLLM's CUTLASS fp8 kernels run (its sm90
# configurations' FP8FastAccum schedules): the large products (prefill, big decode batches) run
# faster, at about twice the error of promoted sums (still within ~1e-2 of the largest output;
# docs/perf has both). `KernelPlan(fp8_fast_accum=False)` keeps the sums promoted
FP8_FAST_ACCUM = True
MOE_KERNELS = ("auto", "reference", "triton")  # experts kernel: auto = Triton where the plan runs kernels


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"dtype {name!r} in a kernel plan is not a torch dtype")
    return dt


def _tile(v) -> tuple:
    """An `fp8_gemv1` tile read back from JSON: (BLOCK_N, BLOCK_W, num_warps, DW, AHEAD)."""
    if len(v) != 5:
        raise ValueError(f"an fp8_gemv1 tile in a kernel plan has 5 entries, got {v!r}")
    return (int(v[0]), int(v[1]), int(v[2]), int(v[3]), bool(v[4]))


@dataclass
class KernelPlan:
    backend: str = "torch"                 # "torch" | "triton" | "aiter": the layers' kernels
    fusions: tuple[str, ...] = ()          # installed by `fusions.install`
    triton_gemm: bool = False              # ATOM_USE_TRITON_GEMM: products on the Triton GEMM
    gemv: dict = field(default_factory=dict)          # (N, K, dtype, variant) -> GEMV config
    gemv_timings: dict = field(default_factory=dict)  # same key -> (unfused us, Triton us)
    lt: dict = field(default_factory=dict)            # (rows, N, K, dtype) -> (LtProduct, algo)
    lt_timings: dict = field(default_factory=dict)    # same key -> (library us, best us, tried)
    lt_configs: dict = field(default_factory=dict, repr=False)  # enumerations (search cache)
    fp8_tiles: dict = field(default_factory=dict)     # (N, K) -> one-row ptpc fp8 tile (`fp8_tile_choice`)
    fp8_tile_timings: dict = field(default_factory=dict)  # same key -> (the table's tile, {tile: us})
    force_kernels: bool = False            # use the kernels on CPU tensors too (Triton's interpreter)
    moe_kernel: str = "auto"               # the experts kernel (MOE_KERNELS)
    moe_config_dirs: tuple = ()            # folders searched for MoE tile files before the package's
    moe_tile_tables: dict = field(default_factory=dict, repr=False)  # (E, I, H, dtype, device) -> TileTable
    # row-wise fp8 products on cuBLASLt / torch._scaled_mm (from quant.common.SCALED_MM_MIN_M rows)
    # keep their sums in the tensor cores' accumulators (FAST_ACCUM), as vLLM's CUTLASS fp8 kernels do
    fp8_fast_accum: bool = FP8_FAST_ACCUM

    def __post_init__(self):
        from atom.platform import BACKENDS
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is invalid: choose one of {', '.join(BACKENDS)}")
        bad = [f for f in self.fusions if f not in FUSIONS]
        if bad:
            raise ValueError(f"fusions={bad} are invalid: choose among {', '.join(FUSIONS)}")
        self.fusions = tuple(self.fusions)
        if "w4_o_proj_norm" in self.fusions and "w4_prepared_x" not in self.fusions:
            raise ValueError("fusions=['w4_o_proj_norm'] needs 'w4_prepared_x' too: gate-up reads the row o_proj "
                             "prepares through the prepared-row loop")
        if "w4_gate_up_silu" in self.fusions and "w4_o_proj_add_norm" not in self.fusions:
            raise ValueError("fusions=['w4_gate_up_silu'] needs 'w4_o_proj_add_norm' too: the SiLU-and-mul goes into "
                             "the gate-up product that reads the row o_proj writes")
        if "w4_down_add_norm" in self.fusions and "w4_o_proj_add_norm" not in self.fusions:
            raise ValueError("fusions=['w4_down_add_norm'] needs 'w4_o_proj_add_norm' too: down's epilogue runs in "
                             "the MLP that follows o_proj's")
        if "w4_l2_next" in self.fusions and not {"w4_norm_gemv", "w4_o_proj_add_norm"} <= set(self.fusions):
            raise ValueError("fusions=['w4_l2_next'] needs 'w4_norm_gemv' and 'w4_o_proj_add_norm' too: the q/k/v GEMV "
                             "with the norm inside asks L2 for the weights of that path's o_proj and gate-up")
        if self.moe_kernel not in MOE_KERNELS:
            raise ValueError(f"moe_kernel={self.moe_kernel!r} is invalid: choose one of {', '.join(MOE_KERNELS)}")
        self.moe_config_dirs = tuple(self.moe_config_dirs)
        self.check_fp8_tiles()
        self._kernels = None
        self._side_streams: dict = {}  # device -> the second CUDA stream (`side_stream`)
        self.handle = next(_HANDLES)
        _LIVE[self.handle] = self

    def check_fp8_tiles(self) -> None:
        """ValueError unless every `fp8_tiles` entry is a tile `fp8_gemv1` can run at its (N, K)
        (`fp8_gemv1.tile_problem`), and every `fp8_tile_timings` entry holds its table tile's
        time, before any layer launches a tile or a frame shows one."""
        from atom.model_ops.kernels.fp8_gemv1 import tile_problem
        for key, tile in self.fp8_tiles.items():
            problem = "key (N, K) expected" if len(key) != 2 else tile_problem(key[0], key[1], tile)
            if problem:
                raise ValueError(f"fp8_tiles[{key}]={tile}: {problem}")
        for key, (table_tile, us) in self.fp8_tile_timings.items():
            if table_tile not in us:
                raise ValueError(f"fp8_tile_timings[{key}]: the table's tile {table_tile} has no time "
                                 f"(timed: {list(us)})")

    # --- what the layers ask ------------------------------------------------------------
    @property
    def kernels(self):
        """The kernels module of `backend` (None: the layers' torch references)."""
        if self._kernels is None:
            from atom.model_ops.kernel_backend import kernels_for
            self._kernels = kernels_for(self.backend) or False
        return self._kernels or None

    def runs_kernels(self, x: torch.Tensor) -> bool:
        """Whether this plan's backend runs kernels for tensor `x`: a GPU, or anywhere when
        `force_kernels` (compiled or not; what runs under torch.compile is the caller's call)."""
        return self.backend != "torch" and (x.is_cuda or self.force_kernels)

    def kernels_for(self, x: torch.Tensor):
        """The kernels for tensor `x` where `runs_kernels(x)`, None elsewhere and under
        torch.compile (Inductor fuses the torch code)."""
        if torch.compiler.is_compiling() or not self.runs_kernels(x):
            return None
        return self.kernels

    def one_row_config(self, x: torch.Tensor, weight: torch.Tensor, variant: str) -> dict | None:
        """The GEMV configuration chosen for this product when `x` is one row (outside
        torch.compile), else None (the library product runs)."""
        # is_compiling first: under torch.compile nothing here may become a guard on the plan
        if torch.compiler.is_compiling() or not self.gemv or x.dim() != 2 or x.shape[0] != 1:
            return None
        return self.gemv.get((weight.shape[0], weight.shape[1], weight.dtype, variant))

    def fp8_tile(self, w: torch.Tensor) -> tuple | None:
        """The one-row ptpc fp8 product's tile chosen for weight `w`'s shape (`fp8_gemv1`'s
        `tile`), or None: the kernel's table. (None while torch.compile traces, as the other
        lookups here; the custom op around a compiled layer's product asks at run time.)"""
        if torch.compiler.is_compiling() or not self.fp8_tiles:
            return None
        return self.fp8_tiles.get((w.shape[0], w.shape[1]))

    def _lt_hit(self, x: torch.Tensor, w: torch.Tensor, scaled: bool):
        """The (LtProduct, algo) chosen for x W^T's shape, of the kind asked (fp8 scaled or
        not), where x and W are contiguous, of W's dtype and 256-byte aligned (what the
        heuristic assumed); else None."""
        if torch.compiler.is_compiling() or not self.lt or x.dim() != 2:
            return None
        hit = self.lt.get((x.shape[0], w.shape[0], w.shape[1], w.dtype))
        if hit is None or getattr(hit[0], "scaled", False) != scaled or x.dtype != w.dtype \
                or not (x.is_contiguous() and w.is_contiguous()) or x.data_ptr() % 256 or w.data_ptr() % 256:
            return None
        return hit

    def lt_product(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
        """x W^T with the cuBLASLt algorithm chosen for this shape, or None where none was."""
        hit = self._lt_hit(x, w, scaled=False)
        if hit is None:
            return None
        prod, algo = hit
        return prod(x, w, algo)

    def lt_args(self, dtype: torch.dtype) -> dict:
        """The `cublaslt.LtProduct` options of this plan for a product in `dtype`."""
        return {"fast_accum": True} if self.fp8_fast_accum and dtype == torch.float8_e4m3fn else {}

    def lt_scaled(self, xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor | None:
        """The ptpc FP8 product (xq W^T) * xs[:, None] * ws[None, :] -> bf16 with the cuBLASLt
        algorithm chosen for this shape (key dtype float8_e4m3fn), or None where none was.
        xs: one scale a row of xq, or one for all; ws: one a row of W."""
        hit = self._lt_hit(xq, w, scaled=True)
        if hit is None or ws.numel() != w.shape[0]:
            return None
        xs = xs.float().reshape(-1)
        if xs.numel() == 1:
            xs = xs.expand(xq.shape[0])
        xs, ws = xs.contiguous(), ws.float().reshape(-1).contiguous()
        if xs.numel() != xq.shape[0] or xs.data_ptr() % 16 or ws.data_ptr() % 16:  # (cuBLASLt's vectors)
            return None
        prod, algo = hit
        return prod(xq, w, algo, x_scale=xs, w_scale=ws)

    def experts_kernel(self, x: torch.Tensor) -> str:
        """"triton" (the grouped GEMM) or "reference" (the per-expert torch loop) for the
        experts of a MoE layer on `x`: `moe_kernel`, where "auto" means Triton wherever this
        plan's backend runs kernels for `x` (a GPU, or `force_kernels`). Under torch.compile
        too: the layer then calls the Triton path through the `atom::moe_experts` op."""
        if self.moe_kernel != "auto":
            return self.moe_kernel
        return "triton" if self.runs_kernels(x) else "reference"

    def moe_tiles(self, experts: int, width: int, hidden: int, dtype: torch.dtype, device: torch.device | str):
        """The MoE `TileTable` of this shape for this dtype and device, read once (tuned file for
        the GPU's name, or defaults; `atom.model_ops.moe.tile_configs`)."""
        device = torch.device(device)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        key = (experts, width, hidden, _dtype_name(dtype), name)
        table = self.moe_tile_tables.get(key)
        if table is None:
            from atom.model_ops.moe.tile_configs import find_tiles
            table = self.moe_tile_tables[key] = find_tiles(*key, folders=self.moe_config_dirs)
        return table

    def has(self, fusion: str) -> bool:
        return fusion in self.fusions

    def overlaps_shared(self, x: torch.Tensor) -> bool:
        """Whether a MoE layer runs its shared experts on `side_stream` for input `x`
        ("shared_overlap"): a GPU, this plan's kernels, outside torch.compile, up to
        `SHARED_OVERLAP_MAX_TOKENS` tokens."""
        return (self.has("shared_overlap") and x.is_cuda and x.shape[0] <= SHARED_OVERLAP_MAX_TOKENS
                and self.kernels_for(x) is not None)

    def side_stream(self, device: torch.device) -> "torch.cuda.Stream":
        """This engine's second CUDA stream on `device` (made once; "shared_overlap" runs the
        shared experts there)."""
        device = torch.device(device)
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device=device)
        return self._side_streams[device]

    # --- inspection -----------------------------------------------------------------------
    def rows(self) -> list[dict]:
        """One dict per timed choice: kind, shape, variant / rows, timings, what runs."""
        out = []
        for (n, k, dt, variant), (base, tri) in self.gemv_timings.items():
            out.append({"kind": "gemv", "rows": 1, "n": n, "k": k, "dtype": _dtype_name(dt), "variant": variant,
                        "library_us": round(base, 2), "best_us": round(tri, 2),
                        "runs": "triton-gemv" if (n, k, dt, variant) in self.gemv else "library"})
        for (rows, n, k, dt), (base, best, tried) in self.lt_timings.items():
            out.append({"kind": "gemm", "rows": rows, "n": n, "k": k, "dtype": _dtype_name(dt), "variant": "plain",
                        "library_us": round(base, 2), "best_us": round(best, 2),
                        "runs": "cublaslt" if (rows, n, k, dt) in self.lt else "library", "tried": tried})
        for (n, k), (table_tile, us) in self.fp8_tile_timings.items():
            best = min(us, key=us.get)
            out.append({"kind": "fp8_gemv1", "rows": 1, "n": n, "k": k, "dtype": "float8_e4m3fn", "variant": "plain",
                        "library_us": round(us[table_tile], 2), "best_us": round(us[best], 2),
                        "runs": str(self.fp8_tiles.get((n, k), table_tile)), "tried": len(us), "fastest": str(best)})
        for (e, i, h, dt, dev), table in self.moe_tile_tables.items():
            out.append({"kind": "moe", "rows": len(table.configs), "n": 2 * i, "k": h, "dtype": dt,
                        "variant": f"E={e}", "runs": table.source or "default tiles", "device": dev})
        return out

    def to_frame(self):
        import pandas as pd
        return pd.DataFrame(self.rows())

    def __repr__(self) -> str:
        return (f"KernelPlan(backend={self.backend}, fusions={list(self.fusions)}, triton_gemm={self.triton_gemm}, "
                f"moe_kernel={self.moe_kernel}, fp8_fast_accum={self.fp8_fast_accum}, "
                f"gemv={len(self.gemv)}/{len(self.gemv_timings)} chosen/timed, "
                f"cublaslt={len(self.lt)}/{len(self.lt_timings)} chosen/timed, "
                f"fp8_gemv1 tiles={len(self.fp8_tiles)}/{len(self.fp8_tile_timings)} chosen/timed)")

    # --- save / load ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "backend": self.backend, "fusions": list(self.fusions), "triton_gemm": self.triton_gemm,
            "moe_kernel": self.moe_kernel, "moe_config_dirs": [str(d) for d in self.moe_config_dirs],
            "fp8_fast_accum": self.fp8_fast_accum,
            "gemv": [{"key": [n, k, _dtype_name(dt), v], "config": cfg,
                      "timings": list(self.gemv_timings.get((n, k, dt, v), ()))}
                     for (n, k, dt, v), cfg in self.gemv.items()],
            "gemv_timings": [{"key": [n, k, _dtype_name(dt), v], "us": list(t)}
                             for (n, k, dt, v), t in self.gemv_timings.items()],
            "lt": [{"key": [r, n, k, _dtype_name(dt)], "algo": bytes(algo).hex()}
                   for (r, n, k, dt), (_, algo) in self.lt.items()],
            "lt_timings": [{"key": [r, n, k, _dtype_name(dt)], "us": list(t)}
                           for (r, n, k, dt), t in self.lt_timings.items()],
            "fp8_tiles": [{"key": [n, k], "tile": list(t)} for (n, k), t in self.fp8_tiles.items()],
            "fp8_tile_timings": [{"key": [n, k], "table": list(tt), "us": [[list(t), v] for t, v in us.items()]}
                                 for (n, k), (tt, us) in self.fp8_tile_timings.items()],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "KernelPlan":
        plan = cls(backend=data.get("backend", "torch"), fusions=tuple(data.get("fusions", ())),
                   triton_gemm=bool(data.get("triton_gemm", False)), moe_kernel=data.get("moe_kernel", "auto"),
                   moe_config_dirs=tuple(data.get("moe_config_dirs", ())),
                   fp8_fast_accum=bool(data.get("fp8_fast_accum", False)))
        for e in data.get("gemv", []):
            n, k, dt, v = e["key"]
            plan.gemv[(int(n), int(k), _dtype(dt), v)] = dict(e["config"])
        for e in data.get("gemv_timings", []):
            n, k, dt, v = e["key"]
            plan.gemv_timings[(int(n), int(k), _dtype(dt), v)] = tuple(float(t) for t in e["us"])
        for e in data.get("lt_timings", []):
            r, n, k, dt = e["key"]
            plan.lt_timings[(int(r), int(n), int(k), _dtype(dt))] = (float(e["us"][0]), float(e["us"][1]),
                                                                     int(e["us"][2]))
        for e in data.get("fp8_tiles", []):
            plan.fp8_tiles[tuple(int(v) for v in e["key"])] = _tile(e["tile"])
        for e in data.get("fp8_tile_timings", []):
            plan.fp8_tile_timings[tuple(int(v) for v in e["key"])] = (
                _tile(e["table"]), {_tile(t): float(v) for t, v in e["us"]})
        plan.check_fp8_tiles()
        lt = data.get("lt", [])
        if lt:  # cuBLASLt algorithms need the library: only where it is there (a GPU)
            from atom.model_ops import cublaslt
            if not cublaslt.available():
                raise ValueError("the plan holds cuBLASLt algorithms but cuBLASLt is not available here")
            for e in lt:
                r, n, k, dt = e["key"]
                key = (int(r), int(n), int(k), _dtype(dt))
                try:
                    prod = cublaslt.LtProduct(*key, **plan.lt_args(key[3]))
                except RuntimeError as err:  # e.g. a cuBLASLt without the fp8 outer-vector scales
                    logger.warning("plan entry %s left out (the library's product runs): %s", key, err)
                    continue
                plan.lt[key] = (prod, cublaslt.algo_from_bytes(bytes.fromhex(e["algo"])))
        return plan

    def save(self, path: str | Path) -> Path:
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "KernelPlan":
        return cls.from_dict(json.loads(Path(path).expanduser().read_text()))
