"""The start-up choice of a cuBLASLt algorithm per decode-batch product (`gemm_tuning`) and
the cuBLASLt binding under it (`cublaslt`): the choice's rules with a stand-in product and
timer on the CPU; on a GPU (marked gpu) every candidate against F.linear, the chosen
products inside the linear layers, and a CUDA graph replaying one."""

import functools
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from atom.model_ops import cublaslt, linear
from atom.tuning import gemm_choice as gemm_tuning
from atom.tuning.plan import KernelPlan

GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None,
                              reason="needs an NVIDIA GPU (cuBLASLt)")


class _P:  # the kernel plan the choices go into (a fresh one per test)
    plan = KernelPlan()


@pytest.fixture(autouse=True)
def _fresh_choices():
    _P.plan = KernelPlan()
    yield


NAMES = ["good-slow", "wrong", "refused", "good-fast"]


def _algo(name):
    a = cublaslt._Algo()
    a.data[0] = NAMES.index(name) + 1
    return a


def _name(algo):
    return NAMES[algo.data[0] - 1]


class _FakeProduct:
    """Stands in for `cublaslt.LtProduct`: algorithm "good-*" computes x W^T, "wrong" a
    different product, "refused" raises like an algorithm cuBLASLt rejects for the shape."""

    def __init__(self, rows, n, k, dtype):
        self.rows, self.n, self.k, self.dtype = rows, n, k, dtype

    def candidates(self):
        return [_algo(n) for n in NAMES]

    def check(self, algo):
        return _name(algo) != "refused"

    def __call__(self, x, w, algo, out=None):
        if _name(algo) == "refused":
            raise RuntimeError("cuBLASLt: Matmul returned status 15")
        y = F.linear(x, w)
        return y * 2 if _name(algo) == "wrong" else y


def _fake_timer(us: dict, calls_seen: list | None = None):
    """graph_time stand-in: runs each call once and reports the time set for its algorithm
    (F.linear: "base")."""
    def graph_time(calls, iters=25):
        for c in calls:
            c()
        c = calls[0]
        algo = _name(c.args[2]) if isinstance(c, functools.partial) and len(c.args) > 2 else "base"
        if calls_seen is not None:
            calls_seen.append((algo, len(calls)))
        return us[algo] * 1e-6
    return graph_time


def _fake_cublaslt(monkeypatch, us, calls_seen=None):
    monkeypatch.setattr(gemm_tuning.cublaslt, "LtProduct", _FakeProduct)
    monkeypatch.setattr(gemm_tuning, "graph_time", _fake_timer(us, calls_seen))


def _run_choice(monkeypatch, us, min_gain=1.02):
    _fake_cublaslt(monkeypatch, us)
    ws = [torch.randn(24, 16) for _ in range(3)]
    gemm_tuning._choose_one(_P.plan, 8, ws, min_gain, iters=3, max_candidates=8)
    return (8, 24, 16, torch.float32)


def test_choice_keeps_the_fastest_correct_candidate_when_it_wins(monkeypatch):
    key = _run_choice(monkeypatch, {"base": 10.0, "good-slow": 9.9, "wrong": 1.0, "good-fast": 9.0})
    base, best, tried = _P.plan.lt_timings[key]
    assert (base, best) == (10.0, 9.0)
    assert tried == 2  # "wrong" failed the check, "refused" did not run
    assert _name(_P.plan.lt[key][1]) == "good-fast"


def test_choice_stays_on_f_linear_below_the_gain(monkeypatch):
    key = _run_choice(monkeypatch, {"base": 10.0, "good-slow": 9.95, "wrong": 1.0, "good-fast": 9.9})
    assert _P.plan.lt_timings[key][:2] == (10.0, 9.9)
    assert key not in _P.plan.lt  # 1% faster is within the timings' spread


