"""The 4-bit weight-only GPU kernels (`atom.model_ops.kernels.w4_gemm`: W4A16 int4 groups and
MXFP4) against torch references: the op on random packed tensors under the Triton
interpreter (both kernels, odd K and group sizes, M = 1, 3, 17, 64, bf16 / fp16), the int4
and MXFP4 linear methods' GPU branch against their own CPU reference (the same layer, the
same checkpoint tensors), the tile table, the argument checks, and (marked gpu) the
Llama-3.1-8B shapes on the device."""
from __future__ import annotations

import os
import types

import pytest
import torch

import atom.model_ops.quant.int4 as int4_mod
import atom.model_ops.quant.mxfp4 as mxfp4_mod
from atom.model_ops.kernels import w4_dot, w4_gemm, w4_gemv1
from atom.model_ops.kernels.w4_gemm import (GEMV_MAX_M, dequantize_w4, w4_config, w4_linear, w4_linear_launch,
                                            w4_linear_ref)
from atom.model_ops.linear import Linear, QKVLinear
from atom.model_ops.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from atom.quant_spec import LayerQuantConfig, QuantType
from test_quant_int4_layouts import quark_int4
from test_quant_methods import q_int4

FP4 = getattr(torch, "float4_e2m1fn_x2", torch.uint8)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)).item()


