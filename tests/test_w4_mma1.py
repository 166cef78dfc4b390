"""The one-row int4 product on the tensor cores (`kernels.w4_mma1`): what it compiles to for
sm90 (on the CPU, no GPU: its operands are built in registers, the tensor-core and dequantizing
instruction counts are the design's), which layers it takes, and on a GPU (`gpu`) its outputs
against the float64 product of the dequantized weight and against the torch reference the
engine checks every 4-bit kernel with."""
from __future__ import annotations

import pytest
import torch

from atom.model_ops.kernels import w4_mma1
from atom.model_ops.kernels.w4_gemm import dequantize_w4, w4_linear_launch, w4_linear_ref

pytestmark = pytest.mark.skipif(not w4_mma1.HAS_GLUON, reason="needs triton with Gluon")


def test_w4_mma1_compiles_to_register_operands_for_sm90():
    from sm90_child import run_sm90_check
    got = run_sm90_check("w4_mma1_sm90.py")
    assert set(w4_mma1.TILES) <= set(got)
    for name, r in got.items():
        cfg = r["cfg"]
        words = cfg["ROWS"] // 8 * 4 * cfg["REP"]  # words a lane dequantizes a step
        assert r["mma"] == cfg["ROWS"] // 16 * 8 * cfg["REP"], (name, r)
        assert r["lop3"] == r["sub"] == 4 * words, (name, r)
        assert r["pdl"] == 1 and r["loop"] and r["loop_shared"] == 0, (name, r)


def test_supports_only_what_it_runs():
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    assert not w4_mma1.supports("int4", 128, 4096, 4096, False, x)  # a CPU tensor
    assert w4_mma1.tiles(4096, 4096) is None or isinstance(w4_mma1.tiles(4096, 4096), dict)


def _case(n, k, group, seed=0, bias=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32, device="cuda", generator=g)
    scales = (torch.rand(n, k // group, device="cuda", generator=g) / k ** 0.5 + 1e-3).bfloat16()
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g) if bias else None
    return x, words, scales, b


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("cfg", [dict(ROWS=16, NW=8, REP=1, AHEAD=True, num_warps=8),
                                 dict(ROWS=16, NW=4, REP=4, AHEAD=True, num_warps=4),
                                 dict(ROWS=32, NW=2, REP=2, AHEAD=True, num_warps=2),
                                 dict(ROWS=32, NW=4, REP=1, AHEAD=False, num_warps=4)])
@pytest.mark.parametrize("n,k,group,bias", [(64, 1024, 128, False), (4096, 4096, 128, True),
                                            (96, 2048, 256, False), (32, 4096, 4096, True),
                                            (4096, 14336, 128, False)])
def test_w4_mma1_against_the_float64_product(cfg, n, k, group, bias):
    step = 128 * cfg["NW"] * cfg["REP"]
    if n % cfg["ROWS"] or k % step:
        pytest.skip("the tile does not tile this shape")
    x, words, scales, b = _case(n, k, group, bias=bias)
    y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    w4_mma1.w4_mma1_launch(x, words, scales, b, y, group, cfg)
    ref = x.double() @ dequantize_w4(words, scales, None, "int4", group, k).double().T
    if b is not None:
        ref = ref + b.double()
    # exact products, fp32 sums, one bf16 rounding of the output
    assert ((y.double() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-5 * ref.abs().max()).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_w4_linear_routes_one_row_to_it_where_the_table_says(n, k):
    x, words, scales, _ = _case(n, k, 128, seed=1)
    y = w4_linear_launch(x, words, scales, None, None, "int4", 128, k)
    ref = w4_linear_ref(x, words, scales, None, None, "int4", 128, k)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -7, atol=1e-3 * ref.float().abs().max().item())
    assert w4_mma1.supports("int4", 128, n, k, False, x) == (w4_mma1.tiles(n, k) is not None)