class _WideProduct(_FakeProduct):
    """Adds configurations beyond the heuristic's: tilings "t0".."t5" (each correct) and,
    of a tiling, its variants "<tiling>v0", "<tiling>v1". cuBLASLt refuses the
    configurations named in `refused` at the row counts given there."""
    made: list = []
    refused: dict = {}

    def candidates(self):
        return [_algo("good-slow"), _algo("good-fast")]

    def check(self, algo):
        if algo.data[1]:
            return self.rows not in _WideProduct.refused.get(_wide_name(algo), ())
        return super().check(algo)

    def tilings(self, ids=()):
        _WideProduct.made.append(("tilings", self.n, tuple(ids)))
        offered = [_algo("good-fast")] + [_wide(f"t{i}") for i in range(6)]  # one the heuristic offers too
        return [a for a in offered if self.check(a)]

    def variants(self, algo):
        _WideProduct.made.append(("variants", self.n, _wide_name(algo)))
        return [a for a in [algo] + [_wide(f"{_wide_name(algo)}v{i}") for i in range(2)] if self.check(a)]

    def __call__(self, x, w, algo, out=None):
        return F.linear(x, w) if algo.data[1] else super().__call__(x, w, algo, out)


_WIDE_NAMES: list = []


def _wide(name):
    if name not in _WIDE_NAMES:
        _WIDE_NAMES.append(name)
    a = cublaslt._Algo()
    a.data[1] = _WIDE_NAMES.index(name) + 1
    return a


def _wide_name(algo):
    return _WIDE_NAMES[algo.data[1] - 1] if algo.data[1] else _name(algo)


def _fake_wide(monkeypatch, graph_us):
    """The wide search's stand-ins: screening times t0 (fastest) .. t5, each variant of t<i> a
    bit faster than t<i>; graph times from `graph_us` (9.5 us for what it does not name).
    Returns the list of the names each screening was given and that of those graph-timed."""
    rough = {f"t{i}": 10.0 + i for i in range(6)}
    rough.update({"good-fast": 1.0, "good-fastv0": 50.0, "good-fastv1": 50.0})
    rough.update({f"t{i}v{j}": 9.5 + i - 0.1 * j for i in range(6) for j in range(2)})
    screened, timed = [], []

    def screen(prod, x, ws, out, algos):
        screened.append([_wide_name(a) for a in algos])
        return sorted(((rough[_wide_name(a)], a) for a in algos), key=lambda p: p[0])

    def graph_time(calls, iters=25):
        for c in calls:
            c()
        c = calls[0]
        name = _wide_name(c.args[2]) if isinstance(c, functools.partial) and len(c.args) > 2 else "base"
        timed.append(name)
        return graph_us.get(name, 9.5) * 1e-6

    monkeypatch.setattr(gemm_tuning.cublaslt, "LtProduct", _WideProduct)
    monkeypatch.setattr(gemm_tuning.cublaslt, "describe", lambda a: {"id": 0 if a.data[1] else 66})
    monkeypatch.setattr(gemm_tuning, "_screen", screen)
    monkeypatch.setattr(gemm_tuning, "graph_time", graph_time)
    _WideProduct.made.clear()
    _WideProduct.refused = {}
    return screened, timed


