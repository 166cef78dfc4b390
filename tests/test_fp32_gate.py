"""`Fp32Gate` (DeepSeek's fp32 router logits): the bf16 copy is kept only where it holds the
weight exactly, the CPU path is the fp32 reference, and on a GPU the bf16 GEMM with fp32
output gives the reference's logits up to the order of fp32 sums. Dummy weights of a bf16
model give the gate bf16 values, as a bf16 checkpoint would."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from atom.model_loader.loader import init_dummy_weights
from atom.model_ops.moe.gate import Fp32Gate


def _gate(exact: bool, device="cpu") -> Fp32Gate:
    g = Fp32Gate(8, 32).to(device)
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    g.weight.data.copy_(w.bfloat16().float() if exact else w)
    return g


def test_low_precision_copy_only_when_exact():
    exact, inexact = _gate(True), _gate(False)
    exact.finish_loading(torch.bfloat16)
    inexact.finish_loading(torch.bfloat16)
    assert exact.lowp_weight is not None and exact.lowp_weight.dtype == torch.bfloat16
    assert torch.equal(exact.lowp_weight.float(), exact.weight)
    assert inexact.lowp_weight is None
    exact.finish_loading(torch.float32)  # an fp32 model: the reference only
    assert exact.lowp_weight is None
    assert "bfloat16 GEMM" not in repr(exact) and "fp32 logits" in repr(exact)


def test_cpu_forward_is_the_fp32_reference():
    g = _gate(True)
    g.finish_loading(torch.bfloat16)
    assert "bfloat16 GEMM" in repr(g)
    x = torch.randn(5, 32).bfloat16()
    out = g(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, nn.functional.linear(x.float(), g.weight))


def test_dummy_weights_of_a_bf16_model_are_bf16_values():
    m = nn.ModuleDict(dict(gate=Fp32Gate(8, 32), norm=nn.LayerNorm(32)))
    init_dummy_weights(m, "xavier", torch.bfloat16)
    w = m["gate"].weight
    assert w.dtype == torch.float32 and w.abs().sum() > 0
    assert torch.equal(w.bfloat16().float(), w)
    m2 = nn.ModuleDict(dict(gate=Fp32Gate(8, 32)))
    init_dummy_weights(m2, "xavier")  # no model dtype: fp32 values as drawn
    assert not torch.equal(m2["gate"].weight.bfloat16().float(), m2["gate"].weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tokens", [1, 200, 4096])
def test_gpu_bf16_gemm_gives_the_fp32_logits(tokens):
    g = Fp32Gate(64, 2048).cuda()
    g.weight.data.copy_((torch.randn(64, 2048, device="cuda") * 0.02).bfloat16().float())
    g.finish_loading(torch.bfloat16)
    x = torch.randn(tokens, 2048, device="cuda").bfloat16()
    ref = nn.functional.linear(x.float(), g.weight)
    out = g(x)  # outside a forward: the platform's kernels (Triton on a GPU)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
