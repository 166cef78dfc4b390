"""The routing rule in one Triton kernel (`moe.route_triton.fused_topk`) against the torch rule
(`router.topk_select`) under TRITON_INTERPRET=1 on the CPU, and on a GPU at model shapes
(`-m gpu`); which rules it takes, ties, and the layer's choice between the two (`FusedMoE.route`)."""
from __future__ import annotations

import pytest
import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON
from atom.model_ops.moe import FusedMoE, TopK
from atom.model_ops.moe.route_triton import fused_topk, fused_topk_fits
from atom.model_ops.moe.router import topk_select
from atom.tuning.plan import KernelPlan

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (interpreter on CPU)")

RULES = [  # (experts, k, scoring, renormalize, bias, scale): Qwen3-MoE, Mixtral, DeepSeek-V2-Lite, V3-like, GPT-like
    (128, 8, "softmax", True, False, 1.0), (8, 2, "softmax", True, False, 1.0), (64, 6, "softmax", False, False, 1.0),
    (160, 6, "sigmoid", True, True, 2.5), (32, 4, "softmax", False, False, 1.0), (60, 1, "sigmoid", False, False, 1.0),
]


def _check(logits, topk, bias=None, rtol=2e-6):
    """The same choice as the torch rule: equal ids in every row whose k + 1 best (biased)
    scores are distinct; elsewhere (equal bf16 logits: which of the tied experts is taken is
    arbitrary, torch.topk's pick is not the lowest id on a GPU) the same chosen scores; and
    the weights of the ids taken."""
    w, ids = fused_topk(logits, topk, bias)
    rw, rids = topk_select(logits, topk.top_k, scoring=topk.scoring, renormalize=topk.renormalize,
                           correction_bias=bias, routed_scaling_factor=topk.routed_scaling_factor)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == rids.shape
    scores = logits.float().softmax(-1) if topk.scoring == "softmax" else logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    best = choice.topk(min(topk.top_k + 1, topk.num_experts), dim=-1).values
    distinct = (best[:, 1:] != best[:, :-1]).all(1)
    assert torch.equal(ids[distinct], rids[distinct]) and distinct.float().mean() >= 0.5  # (not vacuous)
    torch.testing.assert_close(choice.gather(1, ids), choice.gather(1, rids), rtol=rtol, atol=0)
    want = scores.gather(1, ids)
    want = want / want.sum(-1, keepdim=True) if topk.renormalize else want
    torch.testing.assert_close(w, want * topk.routed_scaling_factor, rtol=rtol, atol=1e-7)
    torch.testing.assert_close(w[distinct], rw[distinct], rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("E,k,scoring,renorm,has_bias,scale", RULES)
@pytest.mark.parametrize("T,dtype", [(1, torch.float32), (5, torch.bfloat16), (33, torch.float32)])
def test_fused_topk_is_the_torch_rule(E, k, scoring, renorm, has_bias, scale, T, dtype):
    g = torch.Generator().manual_seed(E * 100 + T)
    logits = (torch.randn(T, E, generator=g) * 2).to(dtype)
    bias = torch.randn(E, generator=g) * 0.1 if has_bias else None
    _check(logits, TopK(E, k, scoring=scoring, renormalize=renorm, routed_scaling_factor=scale), bias)


@pytest.mark.parametrize("fixed", [1, 2, 3])
def test_fixed_experts_follow_the_chosen_ones(fixed):
    """`fixed` always-on experts (shared experts stacked after the routed ones): ids E, E + 1,
    ... with weight 1 after the k chosen, which are those of the plain call."""
    topk = TopK(64, 6, routed_scaling_factor=1.5)
    logits = torch.randn(7, 64, generator=torch.Generator().manual_seed(fixed))
    w0, ids0 = fused_topk(logits, topk)
    w, ids = fused_topk(logits, topk, fixed=fixed)
    assert ids.shape == (7, 6 + fixed) and w.shape == (7, 6 + fixed)
    assert torch.equal(ids[:, :6], ids0) and torch.equal(w[:, :6], w0)
    assert torch.equal(ids[:, 6:], torch.arange(64, 64 + fixed).expand(7, fixed))
    assert torch.equal(w[:, 6:], torch.ones(7, fixed))
    with pytest.raises(ValueError, match="fixed=-1"):
        fused_topk(logits, topk, fixed=-1)


def test_ties_go_to_the_lower_expert_and_rows_are_independent():
    topk = TopK(16, 3, renormalize=True)
    logits = torch.zeros(4, 16)
    logits[1, 9] = logits[1, 4] = 5.0  # two best tied: 4 first, then 9, then the lowest of the rest
    logits[2] = torch.arange(16.0)
    w, ids = fused_topk(logits, topk)
    assert ids.tolist() == [[0, 1, 2], [4, 9, 0], [15, 14, 13], [0, 1, 2]]
    torch.testing.assert_close(w.sum(1), torch.ones(4))
    assert fused_topk(torch.zeros(0, 16), topk)[1].shape == (0, 3)


def test_rows_of_nan_or_inf_keep_ids_in_range_and_a_bad_bias_is_refused():
    """A row whose scores are NaN (a +inf or NaN logit: softmax makes the whole row NaN) still
    yields k distinct experts in [0, E) (the MoE kernels index buffers with them), a NaN score
    ranked first as torch.topk ranks it;
    the other rows are unaffected. A bias of the wrong size is refused, a strided one read
    as its values."""
    topk = TopK(8, 2, renormalize=True)
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    logits[0, 5] = float("nan")
    logits[1, 2] = float("inf")
    logits[2] = float("-inf")
    w, ids = fused_topk(logits, topk)
    assert ((ids >= 0) & (ids < 8)).all() and all(len(set(r)) == 2 for r in ids.tolist())
    assert torch.equal(ids[3], topk_select(logits[3:], 2, renormalize=True)[1][0])
    _, sig = fused_topk(logits, TopK(8, 2, scoring="sigmoid"))  # sigmoid: NaN in one lane only
    assert sig[0, 0] == 5 and sig[1, 0] == 2 and ((sig >= 0) & (sig < 8)).all()
    with pytest.raises(ValueError, match="correction_bias has 4 values"):
        fused_topk(logits, TopK(8, 2, scoring="sigmoid"), torch.zeros(4))
    big = torch.randn(16, generator=torch.Generator().manual_seed(4))
    _check(torch.randn(6, 8, generator=torch.Generator().manual_seed(5)), TopK(8, 2, scoring="sigmoid"), big[::2])


def test_rules_it_does_not_compute_are_left_to_torch():
    grouped = TopK(16, 2, num_expert_group=4, topk_group=2)
    custom = TopK(16, 2, select_fn=topk_select)
    assert fused_topk_fits(TopK(16, 2)) and not fused_topk_fits(grouped) and not fused_topk_fits(custom)
    assert not fused_topk_fits(TopK(2048, 2))
    with pytest.raises(ValueError, match="without expert groups"):
        fused_topk(torch.randn(3, 16), grouped)
    with pytest.raises(ValueError, match=r"not \[tokens, 16\]"):
        fused_topk(torch.randn(3, 8), TopK(16, 2))


def test_layer_routes_through_the_kernel_where_the_plan_runs_kernels(monkeypatch):
    import atom.model_ops.moe.layer as layer_mod
    calls = []

    def counting(*a, **kw):
        calls.append(1)
        return fused_topk(*a, **kw)

    monkeypatch.setattr(layer_mod, "fused_topk", counting)
    layer = FusedMoE(8, 32, 16, TopK(8, 2, renormalize=True), prefix="t.experts")
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    want = layer.topk(logits)
    layer.plan = KernelPlan()  # the torch backend: the torch rule
    assert all(torch.equal(a, b) for a, b in zip(layer.route(logits), want)) and not calls
    assert layer.route_kernel() == "torch (router.topk_select)"
    layer.plan = KernelPlan(backend="triton", force_kernels=True)
    assert layer.route_kernel() == "triton (route_triton.fused_topk)"
    got = layer.route(logits)
    assert calls and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=1e-7)
    layer.topk = TopK(8, 2, num_expert_group=2, topk_group=1)  # grouped: the torch rule again
    calls.clear()
    layer.route(logits)
    assert not calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("E,k,scoring,renorm,has_bias,scale", RULES)