def test_wide_search_adds_the_fastest_configurations_beyond_the_heuristic(monkeypatch):
    screened, timed = _fake_wide(monkeypatch, {"base": 10.0, "good-slow": 9.9, "good-fast": 9.0, "t1v1": 8.0,
                                               "t2v0": 7.0})
    _WideProduct.refused = {"t2v0": (8, 16), "t1v1": (16,)}  # the fastest, refused at these rows
    ws = [torch.randn(24, 16) for _ in range(3)]
    gemm_tuning._choose_one(_P.plan, 8, ws, 1.02, iters=3, max_candidates=8, wide=True)
    key = (8, 24, 16, torch.float32)
    assert _WideProduct.made[0] == ("tilings", 24, (66,))  # the heuristic's algorithm ids
    assert [m[2] for m in _WideProduct.made[1:]] == ["good-fast", "t0", "t1", "t2"]  # the 4 fastest tilings' variants
    assert all(f"t{i}" not in names for i, names in enumerate(screened[1:]))  # a tiling is not screened again
    assert "t2v0" not in sum(screened, [])  # refused at these rows
    base, best, tried = _P.plan.lt_timings[key]
    assert tried == 2 + 6  # the heuristic's two, then the six fastest screened
    # each once: the heuristic's "good-fast" came up in the screening too
    assert sorted(timed) == sorted(["base", "good-slow", "good-fast", "t0v1", "t0v0", "t0", "t1v1", "t1v0", "t1"])
    assert (base, best) == (10.0, 8.0) and _wide_name(_P.plan.lt[key][1]) == "t1v1"
    # another row count of the shape re-checks the enumerated configurations, builds none
    _WideProduct.made.clear()
    screened.clear()
    gemm_tuning._choose_one(_P.plan, 16, ws, 1.02, iters=3, max_candidates=8, wide=True)
    assert _WideProduct.made == []
    assert "t1v1" not in sum(screened, []) and "t1v0" in sum(screened, [])
    assert _P.plan.lt_timings[(16, 24, 16, torch.float32)][1:] == (9.0, 8)  # t1v1 refused here
    # another weight shape builds its own
    gemm_tuning._choose_one(_P.plan, 16, [torch.randn(40, 16)], 1.02, iters=3, max_candidates=8, wide=True)
    assert _WideProduct.made[0] == ("tilings", 40, (66,))
    # without the wide search only the heuristic's candidates run
    _P.plan = KernelPlan()
    _WideProduct.made.clear()
    gemm_tuning._choose_one(_P.plan, 8, ws, 1.02, iters=3, max_candidates=8)
    assert _WideProduct.made == [] and _P.plan.lt_timings[key][1:] == (9.0, 2)


def test_wide_search_only_at_the_capture_sizes_asked_for(monkeypatch):
    _fake_wide(monkeypatch, {"base": 10.0, "good-slow": 9.9, "good-fast": 9.0})
    monkeypatch.setattr(gemm_tuning.cublaslt, "available", lambda: True)
    monkeypatch.setattr(gemm_tuning, "_enough_weights", lambda ws: ws)
    monkeypatch.setattr(gemm_tuning, "_fits", lambda rows, w: True)
    monkeypatch.setattr(gemm_tuning, "_layer_weights", lambda model: {(24, 16, torch.float32): [_aligned(24, 16)]})
    res = gemm_tuning.choose_lt_algos(_P.plan, nn.Identity(), [4, 8, 16, 32], prefill_rows=64, wide_rows=(8, 16))
    assert {k[0]: v[2] for k, v in res.items()} == {4: 2, 8: 8, 16: 8, 32: 2, 64: 2}
    assert _WideProduct.made[0] == ("tilings", 24, (66,))
    _P.plan = KernelPlan()
    _WideProduct.made.clear()
    res = gemm_tuning.choose_lt_algos(_P.plan, nn.Identity(), [4, 8, 16, 32])  # off by default
    assert all(tried == 2 for _, _, tried in res.values()) and _WideProduct.made == []


def test_a_failing_wide_search_leaves_the_heuristic_choice(monkeypatch):
    class Failing(_WideProduct):
        def tilings(self, ids=()):
            raise RuntimeError("cuBLASLt: MatmulAlgoGetIds returned status 7")

    _fake_cublaslt(monkeypatch, {"base": 10.0, "good-slow": 9.9, "good-fast": 9.0})
    monkeypatch.setattr(gemm_tuning.cublaslt, "LtProduct", Failing)
    monkeypatch.setattr(gemm_tuning.cublaslt, "describe", lambda a: {"id": 66})
    gemm_tuning._choose_one(_P.plan, 8, [torch.randn(24, 16)], 1.02, iters=3, max_candidates=8, wide=True)
    key = (8, 24, 16, torch.float32)
    assert _P.plan.lt_timings[key] == (10.0, 9.0, 2) and _name(_P.plan.lt[key][1]) == "good-fast"


