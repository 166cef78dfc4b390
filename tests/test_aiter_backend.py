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
    def rmsnorm2d_fwd(input, weight, epsilon):
        assert input.dim() == 2 and weight.dtype == input.dtype
        calls.append("rmsnorm2d_fwd")
        return rms_norm_ref(input, weight, epsilon)

    def rmsnorm2d_fwd_with_add(out, input, residual_in, residual_out, weight, epsilon):
        assert out.dim() == input.dim() == residual_in.dim() == residual_out.dim() == 2
        assert weight.dtype == input.dtype and residual_in.is_contiguous()
        calls.append("rmsnorm2d_fwd_with_add")
        y, r = fused_add_rms_norm_ref(input, residual_in, weight, epsilon)
        out.copy_(y)
        residual_out.copy_(r)

    def silu_and_mul(out, input):
        assert out.shape[-1] * 2 == input.shape[-1]
        calls.append("silu_and_mul")
        out.copy_(silu_and_mul_ref(input))

    mod = types.ModuleType("aiter")
    mod.rmsnorm2d_fwd, mod.rmsnorm2d_fwd_with_add, mod.silu_and_mul = rmsnorm2d_fwd, rmsnorm2d_fwd_with_add, silu_and_mul
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
    monkeypatch.setattr(kernel_backend, "_kernels", None)
    on_gpu = types.SimpleNamespace(is_cuda=True)
    assert kernel_backend.get(on_gpu) is k
    assert kernel_backend.get(types.SimpleNamespace(is_cuda=False)) is None
    monkeypatch.setattr(platform, "kernel_backend", lambda: "torch")
    monkeypatch.setattr(kernel_backend, "_kernels", None)
    assert kernel_backend.get(on_gpu) is None


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
