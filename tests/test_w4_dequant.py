"""The 4-bit weight written out for the library GEMM (`kernels.w4_dequant`, the "w4_dequant"
route of `w4_gemm.w4_config` from `W4_DEQUANT_MIN_M` rows): the written weight equals the torch
reference's dequantization bit for bit in fp32 (int4 with and without zero points, MXFP4,
MXFP4 pair words, K past the last word tile), and the op on that route matches its reference,
under the Triton interpreter on the CPU; the route runs from 65 rows by default and only for
16-bit activations; on a GPU (marked gpu) the Llama-3.1-8B gate-up shape."""
from __future__ import annotations

import pytest
import torch

from atom.model_ops.kernels import fp4_pairs, w4_gemm
from atom.model_ops.kernels.w4_dequant import w4_dequant
from atom.model_ops.kernels.w4_gemm import FORMATS, dequantize_w4, w4_config, w4_linear, w4_linear_ref
from test_quant_kernels_4bit import TOL, random_w4, rel_err

CASES = [("int4", 12, 96, 32, False), ("int4", 10, 192, 48, True), ("int4", 9, 100, 20, True),
         ("mxfp4", 12, 96, 32, False), ("mxfp4", 20, 288, 32, False), ("mxfp4_pairs", 17, 320, 32, False)]


def _operands(fmt, N, K, g, zp, device="cpu"):
    """The packed tensors as `w4_linear` takes them (pair words: the MXFP4 bytes repacked)."""
    packed, scales, zeros = random_w4("mxfp4" if fmt == "mxfp4_pairs" else fmt, N, K, g, zp, device)
    if fmt == "mxfp4_pairs":
        packed = fp4_pairs.pair_words(packed.view(torch.int32))
    return packed, scales, zeros


@pytest.mark.parametrize("fmt, N, K, g, zp", CASES)
def test_written_weight_is_the_reference_dequantization(fmt, N, K, g, zp):
    packed, scales, zeros = _operands(fmt, N, K, g, zp)
    words = packed if fmt == "int4" else packed.view(torch.int32)
    got = w4_dequant(words, scales, zeros, FORMATS.index(fmt), g, K, torch.float32)
    want = dequantize_w4(packed, scales, zeros, fmt, g, K)
    assert got.shape == (N, K) and torch.equal(got, want)
    # bf16 out: the fp32 value rounded once (to nearest on the GPU; the interpreter's conversion
    # may truncate: within one bf16 step either way)
    got16 = w4_dequant(words, scales, zeros, FORMATS.index(fmt), g, K, torch.bfloat16)
    assert got16.dtype == torch.bfloat16 and bool(((got16.float() - want).abs() <= want.abs() * 2.0 ** -7).all())


@pytest.mark.parametrize("fmt, N, K, g, zp", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_route_matches_the_reference(fmt, N, K, g, zp, dtype, monkeypatch):
    monkeypatch.setitem(w4_gemm.W4_DEQUANT_MIN_M, fmt, 8)
    if dtype not in w4_gemm.written_out_dtypes(fmt):  # MXFP4 in fp16: the in-kernel routes
        assert w4_config(33, N, K, dtype, g, fmt)[0] != "w4_dequant"
        return
    packed, scales, zeros = _operands(fmt, N, K, g, zp)
    for M in (8, 33):
        assert w4_config(M, N, K, dtype, g, fmt)[0] == "w4_dequant"
        x = torch.randn(M, K).to(dtype)
        bias = torch.randn(N).to(dtype) if M % 2 else None
        y = w4_linear(x, packed, scales, zeros, bias, fmt, g, K)
        ref = w4_linear_ref(x, packed, scales, zeros, bias, fmt, g, K)
        assert y.dtype == dtype and y.shape == (M, N) and rel_err(y, ref) < TOL[dtype]
    assert w4_config(7, N, K, dtype, g, fmt)[0] != "w4_dequant"  # below the threshold


def test_from_65_rows_by_default_and_for_16_bit_activations_only(monkeypatch):
    assert set(w4_gemm.W4_DEQUANT_MIN_M) == set(FORMATS)
    assert all(v == 65 for v in w4_gemm.W4_DEQUANT_MIN_M.values())
    for fmt, g in (("mxfp4", 32), ("mxfp4_pairs", 32), ("int4", 128)):
        assert w4_config(65, 4096, 4096, torch.bfloat16, g, fmt)[0] == "w4_dequant"
        # fp16: int4 only (MXFP4's scaled values can leave fp16's range; w4_dot scales in fp32)
        assert (w4_config(4096, 4096, 4096, torch.float16, g, fmt)[0] == "w4_dequant") == (fmt == "int4")
        assert w4_config(4096, 4096, 4096, torch.float32, g, fmt)[0] != "w4_dequant"
        assert w4_config(64, 4096, 4096, torch.bfloat16, g, fmt)[0] == "w4_dot"
    monkeypatch.setitem(w4_gemm.W4_DEQUANT_MIN_M, "mxfp4", None)  # None: never
    assert w4_config(4096, 4096, 4096, torch.bfloat16, 32, "mxfp4")[0] == "w4_dot"
    assert "W4_DEQUANT_MIN_M" in w4_gemm.KERNEL_DESCRIPTION


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_gpu_gate_up_shape(fmt, monkeypatch):
    monkeypatch.setitem(w4_gemm.W4_DEQUANT_MIN_M, fmt, 65)
    g = 128 if fmt == "int4" else 32
    packed, scales, zeros = _operands(fmt, 28672, 4096, g, False, "cuda")
    words = packed if fmt == "int4" else packed.view(torch.int32)
    want = dequantize_w4(packed, scales, zeros, fmt, g, 4096)
    assert torch.equal(w4_dequant(words, scales, zeros, FORMATS.index(fmt), g, 4096, torch.float32), want)
    assert torch.equal(w4_dequant(words, scales, zeros, FORMATS.index(fmt), g, 4096, torch.bfloat16),
                       want.bfloat16())  # rounded to nearest, as torch
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    y = w4_linear(x, packed, scales, zeros, None, fmt, g, 4096)
    assert rel_err(y, w4_linear_ref(x, packed, scales, zeros, None, fmt, g, 4096)) < TOL[torch.bfloat16]


def test_every_probe_tile_writes_the_same_weight():
    """`w4_dequant`'s tile (the probe's grid, `scripts/w4_dequant_probe.py`) changes how the work is
    cut, not the values; a tile that is not three powers of two is refused before launching."""
    import importlib.util
    import os
    spec = importlib.util.spec_from_file_location(
        "w4_dequant_probe", os.path.join(os.path.dirname(__file__), "..", "scripts", "w4_dequant_probe.py"))
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    for fmt, N, K, g, zp in (("int4", 10, 192, 48, True), ("int4", 9, 100, 20, True), ("mxfp4_pairs", 17, 320, 32, False)):
        packed, scales, zeros = _operands(fmt, N, K, g, zp)
        words = packed if fmt == "int4" else packed.view(torch.int32)
        want = dequantize_w4(packed, scales, zeros, fmt, g, K)
        for tile in probe.TILES[:4]:
            got = w4_dequant(words, scales, zeros, FORMATS.index(fmt), g, K, torch.float32, tile=tile)
            assert torch.equal(got, want), (fmt, tile)
    with pytest.raises(ValueError, match="powers of two"):
        w4_dequant(words, scales, zeros, FORMATS.index(fmt), g, K, torch.float32, tile=(12, 32, 4))