def _aligned(rows, cols, shift=0):
    """A [rows, cols] fp32 view whose data starts `shift` elements past a 256-byte boundary."""
    buf = torch.randn(rows * cols + 128)
    start = (-buf.data_ptr() % 256) // 4 + shift
    return buf[start:start + rows * cols].view(rows, cols)


def test_lt_product_serves_only_chosen_shapes():
    w = _aligned(24, 16)
    _P.plan.lt[(8, 24, 16, torch.float32)] = (_FakeProduct(8, 24, 16, torch.float32), _algo("good-fast"))
    x = _aligned(8, 16)
    torch.testing.assert_close(_P.plan.lt_product(x, w), F.linear(x, w))
    assert _P.plan.lt_product(torch.randn(7, 16), w) is None  # another row count
    assert _P.plan.lt_product(torch.randn(16, 8).t(), w) is None  # not contiguous
    assert _P.plan.lt_product(x.half(), w) is None  # another dtype
    assert _P.plan.lt_product(_aligned(8, 16, shift=4), w) is None  # not 256-byte aligned


def _cached_run(monkeypatch, tmp_path, us, fingerprint="gpu A", sizes=(1, 4, 8)):
    """choose_lt_algos over two shapes at two sizes through a cache in tmp_path (cuBLASLt and
    the model's GPU weights stood in for); returns the algorithms timed."""
    seen = []
    _fake_cublaslt(monkeypatch, us, seen)
    monkeypatch.setattr(gemm_tuning.cublaslt, "available", lambda: True)
    monkeypatch.setattr(gemm_tuning, "_fingerprint", lambda wide_rows=None: {"device": fingerprint})
    monkeypatch.setattr(gemm_tuning, "_enough_weights", lambda ws: ws)
    g = torch.Generator().manual_seed(0)
    groups = {(24, 16, torch.float32): [torch.randn(24, 16, generator=g)],
              (40, 16, torch.float32): [torch.randn(40, 16, generator=g)]}
    monkeypatch.setattr(gemm_tuning, "_layer_weights", lambda model: groups)
    _P.plan = KernelPlan()
    res = gemm_tuning.choose_lt_algos(_P.plan, nn.Identity(), list(sizes), cache_dir=str(tmp_path))
    assert set(res) == {(r, n, 16, torch.float32) for r in sizes if r > 1 for n in (24, 40)}
    return seen


US = {"base": 10.0, "good-slow": 9.9, "wrong": 1.0, "good-fast": 9.0}


def test_cache_round_trip(monkeypatch, tmp_path):
    assert len(_cached_run(monkeypatch, tmp_path, US)) == 4 * 3  # F.linear and two candidates per product
    first = {k: bytes(v[1]) for k, v in _P.plan.lt.items()}
    assert len(first) == 4 and gemm_tuning.cache_path(tmp_path, {"device": "gpu A"}).exists()
    assert _cached_run(monkeypatch, tmp_path, US) == []  # all from the file, nothing timed
    assert {k: bytes(v[1]) for k, v in _P.plan.lt.items()} == first
    assert _P.plan.lt_timings[(4, 24, 16, torch.float32)] == (10.0, 9.0, 2)


def test_cache_keeps_other_shapes_and_gpus(monkeypatch, tmp_path):
    _cached_run(monkeypatch, tmp_path, US)
    _cached_run(monkeypatch, tmp_path, US, sizes=[16])  # another engine's capture sizes, same directory
    _cached_run(monkeypatch, tmp_path, US, fingerprint="gpu B")  # another GPU kind, same directory
    a = json.loads(gemm_tuning.cache_path(tmp_path, {"device": "gpu A"}).read_text())
    assert sorted(a["choices"]) == sorted(f"{r} {n} 16 float32" for r in (4, 8, 16) for n in (24, 40))
    assert len(list(tmp_path.glob("gemm_algorithms-*.json"))) == 2


