"""cuBLASLt through ctypes: list the algorithms cuBLASLt's heuristic offers for one product
shape, and run the product with a chosen one.

torch's `F.linear` takes cuBLAS's (or cuBLASLt's) first pick for a shape. For decode batches
of 100-256 rows against an 8B model's weights that pick wastes a third of a wave or more
(`docs/perf/`); the heuristic's other candidates include other tilings, split-K and
stream-K kernels. `LtProduct` holds the descriptors of one (rows, N, K, dtype) product;
`LtProduct.algos()` lists the candidates and `LtProduct(...)(x, w, algo)` runs one on the
current CUDA stream (so a CUDA graph captures it like any other launch).
`LtProduct(..., torch.float8_e4m3fn)` is the ptpc FP8 product: e4m3 operands, one fp32 scale
per row of x and per row of W (cuBLASLt's outer-vector scaling, sm90 with cuBLASLt 12.9+: the
kernels torch._scaled_mm's row-wise scales run there), bf16 out; its fp32 sums promoted out of
the tensor cores' accumulators as without fast accumulation, or not (`fast_accum`: cuBLASLt's
FAST_ACCUM, what torch._scaled_mm's `use_fast_accum` asks for).
`LtProduct.configurations` builds configurations the heuristic does not offer (other tiles,
custom options, cluster shapes) from algorithm ids, each checked by cuBLASLt for the shape;
`tilings` and `variants` are the two cuts of it the start-up search uses (`atom.tuning.gemm_choice`).

The library is the libcublasLt that torch has loaded (found by soname without loading
anything new), else the one of torch's CUDA major version. Nothing here runs on the CPU;
`available()` says whether the GPU build has it.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import os

import torch

logger = logging.getLogger(__name__)

# cublasLt.h / library_types.h enums
_R_16F, _R_16BF, _R_32F, _R_8F_E4M3 = 2, 14, 0, 28
_COMPUTE_32F = 68
_DESC_TRANSA = 3
# cublasLtMatmulDescAttributes_t's scale pointers and modes; cublasLtMatmulMatrixScale_t
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER, _DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 17, 18, 31, 32
_SCALE_OUTER_VEC_32F = 3
_DESC_FAST_ACCUM = 25  # int8_t: fp8 sums kept in the tensor cores' accumulators (no promotion)
_PREF_MAX_WORKSPACE = 1
_OP_T = 1
# cublasLtMatmulAlgoCapAttributes_t / cublasLtMatmulAlgoConfigAttributes_t
_CAP_SPLITK, _CAP_REDUCTION_MASK, _CAP_SWIZZLE, _CAP_TILE_IDS, _CAP_CUSTOM_MAX, _CAP_STAGES_IDS = 0, 1, 2, 6, 7, 13
CONFIG_FIELDS = ("id", "tile", "split_k", "reduction", "swizzle", "custom", "stages", "inner_shape", "cluster")
_CONFIG_SIZES = (4, 4, 4, 4, 4, 4, 4, 2, 2)  # bytes of each field, in the enum's order
_ONLY_FIELDS = ("id", "tile", "stages", "custom", "cluster")  # what `configurations(only=)` can match
CLUSTER_IDS = range(17)  # cublasLtClusterShape_t ids tried (0: cuBLASLt's choice; Hopper kernels need one)
# the start-up search's cut: no split-K, no swizzle, every custom option and cluster shape
_SEARCH = dict(split_ks=(1,), max_custom=7, swizzle=False, clusters=CLUSTER_IDS)
_DTYPES = {torch.bfloat16: _R_16BF, torch.float16: _R_16F, torch.float8_e4m3fn: _R_8F_E4M3}
WORKSPACE_BYTES = 32 << 20


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@functools.cache
def _lib():
    """(library, handle), or None where no libcublasLt loads (CPU builds, ROCm) or its
    handle cannot be created: products then stay on torch's BLAS."""
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return None
    torch.ones(1, device="cuda") @ torch.ones(1, 1, device="cuda")  # torch loads cuBLAS(Lt)
    major = (torch.version.cuda or "").split(".")[0]
    names = [f"libcublasLt.so.{major}"] if major else []
    names += [n for n in ("libcublasLt.so.13", "libcublasLt.so.12") if n not in names]
    lib = None
    for name in names:  # the copy torch has loaded (dlopen with RTLD_NOLOAD loads nothing new)
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            break
        except OSError:
            continue
    if lib is None and major:  # not loaded yet: the one of torch's CUDA major version
        try:
            lib = ctypes.CDLL(f"libcublasLt.so.{major}")
        except OSError:
            pass
    if lib is None:
        logger.info("cuBLASLt: no libcublasLt of CUDA %s could be opened; products stay on torch's BLAS",
                    torch.version.cuda)
        return None
    handle = ctypes.c_void_p()
    try:
        _check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    except (RuntimeError, AttributeError) as err:
        logger.warning("cuBLASLt unusable (%s); products stay on torch's BLAS", err)
        return None
    lib.cublasLtGetVersion.restype = ctypes.c_size_t
    return lib, handle


