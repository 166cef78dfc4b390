"""The one-row ptpc FP8 product in fp16 pairs (`kernels.fp8_gemv1`): its torch model of the
arithmetic against the exact product, its inline PTX, which products it takes and the 8-bit
route handing batch-1 products to it, on the CPU; on a GPU (marked gpu) the kernel against the
exact product, its torch model and the swap-AB kernel, every tile, with a bias, and the fp8
layer's one-row product running it eagerly and in a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from atom.model_ops.kernels import fp8_gemv1
from atom.model_ops.quant import common
from atom.tuning.fp8_tile_choice import CANDIDATES
from atom.tuning.plan import KernelPlan

E4M3 = torch.float8_e4m3fn
NVIDIA = torch.cuda.is_available() and torch.version.hip is None \
    and torch.cuda.get_device_capability() >= fp8_gemv1.MIN_CAPABILITY
GPU_ONLY = pytest.mark.skipif(not NVIDIA, reason="needs an NVIDIA sm_89+ GPU (cvt.rn.f16x2.e4m3x2)")


def _rel(y, ref) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("chain", [1, 2])
def test_torch_model_stays_near_the_exact_product(chain):
    """`h2_ref`: the kernel's fp16 pair arithmetic (x scaled by 2^-8, chains of one or two
    words, the lanes added in fp16) within 1e-3 of the largest exact output (float64) but not
    exact (the fp16 rounding is modelled), and finite at full scale, where every weight and x
    is e4m3's 448 (the 2^-8 keeps a chain of 8 products under fp16's max)."""
    g = torch.Generator().manual_seed(chain)
    w8 = (torch.randn(48, 4096, generator=g) * 40).to(E4M3)
    x = (torch.randn(1, 4096, generator=g) * 30).to(E4M3)
    exact = (x.double() @ w8.double().T).float()
    err = _rel(fp8_gemv1.h2_ref(x, w8, chain), exact)
    assert 0 < err < 1e-3, err
    full_w = torch.full((4, 256), 448.0).to(E4M3)
    full_x = torch.full((1, 256), 448.0).to(E4M3)
    y = fp8_gemv1.h2_ref(full_x, full_w, chain)
    assert torch.isfinite(y).all() and torch.equal(y, torch.full((1, 4), 448.0 * 448.0 * 256))


def test_ptx_has_four_instructions_a_word_and_one_chain():
    for words in (1, 2):
        asm = fp8_gemv1.h2_ptx(words)
        assert asm.count("cvt.rn.f16x2.e4m3x2") == 2 * words
        assert asm.count("mul.rn.f16x2") == 1 and asm.count("fma.rn.f16x2") == 2 * words - 1
        assert asm.count("cvt.f32.f16") == 1  # widened once a chain
        assert f"${3 * words}" in asm and f"${3 * words + 1}" not in asm  # out, W words, 2W pairs
    with pytest.raises(ValueError, match="words=0"):
        fp8_gemv1.h2_ptx(0)
    # the row's pairs are scaled by 2^-8: 0x1C00 is fp16 2^-8 in both halves
    assert torch.tensor([0x1C00], dtype=torch.int16).view(torch.float16).item() == 2.0 ** -8
    assert "0x1C001C00" in fp8_gemv1.XQ_LO and "p, l;" in fp8_gemv1.XQ_LO and "p, h;" in fp8_gemv1.XQ_HI


def test_tiles_cover_the_llama_shapes_and_refuse_remainders():
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        assert fp8_gemv1.even(n, k, fp8_gemv1.tile_for(n, k))
    assert fp8_gemv1.tile_for(6144, 4096) == fp8_gemv1.tile_for(4096, 14336) == fp8_gemv1.DEFAULT_TILE
    # K a multiple of 1024 but not of the default's 2048 bytes a step (Qwen3-0.6B's 1024 and 3072)
    for n, k in [(1024, 3072), (3072, 1024), (2048, 5120)]:
        assert not fp8_gemv1.even(n, k, fp8_gemv1.DEFAULT_TILE)
        assert fp8_gemv1.tile_for(n, k) == fp8_gemv1.SHORT_K_TILE and fp8_gemv1.even(n, k, fp8_gemv1.SHORT_K_TILE)
    assert not fp8_gemv1.even(4096, 4096 + 512, fp8_gemv1.tile_for(4096, 4096 + 512))  # K not a multiple of 1024
    assert not fp8_gemv1.even(4098, 4096, fp8_gemv1.DEFAULT_TILE)  # N not a multiple of 4
    with pytest.raises(ValueError, match="does not cover N=4098"):
        fp8_gemv1.fp8_gemv1_launch(torch.zeros(1, 4096).to(E4M3), torch.ones(1), torch.zeros(4098, 4096).to(E4M3),
                                   torch.ones(4098))


def test_cpu_tensors_and_other_products_are_not_taken():
    xq, w = torch.zeros(1, 1024).to(E4M3), torch.zeros(8, 1024).to(E4M3)
    assert not fp8_gemv1.takes(xq, torch.ones(1), w, torch.ones(8))  # CPU tensors


def _route_spy(monkeypatch, takes=True):
    """`takes` stood in for (the CPU has no kernel), the kernel and the swap-AB kernel
    replaced by stand-ins that record their calls."""
    from atom.model_ops.kernels import quant_gemv_dot as qgd
    calls = []
    monkeypatch.setattr(fp8_gemv1, "takes", lambda xq, xs, w, ws: takes and xq.shape[0] == 1)
    monkeypatch.setattr(fp8_gemv1, "fp8_gemv1_launch",
                        lambda xq, xs, w, ws, bias, out_dtype, tile: calls.append(
                            ("h2", bias is not None) + ((tile,) if tile is not None else ()))
                        or torch.zeros(1, w.shape[0], dtype=out_dtype))
    for name in ("quant_gemv_dot", "quant_gemv_dot_launch"):
        monkeypatch.setattr(qgd, name, lambda *a, **k: calls.append(("dot", a[4] is not None))
                            or torch.zeros(a[0].shape[0], a[2].shape[0], dtype=a[5]))
    return calls


def test_the_one_row_route_runs_the_kernel(monkeypatch):
    """One row on the swap-AB route runs `fp8_gemv1` (bias or not); a split K folded in or
    left pending (opt-in fusions), block scales, more rows, or `ONE_ROW_FP8` off keep the
    swap-AB kernel."""
    calls = _route_spy(monkeypatch)
    w, ws, bias = torch.zeros(64, 1024).to(E4M3), torch.ones(64, 1), torch.zeros(64).bfloat16()
    x1, x4, xs = torch.zeros(1, 1024).to(E4M3), torch.zeros(4, 1024).to(E4M3), torch.ones(1)
    common._product_on_route("dot", x1, xs, w, ws, None, torch.bfloat16, 0, None)
    common._product_on_route("dot", x1, xs, w, ws, bias, torch.bfloat16, 0, None)
    assert calls == [("h2", False), ("h2", True)]
    calls.clear()
    common._product_on_route("dot", x1, xs, w, ws, None, torch.bfloat16, 0, None, lock=torch.zeros(4))
    common._product_on_route("dot", x1, xs, w, ws, None, torch.bfloat16, 0, None, defer_sum=True)
    common._product_on_route("dot", x1, xs, w, torch.ones(64, 8), None, torch.bfloat16, 128, None)
    common._product_on_route("dot", x4, torch.ones(4), w, ws, None, torch.bfloat16, 0, None)
    monkeypatch.setattr(common, "ONE_ROW_FP8", False)
    common._product_on_route("dot", x1, xs, w, ws, None, torch.bfloat16, 0, None)
    assert [c[0] for c in calls] == ["dot"] * 5
    calls.clear()  # an engine's plan hands the kernel the tile its start-up chose for the shape
    monkeypatch.setattr(common, "ONE_ROW_FP8", True)
    plan = KernelPlan(fp8_tiles={(64, 1024): (2, 128, 4, 2, True)})
    common._product_on_route("dot", x1, xs, w, ws, None, torch.bfloat16, 0, None, plan=plan)
    common._product_on_route("dot", x1, xs, w[:32], ws[:32], None, torch.bfloat16, 0, None, plan=plan)
    assert calls == [("h2", False, (2, 128, 4, 2, True)), ("h2", False)]


def test_the_layer_table_names_the_kernel(monkeypatch):
    assert "fp8_gemv1" in common.kernel_summary("fp8", "token")
    assert "fp8_gemv1" not in common.kernel_summary("fp8", "group", 128)
    assert "fp8_gemv1" not in common.kernel_summary("int8", "token")
    monkeypatch.setattr(common, "ONE_ROW_FP8", False)
    assert "fp8_gemv1" not in common.kernel_summary("fp8", "token")


def _operands(n, k, seed=0):
    """A ptpc fp8 weight [n, k] with a scale a row, and one row quantized by `act_quant`."""
    from atom.model_ops.kernels.act_quant import act_quant
    g = torch.Generator(device="cuda").manual_seed(seed)
    w16 = torch.randn(n, k, device="cuda", generator=g)
    ws = (w16.abs().amax(dim=1) / 448.0).contiguous()
    w8 = (w16 / ws[:, None]).to(E4M3)
    x = torch.randn(1, k, device="cuda", generator=g, dtype=torch.bfloat16)
    xq, xs = act_quant(x, "fp8", k, 448.0)
    return xq, xs.reshape(-1).float(), w8, ws


# the probe's tiles, and every tile the start-up choice may pick (`fp8_tile_choice.CANDIDATES`)
TILES = list(dict.fromkeys([(4, 128, 4, 1, True), (8, 128, 4, 1, False), (8, 256, 8, 1, True), (8, 128, 4, 2, True),
                            (4, 128, 4, 2, True), (16, 128, 4, 2, False), (4, 256, 8, 2, True), (2, 128, 4, 2, True),
                            *CANDIDATES]))


@pytest.mark.gpu
@GPU_ONLY
@pytest.mark.parametrize("n,k", [(64, 1024), (6144, 4096), (4096, 14336), (512, 2048)])
@pytest.mark.parametrize("tile", TILES, ids=str)
def test_gpu_kernel_matches_the_exact_product_and_its_model(n, k, tile):
    xq, xs, w8, ws = _operands(n, k)
    if not fp8_gemv1.even(n, k, tile):
        pytest.skip("the tile does not cover the shape")
    y = fp8_gemv1.fp8_gemv1_launch(xq, xs, w8, ws, tile=tile)
    exact = (xq.double() @ w8.double().T).float() * xs * ws
    model = fp8_gemv1.h2_ref(xq, w8, tile[3]) * xs * ws
    assert y.dtype == torch.bfloat16 and y.shape == (1, n)
    assert _rel(y, exact) <= 5e-3  # bf16's step (up to 3.9e-3 of the largest output) and the fp16 chains
    assert _rel(y, model) <= 4e-3  # the modelled rounding, then bf16's
    from atom.model_ops.kernels.quant_gemv_dot import quant_gemv_dot_launch
    dot = quant_gemv_dot_launch(xq, xs, w8, ws, None, torch.bfloat16)
    assert _rel(y, dot) <= 1e-2


@pytest.mark.gpu
@GPU_ONLY
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gpu_weights_cached_in_l2_only_change_no_bit(n, k):
    """The weight loads with ".cg" (`WORD_CACHE`'s opt-in: L2 only) give the default's bits at
    Llama-3.1-8B's shapes: only where the weights are cached differs."""
    xq, xs, w8, ws = _operands(n, k, seed=2)
    want = fp8_gemv1.fp8_gemv1_launch(xq, xs, w8, ws)
    assert torch.equal(fp8_gemv1.fp8_gemv1_launch(xq, xs, w8, ws, word_cache=".cg"), want)


@pytest.mark.gpu
@GPU_ONLY
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gpu_scales_loaded_first_change_no_bit(n, k, with_bias):
    """The scales (and bias) loaded before the loop (`SCALES_FIRST`'s opt-in) give the
    default's bits at Llama-3.1-8B's shapes: only when they are loaded differs."""
    xq, xs, w8, ws = _operands(n, k, seed=3)
    bias = torch.randn(n, device="cuda").bfloat16() if with_bias else None
    want = fp8_gemv1.fp8_gemv1_launch(xq, xs, w8, ws, bias=bias, scales_first=False)
    assert torch.equal(fp8_gemv1.fp8_gemv1_launch(xq, xs, w8, ws, bias=bias, scales_first=True), want)


@pytest.mark.gpu
@GPU_ONLY
def test_gpu_bias_output_dtype_and_takes():
    xq, xs, w8, ws = _operands(4096, 4096, seed=1)
    bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    assert fp8_gemv1.takes(xq, xs, w8, ws)
    exact = (xq.double() @ w8.double().T).float() * xs * ws
    y = fp8_gemv1.fp8_gemv1_launch(xq, xs, w8, ws, bias, out_dtype=torch.float16)
    assert y.dtype == torch.float16 and _rel(y.float() - bias.float(), exact) <= 5e-3
    assert not fp8_gemv1.takes(torch.cat([xq, xq], dim=1)[:, ::2], xs, w8, ws)  # a strided view of x
    assert not fp8_gemv1.takes(torch.cat([xq, xq]), xs, w8, ws)  # two rows
    assert not fp8_gemv1.takes(xq, xs, w8, ws[:-1])  # not a scale a row


@pytest.mark.gpu
@GPU_ONLY
def test_gpu_layer_runs_it_at_one_row_eager_and_in_a_graph(monkeypatch):
    """A ptpc fp8 `Linear` at one row runs `fp8_gemv1` (spied), agreeing with the swap-AB
    kernel (`ONE_ROW_FP8` off); a CUDA graph replays it with new inputs."""
    from test_gemm_tuning_fp8 import fp8_layer, replayed
    torch.manual_seed(0)
    m = fp8_layer(4096, 6144, "qkv")
    launch, ran = fp8_gemv1.fp8_gemv1_launch, []
    monkeypatch.setattr(fp8_gemv1, "fp8_gemv1_launch", lambda *a, **k: ran.append(1) or launch(*a, **k))
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    y = m(x)
    assert ran == [1]
    monkeypatch.setattr(common, "ONE_ROW_FP8", False)
    swap_ab = m(x)
    assert ran == [1] and _rel(y, swap_ab) <= 1e-2
    monkeypatch.setattr(common, "ONE_ROW_FP8", True)
    yg = replayed(lambda: m(x), x)
    monkeypatch.setattr(common, "ONE_ROW_FP8", False)
    assert _rel(yg, m(x)) <= 1e-2
