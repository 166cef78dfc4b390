"""The "moe+shared" fusion (`moe.shared_stack`): DeepSeek's shared experts (a SiLU-gated MLP of
S x I units) stacked after the routed experts and run in the grouped GEMM, against the layer
without the fusion (routed kernel + the MLP added); the layer's parameters become views of
the stack; routing statistics see only the routed choice; where it does not apply it says why.
Triton's interpreter on CPU, the V2-Lite shape on a GPU (`-m gpu`)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from atom.model_ops.kernels.triton_import import HAS_TRITON
from atom.model_ops.moe import FusedMoE, TopK
from atom.model_ops.moe.shared_stack import stack_shared_experts, why_not_stacked
from atom.models.deepseek_v2 import DeepseekMLP
from atom.tuning import fusions
from atom.tuning.plan import KernelPlan

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (interpreter on CPU)")


class Block(nn.Module):
    """DeepSeek's MoE block in miniature: shared MLP kept under its own name, handed as a forward."""

    def __init__(self, E, H, I, S, k, device="cpu", dtype=torch.float32, **kw):
        super().__init__()
        with torch.device(device):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                self.shared = DeepseekMLP(H, I * S)
                self.experts = FusedMoE(E, H, I, TopK(E, k, routed_scaling_factor=1.5),
                                        shared_experts=self.shared.forward, prefix="mlp.experts", **kw)
            finally:
                torch.set_default_dtype(prev)
        g = torch.Generator(device=device).manual_seed(0)
        for p in self.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g, device=device) * p.shape[-1] ** -0.5)


def _plan(fused: bool, device="cpu") -> KernelPlan:
    return KernelPlan(backend="triton", force_kernels=device == "cpu", fusions=("moe+shared",) if fused else ())


def _run(block, plan, x, logits):
    block.experts.plan = plan
    return block.experts(x, logits)


@pytest.mark.parametrize("S,T", [(1, 3), (2, 5), (2, 1)])
def test_stacked_shared_experts_equal_the_mlp_added(S, T):
    E, H, I, k = 4, 16, 8, 2
    b = Block(E, H, I, S, k)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(2))
    want = _run(b, _plan(False), x, logits)
    ref = _run(b, KernelPlan(), x, logits)  # the torch reference, unfused
    torch.testing.assert_close(want, ref, atol=1e-5, rtol=1e-5)
    w13_before = b.experts.w13_weight.detach().clone()
    plan = _plan(True)
    fusions.install(b, plan)
    assert b.experts.shared_stack is not None and b.experts.shared_stack[2] == S
    w13_all, w2_all, _ = b.experts.shared_stack
    assert w13_all.shape == (E + S, 2 * I, H) and w2_all.shape == (E + S, H, I)
    assert b.experts.w13_weight.data_ptr() == w13_all.data_ptr()  # a view, not a copy
    assert torch.equal(b.experts.w13_weight, w13_before) and b.experts.w13_weight.shape[0] == E
    assert torch.equal(w13_all[E, :I], b.shared.gate_up_proj.weight[:I])          # block 0's gate rows
    assert torch.equal(w13_all[E + S - 1, I:], b.shared.gate_up_proj.weight[-I:])  # last block's up rows
    assert f"shared stacked as {S} experts" in repr(b.experts)
    from atom.model_ops.moe import describe_moe_layers
    assert describe_moe_layers(b)[0]["shared_stacked"] == S
    b.experts.plan = plan
    assert b.experts.runs_stacked(x, logits)
    calls = []
    b.shared.forward = lambda h: calls.append(h) or torch.zeros_like(h)  # the MLP must not run
    got = _run(b, plan, x, logits)
    assert calls == []
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert stack_shared_experts(b.experts) == S  # idempotent: the same stack
    assert b.experts.shared_stack[0] is w13_all


def test_routing_statistics_count_only_the_routed_choice():
    b = Block(4, 16, 8, 2, 2)
    fusions.install(b, _plan(True))
    seen = []

    class Rec:
        def record(self, layer, ids):
            seen.append(ids.clone())
    b.experts.recorder = Rec()
    _run(b, _plan(True), torch.randn(3, 16), torch.randn(3, 4))
    assert len(seen) == 1 and seen[0].shape == (3, 2) and int(seen[0].max()) < 4


def test_where_it_does_not_apply_it_says_why():
    assert why_not_stacked(Block(4, 16, 8, 2, 2, bias=True).experts).startswith("experts method unquantized")
    odd = Block(4, 16, 8, 1, 2)
    odd.experts.intermediate_size = 6  # the shared width 8 is no multiple of it
    assert "not a multiple" in why_not_stacked(odd.experts)
    plain = FusedMoE(4, 16, 8, TopK(4, 2))
    assert why_not_stacked(plain) == "no shared experts" and stack_shared_experts(plain) == 0
    linear_shared = FusedMoE(4, 16, 8, TopK(4, 2), shared_experts=nn.Linear(16, 16, bias=False))
    assert "SiLU-gated MLP" in why_not_stacked(linear_shared)
    b = Block(4, 16, 8, 2, 2)
    fusions.install(b, _plan(False))  # a plan without the fusion stacks nothing
    assert b.experts.shared_stack is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("T", [1, 16, 200, 2048])
def test_stacked_shared_experts_at_v2_lite_shape_on_gpu(T):
    E, H, I, S, k = 64, 2048, 1408, 2, 6
    b = Block(E, H, I, S, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, H, device="cuda").bfloat16()
    logits = torch.randn(T, E, device="cuda")
    want = _run(b, _plan(False, "cuda"), x, logits).float()
    fusions.install(b, _plan(True, "cuda"))
    got = _run(b, _plan(True, "cuda"), x, logits).float()
    # bf16: the unfused path rounds the routed sum and the MLP's output apart, then their sum
    torch.testing.assert_close(got, want, atol=3e-2 * want.abs().max().item(), rtol=2e-2)
    assert (got - want).abs().mean() < 5e-3 * want.abs().mean() + 1e-3
