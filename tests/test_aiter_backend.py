"""The AITER backend (`atom.model_ops.kernels_aiter`) on a machine without AMD GPUs: a stand-in
`aiter` module with AITER's calling conventions (outputs passed in and written, 2-D rows)
computes in torch, so these tests check what the adapter hands AITER and what it returns,
against the torch references; the backend choice and its errors are checked too."""
import importlib
import sys
import types

import pytest
import torch

import atom.model_ops
from atom import platform
from atom.model_ops import kernel_backend
from atom.model_ops import kernels as triton_kernels
from atom.model_ops.kernels import fused_add_rms_norm_ref, rms_norm_ref, silu_and_mul_ref


def _fake_aiter(calls):
    """AITER's conventions and the checks its Python wrappers make (2-D rows with unit last
    stride, contiguous outputs / residual / weight, one dtype), computed in torch."""
    def rows_ok(*ts):
        assert all(t.dim() == 2 and t.stride(-1) == 1 for t in ts)

    def rmsnorm2d_fwd(input, weight, epsilon):
        rows_ok(input)
        assert weight.dtype == input.dtype and weight.is_contiguous() and input.shape[0] > 0
        calls.append("rmsnorm2d_fwd")
        return rms_norm_ref(input, weight, epsilon)

    def rmsnorm2d_fwd_with_add(out, input, residual_in, residual_out, weight, epsilon):
        rows_ok(out, input, residual_in, residual_out)
        assert out.is_contiguous() and residual_in.is_contiguous() and residual_out.is_contiguous()
        assert weight.dtype == input.dtype == residual_in.dtype and weight.is_contiguous() and input.shape[0] > 0
        calls.append("rmsnorm2d_fwd_with_add")
        y, r = fused_add_rms_norm_ref(input, residual_in, weight, epsilon)
        out.copy_(y)
        residual_out.copy_(r)

    def silu_and_mul(out, input):
        assert out.is_contiguous() and input.is_contiguous() and out.shape[-1] * 2 == input.shape[-1]
        assert out.numel() > 0
        calls.append("silu_and_mul")
        out.copy_(silu_and_mul_ref(input))

    mod = types.ModuleType("aiter")
    mod.rmsnorm2d_fwd, mod.rmsnorm2d_fwd_with_add = rmsnorm2d_fwd, rmsnorm2d_fwd_with_add
    mod.silu_and_mul = silu_and_mul
    return mod


@pytest.fixture
def aiter_kernels(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "aiter", _fake_aiter(calls))
    monkeypatch.delitem(sys.modules, "atom.model_ops.kernels_aiter", raising=False)
    mod = importlib.import_module("atom.model_ops.kernels_aiter")
    yield mod, calls
    sys.modules.pop("atom.model_ops.kernels_aiter", None)
    vars(atom.model_ops).pop("kernels_aiter", None)  # the import's binding on the package


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aiter_norms_and_activation_match_the_references(aiter_kernels, dtype):
    k, calls = aiter_kernels
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 64, generator=g).to(dtype)
    res = torch.randn(2, 5, 64, generator=g).to(dtype)
    w = torch.rand(64, generator=g) + 0.5  # fp32 weight: handed to AITER in x's dtype
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)

    torch.testing.assert_close(k.rms_norm(x, w, 1e-6), rms_norm_ref(x, w.to(dtype), 1e-6), **tol)
    y, r = k.fused_add_rms_norm(x, res, w, 1e-6)
    y_ref, r_ref = fused_add_rms_norm_ref(x, res, w.to(dtype), 1e-6)
    assert y.shape == r.shape == x.shape
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(r, r_ref, **tol)
    xi, ri = x.clone(), res.clone()
    yi, rri = k.fused_add_rms_norm(xi, ri, w, 1e-6, inplace=True)
    assert yi.data_ptr() == xi.data_ptr() and rri.data_ptr() == ri.data_ptr()
    torch.testing.assert_close(xi, y_ref, **tol)
    torch.testing.assert_close(ri, r_ref, **tol)

    gu = torch.randn(3, 7, 2 * 48, generator=g).to(dtype)
    out = k.silu_and_mul(gu)
    assert out.shape == (3, 7, 48)
    torch.testing.assert_close(out, silu_and_mul_ref(gu), **tol)
    assert calls == ["rmsnorm2d_fwd", "rmsnorm2d_fwd_with_add", "rmsnorm2d_fwd_with_add", "silu_and_mul"]