def test_the_cache_file_names_how_widely_it_searched(monkeypatch, tmp_path):
    monkeypatch.setattr(gemm_tuning.torch.cuda, "get_device_name", lambda *a: "gpu A")
    monkeypatch.setattr(gemm_tuning.cublaslt, "version", lambda: 130100)
    narrow, wide = gemm_tuning._fingerprint(), gemm_tuning._fingerprint((64, 1024))
    assert narrow["wide_rows"] is None and wide["wide_rows"] == [64, 1024]
    assert gemm_tuning.cache_path(tmp_path, narrow) != gemm_tuning.cache_path(tmp_path, wide)
    asked = []
    real = gemm_tuning._fingerprint
    _fake_wide(monkeypatch, {"base": 10.0})
    monkeypatch.setattr(gemm_tuning, "_fingerprint", lambda wide_rows=None: asked.append(wide_rows) or real(wide_rows))
    monkeypatch.setattr(gemm_tuning.cublaslt, "available", lambda: True)
    monkeypatch.setattr(gemm_tuning, "_enough_weights", lambda ws: ws)
    monkeypatch.setattr(gemm_tuning, "_layer_weights", lambda model: {(24, 16, torch.float32): [_aligned(24, 16)]})
    for sizes in ([4, 8], [4, 64]):  # no capture size in range: the narrow file serves
        gemm_tuning.choose_lt_algos(_P.plan, nn.Identity(), sizes, cache_dir=str(tmp_path), wide_rows=(16, 64))
    assert asked == [None, (16, 64)] and len(list(tmp_path.glob("gemm_algorithms-*.json"))) == 2


def test_damaged_cache_entries_are_timed_again(monkeypatch, tmp_path):
    _cached_run(monkeypatch, tmp_path, US)
    path = gemm_tuning.cache_path(tmp_path, {"device": "gpu A"})
    data = json.loads(path.read_text())
    data["choices"]["4 24 16 float32"]["algo"] = bytes(_algo("wrong")).hex()  # no longer agrees
    data["choices"]["4 40 16 float32"]["algo"] = bytes(_algo("refused")).hex()  # cuBLASLt's check refuses it
    data["choices"]["8 40 16 float32"]["algo"] = "00ff"  # not an algorithm
    del data["choices"]["8 24 16 float32"]
    path.write_text(json.dumps(data))
    assert len(_cached_run(monkeypatch, tmp_path, US)) == 4 * 3
    for text in ("{not json", "[1, 2]", '{"fingerprint": {"device": "gpu A"}, "choices": 3}'):
        path.write_text(text)
        assert len(_cached_run(monkeypatch, tmp_path, US)) == 12, text
    data["fingerprint"] = {"device": "gpu C"}  # a file whose contents are for another GPU
    path.write_text(json.dumps(data))
    assert len(_cached_run(monkeypatch, tmp_path, US)) == 12


def test_cached_choices_timed_against_another_product_are_timed_again(monkeypatch, tmp_path):
    """Each entry names the product it was timed against (`baseline`); where the engine now
    runs another one at those rows (a changed route), or the file predates the field, the
    choice is timed again rather than taken."""
    _cached_run(monkeypatch, tmp_path, US)
    path = gemm_tuning.cache_path(tmp_path, {"device": "gpu A"})
    data = json.loads(path.read_text())
    assert {e["baseline"] for e in data["choices"].values()} == {"F.linear"}
    data["choices"]["4 24 16 float32"]["baseline"] = "fp8 dot"  # timed against another product
    del data["choices"]["8 40 16 float32"]["baseline"]  # a file from before the field
    path.write_text(json.dumps(data))
    assert len(_cached_run(monkeypatch, tmp_path, US)) == 2 * 3  # those two again, the others from the file
    data = json.loads(path.read_text())
    assert {e["baseline"] for e in data["choices"].values()} == {"F.linear"}  # rewritten with it
    assert _cached_run(monkeypatch, tmp_path, US) == []