def available() -> bool:
    return _lib() is not None


def version() -> int:
    """cuBLASLt's version number (e.g. 130100), 0 where it is not available."""
    return int(_lib()[0].cublasLtGetVersion()) if available() else 0


def algo_from_bytes(data: bytes) -> _Algo:
    """An algorithm saved as `bytes(algo)` (its opaque 64 bytes)."""
    if len(data) != ctypes.sizeof(_Algo):
        raise ValueError(f"a cuBLASLt algorithm is {ctypes.sizeof(_Algo)} bytes, got {len(data)}")
    return _Algo.from_buffer_copy(data)


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt: {what} returned status {status}")


@functools.cache
def _workspace(device_index: int) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device_index}")


class LtProduct:
    """y[rows, N] = x[rows, K] W[N, K]^T in `dtype` (fp32 accumulation), x and W contiguous.
    `dtype` float8_e4m3fn: x and W in e4m3, y = (x W^T) * x_scale[:, None] * w_scale[None, :]
    in bf16 (`scaled`), the scales fp32 vectors passed with each call. `fast_accum` (fp8
    only): the sums stay in the tensor cores' accumulators instead of being promoted to fp32
    every few K steps, as vLLM's CUTLASS fp8 kernels run them (faster, ~2x the error)."""

    def __init__(self, rows: int, n: int, k: int, dtype: torch.dtype, fast_accum: bool = False):
        if dtype not in _DTYPES:
            raise ValueError(f"cuBLASLt product: dtype {dtype} is not one of {sorted(map(str, _DTYPES))}")
        if fast_accum and dtype != torch.float8_e4m3fn:
            raise ValueError(f"cuBLASLt product: fast_accum=True is for float8_e4m3fn products, not {dtype}")
        if not available():
            raise RuntimeError("cuBLASLt products need a CUDA GPU whose torch build loads libcublasLt")
        lib, self._handle = _lib()
        self.rows, self.n, self.k, self.dtype = rows, n, k, dtype
        self.scaled = dtype == torch.float8_e4m3fn
        self.fast_accum = bool(fast_accum)
        self.out_dtype = torch.bfloat16 if self.scaled else dtype
        self._lib = lib
        self._desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), _COMPUTE_32F, _R_32F), "MatmulDescCreate")
        self._set_desc(_DESC_TRANSA, ctypes.c_int32(_OP_T), "TRANSA")
        t, o = _DTYPES[dtype], _DTYPES[self.out_dtype]
        self._types = (t, t, o, o)  # A, B, C, D
        if self.scaled:  # one scale per row of W (cuBLASLt's A) and per row of x (its B)
            for attr in (_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE):
                self._set_desc(attr, ctypes.c_int32(_SCALE_OUTER_VEC_32F), "SCALE_MODE")
            # scale vectors for the heuristic's queries; each call sets the real ones
            self._unit = torch.ones(max(n, rows), device="cuda", dtype=torch.float32)
            self._set_scales(self._unit, self._unit)
            if self.fast_accum:
                self._set_desc(_DESC_FAST_ACCUM, ctypes.c_int8(1), "FAST_ACCUM")
        # column-major view: D[N, rows] = op(A)[N, K] B[K, rows], A = W as [K, N], B = x as [K, rows]
        self._a, self._b, self._d = (self._layout(t, k, n, k), self._layout(t, k, rows, k),
                                     self._layout(o, n, rows, n))
        self._pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self._pref)), "PreferenceCreate")
        ws = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(self._pref, _PREF_MAX_WORKSPACE, ctypes.byref(ws), ctypes.c_size_t(8)),
               "MAX_WORKSPACE_BYTES")
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _set_desc(self, attr: int, value, what: str) -> None:
        _check(self._lib.cublasLtMatmulDescSetAttribute(self._desc, attr, ctypes.byref(value),
                                                        ctypes.c_size_t(ctypes.sizeof(value))), what)

    def _set_scales(self, x_scale: torch.Tensor, w_scale: torch.Tensor) -> None:
        self._set_desc(_DESC_A_SCALE_POINTER, ctypes.c_void_p(w_scale.data_ptr()), "A_SCALE_POINTER")
        self._set_desc(_DESC_B_SCALE_POINTER, ctypes.c_void_p(x_scale.data_ptr()), "B_SCALE_POINTER")

    def _layout(self, dtype_id: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        _check(self._lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype_id, ctypes.c_uint64(rows),
                                                    ctypes.c_uint64(cols), ctypes.c_int64(ld)), "MatrixLayoutCreate")
        return layout

    def __del__(self):
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        for name in ("_a", "_b", "_d"):
            if getattr(self, name, None) is not None:
                lib.cublasLtMatrixLayoutDestroy(getattr(self, name))
        if getattr(self, "_pref", None) is not None:
            lib.cublasLtMatmulPreferenceDestroy(self._pref)
        if getattr(self, "_desc", None) is not None:
            lib.cublasLtMatmulDescDestroy(self._desc)

    def algos(self, limit: int = 32) -> list[_Algo]:
        """cuBLASLt's candidates for this shape, its first pick first."""
        results = (_Heuristic * limit)()
        count = ctypes.c_int(0)
        _check(self._lib.cublasLtMatmulAlgoGetHeuristic(
            self._handle, self._desc, self._a, self._b, self._d, self._d, self._pref, limit, results,
            ctypes.byref(count)), "MatmulAlgoGetHeuristic")
        return [results[i].algo for i in range(count.value)
                if results[i].state == 0 and results[i].workspace_size <= WORKSPACE_BYTES]

    def check(self, algo: _Algo) -> bool:
        """Whether cuBLASLt accepts `algo` for this shape (cublasLtMatmulAlgoCheck) within the
        workspace: for algorithms offered for other shapes, or read back from a file."""
        result = _Heuristic()
        status = self._lib.cublasLtMatmulAlgoCheck(self._handle, self._desc, self._a, self._b, self._d, self._d,
                                                   ctypes.byref(algo), ctypes.byref(result))
        return status == 0 and result.state == 0 and result.workspace_size <= WORKSPACE_BYTES

    def candidates(self, hints=(0.5, 2.0, 4.0)) -> list[_Algo]:
        """The heuristic's candidates for this shape, then (each once) those it offers for the
        same N and K at other row counts (`hints`: factors of this one) that pass `check` for
        this one: they often run well here too."""
        seen, out = set(), []
        shapes = [self.rows] + [max(1, int(self.rows * f)) for f in hints]
        for rows in shapes:
            prod = self if rows == self.rows else LtProduct(rows, self.n, self.k, self.dtype, self.fast_accum)
            for algo in prod.algos():
                key = bytes(algo)
                if key not in seen and (prod is self or self.check(algo)):
                    seen.add(key)
                    out.append(algo)
        return out

    def configurations(self, split_ks=(1, 2, 4), max_custom: int = 3, swizzle: bool = True, clusters=(0,),
                       ids=(), listed: bool = True, only=None, first_per_tile: bool = False,
                       limit: int = 50000) -> list[_Algo]:
        """Every configuration cuBLASLt accepts for this shape (`check`), built from algorithm
        ids rather than asked of its heuristic: `ids`, and with `listed` those cuBLASLt lists
        (on the H200 only its pre-Hopper kernels: the Hopper kernels' id comes from the
        heuristic's candidates). For each id: tiles x stages x split-K (each reduction scheme
        it supports) x CTA swizzling x custom options (up to `max_custom`) x cluster shape ids
        (`clusters`; 0 leaves it to cuBLASLt), each once. `only` ({field: value} over
        `_ONLY_FIELDS`) keeps the configurations that match; `first_per_tile` keeps, of each
        tiling's custom options x cluster shapes, the first cuBLASLt accepts. The heuristic
        offers a few dozen of these; the others include tilings it never proposes for
        decode-sized row counts."""
        only = only or {}
        if set(only) - set(_ONLY_FIELDS):
            raise ValueError(f"configurations(only=...) matches {_ONLY_FIELDS}, got {sorted(only)}")
        lib, types = self._lib, self._types
        all_ids = set(ids)
        if listed:
            found = (ctypes.c_int * 256)()
            count = ctypes.c_int(0)
            _check(lib.cublasLtMatmulAlgoGetIds(self._handle, _COMPUTE_32F, _R_32F, *types, 256, found,
                                                ctypes.byref(count)), "MatmulAlgoGetIds")
            all_ids |= set(found[:count.value])
        out, seen = [], set()
        for algo_id in sorted(all_ids):
            if only.get("id", algo_id) != algo_id:
                continue
            base = _Algo()
            if lib.cublasLtMatmulAlgoInit(self._handle, _COMPUTE_32F, _R_32F, *types, algo_id, ctypes.byref(base)):
                continue
            tiles = [v for v in _cap_array(lib, base, _CAP_TILE_IDS) or [0] if only.get("tile", v) == v]
            stages = [v for v in _cap_array(lib, base, _CAP_STAGES_IDS) or [0] if only.get("stages", v) == v]
            can_split, mask = _cap_int(lib, base, _CAP_SPLITK), _cap_int(lib, base, _CAP_REDUCTION_MASK)
            schemes = [b for b in (1, 2, 4) if mask & b] or [0]
            splits = [(s, scheme) for s in split_ks if s == 1 or can_split for scheme in (schemes if s > 1 else [0])]
            swizzles = [0, 1] if swizzle and _cap_int(lib, base, _CAP_SWIZZLE) else [0]
            customs = [c for c in range(min(_cap_int(lib, base, _CAP_CUSTOM_MAX), max_custom) + 1)
                       if only.get("custom", c) == c]
            cluster_ids = [c for c in clusters if only.get("cluster", c) == c]
            for tile, stage, (split, scheme), swz in itertools.product(tiles, stages, splits, swizzles):
                for custom, cluster in itertools.product(customs, cluster_ids):
                    algo = _Algo.from_buffer_copy(base)
                    if not _set(lib, algo, tile=tile, stages=stage, split_k=split, reduction=scheme, swizzle=swz,
                                custom=custom, cluster=cluster):
                        continue  # a field this cuBLASLt does not take
                    if bytes(algo) not in seen and self.check(algo):
                        seen.add(bytes(algo))
                        out.append(algo)
                        if len(out) >= limit:
                            return out
                        if first_per_tile:
                            break
        return out

    def tilings(self, ids) -> list[_Algo]:
        """One configuration per (tile, stages) of the algorithm ids `ids` that cuBLASLt accepts
        for this shape, split-K off: of its custom options x cluster shapes the first accepted
        (`configurations` with `first_per_tile`). A few hundred for Hopper's kernels, where
        the heuristic offers a few dozen."""
        return self.configurations(ids=ids, listed=False, first_per_tile=True, **_SEARCH)

    def variants(self, algo: _Algo) -> list[_Algo]:
        """`algo`'s tiling with each custom option x cluster shape cuBLASLt accepts here."""
        d = describe(algo)
        return self.configurations(ids=[d["id"]], listed=False, only={f: d[f] for f in ("id", "tile", "stages")},
                                   **_SEARCH)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, algo: _Algo, out: torch.Tensor | None = None,
                 x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape != (self.rows, self.k) or w.shape != (self.n, self.k) or not (x.is_contiguous() and w.is_contiguous()):
            raise ValueError(f"cuBLASLt product for rows={self.rows}, N={self.n}, K={self.k}: got x "
                             f"{tuple(x.shape)} and W {tuple(w.shape)} (both must be contiguous)")
        if self.scaled:
            check_scales(x_scale, w_scale, self.rows, self.n)
            self._set_scales(x_scale, w_scale)
        elif x_scale is not None or w_scale is not None:
            raise ValueError(f"a {self.dtype} cuBLASLt product takes no scales")
        if out is None:
            out = torch.empty(self.rows, self.n, device=x.device, dtype=self.out_dtype)
        ws = _workspace(x.device.index or 0)
        stream = ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)
        _check(self._lib.cublasLtMatmul(
            self._handle, self._desc, ctypes.byref(self._alpha), ctypes.c_void_p(w.data_ptr()), self._a,
            ctypes.c_void_p(x.data_ptr()), self._b, ctypes.byref(self._beta), ctypes.c_void_p(out.data_ptr()),
            self._d, ctypes.c_void_p(out.data_ptr()), self._d, ctypes.byref(algo), ctypes.c_void_p(ws.data_ptr()),
            ctypes.c_size_t(WORKSPACE_BYTES), stream), "Matmul")
        return out