# bf16 keeps 8 significant bits (one rounding of the output, and on the tl.dot path of the
# dequantized weight: ~2^-8 relative at the largest output), fp16 11
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _script(name: str):
    """scripts/<name>.py as a module (a script, not a package module)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), "..", "scripts",
                                                                     f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def random_w4(fmt: str, N: int, K: int, g: int, zp: bool, device="cpu", seed=0):
    """Random packed tensors in the kernels' layout (every nibble value, scales near 1 / K)."""
    gen = torch.Generator().manual_seed(seed)
    if fmt == "int4":
        packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (N, -(-K // 8)), generator=gen, dtype=torch.int32)
        scales = (torch.rand(N, K // g, generator=gen) / K ** 0.5).bfloat16()
        zeros = torch.randint(0, 16, (N, K // g), generator=gen, dtype=torch.int8) if zp else None
    else:
        packed = torch.randint(0, 256, (N, K // 2), generator=gen, dtype=torch.uint8)
        scales = torch.randint(118, 126, (N, K // 32), generator=gen, dtype=torch.uint8)
        zeros = None
    return [t.to(device) if t is not None else None for t in (packed, scales, zeros)]


# (fmt, N, K, group, asymmetric): K past the last full tile, groups that divide no tile (20, 48)
OP_CASES = [("int4", 12, 96, 32, False), ("int4", 10, 192, 48, True), ("int4", 9, 100, 20, True),
            ("int4", 16, 64, 64, False), ("mxfp4", 12, 96, 32, False), ("mxfp4", 9, 160, 32, False)]


@pytest.mark.parametrize("legacy", [False, True], ids=["table", "gemv_gemm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 17, 64])
@pytest.mark.parametrize("fmt, N, K, g, zp", OP_CASES)
def test_op_matches_torch_reference(fmt, N, K, g, zp, M, dtype, legacy):
    """The table's kernel (w4_dot for 16-bit activations, where the group allows) and the
    CUDA-core GEMV / dequantizing GEMM it replaced (what fp32 activations still run)."""
    packed, scales, zeros = random_w4(fmt, N, K, g, zp)
    torch.manual_seed(M)
    x = torch.randn(M, K).to(dtype)
    bias = torch.randn(N).to(dtype) if M % 2 else None
    if legacy:
        name, cfg = w4_config(M, N, K, torch.float32, g)
        y = w4_linear_launch(x, packed, scales, zeros, bias, fmt, g, K, config=dict(cfg, kernel=name))
    else:
        y = w4_linear(x, packed, scales, zeros, bias, fmt, g, K)
    ref = w4_linear_ref(x, packed, scales, zeros, bias, fmt, g, K)
    assert y.dtype == dtype and y.shape == (M, N)
    assert rel_err(y, ref) < TOL[dtype]


@pytest.mark.parametrize("fmt, N, K, g, zp", OP_CASES)
def test_gemv_with_the_next_words_loaded_ahead(fmt, N, K, g, zp):
    """The GEMV's AHEAD variant (two word tiles in flight), K past the last tile of 8 words."""
    packed, scales, zeros = random_w4(fmt, N, K, g, zp)
    x = torch.randn(2, K).to(torch.bfloat16)
    cfg = dict(kernel="w4_gemv", BLOCK_M=2, BLOCK_N=4, BLOCK_W=8, AHEAD=True)
    y = w4_linear_launch(x, packed, scales, zeros, None, fmt, g, K, config=cfg)
    assert rel_err(y, w4_linear_ref(x, packed, scales, zeros, None, fmt, g, K)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("kernel", ["w4_gemv", "w4_gemm"])
def test_both_kernels_at_the_same_m(kernel):
    """M = 3 through either kernel (the table picks the GEMV): the same products."""
    packed, scales, zeros = random_w4("int4", 20, 136, 8, True)
    x = torch.randn(3, 136).to(torch.float16)
    cfg = dict(kernel=kernel, BLOCK_M=4, BLOCK_N=4, BLOCK_W=8) if kernel == "w4_gemv" else \
        dict(kernel=kernel, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32)
    y = w4_linear_launch(x, packed, scales, zeros, None, "int4", 8, 136, config=cfg)
    assert rel_err(y, w4_linear_ref(x, packed, scales, zeros, None, "int4", 8, 136)) < TOL[torch.float16]


# groups that tile a 256-column step (32, 64, 128, 8) and groups that do not (96; 512 and channel-wise
# 1024, wider than a step)
ONE_ROW_CASES = [("int4", 8, 1024, 128, False), ("int4", 8, 1024, 32, True), ("int4", 6, 1280, 64, False),
                 ("int4", 8, 512, 8, True), ("int4", 8, 768, 96, True), ("int4", 6, 1536, 512, False),
                 ("int4", 8, 1024, 1024, True), ("mxfp4", 8, 1024, 32, False), ("mxfp4", 5, 1280, 32, False)]


@pytest.mark.parametrize("ahead", [False, True], ids=["", "ahead"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt, N, K, g, zp", ONE_ROW_CASES)
def test_one_row_gemv_even_and_ragged_tiles(fmt, N, K, g, zp, dtype, ahead):
    """`w4_gemv1` with small tiles: rows and words that tile evenly (the loop without masks,
    two steps or more; AHEAD loads the next words a step early) and rows / words past the last
    tile (the masked loop)."""
    packed, scales, zeros = random_w4(fmt, N, K, g, zp, seed=K + N)
    torch.manual_seed(N)
    x = (torch.randn(1, K) * 3).to(dtype)
    bias = torch.randn(N).to(dtype)
    ref = w4_linear_ref(x, packed, scales, zeros, bias, fmt, g, K)
    cfg = dict(kernel="w4_gemv1", BLOCK_N=2, BLOCK_W=32, num_warps=1, num_stages=1, AHEAD=ahead)
    y = w4_linear_launch(x, packed, scales, zeros, bias, fmt, g, K, config=cfg)
    assert y.dtype == dtype and y.shape == (1, N)
    assert rel_err(y, ref) < TOL.get(dtype, 1e-5)


PAIR_CASES = [("int4", 8, 1024, 128, False), ("int4", 4, 2048, 32, True), ("int4", 8, 1536, 512, False),
              ("int4", 8, 1024, 1024, True), ("mxfp4", 8, 1024, 32, False)]


@pytest.mark.parametrize("ahead", [False, True], ids=["", "ahead"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt, N, K, g, zp", PAIR_CASES)
def test_one_row_gemv_with_two_words_a_load(fmt, N, K, g, zp, dtype, ahead):
    """DW = 2 (two adjacent words of a row in one 8-byte load) against the reference, with the
    words ahead or not, groups of 32-1024 columns, zero points; the launcher runs it only
    where the words pair up (and the kernel's DW is 2 there: `pairs_words`)."""
    packed, scales, zeros = random_w4(fmt, N, K, g, zp, seed=K + N + 1)
    torch.manual_seed(N + 1)
    x = (torch.randn(1, K) * 3).to(dtype)
    bias = torch.randn(N).to(dtype)
    cfg = dict(kernel="w4_gemv1", BLOCK_N=2, BLOCK_W=32, num_warps=1, num_stages=1, AHEAD=ahead, DW=2)
    words = packed if fmt == "int4" else packed.view(torch.int32)
    assert w4_gemv1.pairs_words(words, 2, 32, g)
    y = w4_linear_launch(x, packed, scales, zeros, bias, fmt, g, K, config=cfg)
    assert rel_err(y, w4_linear_ref(x, packed, scales, zeros, bias, fmt, g, K)) < TOL.get(dtype, 1e-5)


@pytest.mark.parametrize("dw", [1, 2])
def test_one_row_gemv_rows_of_one_step_load_nothing_ahead(dw):
    """MXFP4's loop with the words ahead and the row strides compiled in (`FIXED_STRIDES`) over
    rows of exactly one step (the row stride is the step, as at Llama's o_proj: K 4096, 256
    loads of two words): the words come from the load before the loop and none are loaded in
    it; the same bits as the plain tile, and the reference."""
    K = 64 * 8 * dw  # 64 loads of dw words: one step of BLOCK_W = 64
    packed, scales, zeros = random_w4("mxfp4", 8, K, 32, False, seed=K + 5)
    torch.manual_seed(5)
    x = (torch.randn(1, K) * 3).to(torch.bfloat16)
    plain = dict(kernel="w4_gemv1", BLOCK_N=2, BLOCK_W=32, num_warps=1, num_stages=1)
    one_step = dict(kernel="w4_gemv1", BLOCK_N=2, BLOCK_W=64, num_warps=2, num_stages=1, AHEAD=True, DW=dw)
    assert w4_gemv1.FIXED_STRIDES["mxfp4"]
    want = w4_linear_launch(x, packed, scales, zeros, None, "mxfp4", 32, K, config=plain)
    got = w4_linear_launch(x, packed, scales, zeros, None, "mxfp4", 32, K, config=one_step)
    assert torch.equal(got, want)
    assert rel_err(got, w4_linear_ref(x, packed, scales, zeros, None, "mxfp4", 32, K)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("opts", [dict(STAGES=2), dict(STAGES=3, DW=2), dict(L2D=2), dict(L2D=1, AHEAD=True, DW=2),
                                  dict(L2D=2, STAGES=3), dict(WCACHE=".cg", AHEAD=True), dict(SPF=True, AHEAD=True),
                                  dict(maxnreg=64)],
                         ids=["stages2", "stages3_dw2", "l2d2", "l2d1_ahead_dw2", "l2d2_stages3", "cg_ahead", "spf",
                              "maxnreg"])
@pytest.mark.parametrize("fmt, N, K, g, zp", [("int4", 8, 1024, 128, False), ("int4", 8, 2048, 32, True),
                                              ("int4", 6, 1280, 64, False), ("mxfp4", 8, 2048, 32, False)])
def test_one_row_gemv_pipelined_and_prefetching_tiles(fmt, N, K, g, zp, opts):
    """The tile options that only change how the weights travel give the plain tile's result
    bit for bit: STAGES (the loop pipelined through shared memory; the interpreter runs it as
    a plain loop), L2D (L2 prefetches a few steps ahead; inline PTX, so the launcher drops it
    off NVIDIA GPUs, here, as it drops SPF, the scale rows' prefetch), WCACHE (the word
    loads' cache modifier) and Triton's register cap (maxnreg, a launch option the kernel call
    passes on), on even tiles of several steps and on the masked loop (6 rows)."""
    packed, scales, zeros = random_w4(fmt, N, K, g, zp, seed=K + N + 2)
    torch.manual_seed(N + 2)
    x = (torch.randn(1, K) * 3).to(torch.bfloat16)
    plain = dict(kernel="w4_gemv1", BLOCK_N=2, BLOCK_W=32, num_warps=1, num_stages=1, DW=opts.get("DW", 1))
    want = w4_linear_launch(x, packed, scales, zeros, None, fmt, g, K, config=plain)
    got = w4_linear_launch(x, packed, scales, zeros, None, fmt, g, K, config=dict(plain, **opts))
    assert torch.equal(got, want)
    assert rel_err(got, w4_linear_ref(x, packed, scales, zeros, None, fmt, g, K)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("kind", ["plain", "ahead", "norm", "gated"])
@pytest.mark.parametrize("N, K, g, zp", [(8, 2048, 128, False), (8, 2048, 32, True), (4, 1536, 96, True)])
def test_one_row_gemv_scale_strides_compiled_in_change_no_bit(monkeypatch, N, K, g, zp, kind):
    """int4's even loops with only the scale and zero-point rows' strides compiled in
    (`FIXED_SCALE_STRIDES`: SS, SZ with SW = 0) give the runtime strides' result bit for bit:
    the plain tile, words ahead, the norm inside and the gated product, groups that tile a step
    (32, 128) and groups that do not (96: each step indexes its words' groups), with and
    without zero points. The launcher passes the constants (checked through the kernel call)."""
    from atom.model_ops.kernels import w4_gemv1
    from atom.model_ops.kernels.w4_gemv1 import w4_gemv1_fused
    packed, scales, zeros = random_w4("int4", N, K, g, zp, seed=K + N + 9)
    torch.manual_seed(N + 9)
    x = (torch.randn(1, K) * 3).to(torch.bfloat16)
    nw = (torch.rand(K) + 0.5).to(torch.bfloat16)
    cfg = dict(BLOCK_N=2, BLOCK_W=32, num_warps=1, num_stages=1, AHEAD=kind != "plain")
    seen = []
    kernel = w4_gemv1._w4_gemv1_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((kw.get("SS", 0), kw.get("SZ", 0)))
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(w4_gemv1, "_w4_gemv1_kernel", Spy())

    def run():
        if kind in ("norm", "gated"):
            return w4_gemv1_fused(x, None, nw, 1e-6, packed, scales, zeros, "int4", g, K, kind == "gated", cfg=cfg)[0]
        return w4_linear_launch(x, packed, scales, zeros, None, "int4", g, K, config=dict(cfg, kernel="w4_gemv1"))

    assert w4_gemv1.FIXED_SCALE_STRIDES["int4"]
    got = run()
    monkeypatch.setitem(w4_gemv1.FIXED_SCALE_STRIDES, "int4", False)
    want = run()
    z_stride = (zeros if zp else scales).stride(0)
    assert seen == [(scales.stride(0), z_stride), (0, 0)]
    assert torch.equal(got, want)


def test_one_row_gemv_refuses_tile_options_that_do_not_combine():
    """STAGES pipelines the loads AHEAD would carry in registers (one or the other), L2D
    gives each of a warp's word and scale lines a lane (BLOCK_N x (DW + 1) lanes of 32), and
    PF1 is a level for SPF's and L2D's prefetches (nothing without them)."""
    packed, scales, zeros = random_w4("int4", 16, 1024, 128, False)
    cfg = dict(kernel="w4_gemv1", BLOCK_N=2, BLOCK_W=32, num_warps=1, num_stages=1)
    with pytest.raises(ValueError, match="STAGES.*AHEAD"):
        w4_linear_launch(torch.randn(1, 1024), packed, scales, zeros, None, "int4", 128, 1024,
                         config=dict(cfg, STAGES=3, AHEAD=True))
    with pytest.raises(ValueError, match="L2D"):
        w4_linear_launch(torch.randn(1, 1024), packed, scales, zeros, None, "int4", 128, 1024,
                         config=dict(cfg, BLOCK_N=16, DW=2, L2D=2))
    with pytest.raises(ValueError, match="PF1"):
        w4_linear_launch(torch.randn(1, 1024), packed, scales, zeros, None, "int4", 128, 1024,
                         config=dict(cfg, PF1=True))


def test_one_row_gemv_register_cap_only_on_nvidia(monkeypatch):
    """maxnreg (MXFP4's table tiles pass 64 or 128) is an option of Triton's NVIDIA backend: the
    launcher passes it on there and drops it under ROCm, where Triton would refuse it."""
    packed, scales, zeros = random_w4("mxfp4", 8, 1024, 32, False)
    x = torch.randn(1, 1024).to(torch.bfloat16)
    cfg = dict(kernel="w4_gemv1", BLOCK_N=2, BLOCK_W=32, num_warps=1, num_stages=1, maxnreg=64)
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(kw)

    monkeypatch.setattr(w4_gemv1, "_w4_gemv1_kernel", Recorder())
    w4_linear_launch(x, packed, scales, zeros, None, "mxfp4", 32, 1024, config=cfg)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    w4_linear_launch(x, packed, scales, zeros, None, "mxfp4", 32, 1024, config=cfg)
    assert [kw.get("maxnreg") for kw in seen] == [64, None]


def test_register_caps_of_the_one_row_tiles():
    """The table's register caps at Llama-3.1-8B's products: MXFP4 (and its pair words) 64
    for o_proj (4096 x 4096) and gate-up (28672 x 4096), 128 for down (4096 x 14336, the deep
    tile: ptxas then issues its next step's words early); int4 leaves them to ptxas (every cap measured
    slower: docs/perf)."""
    for fmt in ("mxfp4", "mxfp4_pairs"):
        assert [w4_gemv1.tiles(n, fmt, k).get("maxnreg") for n, k in ((4096, 4096), (28672, 4096), (4096, 14336))] \
            == [64, 64, w4_gemv1.DEEP_MAXNREG]
    assert w4_gemv1.DEEP_MAXNREG == 128
    assert w4_gemv1.tiles(4096, "mxfp4", 14336)["num_warps"] == 4  # 4 warps at 128 registers: 16K of an SM's 64K a program
    assert all("maxnreg" not in w4_gemv1.tiles(n, "int4", k) for n, k in ((4096, 4096), (28672, 4096), (4096, 14336)))


def test_two_words_a_load_only_where_the_words_pair_up():
    """`pairs_words`: an odd row stride, a start off 8 bytes, steps that do not tile the row or
    groups of 8 columns keep one word a load (the launcher falls back to DW = 1 and the result
    is still right)."""
    packed, scales, zeros = random_w4("int4", 8, 1024, 128, False, seed=3)
    assert w4_gemv1.pairs_words(packed, 2, 32, 128)
    assert not w4_gemv1.pairs_words(packed, 2, 32, 8)  # a group of one word
    assert not w4_gemv1.pairs_words(packed, 2, 128, 128)  # 128 words a row: not a whole 256-word step
    assert not w4_gemv1.pairs_words(packed, 3, 32, 128)  # 8 rows in tiles of 3
    wide = torch.zeros(8, 129, dtype=torch.int32)
    assert not w4_gemv1.pairs_words(wide[:, :128], 2, 32, 128)  # row stride 129 words
    assert not w4_gemv1.pairs_words(wide.view(-1)[1:1 + 8 * 128].view(8, 128), 2, 32, 128)  # 4-byte aligned start
    x = torch.randn(1, 1024)
    odd = torch.zeros(8, 129, dtype=torch.int32)
    odd[:, :128] = packed
    cfg = dict(kernel="w4_gemv1", BLOCK_N=2, BLOCK_W=32, num_warps=1, num_stages=1, DW=2)
    y = w4_linear_launch(x, odd[:, :128], scales, zeros, None, "int4", 128, 1024, config=cfg)
    assert rel_err(y, w4_linear_ref(x, packed, scales, zeros, None, "int4", 128, 1024)) < 1e-5


def test_one_row_gemv_loop_fits_the_issue_budget():
    """The one-row GEMV compiled for sm90 (`scripts/w4_gemv_sass.py`, in a child process
    without the interpreter, a reference tile with the words ahead): its loop issues under 4.5
    instructions a weight for int4 g128 (the H200's issue rate allows ~4 at its byte rate)
    and under 6 for MXFP4, each well below the M = 2-4 GEMV's count for the same format; MXFP4's
    fp16 pair products (HALF2) with the row strides compiled in under 4.75 (~4.85 with runtime
    strides, Triton 3.6 and 3.9: a 64-bit address sum a row and step); word pairs a load (DW = 2)
    under 0.9x (int4) / 0.95x (MXFP4) of one word a load; MXFP4 pair words under 0.92x of MXFP4's
    layout (Triton 3.6: 3.37 against 3.90); a word pair in one fp16 chain (CHAIN) under 0.95x
    of two (3.6: int4 2.68 against 2.99, MXFP4 3.55 against 3.90, pair words 3.05); x prepared by
    the kernel in front (XPACK) under 0.85x (int4, one word a load) / 0.92x (word pairs) of the
    loop preparing it; L2 prefetches two steps ahead (L2D: two prefetches and their addresses
    a step) and the loads pipelined through shared memory (STAGES: asynchronous copies, their
    waits, barriers and shared-memory reads) under 1.1x of the loop with the words ahead."""
    import json
    import os
    import subprocess
    import sys
    pytest.importorskip("triton")
    root = os.path.join(os.path.dirname(__file__), "..")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.abspath(root) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, os.path.join(root, "scripts", "w4_gemv_sass.py"), "--json"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    per_weight = json.loads(run.stdout.strip().splitlines()[-1])
    assert per_weight["w4_gemv1 int4"] < 4.5 and per_weight["w4_gemv1 mxfp4"] < 6.0, per_weight
    assert per_weight["w4_gemv1 HALF2 int4"] < 0.92 * per_weight["w4_gemv1 int4"], per_weight
    assert per_weight["w4_gemv1 HALF2 mxfp4"] < 0.9 * per_weight["w4_gemv1 mxfp4"], per_weight
    assert per_weight["w4_gemv1 HALF2 mxfp4"] < 4.75, per_weight
    # word pairs (DW = 2): one load, address sum and scale load for 16 weights
    assert per_weight["w4_gemv1 HALF2 DW2 int4"] < 0.9 * per_weight["w4_gemv1 HALF2 int4"], per_weight
    assert per_weight["w4_gemv1 HALF2 DW2 mxfp4"] < 0.95 * per_weight["w4_gemv1 HALF2 mxfp4"], per_weight
    # MXFP4 pair words (`fp4_pairs`): 11 decode instructions a word instead of 16
    assert per_weight["w4_gemv1 HALF2 DW2 mxfp4_pairs"] < 0.92 * per_weight["w4_gemv1 HALF2 DW2 mxfp4"], per_weight
    # CHAIN: a word pair's products in one fp16 chain, widened and scaled once for 16 weights
    for fmt in ("int4", "mxfp4", "mxfp4_pairs"):
        assert per_weight[f"w4_gemv1 HALF2 DW2 CHAIN {fmt}"] < 0.95 * per_weight[f"w4_gemv1 HALF2 DW2 {fmt}"], \
            per_weight
    # prepared x (`h2_xpack`): the columns' scaling, packing and sums out of the loop (Triton 3.9:
    # int4 3.56 -> 2.83, DW = 2 2.98 -> 2.34; MXFP4 4.09 -> 3.58; pair words 3.59 -> 3.08)
    assert per_weight["w4_gemv1 HALF2 prepared x int4"] < 0.85 * per_weight["w4_gemv1 HALF2 int4"], per_weight
    for fmt in ("int4", "mxfp4", "mxfp4_pairs"):
        assert per_weight[f"w4_gemv1 HALF2 DW2 prepared x {fmt}"] < 0.92 * per_weight[f"w4_gemv1 HALF2 DW2 {fmt}"], \
            per_weight
    for fmt, tile in (("int4", "w4_gemv1 HALF2"), ("mxfp4", "w4_gemv1 HALF2 DW2")):
        for option in ("L2D2", "STAGES3"):
            assert per_weight[f"{tile} {option} {fmt}"] < 1.1 * per_weight[f"{tile} {fmt}"], per_weight
    assert per_weight["w4_gemv int4"] > 1.5 * per_weight["w4_gemv1 int4"], per_weight
    assert per_weight["w4_gemv mxfp4"] > 1.5 * per_weight["w4_gemv1 mxfp4"], per_weight


def half2_x(K: int, kind: str, dtype=torch.bfloat16, device="cpu") -> torch.Tensor:
    """Activations for the HALF2 checks: plain, with 300x outliers every 97 columns, all of
    1e-6 size, or with every other 8-column word all zero (a column scale's floor)."""
    torch.manual_seed(K)
    x = torch.randn(1, K)
    if kind == "outliers":
        x[0, ::97] *= 300
    elif kind == "tiny":
        x = x * 1e-6
    elif kind == "zero_words":
        x.view(-1, 16)[:, :8] = 0
    return x.to(dtype).to(device)


HALF2_CASES = [(64, 4096, 128, False), (64, 4096, 128, True), (32, 1024, 32, True), (16, 768, 96, True),
               (16, 14336, 128, False)]


@pytest.mark.parametrize("kind", ["plain", "outliers", "tiny", "zero_words"])
@pytest.mark.parametrize("fmt, N, K, g, zp", [("int4",) + c for c in HALF2_CASES] +
                         [("mxfp4", 64, 4096, 32, False), ("mxfp4", 16, 14336, 32, False)])
def test_half2_arithmetic_is_as_close_as_bf16_weights(fmt, N, K, g, zp, kind):
    """The HALF2 path's roundings (`w4_gemv1.half2_ref`: fp16 products of each word, x scaled
    per word column) against the exact product: under 2e-3 of the largest output, below
    bf16's own output rounding; for int4 within twice what rounding the dequantized weights to
    bf16 costs (the tensor-core kernels' operands; MXFP4's are exact in bf16); and not exact
    (the emulation rounds)."""
    packed, scales, zeros = random_w4(fmt, N, K, g, zp, seed=K + g)
    x = half2_x(K, kind)
    exact = w4_linear_ref(x.float(), packed, scales, zeros, None, fmt, g, K)
    words = packed if fmt == "int4" else packed.view(torch.int32)
    h2 = w4_gemv1.half2_ref(x, words, scales, zeros, None, g, fmt)
    err = rel_err(h2, exact)
    assert 1e-6 < err < 2e-3, err
    if fmt == "int4":
        bf16_weights = x.float() @ dequantize_w4(packed, scales, zeros, fmt, g, K).bfloat16().float().T
        assert err < 2 * rel_err(bf16_weights, exact), (err, rel_err(bf16_weights, exact))


def test_half2_is_for_16_bit_activations_on_nvidia_only():
    """The launcher keeps the exact float32 path where HALF2 cannot run or would cost bits:
    CPU tensors (the interpreter), fp32 activations."""
    cpu = torch.zeros(1, 8, dtype=torch.bfloat16)
    assert not w4_gemv1.half2_applies(cpu, 0)
    meta = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    if torch.version.hip is None and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        assert w4_gemv1.half2_applies(meta, 0)
    assert not w4_gemv1.half2_applies(types.SimpleNamespace(is_cuda=True, dtype=torch.float32), 0)
    if w4_gemv1.half2_applies(meta, 0):
        assert w4_gemv1.half2_applies(meta, w4_gemm.FORMATS.index("mxfp4"))
    assert all(w4_gemv1.tiles(n, f)["HALF2"] for n in (4096, 28672) for f in ("int4", "mxfp4"))


@pytest.mark.parametrize("N, K, g", [(16, 4608, 96), (16, 8192, 4096), (8200, 2048, 1024)])
def test_one_row_gemv_table_tiles_with_groups_that_do_not_tile_a_step(N, K, g):
    """The table's tiles (2048 / 1024 columns a step) with groups that split a step or span
    several: every word reads its own group's scale and zero point."""
    packed, scales, zeros = random_w4("int4", N, K, g, True, seed=g)
    x = torch.randn(1, K).to(torch.bfloat16)
    assert w4_config(1, N, K, torch.bfloat16, g)[0] == "w4_gemv1"
    y = w4_linear(x, packed, scales, zeros, None, "int4", g, K)
    assert rel_err(y, w4_linear_ref(x, packed, scales, zeros, None, "int4", g, K)) < TOL[torch.bfloat16]


def test_one_row_gemv_refuses_what_it_cannot_run():
    packed, scales, zeros = random_w4("int4", 8, 96, 32, False)
    cfg = dict(kernel="w4_gemv1", BLOCK_N=2, BLOCK_W=32, num_warps=1, num_stages=1)
    with pytest.raises(ValueError, match="M=2"):
        w4_linear_launch(torch.randn(2, 96), packed, scales, zeros, None, "int4", 32, 96, config=cfg)
    with pytest.raises(ValueError, match="BLOCK_W=64"):
        w4_linear_launch(torch.randn(1, 96), packed, scales, zeros, None, "int4", 32, 96,
                         config=dict(cfg, BLOCK_W=64))


def test_mxfp4_decode_of_every_code_and_scale_edge():
    """The in-register e2m1 and E8M0 decode: all 16 codes (both nibbles) and scales 0
    (2^-127, a subnormal), 1, 127, 200 against `dequantize_mxfp4`."""
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes.repeat(4) | (codes.flip(0).repeat(4) << 4)).reshape(4, 16)  # K = 32: one group per row
    scales = torch.tensor([[0], [1], [127], [200]], dtype=torch.uint8)
    w = dequantize_mxfp4(packed, scales)
    for i in range(32):  # one-hot rows of x pick out each column
        x = torch.zeros(1, 32)
        x[0, i] = 1.0
        y = w4_linear(x, packed, scales, None, None, "mxfp4", 32, 32)
        torch.testing.assert_close(y[0], w[:, i], rtol=0, atol=0)
    assert torch.equal(dequantize_w4(packed, scales, None, "mxfp4", 32, 32), w)


def test_op_traces_under_fake_tensors():
    packed, scales, zeros = random_w4("int4", 8, 64, 32, True)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.atom.w4_linear.default, (x, packed, scales, zeros, None, "int4", 32, 64),
                          test_utils=("test_schema", "test_faketensor"))


def test_tile_table_regimes(monkeypatch):
    """16-bit activations: the FMA GEMV up to M = 4, w4_dot above (int4 up to M = 64, then
    the dequantizing GEMM; MXFP4 at every M) where the weight is not written out for the
    library GEMM (`W4_DEQUANT_MIN_M`: from 65 rows by default); fp32 activations and groups
    without a power-of-two factor >= 16 keep the GEMV (M <= 4) / dequantizing GEMM table."""
    ms = (1, GEMV_MAX_M, GEMV_MAX_M + 1, 16, 64, 512)
    one_two = ["w4_gemv1", "w4_gemv"]  # the one-row GEMV at M = 1 (groups of whole words), then the GEMV
    assert [w4_config(m, 4096, 4096)[0] for m in ms] == one_two + ["w4_dot"] * 3 + ["w4_dequant"]
    assert [w4_config(m, 4096, 4096, torch.bfloat16, 32, "mxfp4")[0] for m in ms] == \
        one_two + ["w4_dot"] * 3 + ["w4_dequant"]
    # MXFP4 in fp16 is not written out (`w4_gemm.written_out_dtypes`): w4_dot at every M past 4
    assert [w4_config(m, 4096, 4096, torch.float16, 32, "mxfp4")[0] for m in ms] == one_two + ["w4_dot"] * 4
    for fmt in w4_gemm.FORMATS:  # the in-kernel tables below
        monkeypatch.setitem(w4_gemm.W4_DEQUANT_MIN_M, fmt, None)
    assert [w4_config(m, 4096, 4096)[0] for m in ms] == one_two + ["w4_dot"] * 3 + ["w4_gemm"]
    assert [w4_config(m, 4096, 4096, torch.float16, 32, "mxfp4")[0] for m in ms] == one_two + ["w4_dot"] * 4
    for dtype, g in ((torch.float32, 128), (torch.bfloat16, 20), (torch.bfloat16, 8)):
        first = ["w4_gemv"] * 2 if g == 20 else one_two
        assert [w4_config(m, 4096, 4096, dtype, g)[0] for m in ms] == first + ["w4_gemm"] * 4
    assert w4_config(1, 4096, 100)[0] == "w4_gemv"  # K not whole words
    assert w4_config(1, 4096, 4096)[1]["num_warps"] == 8 and w4_config(1, 28672, 4096)[1]["num_warps"] == 4
    old = {m: w4_config(m, 4096, 4096, torch.float32)[1] for m in (3, 16, 64, 512)}
    assert old[3]["BLOCK_M"] == 4 and old[16]["BLOCK_M"] == 16  # every row in one program
    assert old[16]["BLOCK_N"] == 16 and w4_config(16, 28672, 4096, torch.float32)[1]["BLOCK_N"] == 32
    assert old[64]["BLOCK_M"] == 64 and old[512]["BLOCK_M"] == 128
    dot = {m: w4_config(m, 4096, 4096)[1] for m in (5, 17, 64)}
    assert dot[5]["BLOCK_M"] == 16 and dot[17]["BLOCK_M"] == 32 and dot[64]["BLOCK_M"] == 64
    assert dot[5]["ORDER"] == 1 and dot[17]["ORDER"] == 1 and "ORDER" not in dot[64]
    assert "ORDER" not in w4_config(8, 4096, 4096, fmt="mxfp4")[1]
    assert dot[64]["BLOCK_N"] == 128 and w4_config(512, 4096, 4096, fmt="mxfp4")[1]["BLOCK_M"] == 128
    # split-K: 64 row blocks of N = 4096 become 256 programs; N = 28672 (448 blocks) does not split;
    # a short K keeps two K steps per split; at most 4 at M = 64
    assert dot[5]["SPLIT_K"] == 4 and w4_config(8, 28672, 4096)[1]["SPLIT_K"] == 1
    assert w4_config(8, 4096, 14336)[1]["SPLIT_K"] == 4 and w4_config(8, 4096, 1024)[1]["SPLIT_K"] == 2
    assert dot[64]["SPLIT_K"] == 4 and w4_config(512, 4096, 4096, fmt="mxfp4")[1]["SPLIT_K"] == 1
    assert w4_gemm.kernel_name(8) == "w4_dot" and w4_gemm.kernel_name(1) == "w4_gemv1"
    assert w4_gemm.kernel_name(2) == "w4_gemv"
    assert w4_gemm.kernel_name(8, torch.float32) == "w4_gemm"


# (fmt, N, K, group, asymmetric): N past the last 64-row block, K past the last tile
DOT_CASES = [("int4", 72, 256, 128, False), ("int4", 72, 256, 128, True), ("int4", 70, 160, 32, False),
             ("int4", 40, 96, 32, True), ("mxfp4", 72, 256, 32, False), ("mxfp4", 24, 96, 32, False)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M, split, order", [(1, 1, 0), (3, 2, 1), (17, 2, 0), (17, 1, 1)])
@pytest.mark.parametrize("fmt, N, K, g, zp", DOT_CASES)
def test_w4_dot_matches_torch_reference(fmt, N, K, g, zp, M, split, order, dtype):
    """The swap-AB tensor-core kernel: int4 sym / asym (groups 32, 128), MXFP4, M 1 / 3 / 17
    (one and two row tiles), split-K 1 and 2, both column orders, bias, bf16 / fp16 (the
    fp16 magic number 1024 and bf16's 128 both exact)."""
    packed, scales, zeros = random_w4(fmt, N, K, g, zp, seed=N + M)
    torch.manual_seed(M)
    x = torch.randn(M, K).to(dtype)
    bias = torch.randn(N).to(dtype) if split == 1 or M == 3 else None
    cfg = dict(kernel="w4_dot", BLOCK_M=16, BLOCK_N=64 if N > 32 else 16, BLOCK_K=64, SPLIT_K=split, ORDER=order)
    y = w4_linear_launch(x, packed, scales, zeros, bias, fmt, g, K, config=cfg)
    ref = w4_linear_ref(x, packed, scales, zeros, bias, fmt, g, K)
    assert y.dtype == dtype and y.shape == (M, N)
    assert rel_err(y, ref) < TOL[dtype]


def test_w4_dot_scales_after_the_dot_are_exact_in_fp16():
    """One-hot rows of x pick out single weights: (q - z) * s with the scale applied to the
    fp32 partial equals the fp32 dequantized weight rounded once to fp16."""
    packed, scales, zeros = random_w4("int4", 16, 64, 32, True, seed=3)
    scales = scales.half()
    x = torch.eye(64, dtype=torch.float16)[:17]
    cfg = dict(kernel="w4_dot", BLOCK_M=32, BLOCK_N=16, BLOCK_K=64, SPLIT_K=1)
    y = w4_linear_launch(x, packed, scales, zeros, None, "int4", 32, 64, config=cfg)
    w = dequantize_w4(packed, scales, zeros, "int4", 32, 64)
    torch.testing.assert_close(y, w[:, :17].T.half(), rtol=0, atol=0)


@pytest.mark.parametrize("cfg, match", [
    (dict(BLOCK_M=8, BLOCK_N=16, BLOCK_K=64), "BLOCK_M=8 must be >= 16"),
    (dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, group=8), "BLOCK_K=64 and group=8"),
])
def test_w4_dot_refuses_configs_it_cannot_run(cfg, match):
    cfg = dict(cfg, kernel="w4_dot")
    g = cfg.pop("group", 32)
    packed, scales, zeros = random_w4("int4", 16, 64, g, False)
    with pytest.raises(ValueError, match=match):
        w4_linear_launch(torch.randn(2, 64).bfloat16(), packed, scales, zeros, None, "int4", g, 64, config=cfg)


@pytest.mark.parametrize("bad, match", [
    (dict(fmt="int3"), "fmt='int3'"),
    (dict(group=24), "group=24 must divide K=64"),
    (dict(packed=torch.zeros(8, 8, dtype=torch.uint8)), "packed must be torch.int32"),
    (dict(scales=torch.ones(8, 3)), r"scales must be \[8, 2\]"),
    (dict(x=torch.randn(2, 63)), r"x must be \[M, 64\]"),
])
def test_bad_arguments_name_the_field(bad, match):
    packed, scales, zeros = random_w4("int4", 8, 64, 32, False)
    args = dict(x=torch.randn(2, 64), packed=packed, scales=scales, zeros=zeros, bias=None, fmt="int4", group=32,
                k=64)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        w4_linear_launch(**args)


# ---------------------------------------------------------------------------
# the methods' GPU branch (forced onto CPU tensors, interpreted) vs their CPU reference
# ---------------------------------------------------------------------------

class OneSpec:
    def __init__(self, s):
        self.s = s

    def get_layer_quant_config(self, prefix):
        return self.s


def int4_layer(kind: str, g, sym: bool, quark: bool = False):
    method = "quark" if quark else "compressed-tensors"
    spec = LayerQuantConfig(QuantType.per_1x32 if g else QuantType.per_Token, torch.uint8, True, method,
                            group_size=g, symmetric=sym, act_scheme="none")
    qc = OneSpec(spec)
    layer = (Linear(224, 24, bias=True, quant_config=qc, prefix="t.proj") if kind == "linear"
             else QKVLinear(128, 16, 4, 2, quant_config=qc, prefix="t.qkv_proj"))
    torch.manual_seed(1)
    for sid in layer.shard_ids():
        w = torch.randn(layer.shard_range(sid)[1], layer.in_features)
        t = quark_int4(w, g, 0 if sym else -3)[0] if quark else q_int4(w, g, sym)[0]
        for n, v in t.items():
            p = getattr(layer, n)
            p.weight_loader(p, v, sid)
    if layer.bias is not None:
        layer.bias.weight_loader(layer.bias, torch.randn(layer.out_features), None)
    layer.method.process_weights_after_loading(layer)
    return layer


def mxfp4_layer(kind: str, act: str):
    extra = dict(act_scheme="group", act_group_size=32, act_dtype="fp4x2") if act == "mxfp4" else \
        dict(act_scheme="none")
    spec = LayerQuantConfig(QuantType.per_1x32, FP4, True, "compressed-tensors", group_size=32, symmetric=True,
                            **extra)
    qc = OneSpec(spec)
    layer = (Linear(192, 24, bias=True, quant_config=qc, prefix="t.proj") if kind == "linear"
             else QKVLinear(128, 16, 4, 2, quant_config=qc, prefix="t.qkv_proj"))
    torch.manual_seed(2)
    for sid in layer.shard_ids():
        packed, scales = quantize_mxfp4(torch.randn(layer.shard_range(sid)[1], layer.in_features))
        for n, v in (("weight_packed", packed), ("weight_scale", scales)):
            p = getattr(layer, n)
            p.weight_loader(p, v, sid)
    if layer.bias is not None:
        layer.bias.weight_loader(layer.bias, torch.randn(layer.out_features), None)
    layer.method.process_weights_after_loading(layer)
    return layer


LAYERS = {
    "int4_g32_sym": lambda kind: int4_layer(kind, 32, True),
    "int4_g8_asym": lambda kind: int4_layer(kind, 8, False),
    "int4_channel_asym": lambda kind: int4_layer(kind, None, False),
    "int4_quark_g32": lambda kind: int4_layer(kind, 32, True, quark=True),
    "mxfp4": lambda kind: mxfp4_layer(kind, "none"),
    "mxfp4_act_mxfp4": lambda kind: mxfp4_layer(kind, "mxfp4"),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["linear", "qkv"])
@pytest.mark.parametrize("fmt", list(LAYERS))
def test_method_gpu_branch_matches_its_reference(fmt, kind, dtype, monkeypatch):
    layer = LAYERS[fmt](kind)
    xs = [torch.randn(m, layer.in_features).to(dtype) for m in (1, 3, 17)] + \
        [torch.randn(2, 2, layer.in_features).to(dtype)]
    refs = [layer(x) for x in xs]  # the torch reference (CPU)
    called = []
    real = w4_gemm.w4_linear_launch

    def spy(*args, **kwargs):
        called.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(w4_gemm, "w4_linear_launch", spy)
    mod = int4_mod if fmt.startswith("int4") else mxfp4_mod
    monkeypatch.setattr(mod, "use_w4_kernel", lambda x: True)
    for x, ref in zip(xs, refs):
        y = layer(x)
        assert y.shape == ref.shape and y.dtype == dtype
        assert rel_err(y, ref) < TOL[dtype], (x.shape, rel_err(y, ref))
    assert called == [1, 3, 17, 4]  # every product went through the kernel


def test_int4_keeps_packed_bytes_and_bf16_scales():
    """No dequantized copy: the layer holds the packed words, bf16 scales (exact: the
    checkpoint's) and int8 zero points; `kernel_for` names the kernel on CUDA only."""
    layer = int4_layer("linear", 8, False)
    assert layer.weight_scale.dtype == torch.bfloat16 and layer.zero_point.dtype == torch.int8
    dense = layer.out_features * layer.in_features * 2
    assert layer.method.weight_bytes(layer) < 0.5 * dense  # 0.5 + 3 / 8 bytes a weight at g8, vs 2
    assert layer.method.format(layer) == "int4 g8 asym"
    assert "w4_gemv" in layer.method.kernel
    assert layer.method.kernel_for(layer) == w4_gemm.REFERENCE_DESCRIPTION  # CPU
    on_gpu = w4_gemm.kernel_for_weight(types.SimpleNamespace(is_cuda=True))
    assert on_gpu == (w4_gemm.KERNEL_DESCRIPTION if w4_gemm.HAS_TRITON else w4_gemm.REFERENCE_DESCRIPTION)


def test_per_layer_table_names_the_kernel():
    from atom.model_ops.quant import describe_layers
    model = torch.nn.ModuleDict({"a": int4_layer("linear", 32, True), "b": mxfp4_layer("qkv", "none")})
    rows = {r["layer"]: r for r in describe_layers(model)}
    assert rows["a"]["kernel"] == rows["b"]["kernel"] == w4_gemm.REFERENCE_DESCRIPTION
    assert rows["a"]["format"] == "int4 g32 sym"


# ---------------------------------------------------------------------------
# the device (run by the integrator on the H200)
# ---------------------------------------------------------------------------

LLAMA = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 64, 512])
@pytest.mark.parametrize("N, K", LLAMA)
@pytest.mark.parametrize("fmt, g, zp", [("int4", 128, False), ("int4", 128, True), ("int4", 32, False),
                                        ("mxfp4", 32, False)])
def test_gpu_llama_shapes(fmt, g, zp, N, K, M):
    packed, scales, zeros = random_w4(fmt, N, K, g, zp, device="cuda", seed=N + K)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16) if M == 8 else None
    y = torch.ops.atom.w4_linear(x, packed, scales, zeros, bias, fmt, g, K)
    ref = w4_linear_ref(x, packed, scales, zeros, bias, fmt, g, K)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert rel_err(y, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [dict(L2D=1), dict(L2D=2), dict(L2D=4), dict(STAGES=2, AHEAD=False),
                                  dict(STAGES=3, AHEAD=False), dict(STAGES=3, AHEAD=False, L2D=2),
                                  dict(WCACHE=".cg", L2D=2), dict(SPF=True), dict(SPF=True, L2D=2), dict(maxnreg=64),
                                  dict(WCACHE=".cg", SPF=True, PF1=True, L2D=1)],
                         ids=["l2d1", "l2d2", "l2d4", "stages2", "stages3", "stages3_l2d2", "cg_l2d2", "spf",
                              "spf_l2d2", "maxnreg64", "cg_spf_l1_l2d1"])
@pytest.mark.parametrize("N, K", LLAMA)
@pytest.mark.parametrize("fmt, g, zp", [("int4", 128, False), ("int4", 128, True), ("mxfp4", 32, False)])
def test_gpu_pipelined_and_prefetching_tiles_change_no_bit(fmt, g, zp, N, K, opts):
    """The table's one-row tile at Llama-3.1-8B's shapes without its scale rows' prefetch and
    register cap (SPF, maxnreg), and with L2 prefetches ahead (L2D), its loads pipelined
    through shared memory (STAGES), its word loads cached in L2 only (WCACHE), its scale rows
    prefetched at the start (SPF; PF1: into L1 too) or its registers capped at 64 (maxnreg):
    the same bits (the arithmetic and its order are the same; only how the weights travel
    differs)."""
    packed, scales, zeros = random_w4(fmt, N, K, g, zp, device="cuda", seed=N + K + 5)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    table = {k_: v for k_, v in w4_gemv1.tiles(N, fmt, K).items() if k_ not in ("SPF", "maxnreg")}
    table["kernel"] = "w4_gemv1"
    want = w4_linear_launch(x, packed, scales, zeros, None, fmt, g, K, config=table)
    got = w4_linear_launch(x, packed, scales, zeros, None, fmt, g, K, config=dict(table, **opts))
    assert torch.equal(got, want)
    assert rel_err(got, w4_linear_ref(x, packed, scales, zeros, None, fmt, g, K)) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["plain", "outliers", "zero_words"])
@pytest.mark.parametrize("fmt, N, K, g, zp", [("int4",) + c for c in HALF2_CASES + [(28672, 4096, 128, False)]] +
                         [("mxfp4", 64, 4096, 32, False), ("mxfp4", 28672, 4096, 32, False),
                          ("mxfp4", 24, 1280, 32, False)])
@pytest.mark.parametrize("dw", [1, 2], ids=["", "dw2"])
def test_gpu_half2_gemv_computes_its_reference_arithmetic(fmt, N, K, g, zp, kind, dtype, dw):
    """The HALF2 one-row GEMV (the table's int4 kernel at M = 1) on the GPU against
    `half2_ref`, the same roundings in torch: equal up to the output's rounding (fp16: 2^-11
    of a value) and float32 sums in another order; and within the bf16 tolerance of the
    exact product. dw: the table's tile with one or two words a load (DW)."""
    packed, scales, zeros = random_w4(fmt, N, K, g, zp, device="cuda", seed=K + g)
    x = half2_x(K, kind, dtype, "cuda")
    bias = torch.randn(N, device="cuda").to(dtype)
    cfg = dict(w4_gemv1.tiles(N, fmt, K), kernel="w4_gemv1", DW=dw)
    if dw == 2 and (K // 8) % (2 * cfg["BLOCK_W"]) and (K // 8) % 256 == 0:
        cfg.update(BLOCK_W=128, num_warps=4)  # K = 14336: word pairs over 4 warps tile the row
    if N % cfg["BLOCK_N"] or (K // 8) % cfg["BLOCK_W"]:
        cfg.update(BLOCK_N=4, BLOCK_W=64, num_warps=2)  # the masked loop
    assert cfg["HALF2"] and w4_config(1, N, K, dtype, g, fmt)[1]["HALF2"]
    y = w4_linear_launch(x, packed, scales, zeros, bias, fmt, g, K, config=cfg)
    words = packed if fmt == "int4" else packed.view(torch.int32)
    h2 = w4_gemv1.half2_ref(x, words, scales, zeros, bias, g, fmt)
    assert rel_err(y, h2) < (6e-4 if dtype == torch.float16 else 4e-3)
    assert rel_err(y, w4_linear_ref(x, packed, scales, zeros, bias, fmt, g, K)) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", list(LAYERS))
def test_gpu_method_matches_its_reference(fmt, dtype):
    layer = LAYERS[fmt]("qkv")
    xs = [torch.randn(m, layer.in_features).to(dtype) for m in (1, 8, 64)]
    refs = [layer(x) for x in xs]
    layer.to("cuda")
    assert layer.method.kernel_for(layer) == w4_gemm.KERNEL_DESCRIPTION
    for x, ref in zip(xs, refs):
        y = layer(x.cuda())
        assert rel_err(y.cpu(), ref) < TOL[dtype]


@pytest.mark.gpu
def test_gpu_compiled_layer_traces_through_the_op():
    layer = LAYERS["int4_g32_sym"]("linear").to("cuda")
    x = torch.randn(4, layer.in_features, device="cuda", dtype=torch.bfloat16)
    ref = layer(x)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x), ref)


# ---------------------------------------------------------------------------
# the MoE MXFP4 experts (GPT-OSS): each expert's products through the kernel
# ---------------------------------------------------------------------------

def mxfp4_experts(E=4, H=96, I=64, device="cpu"):
    """A stand-in for a FusedMoE holding MXFP4 experts (what `Mxfp4MoEMethod.apply` reads)."""
    from atom.model_ops.moe.mxfp4_method import Mxfp4MoEMethod
    torch.manual_seed(3)
    w13, s13 = quantize_mxfp4(torch.randn(E, 2 * I, H) * 0.2)
    w2, s2 = quantize_mxfp4(torch.randn(E, H, I) * 0.2)

    def act(h):
        return (F_silu(h[:, :I].float()) * h[:, I:].float()).to(h.dtype)

    layer = types.SimpleNamespace(w13_weight=w13, w13_weight_scale=s13, w2_weight=w2, w2_weight_scale=s2,
                                  w13_bias=torch.randn(E, 2 * I), w2_bias=torch.randn(E, H), activation=act,
                                  num_experts=E)
    for n in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale", "w13_bias", "w2_bias"):
        setattr(layer, n, getattr(layer, n).to(device))
    spec = LayerQuantConfig(QuantType.per_1x32, FP4, True, "mxfp4", group_size=32, act_scheme="none")
    return Mxfp4MoEMethod(spec, "t.experts"), layer


def F_silu(x):
    return x * torch.sigmoid(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_moe_mxfp4_kernel_branch_matches_its_reference(T, dtype, monkeypatch):
    import atom.model_ops.moe.mxfp4_method as moe_mod
    method, layer = mxfp4_experts()
    x = torch.randn(T, 96).to(dtype)
    ids = torch.randint(0, 4, (T, 2))
    weights = torch.rand(T, 2).to(dtype)
    ref = method.apply(layer, x, weights, ids)
    calls = []
    real = w4_gemm.w4_linear_launch
    monkeypatch.setattr(w4_gemm, "w4_linear_launch", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    monkeypatch.setattr(moe_mod, "use_w4_kernel", lambda x: True)
    y = method.apply(layer, x, weights, ids)
    assert y.dtype == dtype and y.shape == ref.shape
    assert rel_err(y, ref) < 2 * TOL[dtype]  # two products, the activation rounded between them
    assert len(calls) == 2 * len(ids.unique())  # two products per expert that got tokens
    assert method.kernel_for(layer) == w4_gemm.REFERENCE_DESCRIPTION  # CPU tensors


@pytest.mark.gpu
def test_gpu_moe_mxfp4_matches_its_reference():
    method, layer = mxfp4_experts(E=8, H=256, I=128)
    x = torch.randn(24, 256, dtype=torch.bfloat16)
    ids = torch.randint(0, 8, (24, 2))
    weights = torch.rand(24, 2, dtype=torch.bfloat16)
    ref = method.apply(layer, x, weights, ids)
    _, gpu = mxfp4_experts(E=8, H=256, I=128, device="cuda")
    y = method.apply(gpu, x.cuda(), weights.cuda(), ids.cuda())
    assert method.kernel_for(gpu) == w4_gemm.KERNEL_DESCRIPTION
    assert rel_err(y.cpu(), ref) < 2 * TOL[torch.bfloat16]


# ---------------------------------------------------------------------------
# the compiled path: built for sm90 without a GPU (as tests/test_kernel_compile.py does)
# ---------------------------------------------------------------------------

def _loop_body(ptx: str) -> str:
    body = ptx[ptx.index("Inner Loop Header"):]
    return body[:body.index("bra")]


def _compile_w4() -> dict:
    """Child process: the GEMV, GEMM and w4_dot (split-K and not) for sm90 per format; what
    their PTX shows."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from test_kernel_compile import _signature
    out = {}
    aligned = ("x_ptr", "w_ptr", "s_ptr", "z_ptr", "y_ptr", "stride_xm", "stride_wn", "stride_sn", "stride_zn",
               "n_words", "K")  # what the JIT specializes (16-divisible) at the Llama shapes
    dot = dict(DOT_F32=False, MAGIC=w4_dot.MAGIC2[torch.bfloat16][0], MAGIC_F=w4_dot.MAGIC2[torch.bfloat16][1])
    for fmt, group, zp in ((0, 128, False), (0, 64, True), (1, 32, False), (2, 32, False)):  # 2: MXFP4 pair words
        types = {"w_ptr": "*i32", "s_ptr": "*bf16" if fmt == 0 else "*u8", "z_ptr": "*i8", "b_ptr": "*bf16"}
        for kind, kernel, consts, warps in (
                ("gemv1", w4_gemm._w4_gemv_kernel, dict(BLOCK_M=1, BLOCK_N=4, BLOCK_W=128, AHEAD=True), 4),
                ("gemv4", w4_gemm._w4_gemv_kernel, dict(BLOCK_M=4, BLOCK_N=4, BLOCK_W=128, AHEAD=False), 4),
                ("gemm16", w4_gemm._w4_gemm_kernel, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, PER=2 if fmt == 1 else 8,
                                                          DOT_PREC="tf32", DOT_F32=False), 4),
                ("gemm128", w4_gemm._w4_gemm_kernel, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, PER=2 if fmt == 1 else 8,
                                                           DOT_PREC="tf32", DOT_F32=False), 8),
                ("dot16", w4_dot._w4_dot_kernel, dict(dot, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, ORDER=0,
                                                       DK=w4_dot.dot_k(256, group), PARTIAL=True), 4),
                ("dot128", w4_dot._w4_dot_kernel, dict(dot, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, ORDER=1,
                                                        DK=w4_dot.dot_k(64, group), PARTIAL=False), 8)):
            c = dict(FMT=fmt, GROUP=group, HAS_ZP=zp, HAS_BIAS=True, PDL=True, **consts)
            t = dict(types, w_ptr="*u8") if kind.startswith("gemm") and fmt == 1 else types
            if kind == "dot16":
                t = dict(t, y_ptr="*fp32")  # the split-K partials
            attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned if a in kernel.arg_names}
            src = ASTSource(fn=kernel, signature=_signature(kernel, c, t), constexprs=c, attrs=attrs)
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)).asm["ptx"]
            loop = _loop_body(ptx)
            out[f"{kind}_{fmt}_{group}"] = dict(pdl="griddepcontrol.wait" in ptx, mma="mma" in ptx,
                                                loop_bar_sync="bar.sync" in loop,
                                                loop_int_to_float="cvt.rn.f32.s32" in loop)
    return out


def test_kernels_compile_for_sm90_without_layout_shuffles_in_the_gemv():
    import json
    import os
    import subprocess
    import sys
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton has no ptxas for NVIDIA targets")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), here, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-W", "ignore", os.path.abspath(__file__)], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(got) == 24
    for name, flags in got.items():
        assert flags["pdl"], name  # waits for the kernel in front (programmatic dependent launch)
        assert not flags["loop_int_to_float"], name  # nibbles become floats by bit tricks
        if name.startswith("gemv"):
            assert not flags["loop_bar_sync"], name  # the streaming loop never goes through shared memory
        else:
            assert flags["mma"], name  # tensor cores


if __name__ == "__main__":
    import json
    print(json.dumps(_compile_w4()))


# ---------------------------------------------------------------------------
# the tile sweep (scripts/w4_sweep.py): its loop on the CPU with a stand-in timer
# ---------------------------------------------------------------------------

def test_w4_sweep_loop_runs_every_format_and_regime(tmp_path, monkeypatch, capsys):
    """The sweep's candidates, the table's pick and the old kernel are all launched (through
    the interpreter here) and the JSON names a best tile per (format, shape, M); the
    asymmetric int4 re-times the best symmetric tiles only. The timer is a stand-in that
    runs each call once and ranks configs by BLOCK_N (larger is "faster")."""
    import json
    sweep = _script("w4_sweep")
    import atom.utils.cuda_timing as cuda_timing
    calls_seen = []

    def fake_time(calls, iters=10):
        launched.clear()
        for c in calls:
            calls_seen.append(tuple(c().shape))
        return 1e-5 / (1 + (launched[0].get("BLOCK_N", 0) if launched else 0))  # the config these calls ran

    launched, kernels = [], set()
    real = w4_gemm.w4_linear_launch

    def spy(*args, config=None, **kwargs):
        launched.append(config)
        kernels.add(config["kernel"])
        return real(*args, config=config, **kwargs)

    monkeypatch.setattr(w4_gemm, "w4_linear_launch", spy)
    monkeypatch.setattr(cuda_timing, "graph_time", fake_time)
    monkeypatch.setattr(sweep, "DEVICE", "cpu")
    monkeypatch.setattr(sweep, "SHAPES", [(72, 256)])
    monkeypatch.setattr(sweep, "L2_MISS_BYTES", 1)
    monkeypatch.setattr(sweep, "LARGE_QUICK", [(64, 64, 64, 4, 3, 0)])
    out = tmp_path / "sweep.json"
    assert sweep.main(["--out", str(out), "--quick", "--jobs", "0", "--ms", "1", "17", "80"]) == 0
    got = json.loads(out.read_text())
    best = {(r["format"], r["M"]) for r in got["best"]}
    assert best == {(f, m) for f in ("int4", "int4_asym", "mxfp4") for m in (1, 17, 80)}
    assert all(s[1] == 72 for s in calls_seen)
    # candidates / table (M = 80: the weight written out, `W4_DEQUANT_MIN_M`), and the old kernels (M = 1: w4_gemv1)
    assert kernels == {"w4_dot", "w4_gemv1", "w4_gemm", "w4_dequant"}
    asym = [r for r in got["rows"] if r["format"] == "int4_asym" and r["M"] == 1]
    assert len(asym) <= sweep.ASYM_TOP + 1 < len([r for r in got["rows"] if r["format"] == "int4" and r["M"] == 1])
    assert any(r["is_table"] for r in got["rows"])
    for r in got["best"]:  # the largest BLOCK_N among the tiles timed for it (the written-out weight: none)
        timed = [x["cfg"].get("BLOCK_N", 0) for x in got["rows"] if (x["format"], x["M"]) == (r["format"], r["M"])]
        assert r["cfg"]["BLOCK_N"] == max(timed)
    assert any(x["is_table"] and x["cfg"] == {"kernel": "w4_dequant"} for x in got["rows"] if x["M"] == 80)
    assert "w4_sweep" not in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, g, zp", [("int4", 128, True), ("int4", 32, False), ("mxfp4", 32, False)])
@pytest.mark.parametrize("M, cfg", [
    (1, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=8, ORDER=0)),
    (8, dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=256, SPLIT_K=2, ORDER=1, num_warps=8)),
    (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, ORDER=0)),
    (512, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, SPLIT_K=1, ORDER=1, num_warps=8)),
])
def test_gpu_w4_dot_configs(fmt, g, zp, M, cfg):
    """The sweep's corners of the w4_dot grid compile and agree with the reference at a
    Llama shape with bias (split-K sums, both column orders)."""
    N, K = 4096, 14336
    packed, scales, zeros = random_w4(fmt, N, K, g, zp, device="cuda", seed=M)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    y = w4_linear_launch(x, packed, scales, zeros, bias, fmt, g, K, config=dict(cfg, kernel="w4_dot"))
    assert rel_err(y, w4_linear_ref(x, packed, scales, zeros, bias, fmt, g, K)) < TOL[torch.bfloat16]


FUSED_CASES = [("int4", 16, 512, 128, False), ("int4", 12, 768, 96, True), ("int4", 16, 4096, 128, False),
               ("mxfp4", 16, 512, 32, False), ("mxfp4", 10, 1280, 32, False)]


def fused_ref(x, residual, norm_weight, eps, packed, scales, zeros, fmt, g, k, gated):
    """The unfused layers in float64 without rounding the normed row (as the fused kernel
    does not): (add +) RMSNorm, the 4-bit product, SiLU-and-mul; and the residual sum in x's
    dtype."""
    s = x.double() + (residual.double() if residual is not None else 0)
    res = s.to(x.dtype)
    h = res.double() * torch.rsqrt(res.double().pow(2).mean() + eps) * norm_weight.double()
    y = w4_linear_ref(h.float(), packed, scales, zeros, None, fmt, g, k).double()
    if gated:
        n = y.shape[1] // 2
        y = torch.nn.functional.silu(y[:, :n]) * y[:, n:]
    return y, res


@pytest.mark.parametrize("gated", [False, True], ids=["", "gated"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["", "residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt, N, K, g, zp", FUSED_CASES)
def test_one_row_gemv_with_the_norm_and_silu_inside(fmt, N, K, g, zp, dtype, with_residual, gated):
    """`w4_gemv1_fused` (the RMSNorm of x + residual in the one-row GEMV's prologue, SiLU-and-mul
    of a [gate | up] weight in its epilogue) against the unfused layers: float32 to float32's
    rounding; bf16 to bf16's (the kernel does not round the normed row, the unfused norm
    does). The residual sum is written once, in x's dtype (the interpreter's bf16 conversion
    may differ from round-to-nearest by one unit)."""
    from atom.model_ops.kernels.w4_gemv1 import w4_gemv1_fused
    packed, scales, zeros = random_w4(fmt, N, K, g, zp, seed=N + K)
    torch.manual_seed(K)
    x = (torch.randn(1, K) * 3).to(dtype)
    residual = torch.randn(1, K).to(dtype) if with_residual else None
    nw = (torch.rand(K) + 0.5).to(dtype)
    y, res = w4_gemv1_fused(x, residual, nw, 1e-6, packed, scales, zeros, fmt, g, K, gated)
    ref, ref_res = fused_ref(x, residual, nw, 1e-6, packed, scales, zeros, fmt, g, K, gated)
    assert y.shape == (1, N // 2 if gated else N) and y.dtype == dtype and res.shape == (1, K)
    assert rel_err(y.double(), ref) < (1e-5 if dtype == torch.float32 else TOL[torch.bfloat16])
    if with_residual:
        assert torch.allclose(res.float(), ref_res.float(), rtol=2 ** -7, atol=0)
    else:
        assert res.data_ptr() == x.data_ptr()


def test_one_row_operands_of_the_4bit_methods():
    """What the fusions hand the fused one-row GEMV: int4 layers' packed weight, scales, zero
    points and group; MXFP4 weight-only's; none with dynamic MXFP4 activations (quantized in
    torch before the product)."""
    int4_layer = LAYERS["int4_g32_sym"]("linear")
    packed, scales, zeros, fmt, g, k = int4_layer.method.one_row_operands(int4_layer)
    assert fmt == "int4" and g == 32 and k == int4_layer.in_features and zeros is None
    assert packed is getattr(int4_layer, int4_layer.method.packed_name) and scales is int4_layer.weight_scale
    mx = LAYERS["mxfp4"]("linear")
    assert mx.method.one_row_operands(mx)[3:] == ("mxfp4", 32, mx.in_features)
    act = LAYERS["mxfp4_act_mxfp4"]("linear")
    assert act.method.one_row_operands(act) is None
    from atom.tuning.fusions import w4_one_row
    plan = types.SimpleNamespace(has=lambda name: True)
    x = torch.zeros(1, int4_layer.in_features, dtype=torch.bfloat16)
    assert w4_one_row(plan, int4_layer, x, False) is None  # CPU: the torch reference runs the layer
    assert w4_one_row(types.SimpleNamespace(has=lambda name: False), int4_layer, x, False) is None


def test_the_fusion_takes_one_row_into_a_product_that_is_not_gated(monkeypatch):
    """Where the 4-bit kernels run (faked here), "w4_norm_gemv" hands the fused GEMV the
    operands of one row into a product without bias; a gated product, two rows, or a plan
    without the fusion keep the unfused layers."""
    from atom.model_ops.kernels import w4_gemm
    from atom.tuning.fusions import w4_one_row
    monkeypatch.setattr(w4_gemm, "use_w4_kernel", lambda x: True)
    layer = LAYERS["int4_g32_sym"]("linear")
    assert w4_one_row(types.SimpleNamespace(has=lambda name: True), layer,
                      torch.zeros(1, layer.in_features, dtype=torch.bfloat16), False) is None  # its bias
    layer.bias = None
    on, off = types.SimpleNamespace(has=lambda name: name == "w4_norm_gemv"), types.SimpleNamespace(has=lambda n: False)
    x = torch.zeros(1, layer.in_features, dtype=torch.bfloat16)
    assert w4_one_row(on, layer, x, False) == layer.method.one_row_operands(layer)
    assert w4_one_row(on, layer, x, True) is None
    assert w4_one_row(on, layer, torch.zeros(2, layer.in_features, dtype=torch.bfloat16), False) is None
    assert w4_one_row(off, layer, x, False) is None


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True], ids=["", "gated"])
@pytest.mark.parametrize("fmt, N, K, g, zp", FUSED_CASES + [("int4", 6144, 4096, 128, False),
                                                            ("int4", 28672, 4096, 128, True),
                                                            ("mxfp4", 28672, 4096, 32, False)])
def test_gpu_one_row_gemv_with_the_norm_and_silu_inside(fmt, N, K, g, zp, gated):
    """The fused one-row GEMV on the GPU (HALF2 products, the table's tiles) against the
    unfused layers, bf16, with a residual."""
    from atom.model_ops.kernels.w4_gemv1 import w4_gemv1_fused
    packed, scales, zeros = random_w4(fmt, N, K, g, zp, device="cuda", seed=N + K)
    x = (torch.randn(1, K, device="cuda") * 3).bfloat16()
    residual = torch.randn(1, K, device="cuda").bfloat16()
    nw = (torch.rand(K, device="cuda") + 0.5).bfloat16()
    y, res = w4_gemv1_fused(x, residual, nw, 1e-6, packed, scales, zeros, fmt, g, K, gated)
    ref, ref_res = fused_ref(x, residual, nw, 1e-6, packed, scales, zeros, fmt, g, K, gated)
    assert rel_err(y.double(), ref) < TOL[torch.bfloat16]
    assert torch.equal(res, ref_res)


@pytest.mark.gpu
@pytest.mark.parametrize("kind, N, K", [("plain", 4096, 4096), ("plain", 4096, 14336), ("norm", 6144, 4096),
                                        ("gated", 28672, 4096)])
@pytest.mark.parametrize("zp", [False, True], ids=["", "zp"])
def test_gpu_scale_strides_compiled_in_change_no_bit(monkeypatch, kind, N, K, zp):
    """int4's table tiles at Llama-3.1-8B's batch-1 products (HALF2 on the GPU) with the scale
    and zero-point strides compiled in (`FIXED_SCALE_STRIDES`) give the runtime strides' bits:
    o_proj, down, q/k/v with the norm inside, gate-up with SiLU-and-mul inside."""
    from atom.model_ops.kernels.w4_gemv1 import gated_tiles, w4_gemv1_fused
    packed, scales, zeros = random_w4("int4", N, K, 128, zp, device="cuda", seed=N + K + 3)
    x = (torch.randn(1, K, device="cuda") * 3).bfloat16()
    nw = (torch.rand(K, device="cuda") + 0.5).bfloat16()

    def run():
        if kind == "plain":
            return torch.ops.atom.w4_linear(x, packed, scales, zeros, None, "int4", 128, K)
        cfg = gated_tiles(N, "int4", K) if kind == "gated" else None
        return w4_gemv1_fused(x, None, nw, 1e-6, packed, scales, zeros, "int4", 128, K, kind == "gated", cfg=cfg)[0]

    assert w4_gemv1.FIXED_SCALE_STRIDES["int4"]
    got = run()
    monkeypatch.setitem(w4_gemv1.FIXED_SCALE_STRIDES, "int4", False)
    assert torch.equal(got, run())


def test_sass_load_cover_counts_the_work_before_the_first_wait():
    """`scripts/w4_gemv_sass.py --loads`: for each global load of the loop, the instructions
    issued before the first one that waits on its scoreboard (the control field's write
    barrier against later wait masks), around the back edge; loads that set no scoreboard
    are left out. Parsed from a hand-written listing in triton's disassembly format."""
    mod = _script("w4_gemv_sass")
    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        ".LBB0_1:",
        "--:-:2:-:1\tLDG.E.128 R4, desc[UR6][R2.64];",  # scoreboard 2
        "--:-:-:-:1\tIADD3 R8, R8, 0x1, RZ;",
        "04:-:-:-:1\tFFMA R9, R4, R5, R9;",  # waits on 2: one instruction hid the load
        "--:-:3:-:1\tLDG.E.64 R10, desc[UR6][R12.64];",  # scoreboard 3, waited at the top next step
        "--:-:-:-:1\tFMUL R14, R14, R9;",
        "--:-:-:-:1\tLDG.E R16, desc[UR6][R12.64];",  # no scoreboard: not counted
        "08:-:-:-:1\t@!P0 BRA `(.LBB0_1);",
    ])
    body = mod.loop_body(sass)
    assert len(body) == 7
    # the 64-bit load: FMUL and the untracked load, then the branch waits on scoreboard 3
    assert mod.load_cover(sass) == [(0, "LDG.E.128", 1), (3, "LDG.E.64", 2)]


def test_gated_tiles_take_the_formats_own_tile_over_wide_products():
    """`gated_tiles`: int4's own tile (`GATED_TILES`: 8 + 8 rows over 2 warps, word pairs in
    one fp16 chain) over more than WIDE_N [gate | up] rows, as at Llama's 28,672; `tiles`' tile
    with half its rows for narrower products and for MXFP4 (no entry). A copy each call."""
    from atom.model_ops.kernels import w4_gemv1 as g1
    wide = g1.gated_tiles(28672, "int4", 4096)
    assert wide == g1.GATED_TILES["int4"] and wide is not g1.GATED_TILES["int4"]
    assert wide["BLOCK_W"] == 32 * wide["num_warps"] and wide["DW"] == 2 and wide["CHAIN"]
    assert g1.gated_tiles(6144, "int4", 1024) == dict(g1.TILES["int4"], BLOCK_N=g1.TILES["int4"]["BLOCK_N"] // 2)
    for fmt in ("mxfp4", "mxfp4_pairs"):
        assert fmt not in g1.GATED_TILES
        assert g1.gated_tiles(28672, fmt, 4096) == dict(g1.TILES_WIDE[fmt], BLOCK_N=g1.TILES_WIDE[fmt]["BLOCK_N"] // 2)


def test_sass_tables_name_the_launchers_tiles():
    """`scripts/w4_gemv_sass.py --tables`: the tiles it compiles are the ones `w4_gemv1`
    picks at Llama-3.1-8B's batch-1 products (o_proj, gate-up, down, q/k/v with the norm
    inside: `fused_tiles`, gate-up with SiLU-and-mul inside: `gated_tiles`, and q/k/v after
    down's epilogue: `fused_tiles` scaled by 1 / rms), for int4 and
    MXFP4 pair words, with the inputs of each product; the register count of a listing is one
    more than the highest R it names."""
    from atom.model_ops.kernels import w4_gemv1 as g1
    mod = _script("w4_gemv_sass")
    rows = {(name, fmt): (k, tile, norm, gated, rsq) for name, fmt, k, tile, norm, gated, rsq in mod.table_tiles()}
    assert len(rows) == 12
    for fmt in ("int4", "mxfp4_pairs"):
        assert rows[("o_proj", fmt)] == (4096, g1.TILES[fmt], False, False, False)
        assert rows[("gate-up", fmt)] == (4096, g1.TILES_WIDE[fmt], False, False, False)
        assert rows[("down", fmt)] == (14336, g1.TILES_DEEP[fmt], False, False, False)
        assert rows[("q/k/v+norm", fmt)] == (4096, g1.FUSED_TILES[False], True, False, False)
        halved = dict(g1.TILES_WIDE[fmt], BLOCK_N=g1.TILES_WIDE[fmt]["BLOCK_N"] // 2)
        assert rows[("gate-up+silu", fmt)] == (4096, g1.GATED_TILES.get(fmt, halved), False, True, False)
        assert rows[("q/k/v+rsq", fmt)] == (4096, g1.TILES[fmt], False, False, True)
    assert mod.registers("MOV R1, c[0x0][0x28] ;\nIADD3 R17, R2, 0x1, RZ ;\nSTG.E desc[UR4][R4.64], R9 ;") == 18
    assert set(mod.GRID_ROWS) == {name for name, *_ in mod.table_tiles()}


def test_programs_an_sm_and_waves():
    """`w4_gemv_sass.programs_per_sm`: registers allocated in steps of 8 a thread out of 65,536
    an SM, at most 64 warps and 32 programs; `waves`: a grid over all SMs' programs."""
    mod = _script("w4_gemv_sass")
    assert mod.programs_per_sm(59, 8) == 4      # 64 x 256 threads = 16,384 registers a program
    assert mod.programs_per_sm(83, 4) == 5      # 88 x 128 = 11,264
    assert mod.programs_per_sm(54, 4) == 9      # 56 x 128 = 7,168
    assert mod.programs_per_sm(16, 1) == 32     # the program limit
    assert mod.programs_per_sm(24, 16) == 4     # the warp limit (24 x 512 = 12,288 would allow 5)
    assert mod.waves(768, 59, 8) == pytest.approx(768 / 528)
    assert mod.waves(768, 54, 4) < 1 < mod.waves(768, 83, 4) < 2