def test_fp8_choices_name_the_route_they_were_timed_against(monkeypatch):
    """The fp8 baseline follows the product's route at those rows: "fp8 dot" for the swap-AB
    kernel's rows, "fp8 scaled_mm" where torch._scaled_mm runs (route_for stood in for)."""
    from atom.model_ops.quant import common
    monkeypatch.setattr(common, "route_for", lambda kind, M, *a, **k: "dot" if M <= 128 else "scaled_mm")
    w = torch.zeros(4096, 4096, dtype=torch.float8_e4m3fn)
    assert gemm_tuning.baseline(80, w) == "fp8 dot" and gemm_tuning.baseline(256, w) == "fp8 scaled_mm"
    assert gemm_tuning.baseline(80, torch.zeros(8, 8, dtype=torch.bfloat16)) == "F.linear"


def test_prefill_rows_time_each_shape_once_on_one_weight(monkeypatch):
    seen = []
    _fake_cublaslt(monkeypatch, US, seen)
    monkeypatch.setattr(gemm_tuning.cublaslt, "available", lambda: True)
    monkeypatch.setattr(gemm_tuning, "_enough_weights", lambda ws: ws)
    big = _aligned(56, 16)  # a shape whose prefill timing the GPU has no memory for
    monkeypatch.setattr(gemm_tuning, "_fits", lambda rows, w: w.shape[0] != 56)
    groups = {(24, 16, torch.float32): [_aligned(24, 16), _aligned(24, 16)],  # two layers' weights
              (40, 16, torch.float32): [_aligned(40, 16)], (56, 16, torch.float32): [big]}
    monkeypatch.setattr(gemm_tuning, "_layer_weights", lambda model: groups)
    res = gemm_tuning.choose_lt_algos(_P.plan, nn.Identity(), [1, 4], prefill_rows=64)
    assert set(res) == {(r, n, 16, torch.float32) for r in (4, 64) for n in (24, 40, 56)} - {(64, 56, 16, torch.float32)}
    # F.linear and two candidates per (rows, shape); the two-layer shape cycles both weights
    # at 4 rows and takes one at the prefill rows
    assert len(seen) == 5 * 3 and sum(calls == 2 for _, calls in seen) == 3
    x, w = _aligned(64, 16), groups[(24, 16, torch.float32)][0]
    torch.testing.assert_close(_P.plan.lt_product(x, w), F.linear(x, w))  # a full prefill step's product
    assert _P.plan.lt_product(_aligned(63, 16), w) is None  # a shorter last step stays on F.linear
    _P.plan = KernelPlan()
    seen.clear()
    assert set(gemm_tuning.choose_lt_algos(_P.plan, nn.Identity(), [1, 4], prefill_rows=4)) == \
        {(4, n, 16, torch.float32) for n in (24, 40, 56)}  # a capture size already times those rows
    assert len(seen) == 3 * 3  # each shape once


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")
def test_no_choice_without_cublaslt():
    model = nn.Sequential(linear.Linear(16, 24))
    assert not cublaslt.available() and cublaslt.version() == 0
    assert gemm_tuning.choose_lt_algos(_P.plan, model, [2, 4, 8]) == {}
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        cublaslt.LtProduct(8, 24, 16, torch.bfloat16)


def test_algorithm_bytes_round_trip():
    a = _algo("good-fast")
    assert bytes(cublaslt.algo_from_bytes(bytes(a))) == bytes(a)
    with pytest.raises(ValueError, match="64 bytes, got 2"):
        cublaslt.algo_from_bytes(b"\x00\xff")


def test_lt_product_rejects_other_dtypes():
    with pytest.raises(ValueError, match="dtype torch.float32"):
        cublaslt.LtProduct(8, 24, 16, torch.float32)


def run_candidates(prod, call):
    """(`prod`'s candidates, the outputs of those `call(algo)` runs): cuBLASLt may refuse here
    an algorithm it offered for another row count, but runs every one offered for this one."""
    algos = prod.candidates()
    assert len(algos) >= len(prod.algos()) >= 1
    outs = []
    for algo in algos:
        try:
            outs.append(call(algo))
        except RuntimeError:
            continue
    assert len(outs) >= len(prod.algos())
    return algos, outs


