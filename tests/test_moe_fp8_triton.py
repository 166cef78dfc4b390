"""The FP8 experts' Triton path (`experts_fp8_triton`, interpreter on CPU) against the method's
torch reference: per-channel weights x per-token activations and block weights x 1 x bk groups
(DeepSeek's 128 x 128, and blocks that end in a partial block row), fp32 and bf16; the method
dispatches to it by the plan and then no longer syncs the host; per-tensor activations stay on
the reference."""
from __future__ import annotations

import pytest
import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON
from atom.model_ops.moe import FusedMoE, Fp8MoEMethod, TopK
from atom.quant_spec import LayerQuantConfig, QuantType
from atom.tuning.plan import KernelPlan
from tiny_fp8_moe import FP8, quant_fp8_block, quant_fp8_channel, quant_fp8_tensor

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (interpreter on CPU)")


class OneSpec:
    def __init__(self, s):
        self.s = s

    def get_layer_quant_config(self, prefix):
        return self.s


def spec(kind, block=None):
    if kind == "channel_token":
        return LayerQuantConfig(QuantType.per_Token, FP8, True, "compressed-tensors", act_scheme="token")
    if kind == "tensor_static":
        return LayerQuantConfig(QuantType.per_Tensor, FP8, False, "compressed-tensors", act_scheme="tensor")
    return LayerQuantConfig(QuantType.per_1x128, FP8, True, "fp8", block_size=block, act_scheme="group",
                            act_group_size=block[1])


def build(kind, E, H, I, block=None, seed=0):
    layer = FusedMoE(E, H, I, TopK(E, 2, renormalize=True), quant_config=OneSpec(spec(kind, block)), prefix="t.experts")
    g = torch.Generator().manual_seed(seed)
    for e in range(E):
        for part, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            w = torch.randn(shape, generator=g) * 0.3
            q = (quant_fp8_block(w, block) if kind == "block" else
                 quant_fp8_channel(w) if kind == "channel_token" else quant_fp8_tensor(w))
            target = "w2" if part == "w2" else "w13"
            for suffix, t in q.items():
                p = getattr(layer, f"{target}_{suffix}")
                p.weight_loader(p, t, (e, part))
            if kind == "tensor_static":
                p = getattr(layer, f"{target}_input_scale")
                p.weight_loader(p, torch.tensor([0.02]), (e, part))
    assert layer.missing_shards() == []
    layer.method.process_weights_after_loading(layer)
    return layer


CASES = [("channel_token", 6, 64, 32, None), ("block", 4, 256, 128, (128, 128)), ("block", 6, 64, 32, (64, 32))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,E,H,I,block", CASES)
@pytest.mark.parametrize("T", [1, 21])
def test_triton_path_equals_the_reference(kind, E, H, I, block, dtype, T):
    layer = build(kind, E, H, I, block)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g) * 2
    ref = layer(x, logits)  # no plan: the reference
    assert layer.method._kernel(layer, x) == "reference"
    layer.plan = KernelPlan(moe_kernel="triton")
    assert layer.method._kernel(layer, x) == "triton"
    got = layer(x, logits)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    else:
        # bf16: the first product is stored as bf16 before the activation and the second
        # product's fp8 quantization, and Triton's interpreter converts fp32 to bf16 without
        # rounding to nearest (about half the values end one ulp off; a GPU rounds to
        # nearest), which moves some fp8 roundings of the second product's input. So both
        # paths are held against the fp32 reference, to within that fp8 noise.
        layer.plan = None
        exact = layer(x.float(), logits)

        def err(y):
            return float((y.float() - exact).norm() / exact.norm())
        assert err(ref) < 0.02 and err(got) < 0.06, (err(got), err(ref))
    assert got.abs().max() > 0.1  # not a degenerate output


def test_host_syncs_follow_the_path():
    from atom.model_ops.moe import describe_moe_layers
    layer = build("channel_token", 4, 64, 32)
    cpu = torch.device("cpu")
    assert layer.method.syncs_host(layer, cpu)  # no plan: the reference's loop
    assert describe_moe_layers(torch.nn.ModuleDict({"m": layer}))[0]["kernel"].startswith("torch reference")
    layer.plan = KernelPlan(moe_kernel="triton")
    assert not layer.method.syncs_host(layer, cpu)
    assert describe_moe_layers(torch.nn.ModuleDict({"m": layer}))[0]["kernel"] == "triton grouped GEMM (e4m3 x e4m3)"
    layer.plan = KernelPlan(moe_kernel="reference")
    assert layer.method.syncs_host(layer, cpu)
    static = build("tensor_static", 4, 64, 32)
    static.plan = KernelPlan(moe_kernel="triton")  # per-tensor activations: the reference only
    assert static.method._kernel(static, torch.empty(0)) == "reference" and static.method.syncs_host(static, cpu)


