"""MoE routing (`TopK`) against transformers' routers, and routing configs refused clearly."""
import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from atom.model_ops.moe import TopK


def _sorted(weights, ids):
    """(weights, ids) with each row's experts in ascending id order (HF may not sort)."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def _hidden(E, H=16, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g), torch.randn(E, H, generator=g)


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_topk_matches_qwen3_moe_router(norm):
    cfg = transformers.Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
    hf = Qwen3MoeTopKRouter(cfg)
    x, w = _hidden(8)
    hf.weight.data.copy_(w)
    _, ref_w, ref_ids = hf(x)
    got_w, got_ids = TopK(8, 3, renormalize=norm)(x @ w.T)
    torch.testing.assert_close(_sorted(got_w, got_ids), _sorted(ref_w, ref_ids))
    assert torch.allclose(got_w.sum(-1), torch.ones(24)) == norm


def test_softmax_topk_matches_mixtral_router():
    cfg = transformers.MixtralConfig(hidden_size=16, num_local_experts=4, num_experts_per_tok=2)
    hf = MixtralTopKRouter(cfg)
    x, w = _hidden(4)
    hf.weight.data.copy_(w)
    _, ref_w, ref_ids = hf(x)
    got = TopK(4, 2, renormalize=True)(x @ w.T)
    torch.testing.assert_close(_sorted(*got), _sorted(ref_w, ref_ids))


def test_grouped_sigmoid_matches_deepseek_v3_router():
    cfg = transformers.DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    hf = DeepseekV3TopkRouter(cfg)
    x, w = _hidden(16, T=40)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(3)) * 0.3
    hf.weight.data.copy_(w)
    hf.e_score_correction_bias.copy_(bias)
    _, ref_w, ref_ids = hf(x)
    topk = TopK(16, 4, scoring="sigmoid", renormalize=True, num_expert_group=4, topk_group=2,
                routed_scaling_factor=2.5)
    got_w, got_ids = topk(x @ w.T, correction_bias=bias)
    gw, gi = _sorted(got_w, got_ids)
    rw, ri = _sorted(ref_w, ref_ids)
    assert torch.equal(gi, ri)
    torch.testing.assert_close(gw, rw)
    # the bias changes the choice, not the weights: without it some tokens pick other experts
    assert not torch.equal(_sorted(*topk(x @ w.T))[1], gi)


def test_custom_select_fn_is_used():
    def first_k(logits, top_k, **kw):
        ids = torch.arange(top_k).expand(logits.shape[0], top_k)
        return torch.full(ids.shape, 1.0 / top_k), ids
    w, ids = TopK(4, 2, select_fn=first_k)(torch.randn(3, 4))
    assert ids.tolist() == [[0, 1]] * 3 and "first_k" in repr(TopK(4, 2, select_fn=first_k))


@pytest.mark.parametrize("kw, field", [
    (dict(num_experts=4, top_k=5), "num_experts_per_tok=5"),
    (dict(num_experts=4, top_k=0), "num_experts_per_tok=0"),
    (dict(num_experts=0, top_k=1), "num_experts=0"),
    (dict(num_experts=4, top_k=2, scoring="tanh"), "scoring_func='tanh'"),
    (dict(num_experts=6, top_k=2, num_expert_group=4, topk_group=2), "n_group=4"),
    (dict(num_experts=8, top_k=2, num_expert_group=4, topk_group=5), "topk_group=5"),
    (dict(num_experts=8, top_k=2, num_expert_group=4), "needs both"),
    (dict(num_experts=8, top_k=5, num_expert_group=4, topk_group=2), "num_experts_per_tok=5"),
])
def test_bad_routing_is_refused_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        TopK(**kw)


def test_logits_of_the_wrong_width_are_refused():
    with pytest.raises(ValueError, match=r"router_logits must be \[tokens, 4\]"):
        TopK(4, 2)(torch.randn(3, 5))
