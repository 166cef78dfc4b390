"""The start-up cuBLASLt choice for row-wise (ptpc) FP8 products: which layers and row counts
it times, the tighter agreement it asks of fp8 candidates, the plan serving the choice
(`KernelPlan.lt_scaled`) and the fp8 route taking it (`quant.common`), with a stand-in
product and timer on the CPU; on a GPU (marked gpu) every fp8 candidate of cuBLASLt against
torch._scaled_mm, and the chosen products inside fp8 layers and a CUDA graph."""

import pytest
import torch
from torch import nn

from atom.model_ops import cublaslt
from atom.model_ops.linear import Linear
from atom.model_ops.quant import common
from atom.tuning import gemm_choice
from atom.tuning.plan import KernelPlan
from test_gemm_tuning import GPU_ONLY, NAMES, _algo, _fake_timer, _name, run_candidates
from test_quant_methods import FORMATS, OneSpec, fill

E4M3 = torch.float8_e4m3fn


class _FakeScaled:
    """Stands in for `cublaslt.LtProduct(..., float8_e4m3fn)`: "good-*" compute the scaled
    product in fp32 as torch._scaled_mm does, "wrong" is 5% off, "refused" raises like an
    algorithm cuBLASLt rejects."""
    scaled = True
    out_dtype = torch.bfloat16
    calls: list = []
    made: list = []  # each instance's fast_accum

    def __init__(self, rows, n, k, dtype, fast_accum=False):
        assert dtype == E4M3
        self.rows, self.n, self.k, self.dtype, self.fast_accum = rows, n, k, dtype, fast_accum
        _FakeScaled.made.append(fast_accum)

    def candidates(self):
        return [_algo(n) for n in NAMES]

    def check(self, algo):
        return _name(algo) != "refused"

    def __call__(self, x, w, algo, out=None, x_scale=None, w_scale=None):
        cublaslt.check_scales(x_scale, w_scale, self.rows, self.n)
        if _name(algo) == "refused":
            raise RuntimeError("cuBLASLt: Matmul returned status 15")
        _FakeScaled.calls.append(_name(algo))
        y = (x.float() @ w.float().t()) * x_scale[:, None] * w_scale[None, :]
        return (y * 1.05 if _name(algo) == "wrong" else y).to(torch.bfloat16)