def test_block_path_refuses_mismatched_groups():
    from atom.model_ops.moe.experts_fp8_triton import fused_experts_fp8
    layer = build("block", 4, 256, 128, (128, 128))
    x, ids = torch.randn(3, 256), torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="act_group=0 is invalid with 128x128 weight blocks"):
        fused_experts_fp8(x, layer.w13_weight, layer.w13_block_scale, layer.w2_weight, layer.w2_block_scale,
                          torch.ones(3, 2), ids, layer.activation, 0, (128, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("kind,E,H,I,block,T", [("channel_token", 128, 2048, 768, None, 1),
                                                ("channel_token", 128, 2048, 768, None, 512),
                                                ("block", 64, 2048, 1408, (128, 128), 1),
                                                ("block", 64, 2048, 1408, (128, 128), 512)])
def test_triton_path_at_model_shapes_on_the_gpu(kind, E, H, I, block, T):
    """Qwen3-30B-A3B's experts (ptpc) and DeepSeek-V2-Lite's (128 x 128 blocks) on the GPU.
    fp32 activations: the kernel's e4m3 x e4m3 products are exact and it quantizes the same
    rows as the reference, so the two agree to the accumulation order. bf16 activations: the
    first product is stored in bf16 before the activation and the second product's fp8
    quantization, which moves some fp8 roundings; both paths on that bf16 input are held
    against the fp32 reference, the kernel to within the reference's own distance plus that
    fp8 noise (as the interpreter test above)."""
    layer = build(kind, E, H, I, block).cuda()
    layer.method.process_weights_after_loading(layer)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).cuda()
    logits = (torch.randn(T, E, generator=g) * 2).cuda()
    exact = layer(x, logits)
    ref16 = layer(x.bfloat16(), logits)
    layer.plan = KernelPlan(moe_kernel="triton")
    got32 = layer(x, logits)
    got16 = layer(x.bfloat16(), logits)

    def err(y):
        return float((y.float() - exact).norm() / exact.norm())
    assert err(got32) < 2e-3, err(got32)
    assert err(got16) < err(ref16) + 0.03 and err(got16) < 0.06, (err(got16), err(ref16))
    assert exact.abs().max() > 0.1


@pytest.mark.parametrize("weights,act,group,block", [("channel", "group", 32, None), ("block", "token", None, (32, 32)),
                                                     ("block", "group", 64, (32, 32)), ("block", "group", 16, (16, 16))])
def test_formats_the_kernel_does_not_compute_stay_on_the_reference(weights, act, group, block):
    """Per-row weights with group activations, block weights with per-token activations or
    groups of another width, blocks narrower than 32: the reference runs (and syncs the host)
    even where the plan asks for Triton, and the kernel refuses them if called."""
    from atom.model_ops.moe.experts_fp8_triton import fused_experts_fp8
    if weights == "channel":
        s = LayerQuantConfig(QuantType.per_Token, FP8, True, "compressed-tensors", act_scheme=act, act_group_size=group)
    else:
        s = LayerQuantConfig(QuantType.per_1x128, FP8, True, "fp8", block_size=block, act_scheme=act,
                             act_group_size=group)
    layer = FusedMoE(4, 64, 64, TopK(4, 2), quant_config=OneSpec(s), prefix="t.experts")
    layer.plan = KernelPlan(moe_kernel="triton")
    assert not layer.method.triton_fits and layer.method.syncs_host(layer, torch.device("cpu"))
    assert layer.method._kernel(layer, torch.empty(0)) == "reference"
    scale = torch.ones(4, 128, 1)
    with pytest.raises(ValueError, match="is invalid"):
        fused_experts_fp8(torch.randn(2, 64), layer.w13_weight, scale, layer.w2_weight, torch.ones(4, 64, 1),
                          torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int64), layer.activation,
                          group or 0, block)


@pytest.mark.parametrize("kind,E,H,I,block", [CASES[0], CASES[2]])
def test_a_fullgraph_compile_calls_the_fp8_op(kind, E, H, I, block):
    """Under torch.compile (fullgraph, as level 3 compiles) the layer goes through the opaque
    `atom::moe_experts_fp8` op and gives the eager Triton path's output."""
    layer = build(kind, E, H, I, block)
    layer.plan = KernelPlan(moe_kernel="triton")
    layer.plan_installed(layer.plan)
    g = torch.Generator().manual_seed(3)
    x, logits = torch.randn(7, H, generator=g), torch.randn(7, E, generator=g)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, logits), layer(x, logits), rtol=0, atol=0)
