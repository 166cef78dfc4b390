"""Rows prepared for the one-row 4-bit GEMV's fp16 pair products (`kernels.h2_xpack`) and the
GEMV loop that reads them (`w4_gemv1_prepared`, XPACK): the producers give `prepare_ref`'s
columns from the unfused kernels' values (add + RMSNorm, SiLU-and-mul; pairs and exponents bit
for bit, column sums to float32 rounding), the
reference keeps `half2_ref`'s scaling, and on a GPU the prepared loop gives the loop's own
products and an engine with "w4_prepared_x" the defaults' tokens. CPU cases run under Triton's
interpreter (its two-conversion pack); GPU cases are marked gpu."""
import pytest
import torch

from test_triton_kernels import CPU, GPU  # noqa: E402  (sets TRITON_INTERPRET)

from atom.model_ops.kernels import h2_xpack  # noqa: E402
from atom.model_ops.kernels.activation import silu_and_mul  # noqa: E402
from atom.model_ops.kernels.h2_xpack import (PreparedRow, norm_prepare, prepare_ref, prepare_row,  # noqa: E402
                                             silu_prepare)
from atom.model_ops.kernels.rmsnorm import fused_add_rms_norm, rms_norm  # noqa: E402


def _row(k, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g) * torch.exp2(torch.randint(-12, 9, (1, k), generator=g).float())
    x[0, :8] = 0.0  # an all-zero column: e = 40
    x[0, 8] = 60000.0 if dtype == torch.float16 else 3.0e5  # a large value: its column's e
    x[0, 16:24] = 1e-30 if dtype != torch.float16 else 1e-7  # a column of tiny values (fp16 subnormals)
    return x.to(dtype).to(device)


def _same(got: torch.Tensor, x: torch.Tensor, odd16: bool) -> None:
    """`got` holds `prepare_ref(x)`'s pairs and e bit for bit, and its column sums up to float32
    rounding (the order of a sum of 8 is the compiler's)."""
    want = prepare_ref(x, odd16)
    assert torch.equal(got[:, :5], want[:, :5])
    tol = 8 * 2.0 ** -24 * x.reshape(-1, 8).float().abs().sum(dim=1)
    assert torch.all((got[:, 5].view(torch.float32) - want[:, 5].view(torch.float32)).abs() <= tol)


def _decode(cols: torch.Tensor, odd16: bool) -> torch.Tensor:
    """The x values the prepared pairs stand for: each fp16 pair half times 2^(e - 141) (16x
    for int4's odd columns), [C, 8] float64."""
    pairs = cols[:, :4]
    lo = (pairs & 0xFFFF).to(torch.int16).view(torch.float16).double()
    hi = ((pairs >> 16) & 0xFFFF).to(torch.int16).view(torch.float16).double()
    vals = torch.cat([lo, hi], dim=1)  # columns 0-3, then 4-7
    unscale = torch.exp2(cols[:, 4].double() - 141.0)[:, None]
    odd = torch.tensor([1.0, 16.0] * 4 if odd16 else [1.0] * 8, dtype=torch.float64)
    return vals * unscale * odd