def test_fused_topk_on_gpu(E, k, scoring, renorm, has_bias, scale):
    for T in (1, 130, 4096):
        g = torch.Generator().manual_seed(T)
        logits = (torch.randn(T, E, generator=g) * 2).to(torch.bfloat16).cuda()
        bias = (torch.randn(E, generator=g) * 0.1).cuda() if has_bias else None
        # (the GPU's exp is ex2.approx: a few ulps from torch's expf)
        _check(logits, TopK(E, k, scoring=scoring, renormalize=renorm, routed_scaling_factor=scale), bias, rtol=1e-5)


@pytest.mark.parametrize("rows,warps", [(1, 1), (4, 1), (16, 2)])
def test_fused_topk_rows_per_program(rows, warps):
    """Every rows-a-program / warps choice (a sweep's overrides) gives the rule's result, with
    a last program that holds fewer rows than the others."""
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(37, 64, generator=g) * 2
    w, ids = fused_topk(logits, TopK(64, 6), config=dict(ROWS=rows, num_warps=warps))
    rw, rids = topk_select(logits, 6)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=2e-6, atol=1e-7)


def test_route_config_spreads_decode_batches():
    """A decode batch gets one row a program (a program per token), a prefill a few rows; wide
    expert counts keep a [ROWS, E] tile of at most 2048 scores."""
    from atom.model_ops.moe.route_triton import route_config
    assert route_config(130, 64)["ROWS"] == 1 and route_config(16384, 64)["ROWS"] > 1
    assert route_config(16384, 1024)["ROWS"] * 1024 <= 2048 and route_config(16384, 1024)["num_warps"] == 4