def test_aiter_edge_cases(aiter_kernels):
    """Strided inputs and outputs, in-place norm, empty batches (no AITER call) and a residual
    in another dtype (the Triton kernel, under the interpreter here)."""
    k, calls = aiter_kernels
    g = torch.Generator().manual_seed(1)
    w = torch.rand(32, generator=g) + 0.5
    xt = torch.randn(32, 6, generator=g).t()  # [6, 32] with a non-unit last stride
    torch.testing.assert_close(k.rms_norm(xt, w), rms_norm_ref(xt, w))
    xi = torch.randn(4, 32, generator=g)
    ref = rms_norm_ref(xi, w)
    assert k.rms_norm(xi, w, inplace=True).data_ptr() == xi.data_ptr()
    torch.testing.assert_close(xi, ref)
    gu = torch.randn(5, 16, generator=g)
    out = torch.zeros(5, 16)[:, ::2]  # [5, 8], row stride 16
    assert k.silu_and_mul(gu, out=out) is out
    torch.testing.assert_close(out, silu_and_mul_ref(gu))
    n = len(calls)
    assert k.rms_norm(torch.randn(0, 32), w).shape == (0, 32)
    assert [t.shape for t in k.fused_add_rms_norm(torch.randn(0, 32), torch.randn(0, 32), w)] == [(0, 32)] * 2
    assert k.silu_and_mul(torch.randn(0, 16)).shape == (0, 8)
    assert len(calls) == n
    x16, r32 = torch.randn(3, 32, generator=g).half(), torch.randn(3, 32, generator=g)
    y, r = k.fused_add_rms_norm(x16, r32, w.half())
    y_ref, r_ref = fused_add_rms_norm_ref(x16, r32, w.half())
    assert len(calls) == n and r.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(r, r_ref)


def test_aiter_input_errors_name_the_shapes(aiter_kernels):
    k, calls = aiter_kernels
    with pytest.raises(ValueError, match="weight shape"):
        k.rms_norm(torch.randn(3, 8), torch.ones(4))
    with pytest.raises(ValueError, match="residual shape"):
        k.fused_add_rms_norm(torch.randn(3, 8), torch.randn(2, 8), torch.ones(8))
    with pytest.raises(ValueError, match="even last dimension"):
        k.silu_and_mul(torch.randn(3, 7))
    assert calls == []


def test_names_aiter_does_not_serve_are_the_triton_kernels(aiter_kernels):
    k, _ = aiter_kernels
    for name in ("rotary_embedding", "reshape_and_cache", "gumbel_sample", "gemv", "gemv_fused"):
        assert getattr(k, name) is getattr(triton_kernels, name)
    with pytest.raises(AttributeError):
        k.no_such_kernel


def test_backend_modules_and_the_layers_choice(aiter_kernels, monkeypatch):
    k, _ = aiter_kernels
    assert kernel_backend.kernels_for("aiter") is k
    assert kernel_backend.kernels_for("triton") is triton_kernels
    assert kernel_backend.kernels_for("torch") is None
    monkeypatch.setattr(platform, "kernel_backend", lambda: "aiter")
    on_gpu = types.SimpleNamespace(is_cuda=True)
    assert kernel_backend.get(on_gpu) is k
    assert kernel_backend.get(types.SimpleNamespace(is_cuda=False)) is None
    monkeypatch.setattr(platform, "kernel_backend", lambda: "torch")
    assert kernel_backend.get(on_gpu) is None


def test_the_engines_plan_decides_inside_a_forward(aiter_kernels, monkeypatch):
    """Inside a forward the kernel plan in the forward context wins over the platform's
    choice, so two engines in one process each get their own kernels."""
    from atom.model_ops.attention import AttentionMetadata, forward_context
    from atom.tuning.plan import KernelPlan
    k, _ = aiter_kernels
    monkeypatch.setattr(platform, "kernel_backend", lambda: "aiter")
    on_gpu, on_cpu = types.SimpleNamespace(is_cuda=True), types.SimpleNamespace(is_cuda=False)
    t = torch.zeros(1)
    meta = AttentionMetadata(t, t, t, t, 1, 1)
    meta.plan = KernelPlan(backend="torch")
    with forward_context(meta):
        assert kernel_backend.get(on_gpu) is None
    meta.plan = KernelPlan(backend="triton", force_kernels=True)
    with forward_context(meta):
        assert kernel_backend.get(on_cpu) is triton_kernels
    assert kernel_backend.get(on_gpu) is k  # outside a forward: the platform's choice


def test_forcing_aiter_without_the_package_is_a_clear_error(monkeypatch):
    monkeypatch.delitem(sys.modules, "aiter", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "aiter" else object())
    monkeypatch.setenv("ATOM_KERNEL_BACKEND", "aiter")
    platform.kernel_backend.cache_clear()
    try:
        with pytest.raises(ValueError, match="needs the aiter package"):
            platform.kernel_backend()
    finally:
        platform.kernel_backend.cache_clear()


def test_rocm_takes_aiter_only_when_it_imports(monkeypatch, caplog):
    """On ROCm (simulated) an importable aiter is chosen; an installed one that fails to import
    leaves the Triton kernels, with a warning that says why."""
    monkeypatch.delenv("ATOM_KERNEL_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(platform, "is_rocm", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    try:
        monkeypatch.setitem(sys.modules, "aiter", _fake_aiter([]))
        platform.kernel_backend.cache_clear()
        assert platform.kernel_backend() == "aiter"
        monkeypatch.setitem(sys.modules, "aiter", None)  # `import aiter` now raises
        platform.kernel_backend.cache_clear()
        with caplog.at_level("WARNING", logger="atom.platform"):
            assert platform.kernel_backend() == "triton"
        assert "aiter failed to import (ModuleNotFoundError" in caplog.text
    finally:
        platform.kernel_backend.cache_clear()