@pytest.mark.parametrize("odd16", [False, True])
def test_reference_scales_each_column_into_fp16(odd16):
    x = _row(4096, torch.bfloat16, "cpu", 1)
    cols = prepare_ref(x, odd16)
    xf = x.reshape(-1, 8).double()
    amax = xf.abs().amax(dim=1)
    e = cols[:, 4]
    assert (e >= 40).all() and (e[amax == 0] == 40).all()
    big = amax > 2.0 ** -86  # a biased exponent above 40
    assert torch.equal(e[big], amax[big].float().view(torch.int32) >> 23)
    back = _decode(cols, odd16)
    # fp16 keeps 11 bits of each scaled value, whose largest lies in [2^14, 2^15), subnormals
    # steps of 2^-24 (of 2^-20 for int4's odd columns, scaled by another 1 / 16)
    step = torch.exp2(e.double() - 141 - 20)[:, None]
    assert torch.all((back - xf).abs() <= amax[:, None] * 2.0 ** -10 + step)
    assert (back == xf).float().mean() > 0.5  # bf16's 8 bits survive where nothing underflows
    assert torch.equal(cols[:, 5].view(torch.float32), x.reshape(-1, 8).float().sum(dim=1))


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("odd16", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prepare_row_gives_the_reference(device, odd16, dtype):
    x = _row(1024 + 64, dtype, device, 2)  # not a whole number of programs' columns
    got = prepare_row(x, odd16)
    assert isinstance(got, PreparedRow) and got.k == x.numel() and got.odd16 == odd16 and got.dtype == dtype
    _same(got.cols, x, odd16)


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("odd16", [False, True])
def test_silu_prepare_is_silu_and_mul_prepared(device, odd16):
    i = 1024 + 8 * 24
    y = (torch.randn(1, 2 * i, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16).to(device)
    got = silu_prepare(y, odd16)
    assert got.k == i and got.cols.shape == (i // 8, 8)
    _same(got.cols, silu_and_mul(y), odd16)


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("k", [512, 4096 - 8 * 12])
def test_norm_prepare_is_the_norm_kernel_prepared(device, with_residual, k):
    g = torch.Generator().manual_seed(k)
    x, r = (torch.randn(1, k, generator=g).to(torch.bfloat16).to(device) for _ in range(2))
    w = (torch.rand(k, generator=g) + 0.5).to(torch.bfloat16).to(device)
    got, res = norm_prepare(x, r if with_residual else None, w, 1e-6, True)
    if with_residual:
        h, want_res = fused_add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(res, want_res)
    else:
        h = rms_norm(x, w, 1e-6)
        assert res is x
    _same(got.cols, h, True)


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("fmt,group", [("int4", 64), ("mxfp4", 32)])
def test_product_epilogue_adds_and_prepares_the_next_norm(device, fmt, group):
    """`w4_gemv1_add_prepared` (the float32 loop under the interpreter): its output added to the
    residual as the unfused product and add round them, and h w prepared with the sums of h^2
    (int 6) for the loop that applies 1 / rms."""
    from atom.model_ops.kernels.w4_gemm import w4_linear_launch
    from atom.model_ops.kernels.w4_gemv1 import w4_gemv1_add_prepared
    n, k = 64, 256
    packed, scales, zeros = _w4_layer(fmt, n, k, group, device, 9)
    g = torch.Generator().manual_seed(4)
    # fp16: the interpreter rounds float32 to bf16 by truncation, not to nearest as torch does
    x, res = (torch.randn(1, s, generator=g).to(torch.float16) for s in (k, n))
    w = (torch.rand(n, generator=g) + 0.5).to(torch.float16)
    cfg = dict(BLOCK_N=8, BLOCK_W=32, num_warps=1, num_stages=1, HALF2=True)
    row, rout = w4_gemv1_add_prepared(x, packed, scales, zeros, fmt, group, k, res, w, 1e-5, fmt == "int4", cfg=cfg)
    y = w4_linear_launch(x, packed, scales, zeros, None, fmt, group, k, config=dict(cfg, kernel="w4_gemv1"))
    h = (y.float() + res.float()).to(torch.float16)
    assert torch.equal(rout, h)
    assert row.eps == 1e-5 and row.k == n and row.odd16 == (fmt == "int4")
    _same(row.cols, h.float() * w.float(), fmt == "int4")
    hsq = row.cols[:, 6].view(torch.float32)
    torch.testing.assert_close(hsq, h.float().reshape(-1, 8).pow(2).sum(dim=1), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="whole word columns"):
        w4_gemv1_add_prepared(x, packed, scales, zeros, fmt, group, k, res, w, 1e-5, False, cfg=dict(cfg, BLOCK_N=4))


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("fmt,group,n", [("int4", 64, 64), ("mxfp4", 32, 60)])
def test_product_epilogue_adds_and_writes_the_next_norms_row(device, fmt, group, n):
    """`w4_gemv1_add_row` (the float32 loop under the interpreter): its output added to the
    residual as the unfused product and add round them, h w rounded once, each program's sum
    of h^2 (60 rows: a masked last tile); `w4_gemv1_rsq` on them is the product of h w scaled
    by h's 1 / rms, within the output's fp16 rounding."""
    from atom.model_ops.kernels.w4_gemm import w4_linear_launch
    from atom.model_ops.kernels.w4_gemv1 import w4_gemv1_add_row, w4_gemv1_rsq
    k, n2 = 256, 48
    packed, scales, zeros = _w4_layer(fmt, n, k, group, device, 9)
    packed2, scales2, zeros2 = _w4_layer(fmt, n2, 64, group, device, 10)
    g = torch.Generator().manual_seed(4)
    # fp16: the interpreter rounds float32 to bf16 by truncation, not to nearest as torch does
    x, res = (torch.randn(1, s, generator=g).to(torch.float16) for s in (k, n))
    w = (torch.rand(n, generator=g) + 0.5).to(torch.float16)
    cfg = dict(BLOCK_N=8, BLOCK_W=32, num_warps=1, num_stages=1, HALF2=True)
    hw, sums, rout = w4_gemv1_add_row(x, packed, scales, zeros, fmt, group, k, res, w, cfg=cfg)
    y = w4_linear_launch(x, packed, scales, zeros, None, fmt, group, k, config=dict(cfg, kernel="w4_gemv1"))
    h = (y.float() + res.float()).to(torch.float16)
    assert torch.equal(rout, h)
    assert torch.equal(hw, (h.float() * w.float()).to(torch.float16))
    hp = torch.nn.functional.pad(h.float().reshape(-1), (0, 8 * sums.numel() - n)).reshape(-1, 8)
    torch.testing.assert_close(sums, hp.pow(2).sum(dim=1), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="norm weight"):
        w4_gemv1_add_row(x, packed, scales, zeros, fmt, group, k, res, w[:8], cfg=cfg)
    if n % 8 == 0:  # the norm's row into a second product of k = n
        got = w4_gemv1_rsq(hw[:, :64], sums[:8], 1e-5, packed2, scales2, zeros2, fmt, group, 64, cfg=cfg)
        plain = w4_linear_launch(hw[:, :64], packed2, scales2, zeros2, None, fmt, group, 64,
                                 config=dict(cfg, kernel="w4_gemv1")).float()
        rstd = torch.rsqrt(h.float()[:, :64].pow(2).mean() + 1e-5)
        torch.testing.assert_close(got.float(), plain * rstd, rtol=2e-3, atol=2e-3 * (plain * rstd).abs().max().item())
    with pytest.raises(ValueError, match="float32 sums"):
        w4_gemv1_rsq(hw, sums.double(), 1e-5, packed, scales, zeros, fmt, group, n)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("fmt,group", [("int4", 64), ("mxfp4", 32), ("mxfp4_pairs", 32)])
def test_early_epilogue_operands_change_no_bit(device, fmt, group, monkeypatch):
    """EARLY (`w4_gemv1.EARLY_EPILOGUE`: RSQ's sums loaded before the loop, EPI_ROW's norm weight
    and residual lines asked of L2 ahead on a GPU): `w4_gemv1_add_row`'s three outputs and
    `w4_gemv1_rsq`'s plain and gated products are the same bits as without it (on a GPU at
    Llama-3.1-8B's o_proj and gate-up shapes and their table tiles, under the interpreter small
    ones); and it reaches the kernel from the module's switch."""
    from atom.model_ops.kernels import w4_gemv1 as g1
    small = device == "cpu"
    k, n, n2 = (256, 64, 96) if small else (4096, 4096, 28672)
    first, second, x, res, w = _product_pair(fmt, group, device, (n, k), (n2, n))
    cfg = dict(BLOCK_N=8, BLOCK_W=32, num_warps=1, num_stages=1, HALF2=True) if small else None
    seen = []
    launch = g1.w4_gemv1_launch
    monkeypatch.setattr(g1, "w4_gemv1_launch", lambda *a, **kw: seen.append(a[8]["EARLY"]) or launch(*a, **kw))
    out = {}
    for early in (False, True):
        monkeypatch.setattr(g1, "EARLY_EPILOGUE", early)
        hw, sums, rout = g1.w4_gemv1_add_row(x, *first, fmt, group, k, res, w, cfg=cfg)
        plain = g1.w4_gemv1_rsq(hw, sums, 1e-5, *second, fmt, group, n, cfg=cfg)
        gated = g1.w4_gemv1_rsq(hw, sums, 1e-5, *second, fmt, group, n, gated=True,
                                cfg=dict(cfg, BLOCK_N=4) if small else None)
        out[early] = (hw, sums, rout, plain, gated)
    assert seen == [False] * 3 + [True] * 3
    for a, b in zip(out[False], out[True]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("fmt,group,zp", [("int4", 64, False), ("int4", 32, True), ("int4", 96, True),
                                          ("mxfp4", 32, False), ("mxfp4_pairs", 32, False)])
def test_gated_rsq_is_silu_and_mul_of_the_product(device, fmt, group, zp):
    """`w4_gemv1_rsq(gated=True)` (the float32 loop under the interpreter, 8 gate and 8 up rows
    a program against 16 rows of the [gate | up] product): SiLU-and-mul of the plain product's
    output, bit for bit (each product rounded to the row's dtype first, the same SiLU); the
    default tile halves `tiles`' rows; odd row counts are refused. Groups of 96 do not tile a
    step (each step indexes its words' groups, the up rows' too) and 384 inputs leave a
    partial step (the masked loop)."""
    from atom.model_ops.kernels.w4_gemv1 import gated_tiles, tiles, w4_gemv1_rsq
    k, rows = (384 if group == 96 else 256), 96
    packed, scales, zeros = _w4_layer(fmt, rows, k, group, device, 5, zp=zp)
    g = torch.Generator().manual_seed(1)
    hw = torch.randn(1, k, generator=g).to(torch.float16).to(device)
    sums = (torch.rand(4, generator=g) * 50).to(device)
    cfg = dict(BLOCK_N=16, BLOCK_W=32, num_warps=1, num_stages=1, HALF2=True)
    plain = w4_gemv1_rsq(hw, sums, 1e-5, packed, scales, zeros, fmt, group, k, cfg=cfg)
    gated = w4_gemv1_rsq(hw, sums, 1e-5, packed, scales, zeros, fmt, group, k, cfg=dict(cfg, BLOCK_N=8), gated=True)
    assert gated.shape == (1, rows // 2) and torch.equal(gated, silu_and_mul(plain))
    assert gated_tiles(28672, fmt, 4096)["BLOCK_N"] == tiles(28672, fmt, 4096)["BLOCK_N"] // 2
    with pytest.raises(ValueError, match="even number of rows"):
        w4_gemv1_rsq(hw, sums, 1e-5, packed[:-1], scales[:-1], zeros[:-1] if zp else None, fmt, group, k,
                     gated=True)


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("zp", [False, True], ids=["", "zp"])
def test_gated_rsq_on_int4s_own_tile(device, zp):
    """`w4_gemv1_rsq(gated=True)` on int4's `GATED_TILES` tile (8 + 8 rows a program, word pairs:
    DW = 2; its CHAIN needs HALF2, which the interpreter's float32 loop drops) against
    SiLU-and-mul of the plain product on single words: within float32's summation order, then
    fp16's rounding of the products."""
    from atom.model_ops.kernels.w4_gemv1 import GATED_TILES, w4_gemv1_rsq
    k, rows, group = 1024, 32, 128
    packed, scales, zeros = _w4_layer("int4", rows, k, group, device, 7, zp=zp)
    g = torch.Generator().manual_seed(2)
    hw = torch.randn(1, k, generator=g).to(torch.float16).to(device)
    sums = (torch.rand(4, generator=g) * 50).to(device)
    cfg = dict(GATED_TILES["int4"], num_stages=1)
    assert (k // 8) % (2 * cfg["BLOCK_W"]) == 0 and cfg["DW"] == 2  # the launcher keeps the word pairs
    plain = w4_gemv1_rsq(hw, sums, 1e-5, packed, scales, zeros, "int4", group, k,
                         cfg=dict(BLOCK_N=16, BLOCK_W=32, num_warps=1, num_stages=1))
    gated = w4_gemv1_rsq(hw, sums, 1e-5, packed, scales, zeros, "int4", group, k, cfg=cfg, gated=True)
    want = silu_and_mul(plain).float()
    assert gated.shape == (1, rows // 2)
    assert ((gated.float() - want).abs().max() / want.abs().max()).item() < 2e-3


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("fmt", ["int4_g32_sym", "int4_g64_asym"])
def test_prepared_fusions_against_the_unfused_mlp(device, fmt, monkeypatch):
    """The fusions' own code with the 4-bit kernels forced onto CPU tensors (the interpreter's
    float32 loops): o_proj, add + RMSNorm, gate-up, SiLU-and-mul and down at one row, unfused,
    with "w4_prepared_x" (the norm and SiLU kernels write prepared rows), with
    "w4_o_proj_norm" too (o_proj's epilogue adds and prepares; no norm kernel) and with
    "w4_o_proj_add_norm" (o_proj's epilogue adds and writes h w; no norm kernel), and with
    "w4_gate_up_silu" too (gate-up applies SiLU-and-mul; no SiLU kernel): the same residual,
    the output within x's fp16 rounding (the last two: the same bits); the launches each takes."""
    from test_quant_fusions import _decoder_parts, _meta

    from atom.model_ops.attention.metadata import forward_context
    from atom.model_ops.kernels import w4_gemm
    from atom.tuning import fusions
    from atom.tuning.fusions import default_fusions
    from atom.tuning.launches import KernelLaunches
    from atom.tuning.plan import KernelPlan
    from atom.model_ops.quant import int4 as int4_mod
    from atom.model_ops.quant import mxfp4 as mxfp4_mod
    for mod in (w4_gemm, int4_mod, mxfp4_mod):  # every product on its kernel, as on a GPU
        monkeypatch.setattr(mod, "use_w4_kernel", lambda x: True)
    layer = _decoder_parts(fmt, I=192, o_out=128)
    g = torch.Generator().manual_seed(2)
    a, res = torch.randn(1, 2048, generator=g).to(torch.bfloat16), torch.randn(1, 128, generator=g).to(torch.bfloat16)
    got, counts = {}, {}
    base = tuple(f for f in default_fusions("triton")  # the unfused MLP
                 if f not in ("w4_o_proj_add_norm", "w4_gate_up_silu"))
    for extra in ((), ("w4_prepared_x",), ("w4_prepared_x", "w4_o_proj_norm"), ("w4_o_proj_add_norm",),
                  ("w4_o_proj_add_norm", "w4_gate_up_silu")):
        plan = KernelPlan(backend="triton", fusions=base + extra, force_kernels=True)
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            lin.plan = plan
        with forward_context(_meta(plan)), KernelLaunches() as trace:
            qkv = torch.zeros(1, 256, dtype=torch.bfloat16)
            ops = fusions.w4_o_proj_norm_operands(layer, plan, qkv)
            row_ops = fusions.w4_o_proj_add_norm_operands(layer, plan, qkv)
            assert (ops is not None) == ("w4_o_proj_norm" in extra)
            assert (row_ops is not None) == ("w4_o_proj_add_norm" in extra)
            if ops is not None:
                got[extra] = fusions.w4_o_proj_norm_mlp(layer, ops, a, res)
            elif row_ops is not None:
                got[extra] = fusions.w4_o_proj_add_norm_mlp(layer, plan, row_ops, a, res)
            else:
                got[extra] = fusions._mlp(layer, plan, fusions.project(plan, layer.self_attn.o_proj, a), res)
        counts[extra] = trace.counts()
    want_y, want_res = got[()]
    for extra in list(got)[1:]:
        y, r = got[extra]
        assert torch.equal(r, want_res), extra
        err = ((y.float() - want_y.float()).abs().max() / want_y.float().abs().max()).item()
        assert err < 2e-2, (extra, err)
    assert counts[()].get("_rmsnorm_kernel") == 1 and "_norm_prepare_kernel" not in counts[()]
    assert counts[("w4_prepared_x",)].get("_norm_prepare_kernel") == 1
    assert counts[("w4_prepared_x",)].get("_silu_prepare_kernel") == 1
    last = counts[("w4_prepared_x", "w4_o_proj_norm")]
    assert "_rmsnorm_kernel" not in last and "_norm_prepare_kernel" not in last and last["_w4_gemv1_kernel"] == 3
    rows = counts[("w4_o_proj_add_norm",)]
    assert "_rmsnorm_kernel" not in rows and rows["_w4_gemv1_kernel"] == 3 and rows["_silu_and_mul_kernel"] == 1
    gated = counts[("w4_o_proj_add_norm", "w4_gate_up_silu")]
    assert "_rmsnorm_kernel" not in gated and "_silu_and_mul_kernel" not in gated and gated["_w4_gemv1_kernel"] == 3
    assert torch.equal(got[("w4_o_proj_add_norm", "w4_gate_up_silu")][0], got[("w4_o_proj_add_norm",)][0])


def test_producers_refuse_rows_that_are_not_whole_words():
    with pytest.raises(ValueError, match="whole words"):
        prepare_row(torch.zeros(12), False)
    with pytest.raises(ValueError, match="I % 8 == 0"):
        silu_prepare(torch.zeros(1, 24), False)
    with pytest.raises(ValueError, match="norm weight shape"):
        norm_prepare(torch.zeros(1, 16), None, torch.ones(8), 1e-6, False)


def test_the_gemv_refuses_a_row_prepared_for_another_format():
    from atom.model_ops.kernels.w4_gemv1 import w4_gemv1_prepared
    row = PreparedRow(torch.zeros(4, 8, dtype=torch.int32), 32, False, torch.bfloat16)
    with pytest.raises(ValueError, match="odd16"):
        w4_gemv1_prepared(row, torch.zeros(8, 4, dtype=torch.int32), torch.ones(8, 1), None, "int4", 32, 32)
    with pytest.raises(ValueError, match="odd16"):
        w4_gemv1_prepared(row._replace(k=64), torch.zeros(8, 32, dtype=torch.uint8),
                          torch.ones(8, 2, dtype=torch.uint8), None, "mxfp4", 32, 32)


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("fmt,group,zp", [("int4", 64, True), ("mxfp4", 32, False), ("mxfp4_pairs", 32, False)])
def test_prepared_loop_under_the_interpreter(device, fmt, group, zp):
    """Without HALF2 (the interpreter) the prepared loop runs the float32 loop on the values the
    columns stand for: the plain loop's product of x rounded to those values, and within fp16's
    rounding of x of the plain loop's (masked tiles: 200 rows, 1,152 columns)."""
    from atom.model_ops.kernels.w4_gemm import w4_linear_launch
    from atom.model_ops.kernels.w4_gemv1 import w4_gemv1_prepared
    n, k = 200, 1152
    packed, scales, zeros = _w4_layer(fmt, n, k, group, device, 3, zp=zp)
    x = _row(k, torch.float16, device, 4) * 1e-3
    cfg = dict(BLOCK_N=8, BLOCK_W=64, num_warps=2, num_stages=1, HALF2=True)
    got = w4_gemv1_prepared(prepare_row(x, fmt == "int4"), packed, scales, zeros, fmt, group, k, cfg=cfg)
    plain = lambda v: w4_linear_launch(v, packed, scales, zeros, None, fmt, group, k, config=dict(cfg, kernel="w4_gemv1"))
    stood = torch.from_numpy(_decode(prepare_ref(x, fmt == "int4"), fmt == "int4").numpy()).reshape(1, k)
    want = plain(stood.float())  # fp32 x holding the columns' values
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=1e-3 * want.float().abs().max().item())
    ref = plain(x).float()
    assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 5e-3


def test_plan_takes_the_fusion_and_the_cpu_keeps_the_unprepared_path():
    from types import SimpleNamespace

    from atom.tuning.fusions import w4_prepared_mlp
    from atom.tuning.plan import KernelPlan
    from atom.tuning.fusions import w4_o_proj_norm_operands
    plan = KernelPlan(backend="triton", fusions=("w4_prepared_x", "w4_o_proj_norm"))
    mlp = SimpleNamespace(gate_up_proj=None, down_proj=None)
    assert w4_prepared_mlp(KernelPlan(backend="triton"), mlp, None, torch.zeros(1, 8), None) is None
    assert w4_prepared_mlp(plan, mlp, None, torch.zeros(1, 8), None) is None  # fp32 row
    with pytest.raises(ValueError, match="needs 'w4_prepared_x'"):
        KernelPlan(backend="triton", fusions=("w4_o_proj_norm",))
    with pytest.raises(ValueError, match="needs 'w4_o_proj_add_norm' too"):
        KernelPlan(backend="triton", fusions=("w4_gate_up_silu",))
    layer = SimpleNamespace(mlp=SimpleNamespace(gate_up_proj=1, down_proj=1))
    assert w4_o_proj_norm_operands(layer, plan, torch.zeros(1, 8)) is None  # fp32 row
    from atom.tuning.fusions import w4_o_proj_add_norm_operands
    rows = KernelPlan(backend="triton", fusions=("w4_o_proj_add_norm",))
    assert w4_o_proj_add_norm_operands(layer, rows, torch.zeros(1, 8)) is None  # fp32 row
    assert w4_o_proj_add_norm_operands(layer, plan, torch.zeros(1, 8, dtype=torch.bfloat16)) is None  # not asked
    both = KernelPlan(backend="triton", fusions=("w4_o_proj_add_norm", "w4_prepared_x"))
    assert w4_o_proj_add_norm_operands(layer, both, torch.zeros(1, 8, dtype=torch.bfloat16)) is None  # prepared first


# --- GPU: the prepared loop against the loop's own x handling -----------------------------------

def _w4_layer(fmt, n, k, group, device, seed, zp=False):
    from atom.model_ops.kernels.fp4_pairs import pair_words
    g = torch.Generator().manual_seed(seed)
    if fmt == "int4":
        packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), generator=g, dtype=torch.int64).to(torch.int32)
        scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
        zeros = torch.randint(0, 16, (n, k // group), generator=g).to(torch.bfloat16) if zp else None
    else:
        packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int64).to(torch.uint8)
        scales = torch.randint(115, 130, (n, k // 32), generator=g).to(torch.uint8)
        zeros = None
        if fmt == "mxfp4_pairs":  # int32 pair words, as the 4-bit kernels take them
            packed = pair_words(packed.view(torch.int32))
    return [t.to(device) if t is not None else None for t in (packed, scales, zeros)]


@pytest.mark.parametrize("device", [GPU])
@pytest.mark.parametrize("fmt,group,zp", [("int4", 128, False), ("int4", 64, True), ("mxfp4", 32, False),
                                          ("mxfp4_pairs", 32, False)])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (200, 1152)])
def test_gpu_prepared_loop_matches_the_loop(device, fmt, group, zp, n, k):
    """Every table tile (and an uneven shape's masked loop): the same products as the loop that
    prepares x itself (the column sums may round in another order: fp32 rounding at most)."""
    from atom.model_ops.kernels.w4_gemm import FORMATS
    from atom.model_ops.kernels.w4_gemv1 import tiles, w4_gemv1_launch, w4_gemv1_prepared
    packed, scales, zeros = _w4_layer(fmt, n, k, group, device, n + k, zp=zp)
    assert (zeros is not None) == zp
    x = _row(k, torch.bfloat16, device, 7) * 0.01
    words = packed if fmt == "int4" else packed.view(torch.int32)
    want = torch.empty(1, n, dtype=torch.bfloat16, device=device)
    cfg = tiles(n, fmt, k)
    w4_gemv1_launch(x, words, scales, zeros if zeros is not None else scales, None, want, FORMATS.index(fmt), group,
                    dict(cfg, HALF2=True), dict(HAS_ZP=zeros is not None, PDL=False))
    got = w4_gemv1_prepared(prepare_row(x, fmt == "int4"), packed, scales, zeros, fmt, group, k)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6 * want.float().abs().max().item(), rtol=8e-3)
    assert (got == want).float().mean() > 0.99


def _product_pair(fmt, group, device, first, second):
    """Two 4-bit layers of (n, k) `first` and `second` (`_w4_layer`), one small row x into the
    first, a residual and a norm weight of the first's outputs: (first, second, x, res, w)."""
    a = _w4_layer(fmt, *first, group, device, 1)
    b = _w4_layer(fmt, *second, group, device, 2)
    x = _row(first[1], torch.bfloat16, device, 3) * 1e-3
    res = torch.randn(1, first[0], device=device).to(torch.bfloat16)
    w = (torch.rand(first[0], device=device) + 0.5).to(torch.bfloat16)
    return a, b, x, res, w


@pytest.mark.parametrize("device", [GPU])
def test_gpu_producers_match_the_reference(device):
    k = 4096
    x, r = (_row(k, torch.bfloat16, device, s) for s in (11, 12))
    w = (torch.rand(k, generator=torch.Generator().manual_seed(5)) + 0.5).to(torch.bfloat16).to(device)
    for odd16 in (False, True):
        _same(prepare_row(x, odd16).cols, x, odd16)
        got, res = norm_prepare(x, r, w, 1e-6, odd16)
        h, want_res = fused_add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(res, want_res)
        _same(got.cols, h, odd16)
        y = torch.randn(1, 2 * 14336, device=device).to(torch.bfloat16)
        _same(silu_prepare(y, odd16).cols, silu_and_mul(y), odd16)


@pytest.mark.parametrize("device", [GPU])
@pytest.mark.parametrize("fmt,group", [("int4", 128), ("int4", 64), ("mxfp4", 32), ("mxfp4_pairs", 32)])
@pytest.mark.parametrize("row", ["prepared", "plain"])
def test_gpu_o_proj_epilogue_then_gate_up(device, fmt, group, row):
    """o_proj adding the residual in its epilogue and writing gate-up's input, gate-up applying
    1 / rms (Llama-3.1-8B's shapes), against o_proj, the add + RMSNorm kernel and gate-up: the
    same residual bit for bit, gate-up within the normalised row's bf16 rounding (the fused
    paths do not round h / rms). `row`: prepared for the pair products (`w4_gemv1_add_prepared`,
    `w4_gemv1_prepared`), or h w in bf16 with the sums of h^2 (`w4_gemv1_add_row`, `w4_gemv1_rsq`)."""
    from atom.model_ops.kernels import w4_gemv1 as g1
    from atom.model_ops.kernels.w4_gemm import w4_linear_launch
    o, gu, x, res, w = _product_pair(fmt, group, device, (4096, 4096), (28672, 4096))
    y = w4_linear_launch(x, *o, None, fmt, group, 4096)
    h_ref, res_ref = fused_add_rms_norm(y, res, w, 1e-5)
    want = w4_linear_launch(h_ref, *gu, None, fmt, group, 4096)
    if row == "prepared":
        prep, rout = g1.w4_gemv1_add_prepared(x, *o, fmt, group, 4096, res, w, 1e-5, fmt == "int4")
        got = g1.w4_gemv1_prepared(prep, *gu, fmt, group, 4096)
    else:
        hw, sums, rout = g1.w4_gemv1_add_row(x, *o, fmt, group, 4096, res, w)
        assert torch.equal(hw, (rout.float() * w.float()).to(torch.bfloat16))
        got = g1.w4_gemv1_rsq(hw, sums, 1e-5, *gu, fmt, group, 4096)
    assert torch.equal(rout, res_ref)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < 1e-2, err


@pytest.mark.parametrize("device", [GPU])
@pytest.mark.parametrize("fmt,group", [("int4", 128), ("mxfp4", 32), ("mxfp4_pairs", 32)])
def test_gpu_gated_gate_up_after_the_o_proj_epilogue(device, fmt, group):
    """Gate-up with SiLU-and-mul inside (`w4_gemv1_rsq(gated=True)`, `gated_tiles`: HALF2 pair
    products on the GPU) after o_proj's epilogue, Llama-3.1-8B's shapes, against gate-up on its
    own tile then the SiLU-and-mul kernel: within bf16's rounding of the output (the two tiles
    may sum a row's products in another order)."""
    from atom.model_ops.kernels import w4_gemv1 as g1
    o, gu, x, res, w = _product_pair(fmt, group, device, (4096, 4096), (28672, 4096))
    hw, sums, _ = g1.w4_gemv1_add_row(x, *o, fmt, group, 4096, res, w)
    want = silu_and_mul(g1.w4_gemv1_rsq(hw, sums, 1e-5, *gu, fmt, group, 4096)).float()
    got = g1.w4_gemv1_rsq(hw, sums, 1e-5, *gu, fmt, group, 4096, gated=True).float()
    assert got.shape == (1, 14336)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-2, err


@pytest.mark.parametrize("device", [GPU])
@pytest.mark.parametrize("fmt", ["w4a16", "mxfp4_w4a16"])
@pytest.mark.parametrize("extra", [("w4_prepared_x",), ("w4_prepared_x", "w4_o_proj_norm"), ("w4_o_proj_add_norm",),
                                   ("w4_gate_up_silu",), ("w4_down_add_norm",), ("w4_l2_next",)], ids="+".join)
def test_gpu_engine_with_prepared_rows(device, fmt, extra, tmp_path, monkeypatch):
    """A 4-bit dummy Llama started with `extra` added to the default fusions (CUDA graphs):
    each greedy token is among the best of an engine without them (the defaults less `extra`),
    eager and teacher-forced (`test_gpu_quant_engine`'s check: dummy weights give near-ties)."""
    from test_gpu_quant_engine import GREEDY, PROMPTS, TOL, _quantized_config

    from atom import LLM, SamplingParams
    from atom.model_engine import model_runner
    from atom.tuning.fusions import default_fusions
    folder = _quantized_config(tmp_path, fmt)
    monkeypatch.setattr(model_runner, "default_fusions",
                        lambda kernels: tuple(f for f in default_fusions(kernels) if f not in extra) + extra)
    llm = LLM(folder, load_dummy="xavier", num_kvcache_blocks=32, enable_log_stats=False)
    assert all(llm.engine.runner.plan.has(f) for f in extra)
    # one prompt at a time: the fused paths run at one row (batch-1 decode steps, their graph)
    tokens = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]
    del llm
    monkeypatch.setattr(model_runner, "default_fusions",
                        lambda kernels: tuple(f for f in default_fusions(kernels) if f not in extra))
    eager = LLM(folder, load_dummy="xavier", enforce_eager=True, num_kvcache_blocks=32, enable_log_stats=False)
    full = [p + t for p, t in zip(PROMPTS, tokens)]
    outs = eager.generate(full, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    for o, p, t in zip(outs, PROMPTS, tokens):
        for i, tok in enumerate(t):
            place = o.prompt_logprobs[len(p) + i]
            assert place[tok].logprob >= max(lp.logprob for lp in place.values()) - TOL, (fmt, i, tok, place)