@pytest.mark.gpu
@GPU_ONLY
@pytest.mark.parametrize("rows,n,k", [(1, 96, 64), (16, 4096, 4096), (100, 6144, 4096), (256, 1000, 520)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_candidate_equals_f_linear(rows, n, k, dtype):
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
    ref = F.linear(x.float(), w.float())
    prod = cublaslt.LtProduct(rows, n, k, dtype)
    algos, outs = run_candidates(prod, lambda algo: prod(x, w, algo))
    for y in outs:
        torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="rows=%d" % rows):
        prod(torch.randn(rows + 1, k, device="cuda", dtype=dtype), w, algos[0])


@pytest.mark.gpu
@GPU_ONLY
def test_wide_configurations_equal_f_linear():
    """The configurations the wide search builds (not offered by the heuristic) compute x W^T."""
    rows, n, k = 96, 3072, 1024
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    ref = F.linear(x.float(), w.float())
    prod = cublaslt.LtProduct(rows, n, k, torch.bfloat16)
    heuristic = prod.candidates()
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    case = gemm_tuning.timing_case(rows, w)
    case.x = x
    wide = gemm_tuning._wide_candidates(_P.plan, prod, case, [w], out, heuristic)
    assert len(wide) == 6 and not {bytes(a) for a in wide} & {bytes(a) for a in heuristic}
    assert len(prod.tilings([cublaslt.describe(heuristic[0])["id"]])) > len(heuristic)
    for algo in wide:
        torch.testing.assert_close(prod(x, w, algo).float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@GPU_ONLY
def test_chosen_products_in_the_layers_and_a_graph():
    torch.manual_seed(0)
    layers = nn.ModuleList(linear.Linear(512, 1536) for _ in range(2)).to("cuda", torch.bfloat16)
    for m in layers:
        m.weight.data.normal_(0, 0.05)
        m.plan = _P.plan  # as the runner installs it
    res = gemm_tuning.choose_lt_algos(_P.plan, layers, [1, 16, 48], min_gain=0.0)  # keep the best, whatever it is
    assert set(res) == {(r, 1536, 512, torch.bfloat16) for r in (16, 48)}
    assert all(base > 0 and best > 0 and tried >= 1 for base, best, tried in res.values())
    x = torch.randn(48, 512, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float(), layers[0].weight.float())
    assert _P.plan.lt_product(x, layers[0].weight) is not None
    torch.testing.assert_close(layers[0](x).float(), ref, atol=3e-2, rtol=2e-2)
    g = torch.cuda.CUDAGraph()
    layers[0](x)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        y = layers[0](x)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y.float(), F.linear(x.float(), layers[0].weight.float()), atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
@GPU_ONLY
def test_cache_on_the_gpu(tmp_path):
    """Choices saved by one start-up and taken, checked, by the next (real algorithms)."""
    layers = nn.ModuleList(linear.Linear(256, 768) for _ in range(2)).to("cuda", torch.float16)
    for m in layers:
        m.weight.data.normal_(0, 0.05)  # (torch.empty's garbage would fail every check)
    first = gemm_tuning.choose_lt_algos(_P.plan, layers, [8, 32], min_gain=0.0, cache_dir=str(tmp_path))
    chosen = {k: bytes(v[1]) for k, v in _P.plan.lt.items()}
    files = list(tmp_path.glob("gemm_algorithms-*.json"))
    assert len(chosen) == 2 and len(files) == 1
    assert json.loads(files[0].read_text())["fingerprint"]["cublaslt"] > 0
    _P.plan = KernelPlan()
    again = gemm_tuning.choose_lt_algos(_P.plan, layers, [8, 32], min_gain=0.0, cache_dir=str(tmp_path))
    assert set(again) == set(first) and all(abs(again[k][1] - first[k][1]) < 1e-2 for k in first)
    assert {k: bytes(v[1]) for k, v in _P.plan.lt.items()} == chosen
    x = torch.randn(32, 256, device="cuda", dtype=torch.float16)
    torch.testing.assert_close(layers[1](x).float(), F.linear(x.float(), layers[1].weight.float()),
                               atol=2e-2, rtol=2e-2)
