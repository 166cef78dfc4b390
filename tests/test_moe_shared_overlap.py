"""The "shared_overlap" fusion: DeepSeek's shared experts on the plan's second CUDA stream
while the routed experts run. The same kernels on the same inputs: the output equals the
one-stream layer's bit for bit, eagerly and replayed from a CUDA graph. Off a GPU, and past
`SHARED_OVERLAP_MAX_TOKENS` tokens, the layer keeps one stream."""
from __future__ import annotations

import pytest
import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON
from atom.model_ops.moe import describe_moe_layers
from atom.tuning.fusions import default_fusions
from atom.tuning.plan import SHARED_OVERLAP_MAX_TOKENS, KernelPlan
from test_moe_shared_stack import Block

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (interpreter on CPU)")


def _plan(overlap: bool, device: str) -> KernelPlan:
    return KernelPlan(backend="triton", force_kernels=device == "cpu", fusions=("shared_overlap",) if overlap else ())


def test_on_by_default_and_never_off_a_gpu():
    assert "shared_overlap" in default_fusions("triton") and "shared_overlap" not in default_fusions("torch")
    b = Block(4, 16, 8, 2, 2)
    b.experts.plan = _plan(True, "cpu")
    x, logits = torch.randn(3, 16), torch.randn(3, 4)
    assert not b.experts.overlaps_shared(x)  # CPU tensors: one stream
    want = b.experts(x, logits)
    b.experts.plan = _plan(False, "cpu")
    assert torch.equal(b.experts(x, logits), want)
    b.experts.plan = _plan(True, "cpu")
    assert describe_moe_layers(b)[0]["shared_stream"] == "second"
    b.experts.plan = _plan(False, "cpu")
    assert describe_moe_layers(b)[0]["shared_stream"] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("T", [1, 200, 512])
def test_second_stream_gives_the_same_bits_eager_and_in_a_graph(T):
    E, H, I, S, k = 64, 2048, 1408, 2, 6
    b = Block(E, H, I, S, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, H, device="cuda").bfloat16()
    logits = torch.randn(T, E, device="cuda")
    b.experts.plan = _plan(False, "cuda")
    want = b.experts(x, logits)
    plan = _plan(True, "cuda")
    b.experts.plan = plan
    assert b.experts.overlaps_shared(x)
    assert not b.experts.overlaps_shared(torch.empty(SHARED_OVERLAP_MAX_TOKENS + 1, H, device="cuda"))  # prefill
    calls = []
    fwd = b.shared.forward
    b.experts.shared_experts = lambda h: calls.append(torch.cuda.current_stream()) or fwd(h)
    got = b.experts(x, logits)
    assert calls == [plan.side_stream(x.device)] and calls[0] != torch.cuda.current_stream()
    assert torch.equal(got, want)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        b.experts(x, logits)  # warm-up off the default stream, as graph capture wants
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = b.experts(x, logits)
    x.copy_(torch.randn(T, H, device="cuda").bfloat16())
    g.replay()
    b.experts.plan = _plan(False, "cuda")
    torch.testing.assert_close(out, b.experts(x, logits), atol=0, rtol=0)