def _fp8(rows, cols, seed=0, shift=0):
    """A [rows, cols] e4m3 tensor whose data starts `shift` bytes past a 256-byte boundary."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.empty(rows * cols + 512, dtype=torch.uint8)
    start = -buf.data_ptr() % 256 + shift
    t = buf[start:start + rows * cols].view(E4M3).view(rows, cols)
    t.copy_(torch.randn(rows, cols, generator=g).mul(32).to(E4M3))
    return t


def _cpu_scaled_mm() -> str:
    """Why torch._scaled_mm's row-wise fp8 product does not run on this CPU ('' where it does)."""
    try:
        x = torch.ones(16, 16).to(E4M3)
        torch._scaled_mm(x, x.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
        return ""
    except (RuntimeError, NotImplementedError) as e:  # pragma: no cover - a torch without CPU fp8 mm
        return str(e)


NEEDS_SCALED_MM = pytest.mark.skipif(bool(_cpu_scaled_mm()), reason="torch._scaled_mm row-wise on the CPU")


def _same(got, ref):
    """The same product up to bf16 rounding (the start-up choice's agreement: 1e-2 of the
    largest output; a 5% error fails it)."""
    assert got is not None and got.dtype == ref.dtype and got.shape == ref.shape
    assert gemm_choice._agree(got, ref)


def _spy_lt_scaled(plan) -> list:
    """Wraps `plan.lt_scaled`: the list it returns gets, per call, whether the plan served
    the product (a chosen algorithm ran) or left it to the route's own kernel."""
    served, lt_scaled = [], plan.lt_scaled

    def spy(*args):
        y = lt_scaled(*args)
        served.append(y is not None)
        return y

    plan.lt_scaled = spy
    return served


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(gemm_choice.cublaslt, "LtProduct", _FakeScaled)
    _FakeScaled.calls = []
    return monkeypatch


@NEEDS_SCALED_MM
def test_fp8_choice_keeps_the_fastest_agreeing_candidate(fake):
    fake.setattr(gemm_choice, "graph_time", _fake_timer({"base": 10.0, "good-slow": 9.9, "wrong": 1.0,
                                                          "good-fast": 9.0}))
    plan = KernelPlan()
    gemm_choice._choose_one(plan, 96, [_fp8(64, 32, s) for s in range(3)], 1.02, iters=3, max_candidates=8)
    key = (96, 64, 32, E4M3)
    assert plan.lt_timings[key] == (10.0, 9.0, 2)  # "wrong" (5% off) failed, "refused" did not run
    assert _name(plan.lt[key][1]) == "good-fast"
    assert _FakeScaled.calls.count("good-fast") == 1 + 3  # checked against torch._scaled_mm, then timed


@NEEDS_SCALED_MM
def test_fp8_shapes_are_timed_from_65_rows(fake):
    seen = []
    fake.setattr(gemm_choice, "graph_time", _fake_timer({"base": 10.0, "good-slow": 9.9, "wrong": 1.0,
                                                          "good-fast": 9.0}, seen))
    fake.setattr(gemm_choice.cublaslt, "available", lambda: True)
    fake.setattr(gemm_choice, "_enough_weights", lambda ws: ws)
    fake.setattr(gemm_choice, "_fits", lambda rows, w: True)
    groups = {(64, 32, E4M3): [_fp8(64, 32, 1), _fp8(64, 32, 2)]}
    fake.setattr(gemm_choice, "_layer_weights", lambda model: groups)
    plan = KernelPlan()
    res = gemm_choice.choose_lt_algos(plan, nn.Identity(), [1, 8, 64, 96, 256], prefill_rows=512)
    # below 65 rows the swap-AB kernel runs these products: nothing to choose there
    assert sorted(k[0] for k in res) == [96, 256, 512]
    assert all(k[1:] == (64, 32, E4M3) for k in res) and len(plan.lt) == 3
    o = torch.empty(4096, 4096, dtype=E4M3, device="meta")
    assert not gemm_choice.is_timed(64, o)
    # the swap-AB kernel's 128-row tile (o_proj, down at 65-128 rows): timed against that kernel
    assert common.route_for("fp8", 128, 4096, 4096, torch.bfloat16, "meta") == "dot"
    assert gemm_choice.is_timed(65, o) and gemm_choice.is_timed(128, o) and gemm_choice.is_timed(129, o)
    assert not gemm_choice.is_timed(128, o, torch.float16)
    # the baseline a candidate must beat is the engine's product on its route there
    assert gemm_choice.timing_case(96, o).route == "dot" and gemm_choice.timing_case(160, o).route == "scaled_mm"
    assert gemm_choice.is_timed(8, torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta"))
    # an fp16 model's row-wise fp8 products are not torch._scaled_mm's (bf16 out only): not timed
    assert not gemm_choice.is_timed(256, torch.empty(4096, 4096, dtype=E4M3, device="meta"), torch.float16)
    assert gemm_choice.choose_lt_algos(KernelPlan(), nn.Identity(), [96, 256], out_dtype=torch.float16) == {}
    xq, w = _fp8(96, 32, 5), groups[(64, 32, E4M3)][0]
    xs, ws = torch.rand(96) + 0.5, torch.rand(64) + 0.5
    _same(plan.lt_scaled(xq, xs, w, ws), common._scaled_mm(xq, xs, w, ws, None, torch.bfloat16, None))


@NEEDS_SCALED_MM
def test_fast_accumulation_reaches_the_candidates_and_the_baseline(fake):
    """A plan with `fp8_fast_accum` builds its candidates with FAST_ACCUM and times them
    against torch._scaled_mm asked for fast accumulation; without it neither is; the cache's
    baseline names it, so a flipped setting times its shapes again."""
    fake.setattr(gemm_choice, "graph_time", _fake_timer({"base": 10.0, "good-slow": 9.9, "wrong": 1.0,
                                                          "good-fast": 9.0}))
    asked = []
    fake.setattr(torch, "_scaled_mm", _spy_scaled_mm(asked))
    ws = [_fp8(64, 32, s) for s in range(3)]
    for fast in (True, False):
        _FakeScaled.made, asked[:] = [], []
        plan = KernelPlan(fp8_fast_accum=fast)
        gemm_choice._choose_one(plan, 160, ws, 1.02, iters=3, max_candidates=8)
        assert _FakeScaled.made and set(_FakeScaled.made) == {fast}
        assert asked and set(asked) == {fast}  # the baseline: torch._scaled_mm on the rows' route
        assert _name(plan.lt[(160, 64, 32, E4M3)][1]) == "good-fast"
    w = torch.empty(4096, 4096, dtype=E4M3, device="meta")
    assert gemm_choice.baseline(256, w, fast_accum=True) == "fp8 scaled_mm fast-accum"
    assert gemm_choice.baseline(256, w) == "fp8 scaled_mm"
    # the route's own call takes the plan's setting, and `fast_accum` without a plan
    xq, xs, wq, wsr = _fp8(96, 32, 1), torch.rand(96) + 0.5, _fp8(64, 32, 2), torch.rand(64, 1) + 0.5
    asked[:] = []
    fast = KernelPlan(fp8_fast_accum=True)
    common._product_on_route("scaled_mm", xq, xs, wq, wsr, None, torch.bfloat16, 0, None, plan=fast)
    common._product_on_route("scaled_mm", xq, xs, wq, wsr, None, torch.bfloat16, 0, None, fast_accum=True)
    common._product_on_route("scaled_mm", xq, xs, wq, wsr, None, torch.bfloat16, 0, None)
    assert asked == [True, True, False]


def _spy_scaled_mm(asked: list):
    """torch._scaled_mm, recording each call's use_fast_accum."""
    real = torch._scaled_mm

    def spy(*args, use_fast_accum=False, **kw):
        asked.append(use_fast_accum)
        return real(*args, use_fast_accum=use_fast_accum, **kw)
    return spy


def test_the_plan_keeps_its_fast_accumulation_setting():
    from atom.tuning import plan as plan_mod
    assert KernelPlan().fp8_fast_accum == plan_mod.FP8_FAST_ACCUM
    plan = KernelPlan(fp8_fast_accum=True)
    assert "fp8_fast_accum=True" in repr(plan) and plan.to_dict()["fp8_fast_accum"] is True
    assert KernelPlan.from_dict(plan.to_dict()).fp8_fast_accum is True
    assert KernelPlan.from_dict({"backend": "torch"}).fp8_fast_accum is False  # a plan saved before the field
    assert plan.lt_args(E4M3) == {"fast_accum": True} and plan.lt_args(torch.bfloat16) == {}
    assert KernelPlan(fp8_fast_accum=False).lt_args(E4M3) == {}
    with pytest.raises(ValueError, match="fast_accum=True is for float8_e4m3fn"):
        cublaslt.LtProduct(8, 24, 16, torch.bfloat16, fast_accum=True)


def test_timed_layers_are_dense_and_rowwise_fp8_ones():
    assert gemm_choice.timed_layer(Linear(32, 64).to(torch.bfloat16))
    assert not gemm_choice.timed_layer(Linear(32, 64, bias=True).to(torch.bfloat16))
    assert not gemm_choice.timed_layer(Linear(32, 64))  # fp32: no cuBLASLt product here
    assert not gemm_choice.timed_layer(nn.Linear(32, 64).to(torch.bfloat16))

    def fp8(fmt, bias=False):
        return Linear(128, 64, bias=bias, quant_config=OneSpec(FORMATS[fmt]["spec"]), prefix="l")

    assert gemm_choice.timed_layer(fp8("fp8_channel"))  # per-channel weights, dynamic per-token activations
    assert gemm_choice.timed_layer(fp8("fp8_channel", bias=True))  # the bias is added after the product
    assert not gemm_choice.timed_layer(fp8("fp8_tensor_static"))  # one scale each side: tensor-wise
    assert not gemm_choice.timed_layer(fp8("fp8_tensor_dynamic"))
    assert not gemm_choice.timed_layer(fp8("ds_block"))  # block scales: the Triton GEMM


@pytest.mark.parametrize("fmt", ["int4_g32_sym", "int4_g64_asym", "int4_channel_asym"])
def test_four_bit_layers_are_not_timed(fmt):
    """4-bit methods hold packed words and no `weight`: the choice passes them by instead of
    failing the engine's start-up on them."""
    layer = Linear(128, 64, quant_config=OneSpec(FORMATS[fmt]["spec"]), prefix="l")
    assert not isinstance(getattr(layer, "weight", None), torch.Tensor)
    assert not gemm_choice.timed_layer(layer)
    model = nn.Sequential(layer, Linear(32, 64).to(torch.bfloat16))
    assert gemm_choice._layer_weights(model) == {}  # CPU weights: nothing to time here either


@NEEDS_SCALED_MM
def test_lt_scaled_serves_only_the_chosen_shape():
    plan = KernelPlan()
    plan.lt[(96, 64, 32, E4M3)] = (_FakeScaled(96, 64, 32, E4M3), _algo("good-fast"))
    xq, w = _fp8(96, 32, 1), _fp8(64, 32, 2)
    xs, ws = torch.rand(96) + 0.5, torch.rand(64, 1) + 0.5
    ref = common._scaled_mm(xq, xs, w, ws, None, torch.bfloat16, None)
    _same(plan.lt_scaled(xq, xs, w, ws), ref)
    one = torch.tensor([0.75])  # one scale for every row: expanded
    _same(plan.lt_scaled(xq, one, w, ws), common._scaled_mm(xq, one.expand(96), w, ws, None, torch.bfloat16, None))
    assert plan.lt_scaled(_fp8(95, 32), xs[:95], w, ws) is None  # another row count
    assert plan.lt_scaled(_fp8(96, 32, shift=16), xs, w, ws) is None  # not 256-byte aligned
    assert plan.lt_scaled(_fp8(32, 96).t(), xs, w, ws) is None  # not contiguous
    assert plan.lt_scaled(xq, xs[:95], w, ws) is None  # not a scale a row
    assert plan.lt_scaled(xq, xs, w, ws[:63]) is None  # not a scale a weight row
    assert plan.lt_scaled(xq, torch.rand(97)[1:], w, ws) is None  # scales not 16-byte aligned
    assert plan.lt_product(xq, w) is None  # the unscaled lookup does not take the fp8 choice
    assert plan.lt_scaled(xq, xs, w.float().bfloat16(), ws) is None  # another weight dtype


@NEEDS_SCALED_MM
def test_the_fp8_route_takes_the_plan_choice_and_adds_the_bias(monkeypatch):
    plan = KernelPlan()
    plan.lt[(96, 64, 32, E4M3)] = (_FakeScaled(96, 64, 32, E4M3), _algo("good-fast"))
    xq, w = _fp8(96, 32, 1), _fp8(64, 32, 2)
    xs, ws, bias = torch.rand(96) + 0.5, torch.rand(64, 1) + 0.5, torch.randn(64).bfloat16()
    _FakeScaled.calls = []
    got = common._product_on_route("scaled_mm", xq, xs, w, ws, bias, torch.bfloat16, 0, None, plan=plan)
    ref = common._scaled_mm(xq, xs, w, ws, bias, torch.bfloat16, None)
    _same(got, ref)
    assert _FakeScaled.calls == ["good-fast"]
    # tensor-wise scales (one for x, the weight's single one) stay on torch's call
    one, w_scalar = torch.tensor([0.5]), torch.tensor(0.25)
    common._product_on_route("scaled_mm", xq, one, w, ws, None, torch.bfloat16, 0, w_scalar, plan=plan)
    # no plan, or another output dtype (the row-wise product is bf16 out): torch's call
    common._product_on_route("scaled_mm", xq, xs, w, ws, None, torch.bfloat16, 0, None)
    y16 = common._product_on_route("scaled_mm", xq, xs, w, ws, None, torch.float16, 0, None, plan=plan)
    assert y16.dtype == torch.float16
    assert _FakeScaled.calls == ["good-fast"]
    # the swap-AB route takes a choice for its shape too (timed against that kernel, without a
    # bias); not with a bias (the kernel adds it in its split-K sum), a split K folded in or
    # left pending, block scales or a 16-bit output other than bf16
    got = common._product_on_route("dot", xq, xs, w, ws, None, torch.bfloat16, 0, None, plan=plan)
    _same(got, common._scaled_mm(xq, xs, w, ws, None, torch.bfloat16, None))
    assert _FakeScaled.calls == ["good-fast"] * 2
    from atom.model_ops.kernels import quant_gemv_dot as qgd
    kernel = []
    fake_kernel = lambda *a, **k: kernel.append(k) or torch.zeros(96, 64, dtype=a[5])  # noqa: E731
    monkeypatch.setattr(qgd, "quant_gemv_dot", fake_kernel)
    monkeypatch.setattr(qgd, "quant_gemv_dot_launch", fake_kernel)
    lock = torch.zeros(4, dtype=torch.int32)
    for call in (dict(bias=bias), dict(lock=lock), dict(defer_sum=True), dict(out_dtype=torch.float16)):
        args = dict(bias=None, out_dtype=torch.bfloat16) | call
        common._product_on_route("dot", xq, xs, w, ws, args.pop("bias"), args.pop("out_dtype"), 0, None,
                                 plan=plan, **args)
    common._product_on_route("dot", xq, xs.reshape(-1, 1), w, ws, None, torch.bfloat16, 32, None, plan=plan)
    assert len(kernel) == 5 and _FakeScaled.calls == ["good-fast"] * 2


@pytest.mark.gpu
@GPU_ONLY
@pytest.mark.parametrize("rows,n,k", [(96, 1024, 512), (160, 6144, 4096), (256, 4096, 14336)])
@pytest.mark.parametrize("fast", [False, True], ids=["promoted", "fast_accum"])
def test_every_fp8_candidate_equals_scaled_mm(rows, n, k, fast):
    x = torch.randn(rows, k, device="cuda").mul(32).to(E4M3)
    w = torch.randn(n, k, device="cuda").mul(32).to(E4M3)
    xs, ws = torch.rand(rows, device="cuda") / 64 + 1e-3, torch.rand(n, device="cuda") / 64 + 1e-3
    # e4m3 products are exact in fp32 and their fp32 sums far closer than bf16's step
    ref = (x.float() @ w.float().t()) * xs[:, None] * ws[None, :]
    # bf16's rounding (up to 3.9e-3 of the largest output) and sums promoted to fp32, as
    # torch._scaled_mm; fast accumulation was 5-9e-3 off at these sizes
    bound = (1.2e-2 if fast else 5e-3) * ref.abs().max()
    lib = common._scaled_mm(x, xs, w, ws, None, torch.bfloat16, None, fast_accum=fast).float()
    assert (lib - ref).abs().max() <= bound
    prod = cublaslt.LtProduct(rows, n, k, E4M3, fast_accum=fast)
    algos, outs = run_candidates(prod, lambda algo: prod(x, w, algo, x_scale=xs, w_scale=ws))
    agree = 0
    for y in outs:
        assert y.dtype == torch.bfloat16
        assert (y.float() - ref).abs().max() <= bound
        agree += gemm_choice._agree(y, lib)
    assert agree == len(outs) if not fast else agree >= 1  # (the start-up choice skips those that do not)
    with pytest.raises(ValueError, match="x_scale"):
        prod(x, w, algos[0], x_scale=xs[:-1], w_scale=ws)


@pytest.mark.gpu
@GPU_ONLY
def test_chosen_fp8_products_in_the_layers_and_a_graph():
    torch.manual_seed(0)
    fmt = FORMATS["fp8_channel"]
    layers = nn.ModuleList(Linear(512, 1536, quant_config=OneSpec(fmt["spec"]), prefix=f"l{i}") for i in range(2))
    for m in layers:
        for name, t in fmt["quant"](torch.randn(1536, 512) * 0.05).items():
            fill(m, name, t, None)
        m.method.process_weights_after_loading(m)
    layers.to("cuda")
    plan = KernelPlan(backend="triton", fp8_fast_accum=False)  # (promoted sums: the unplanned product's)
    for m in layers:
        m.plan = plan  # as the runner installs it
    res = gemm_choice.choose_lt_algos(plan, layers, [1, 48, 96, 200], min_gain=0.0)  # keep the best, whatever it is
    assert set(res) == {(r, 1536, 512, E4M3) for r in (96, 200)}  # 48 rows: the swap-AB kernel
    x = torch.randn(200, 512, device="cuda", dtype=torch.bfloat16)
    m = layers[0]
    m.plan = None
    unplanned = m.method.apply(m, x)  # no plan: torch._scaled_mm
    m.plan = plan
    assert (200, 1536, 512, E4M3) in plan.lt
    lt_scaled = plan.lt_scaled
    served = _spy_lt_scaled(plan)  # the layer's product is the chosen cuBLASLt algorithm's, not torch's
    torch.testing.assert_close(m(x).float(), unplanned.float(), atol=2e-2, rtol=1e-2)
    assert served == [True]
    m(x)
    y = replayed(lambda: m(x), x)
    assert served == [True] * 3  # eager twice, then captured
    m.plan = None
    torch.testing.assert_close(y.float(), m.method.apply(m, x).float(), atol=2e-2, rtol=1e-2)
    # a saved plan brings the fp8 choices back (`KernelPlan.load` on the same GPU)
    again = KernelPlan.from_dict(plan.to_dict())
    assert set(again.lt) == set(plan.lt)
    xq = torch.randn(200, 512, device="cuda").mul(32).to(E4M3)
    xs = torch.rand(200, device="cuda") / 64
    assert torch.equal(again.lt_scaled(xq, xs, m.weight, m.row_scale), lt_scaled(xq, xs, m.weight, m.row_scale))


def replayed(call, x: torch.Tensor) -> torch.Tensor:
    """`call()` captured in a CUDA graph, x refilled with new values, the graph replayed: its
    output."""
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        y = call()
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    return y


def fp8_layer(k: int, n: int, prefix: str, std: float = 0.02) -> Linear:
    """A ptpc fp8 (per-channel weights, per-token activations) `Linear` [k -> n] on the GPU,
    its weight quantized from N(0, std)."""
    fmt = FORMATS["fp8_channel"]
    m = Linear(k, n, quant_config=OneSpec(fmt["spec"]), prefix=prefix)
    for name, t in fmt["quant"](torch.randn(n, k) * std).items():
        fill(m, name, t, None)
    m.method.process_weights_after_loading(m)
    return m.to("cuda")


@pytest.mark.gpu
@GPU_ONLY
def test_swap_ab_rows_are_timed_against_that_kernel():
    """o_proj's shape at 96 rows runs the swap-AB kernel's 128-row tile: the start-up choice
    times cuBLASLt's candidates against that kernel there (not at 64 rows), and a layer with
    the plan takes the chosen product, agreeing with the kernel's."""
    from atom.model_ops.kernels.quant_gemv_dot import quant_gemv_dot
    torch.manual_seed(0)
    m = fp8_layer(4096, 4096, "o")
    assert common.route_for("fp8", 96, 4096, 4096, torch.bfloat16, "cuda") == "dot"
    case = gemm_choice.timing_case(96, m.weight)
    assert case.route == "dot"
    plan = KernelPlan(backend="triton", fp8_fast_accum=False)  # (promoted sums, as the swap-AB kernel's)
    res = gemm_choice.choose_lt_algos(plan, nn.ModuleList([m]), [64, 96], min_gain=0.0)  # keep the best
    assert set(res) == {(96, 4096, 4096, E4M3)} and (96, 4096, 4096, E4M3) in plan.lt
    # the baseline timed there was the swap-AB kernel's product
    assert torch.equal(case.library(m.weight),
                       quant_gemv_dot(case.x, case.xs, m.weight, case.ws, None, torch.bfloat16, 0))
    x = torch.randn(96, 4096, device="cuda", dtype=torch.bfloat16)
    m.plan = None
    swap_ab = m(x)  # no plan: the swap-AB kernel
    m.plan = plan
    served = _spy_lt_scaled(plan)
    torch.testing.assert_close(m(x).float(), swap_ab.float(), atol=2e-2, rtol=1e-2)
    assert served == [True]
