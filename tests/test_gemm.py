"""The Triton GEMM behind ATOM_USE_TRITON_GEMM (`kernels.gemm`) against F.linear: TMA and
pointer-load paths, ragged M / N / K, bias, leading dims; CPU cases under Triton's
interpreter, GPU cases (marked gpu) over the decode and prefill tilings; and the switch in
the linear layers."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from test_triton_kernels import CPU, GPU, _check_close, _dtypes  # noqa: E402  (same parametrization)

from atom.model_ops.quant import dense, library_product  # noqa: E402
from atom.tuning.plan import KernelPlan  # noqa: E402
from atom.model_ops.kernels.gemm import gemm, gemm_config  # noqa: E402

SMALL = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)  # interpreter-sized tiles


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("M,N,K,bias", [(1, 48, 64, False), (37, 70, 104, True), (16, 32, 32, False),
                                        (50, 33, 96, True), (300, 40, 32, False)])  # 300: 19 row tiles, 3 groups
def test_gemm_interpreted(device, tma, M, N, K, bias):
    """Partial tiles in every dimension (K not a multiple of BLOCK_K included) and several
    row tiles per group."""
    g = torch.Generator().manual_seed(M * N + K)
    for dtype in _dtypes(device):
        x = torch.randn(M, K, generator=g).to(dtype)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
        b = torch.randn(N, generator=g).to(dtype) if bias else None
        _check_close(gemm(x, w, b, tma=tma, config=SMALL), F.linear(x.float(), w.float(),
                     None if b is None else b.float()).to(dtype), dtype, f"{dtype} tma={tma}")


@pytest.mark.parametrize("device", [GPU])
@pytest.mark.parametrize("M", [1, 8, 64, 100, 192, 256, 1000])
def test_gemm_gpu(device, M):
    """The tilings the engine uses (decode sizes and a prefill-sized M) at a ragged N and a K
    that is no multiple of any K tile, with a bias: the default path (TMA for 16-bit operands
    on sm90+, checked to be taken there) and pointer loads."""
    from atom.model_ops.kernels import gemm as gemm_mod
    g = torch.Generator().manual_seed(M)
    if torch.cuda.get_device_capability()[0] >= 9:
        assert gemm_mod._tma_device(torch.cuda.current_device())
    for dtype in _dtypes(device):
        x = torch.randn(M, 1000, generator=g).to(device, dtype)
        w = (torch.randn(1000, 1000, generator=g) / 32).to(device, dtype)
        b = torch.randn(1000, generator=g).to(device, dtype)
        ref = F.linear(x.double(), w.double(), b.double()).to(dtype)
        for tma in (None, False):
            _check_close(gemm(x, w, b, tma=tma), ref, dtype, f"{dtype} M={M} tma={tma}")


@pytest.mark.parametrize("device", [CPU])
def test_gemm_shapes_bias_and_errors(device):
    x = torch.randn(2, 3, 40)
    w = torch.randn(24, 40)
    b = torch.randn(24)
    y = gemm(x, w, b, tma=False, config=SMALL)
    assert y.shape == (2, 3, 24)
    _check_close(y, F.linear(x, w, b), torch.float32, "3-D input")
    assert gemm(torch.randn(0, 40), w, tma=False, config=SMALL).shape == (0, 24)
    torch.testing.assert_close(gemm(torch.randn(5, 0), torch.randn(24, 0), b), b.expand(5, 24))  # K = 0
    wide = torch.randn(48)
    _check_close(gemm(x, w, wide[::2], tma=False, config=SMALL), F.linear(x, w, wide[::2]), torch.float32,
                 "strided bias")
    with pytest.raises(ValueError, match=r"bias must be \[24\]"):
        gemm(x, w, torch.randn(23))
    with pytest.raises(ValueError, match=r"weight must be \[N, 40\]"):
        gemm(x, torch.randn(24, 41))
    with pytest.raises(ValueError, match="weight must be torch.float32"):
        gemm(x, w.half())
    with pytest.raises(ValueError, match=r"tma=True: x \(strides \(38, 1\) of 4-byte elements"):
        gemm(torch.randn(3, 38), torch.randn(24, 38), tma=True)
    assert gemm_config(1, True)["BLOCK_M"] == 64 and gemm_config(4096, True)["BLOCK_N"] == 256
    assert gemm_config(128, False)["num_stages"] == 2
    big = gemm_config(4096, False, elem_bytes=4)  # one stage within ROCm's 64 KiB of shared memory
    assert (big["BLOCK_M"] + big["BLOCK_N"]) * big["BLOCK_K"] * 4 <= 64 * 1024


@pytest.mark.parametrize("device", [CPU])
def test_linear_layers_take_the_triton_gemm_when_switched_on(device, monkeypatch):
    """`dense` routes GPU products to the Triton GEMM only while the switch is on (a CPU
    tensor never), and so does the batch-1 GEMV choice's unfused baseline; here a stand-in
    GEMM records what reaches it."""
    seen = []
    monkeypatch.setattr("atom.model_ops.kernels.gemm.gemm",
                        lambda x, w, b=None: seen.append(x.shape) or F.linear(x, w, b))

    class FakeGpuTensor(torch.Tensor):  # is_cpu False, everything else a CPU tensor
        @property
        def is_cpu(self):
            return False

    x = torch.randn(4, 8).as_subclass(FakeGpuTensor)
    w = torch.randn(6, 8)
    plan = KernelPlan(backend="triton")
    dense(x, w, plan=plan)
    assert seen == []
    plan.triton_gemm = True
    dense(x, w, plan=plan)
    dense(torch.randn(4, 8), w, plan=plan)  # a real CPU tensor: oneDNN / F.linear
    library_product(plan, x[:1], w)  # the batch-1 GEMV choice's baseline
    assert seen == [torch.Size([4, 8]), torch.Size([1, 8])]
    library_product(KernelPlan(backend="triton"), x[:1], w)  # another engine's plan: no Triton GEMM
    assert len(seen) == 2
