"""The MXFP4 experts' Triton path (`experts_mxfp4_triton`, interpreter on CPU) against the
method's torch reference (each expert dequantized to fp32): with and without biases, the
GPT-OSS activation, fp32 and bf16, one token and many; the method dispatches to it by the
plan and then no longer syncs the host."""
from __future__ import annotations

import pytest
import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON
from atom.model_ops.moe import FusedMoE, TopK
from atom.model_ops.moe.mxfp4_method import Mxfp4MoEMethod
from atom.quant_spec import DTYPE_KEYS, LayerQuantConfig, QuantType
from atom.tuning.plan import KernelPlan

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (interpreter on CPU)")
SPEC = LayerQuantConfig(QuantType.per_1x32, DTYPE_KEYS["fp4x2"], True, "mxfp4", act_scheme="none")


class OneSpec:
    def get_layer_quant_config(self, prefix):
        return SPEC


def build(E, H, I, bias, activation="silu", seed=0):
    layer = FusedMoE(E, H, I, TopK(E, 2, renormalize=True), quant_config=OneSpec(), prefix="t.experts",
                     bias=bias, activation=activation)
    assert isinstance(layer.method, Mxfp4MoEMethod)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("w13_weight", "w2_weight"):
            p = getattr(layer, name)
            p.copy_(torch.randint(0, 256, p.shape, generator=g, dtype=torch.int32).to(torch.uint8))
        for name in ("w13_weight_scale", "w2_weight_scale"):
            p = getattr(layer, name)
            p.copy_(torch.randint(118, 126, p.shape, generator=g, dtype=torch.int32).to(torch.uint8))
        if bias:
            layer.w13_bias.copy_(torch.randn(layer.w13_bias.shape, generator=g) * 0.1)
            layer.w2_bias.copy_(torch.randn(layer.w2_bias.shape, generator=g) * 0.1)
    layer.method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E,H,I,bias,activation", [(4, 64, 32, False, "silu"), (6, 96, 64, True, "silu"),
                                                   (4, 64, 96, True, "gpt_oss_swiglu(alpha=1.702,limit=7.0)")])
@pytest.mark.parametrize("T", [1, 19])
def test_triton_path_equals_the_reference(E, H, I, bias, activation, dtype, T):
    from atom.model_ops.moe.experts_mxfp4_triton import fused_experts_mxfp4
    layer = build(E, H, I, bias, activation)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g) * 2
    ref = layer(x, logits)  # no plan: the reference
    assert layer.method.syncs_host(layer, torch.device("cpu"))
    layer.plan = KernelPlan(moe_kernel="triton")
    assert not layer.method.syncs_host(layer, torch.device("cpu"))
    got = layer(x, logits)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    else:  # one bf16 rounding of the first product apart (the interpreter's casts truncate)
        assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 0.02
    assert got.abs().max() > 0.1
    w, ids = TopK(E, 2, renormalize=True)(logits)
    direct = fused_experts_mxfp4(x, layer.w13_weight, layer.w13_weight_scale, layer.w2_weight, layer.w2_weight_scale,
                                 w, ids, layer.activation, getattr(layer, "w13_bias", None),
                                 getattr(layer, "w2_bias", None))
    torch.testing.assert_close(direct, got, rtol=0, atol=0)


def test_shapes_that_do_not_fit_are_refused():
    from atom.model_ops.moe.experts_mxfp4_triton import fused_experts_mxfp4
    layer = build(4, 64, 32, False)
    with pytest.raises(ValueError, match="do not fit hidden 96"):
        fused_experts_mxfp4(torch.randn(2, 96), layer.w13_weight, layer.w13_weight_scale, layer.w2_weight,
                            layer.w2_weight_scale, torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int64),
                            layer.activation)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 1024])
def test_triton_path_at_gpt_oss_shape_on_the_gpu(T):
    """GPT-OSS-20B's experts (32 of 2880 x 2880, biases, its activation) in bf16 on the GPU
    against the per-expert reference (the 4-bit kernel per expert there)."""
    layer = build(32, 2880, 2880, True, "gpt_oss_swiglu(alpha=1.702,limit=7.0)").cuda()
    layer.method.process_weights_after_loading(layer)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, 2880, generator=g).bfloat16().cuda()
    logits = (torch.randn(T, 32, generator=g) * 2).cuda()
    ref = layer(x, logits)
    layer.plan = KernelPlan(moe_kernel="triton")
    got = layer(x, logits)
    assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 0.01


def test_a_fullgraph_compile_calls_the_mxfp4_op():
    """Under torch.compile (fullgraph, as level 3 compiles) the layer goes through the opaque
    `atom::moe_experts_mxfp4` op (biases, the activation by name) and gives the eager output."""
    layer = build(4, 64, 96, True, "gpt_oss_swiglu(alpha=1.702,limit=7.0)")
    layer.plan = KernelPlan(moe_kernel="triton")
    layer.plan_installed(layer.plan)
    g = torch.Generator().manual_seed(3)
    x, logits = torch.randn(7, 64, generator=g), torch.randn(7, 4, generator=g)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, logits), layer(x, logits), rtol=0, atol=0)