def check_scales(x_scale, w_scale, rows: int, n: int) -> None:
    """The scaled product's scales: contiguous, 16-byte aligned fp32 vectors of `rows` and `n`
    values."""
    for name, s, want in (("x_scale", x_scale, rows), ("w_scale", w_scale, n)):
        if s is None or s.dtype != torch.float32 or s.numel() != want or not s.is_contiguous() or s.data_ptr() % 16:
            got = "None" if s is None else f"{s.dtype} {tuple(s.shape)}"
            raise ValueError(f"{name}: a contiguous, 16-byte aligned float32 vector of {want} values is needed, "
                             f"got {got}")


def describe(algo: _Algo) -> dict:
    """An algorithm's configuration (`CONFIG_FIELDS`), for logs and probes."""
    lib = _lib()[0]
    out = {}
    for i, (name, size) in enumerate(zip(CONFIG_FIELDS, _CONFIG_SIZES)):
        value = ctypes.c_int32(0) if size == 4 else ctypes.c_uint16(0)
        written = ctypes.c_size_t(0)
        lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), i, ctypes.byref(value), ctypes.c_size_t(size),
                                                 ctypes.byref(written))
        out[name] = int(value.value)
    return out


def _set(lib, algo: _Algo, **fields) -> bool:
    """Sets configuration fields of `algo`; False where cuBLASLt refuses one."""
    for name, value in fields.items():
        i = CONFIG_FIELDS.index(name)
        buf = ctypes.c_uint32(value) if _CONFIG_SIZES[i] == 4 else ctypes.c_uint16(value)
        if lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), i, ctypes.byref(buf),
                                                    ctypes.c_size_t(_CONFIG_SIZES[i])):
            return False
    return True


def _cap_int(lib, algo: _Algo, attr: int) -> int:
    """A 4-byte capability (0 where cuBLASLt does not answer)."""
    value, written = ctypes.c_int32(0), ctypes.c_size_t(0)
    lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), ctypes.c_size_t(4),
                                          ctypes.byref(written))
    return int(value.value)


def _cap_array(lib, algo: _Algo, attr: int) -> list[int]:
    written = ctypes.c_size_t(0)
    lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, ctypes.c_size_t(0), ctypes.byref(written))
    n = written.value // 4
    if n == 0:
        return []
    values = (ctypes.c_uint32 * n)()
    lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, values, ctypes.c_size_t(4 * n), ctypes.byref(written))
    return list(values)
