"""The GPU paths of the 8-bit linear methods (fp8 per-tensor / per-channel / block, int8
W8A8) against their torch references: the Triton kernels under TRITON_INTERPRET=1 on tiny
shapes (activation quantization bit for bit, the GEMV and GEMM against dequantize-then-
matmul), the methods' kernel dispatch on CPU tensors (forced) against their reference
apply, and `@pytest.mark.gpu` checks at Llama-3.1-8B shapes for the H200."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atom.model_ops.kernels.act_quant import act_quant, act_quant_launch, act_quant_ref
from atom.model_ops.kernels.quant_gemm import (gemm_config, gemv_config, quant_gemm, quant_gemm_launch,
                                                quant_gemm_ref, quant_gemv, quant_gemv_launch)
from atom.model_ops.kernels.triton_import import HAS_TRITON
from atom.model_ops.quant import common, fp8, int8
from atom.model_ops.quant.common import fake_quant_act
from test_quant_methods import FORMATS, build, dequant, fill, q_int8_channel, spec
from atom.quant_spec import QuantType

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (interpreter on CPU)")
FP8 = torch.float8_e4m3fn
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _x(M, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * 0.7
    x[0, : min(3, K)] *= 30  # outliers
    return x.to(dtype).to(DEV)


# ---------------------------------------------------------------------------
# activation quantization: exactly the reference
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind,qmax", [("fp8", 448.0), ("int8", 127.0), ("int8", 127.5)])
@pytest.mark.parametrize("M,K,group", [(1, 40, 40), (3, 96, 32), (17, 64, 64), (5, 2048 + 48, 2048 + 48)])
def test_act_quant_is_the_reference(kind, qmax, M, K, group, dtype):
    x = _x(M, K, dtype)
    if M > 1:
        x[1] = 0  # an all-zero row takes the amax floor
    q, s = act_quant(x, kind, group, qmax)
    qr, sr = act_quant_ref(x, kind, group, qmax)
    assert q.dtype == qr.dtype and torch.equal(s, sr)
    assert torch.equal(q.float(), qr.float())
    # and act_quant_ref is the methods' fake quantization
    scheme = "token" if group == K else "group"
    deq = (q.float().reshape(M, -1, group) * s.unsqueeze(-1)).reshape(M, K)
    assert torch.equal(deq, fake_quant_act(x, kind, scheme, group, qmax=qmax))


@pytest.mark.parametrize("static", [False, True])
def test_act_quant_chunked_path(static):
    """Groups wider than the single-pass block walk their columns in chunks: the same result."""
    from atom.model_ops.kernels.act_quant import act_quant_config
    x = _x(3, 200, torch.bfloat16)
    scale = torch.tensor(0.02, device=DEV) if static else None
    cfg = act_quant_config(200, single_pass_max=64)
    assert not cfg["SINGLE"]
    cfg["BLOCK"] = 64  # 200 columns: three full chunks and a partial one
    for kind in ("fp8", "int8"):
        q, s = act_quant_launch(x, kind, 200, 448.0 if kind == "fp8" else 127.0, scale, config=cfg)
        qr, sr = act_quant_ref(x, kind, 200, 448.0 if kind == "fp8" else 127.0, scale)
        assert torch.equal(s, sr) and torch.equal(q.float(), qr.float())


def test_act_quant_static_scale():
    x = _x(3, 48, torch.bfloat16)
    scale = torch.tensor(0.01, device=DEV)
    q, s = act_quant(x, "fp8", 48, 448.0, scale)
    assert torch.equal(s, torch.full((3, 1), 0.01, device=DEV))
    assert torch.equal(q.float() * 0.01, fake_quant_act(x, "fp8", "tensor", static_scale=scale))


@pytest.mark.parametrize("kind,qmax", [("fp8", 448.0), ("int8", 127.0)])
def test_act_quant_divides_as_div_rn_at_the_edges(kind, qmax):
    """`act_quant.div_by` (a reciprocal and Markstein's correction) gives the reference's
    correctly rounded x / scale: e4m3 ties that the product x (1 / scale) alone rounds the other
    way (amax 69), static scales whose quotients overflow float32 (clamped) or whose scale is
    infinite (every quotient 0), and a row of every magnitude."""
    ties = torch.tensor([[69.0, 0.10107421875, -0.10107421875, 0.111328125, 1.0, -3.0]])
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every) & (every.float().abs() < 1e30)][None, :4096 * 15]
    cases = [(ties, None), (every, None), (_x(2, 64, torch.float32) * 1e30, torch.tensor(1e-12)),
             (_x(2, 64, torch.float32), torch.tensor(float("inf"))), (every, torch.tensor(3.0e-3))]
    for x, scale in cases:
        x = x.to(DEV)
        scale = scale.to(DEV) if scale is not None else None
        q, s = act_quant(x, kind, x.shape[1], qmax, scale)
        qr, sr = act_quant_ref(x, kind, x.shape[1], qmax, scale)
        assert torch.equal(s, sr) and torch.equal(q.float(), qr.float()), (x.shape, scale)
    if kind == "fp8":  # the tie at amax 69: 0.65625 to even (0.625), where x r alone gives 0.6875
        q, _ = act_quant(ties.to(DEV), kind, ties.shape[1], qmax)
        assert q.float()[0, 1:3].tolist() == [0.625, -0.625]


def test_act_quant_rejects_bad_group():
    with pytest.raises(ValueError, match="group=32 must divide K=40"):
        act_quant_launch(torch.zeros(2, 40), "fp8", 32, 448.0)
    with pytest.raises(ValueError, match="kind='int4'"):
        act_quant_launch(torch.zeros(2, 40), "int4", 40, 7.0)


# ---------------------------------------------------------------------------
# GEMV / GEMM against dequantize-then-matmul
# ---------------------------------------------------------------------------

def _operands(kind, M, N, K, block_k, dtype, seed=1):
    x = _x(M, K, dtype, seed)
    xq, xs = act_quant_ref(x.cpu(), kind, block_k or K, 448.0 if kind == "fp8" else 127.0)
    g = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(N, K, generator=g)
    if kind == "fp8":
        wq = (w * 50).clamp(-448, 448).to(FP8)
    else:
        wq = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    if block_k:
        ws = torch.rand(N, K // block_k, generator=g) * 0.01 + 1e-3
    else:
        ws, xs = torch.rand(N, generator=g) * 0.01 + 1e-3, xs.reshape(-1)
    bias = torch.randn(N, generator=g)
    return [t.to(DEV) for t in (xq, xs, wq, ws, bias)]


def _close(y, ref, dtype):
    assert y.dtype == ref.dtype == dtype and y.shape == ref.shape
    tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(y.float(), ref.float(), **tol)


SMALL = [(1, 40, 72), (3, 33, 96), (17, 48, 160), (64, 24, 64)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("M,N,K", SMALL)
def test_gemv_and_gemm_row_column_scales(kind, M, N, K, dtype):
    xq, xs, wq, ws, bias = _operands(kind, M, N, K, 0, dtype)
    for b in (None, bias):
        ref = quant_gemm_ref(xq, xs, wq, ws, b, dtype)
        cfg = dict(gemm_config(M, N), BLOCK_K=32)  # K (72, 96, 160) not a multiple of the tile
        _close(quant_gemm_launch(xq, xs, wq, ws, b, dtype, config=cfg), ref, dtype)
        if M <= 17:
            _close(quant_gemv_launch(xq, xs, wq, ws, b, dtype), ref, dtype)
            ahead = dict(gemv_config(M), AHEAD=True, BLOCK_K=32)  # the next tile in flight, K past the last
            _close(quant_gemv_launch(xq, xs, wq, ws, b, dtype, config=ahead), ref, dtype)
    # one (per-tensor) activation scale
    one = xs[:1]
    _close(quant_gemm(xq, one, wq, ws, None, dtype), quant_gemm_ref(xq, one, wq, ws, None, dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K,bk", [(1, 40, 64, 32), (3, 33, 128, 64), (17, 48, 96, 32), (64, 24, 64, 16)])
def test_gemv_and_gemm_block_scales(M, N, K, bk, dtype):
    xq, xs, wq, ws, bias = _operands("fp8", M, N, K, bk, dtype)
    ref = quant_gemm_ref(xq, xs, wq, ws, bias, dtype, bk)
    _close(quant_gemm(xq, xs, wq, ws, bias, dtype, bk), ref, dtype)
    _close(quant_gemv(xq, xs, wq, ws, bias, dtype, bk), ref, dtype)


def test_kernels_reject_bad_operands():
    xq, xs, wq, ws, _ = _operands("fp8", 3, 16, 64, 0, torch.bfloat16)
    with pytest.raises(ValueError, match="both be float8_e4m3fn or int8"):
        quant_gemm_launch(xq, xs, wq.view(torch.int8), ws, None, torch.bfloat16)
    with pytest.raises(ValueError, match="block_k=48"):
        quant_gemm_launch(xq, xs, wq, ws, None, torch.bfloat16, 48)
    with pytest.raises(ValueError, match="ws shape"):
        quant_gemv_launch(xq, xs, wq, ws[:3], None, torch.bfloat16)


# ---------------------------------------------------------------------------
# the methods: the kernel path (forced on CPU tensors) against their reference apply
# ---------------------------------------------------------------------------

INT8_SPEC = spec(QuantType.per_Token, torch.int8, True, "compressed-tensors", act_scheme="token", symmetric=True)
METHOD_FORMATS = ["fp8_tensor_static", "fp8_tensor_dynamic", "fp8_channel", "fp8_block32", "int8"]


def _loaded_layer(fmt, kind):
    f = FORMATS[fmt] if fmt != "int8" else dict(spec=INT8_SPEC, quant=q_int8_channel, act="int8")
    torch.manual_seed(0)
    layer = build(kind, f["spec"])
    for i, sid in enumerate(layer.shard_ids()):
        w = torch.randn(layer.shard_range(sid)[1], layer.in_features) * 0.1
        t = f["quant"](w)
        if f["act"] == "fp8_static":
            t["input_scale"] = torch.tensor([0.002 * (i + 1)], dtype=torch.bfloat16)
        for name, tensor in t.items():
            fill(layer, name, tensor, sid)
    if layer.bias is not None:
        fill(layer, "bias", torch.randn(layer.out_features), None)
    layer.method.process_weights_after_loading(layer)
    return layer


CPU_CASES = ([(f, k, torch.bfloat16) for f in METHOD_FORMATS for k in ("linear", "qkv", "merged")]
             + [(f, "linear", torch.float16) for f in METHOD_FORMATS] + [("ds_block", "linear", torch.bfloat16)])


@pytest.mark.parametrize("fmt,kind,dtype", CPU_CASES)
def test_method_kernel_path_matches_reference(fmt, kind, dtype, monkeypatch):
    layer = _loaded_layer(fmt, kind)
    assert layer.method.kernel.startswith("GPU: act_quant")
    mod = int8 if fmt == "int8" else fp8
    for M in (1, 3, 17):
        x = (torch.randn(M, layer.in_features) * 0.5).to(dtype)
        monkeypatch.setattr(mod.common, "use_kernels", lambda t: False)
        ref = layer(x)
        monkeypatch.setattr(mod.common, "use_kernels", lambda t: True)
        y = layer(x)
        _close(y, ref, dtype)
        assert y.shape == ref.shape


def test_block_weights_with_token_activations_keep_the_reference(monkeypatch):
    """Block weights with per-token activations (a compressed-tensors block / token pair) have
    no kernel (the kernels take a block's own 1 x bk groups): the layer says so and gives the
    reference product where the GPU switch is on."""
    f = FORMATS["fp8_block32"]
    sp = spec(QuantType.per_1x32, FP8, True, "compressed-tensors", block_size=(32, 32), act_scheme="token")
    torch.manual_seed(0)
    layer = build("linear", sp)
    t = f["quant"](torch.randn(layer.out_features, layer.in_features) * 0.1)
    for name, tensor in t.items():
        fill(layer, name, tensor, None)
    if layer.bias is not None:  # created empty: left unfilled it may hold NaN (then NaN != NaN below)
        fill(layer, "bias", torch.randn(layer.out_features), None)
    layer.method.process_weights_after_loading(layer)
    assert not layer.method.kernels and "reference" in layer.method.kernel
    x = (torch.randn(5, layer.in_features) * 0.5).to(torch.bfloat16)
    ref = layer(x)
    monkeypatch.setattr(fp8.common, "use_kernels", lambda t: True)
    torch.testing.assert_close(layer(x), ref, rtol=0, atol=0)


def test_scaled_mm_route_on_cpu():
    """torch._scaled_mm (CPU in torch 2.13) as the fp8 product uses it: tensor-wise and
    row-wise scales, the bias added after, against the reference."""
    M, N, K = 32, 48, 64
    xq, xs, wq, ws, bias = [t.cpu() for t in _operands("fp8", M, N, K, 0, torch.bfloat16)]
    ref = quant_gemm_ref(xq, xs, wq, ws, bias, torch.bfloat16)
    try:
        y = common._scaled_mm(xq, xs, wq, ws, bias, torch.bfloat16, None)
    except (RuntimeError, NotImplementedError) as e:  # pragma: no cover - a torch without CPU fp8 mm
        pytest.skip(f"torch._scaled_mm on CPU: {e}")
    _close(y, ref, torch.bfloat16)
    one, w1 = xs[:1], ws[:1]
    ref1 = quant_gemm_ref(xq, one, wq, w1.expand(N).contiguous(), bias, torch.bfloat16)
    _close(common._scaled_mm(xq, one, wq, None, bias, torch.bfloat16, w1), ref1, torch.bfloat16)


def test_routes_and_kernel_report():
    x = torch.zeros(32, 64, dtype=torch.bfloat16)
    # M <= 64: the swap-AB kernel's table (quant_gemv_dot.small_m_config), the quantizer in front
    x = torch.zeros(80, 64, dtype=torch.bfloat16)
    assert common.product_route("fp8", 1, x, 48) == "dot"
    assert common.product_route("fp8", 8, x, 48, block_k=32) == "dot"
    assert common.product_route("int8", 16, x, 48) == "dot"
    assert common.product_route("fp8", 64, x, 48) == "dot"
    assert common.product_route("fp8", 64, x, 48, block_k=32) == "dot"
    assert common.product_route("fp8", 65, x, 48, block_k=32) == "gemm"
    assert common.product_route("int8", 65, x, 48) == "gemm"
    assert common.product_route("fp8", 65, x, 48) == "scaled_mm"
    assert common.product_route("fp8", 65, x.half(), 48) == "gemm"  # row-wise needs bf16 out
    assert common.product_route("fp8", 65, x.half(), 48, rowwise=False) == "scaled_mm"
    assert common.product_route("fp8", 65, x, 40) == "gemm"  # N not a multiple of 16
    assert "_scaled_mm tensor-wise" in _loaded_layer("fp8_tensor_dynamic", "linear").method.kernel
    assert "_scaled_mm row-wise" in _loaded_layer("fp8_channel", "linear").method.kernel
    assert "_scaled_mm row-wise" in _loaded_layer("fp8_tensor_dynamic", "qkv").method.kernel
    assert "_scaled_mm" not in _loaded_layer("int8", "linear").method.kernel
    weight_only = fp8.Fp8LinearMethod(spec(QuantType.per_Token, FP8, True, "fp8", act_scheme="none"), "t")
    assert weight_only.kernel == common.REFERENCE_KERNEL
    from atom.model_ops.quant import describe_layers
    rows = describe_layers(_loaded_layer("fp8_channel", "linear"))
    assert rows[0]["kernel"].startswith("GPU: act_quant")


def test_custom_ops_trace_under_compile():
    """The launches are custom ops with fake implementations: torch.compile's fake-tensor
    pass takes them (fullgraph), and the compiled graph computes the same."""
    xq, xs, wq, ws, bias = _operands("fp8", 3, 32, 64, 0, torch.bfloat16)
    x = _x(3, 64, torch.bfloat16)

    def f(x):
        q, s = torch.ops.atom.act_quant(x, "fp8", 64, 448.0, None)
        return torch.ops.atom.quant_gemv(q, s.reshape(-1), wq, ws, bias, torch.bfloat16, 0)

    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = f(torch.empty(3, 64, dtype=torch.bfloat16))
    assert out.shape == (3, 32) and out.dtype == torch.bfloat16
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(x), f(x))


# ---------------------------------------------------------------------------
# H200: Llama-3.1-8B shapes
# ---------------------------------------------------------------------------

LLAMA = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("M", [1, 8, 64, 512])
@pytest.mark.parametrize("N,K", LLAMA)
@pytest.mark.parametrize("fmt", ["fp8_channel", "fp8_tensor", "fp8_block", "int8"])
def test_llama_shapes_on_gpu(fmt, N, K, M):
    torch.manual_seed(0)
    dtype = torch.bfloat16
    x = (torch.randn(M, K, device="cuda") * 0.5).to(dtype)
    w = torch.randn(N, K, device="cuda") * 0.02
    if fmt == "int8":
        s = w.abs().amax(1, keepdim=True) / 127
        wq, group, kind, qmax, act = torch.round(w / s).clamp(-128, 127).to(torch.int8), 0, "int8", 127.0, "token"
        w32 = wq.float() * s
    elif fmt == "fp8_block":
        s = w.reshape(N // 128, 128, K // 128, 128).abs().amax((1, 3)) / 448
        full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
        wq, group, kind, qmax, act = (w / full).to(FP8), 128, "fp8", 448.0, "group"
        w32, s = wq.float() * full, s.repeat_interleave(128, 0)
    else:
        s = w.abs().amax(1, keepdim=True) / 448 if fmt == "fp8_channel" else (w.abs().amax() / 448).expand(N, 1)
        wq, group, kind, qmax = (w / s).to(FP8), 0, "fp8", 448.0
        act = "token" if fmt == "fp8_channel" else "tensor"
        w32 = wq.float() * s
    scalar = s[0, 0].reshape(()) if fmt == "fp8_tensor" else None
    y = common.quantized_product(x, wq, s.contiguous(), None, kind, act, qmax, group, w_scalar=scalar)
    ref = F.linear(fake_quant_act(x, kind, act, group or None, qmax=qmax), w32).to(dtype)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


def test_method_compiles_fullgraph(monkeypatch):
    """A layer with the kernel path under torch.compile(fullgraph=True): the whole product
    is one custom op (atom::quant_linear) with a fake, and computes what eager does."""
    layer = _loaded_layer("fp8_channel", "qkv")
    monkeypatch.setattr(fp8.common, "use_kernels", lambda t: True)
    x = (torch.randn(3, layer.in_features) * 0.5).to(torch.bfloat16)
    torch._dynamo.reset()
    y = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(y, layer(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind", ["linear", "qkv", "merged"])
@pytest.mark.parametrize("fmt", METHOD_FORMATS + ["ds_block"])
def test_methods_on_gpu_match_their_reference(fmt, kind, monkeypatch):
    """The methods on CUDA tensors (the kernel path taken by itself) against their reference
    apply on the same layer, for every route (M 1, 8, 32, 300). Errors are measured against
    the output's scale, as in `test_llama_shapes_on_gpu`: Hopper's fp8 tensor cores (the
    tl.dot GEMM, cuBLASLt's scaled mm) accumulate with fewer mantissa bits than fp32, which
    leaves ~0.2-0.8% of max|y| on the elements near zero (measured on the H200:
    docs/perf/raw/2026-12-01-h200-quant-kernels-8bit.json); the CUDA-core GEMV is exact."""
    if fmt == "ds_block" and kind != "linear":
        pytest.skip("the qkv / merged test layers are 128 wide: one 128-block, covered by fp8_block32")
    layer = _loaded_layer(fmt, kind).cuda()
    mod = int8 if fmt == "int8" else fp8
    for M in (1, 8, 32, 300):
        x = (torch.randn(M, layer.in_features, device="cuda") * 0.5).to(torch.bfloat16)
        assert mod.common.use_kernels(x)
        y = layer(x)
        monkeypatch.setattr(mod.common, "use_kernels", lambda t: False)
        ref = layer(x)
        monkeypatch.undo()
        assert y.dtype == ref.dtype == torch.bfloat16 and y.shape == ref.shape
        torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


def test_kernels_compile_for_sm90():
    """The compiled (not interpreted) kernels build for sm90 with the instructions their
    design relies on (tests/quant_kernels_sm90.py, in a child process without the
    interpreter)."""
    from sm90_child import run_sm90_check
    got = run_sm90_check("quant_kernels_sm90.py")
    assert len(got) == 13
    for name, flags in got.items():
        assert all(flags.values()), (name, flags)
