"""DeepSeek routing against transformers' own routers (same gate weights) and against a plain
per-token reimplementation; bad routing configs fail with the field named."""
import pytest
import torch
import transformers

from atom.models.deepseek_routing import DeepseekRouting, deepseek_topk


def _as_dict(weights, ids):
    """{expert: weight} per token: the order of the chosen experts does not matter."""
    return [dict(zip(i.tolist(), w.tolist())) for w, i in zip(weights, ids)]


def _assert_same_routing(a, b, tol=1e-6):
    for da, db in zip(_as_dict(*a), _as_dict(*b)):
        assert set(da) == set(db)
        for e in da:
            assert abs(da[e] - db[e]) <= tol * max(1.0, abs(db[e]))


def _plain(logits, r: DeepseekRouting, bias=None):
    """One token at a time, the way the DeepSeek papers describe it."""
    weights, ids = [], []
    per_group = r.num_experts // r.n_group
    for row in logits.float():
        s = row.softmax(-1) if r.scoring_func == "softmax" else row.sigmoid()
        choice = s + bias if r.topk_method == "noaux_tc" else s.clone()
        if r.topk_method != "greedy" and r.n_group > 1:
            groups = []
            for g in range(r.n_group):
                vals = sorted(choice[g * per_group:(g + 1) * per_group].tolist(), reverse=True)
                groups.append(sum(vals[:2]) if r.topk_method == "noaux_tc" else vals[0])
            keep = sorted(range(r.n_group), key=lambda g: -groups[g])[:r.topk_group]
            allowed = [e for e in range(r.num_experts) if e // per_group in keep]
        else:
            allowed = list(range(r.num_experts))
        chosen = sorted(allowed, key=lambda e: -float(choice[e]))[:r.top_k]
        w = torch.stack([s[e] for e in chosen])
        norm = r.norm_topk_prob and (r.top_k > 1 or r.scale_after_norm)
        if norm:
            w = w / (w.sum() + 1e-20)
        if r.scale_after_norm or not norm:
            w = w * r.routed_scaling_factor
        weights.append(w)
        ids.append(torch.tensor(chosen))
    return torch.stack(weights), torch.stack(ids)


CASES = {
    "v2_greedy": dict(topk_method="greedy", scoring_func="softmax", routed_scaling_factor=1.0),
    "v2_grouped_scaled": dict(topk_method="group_limited_greedy", scoring_func="softmax", n_group=4, topk_group=2,
                              routed_scaling_factor=16.0),
    "v3_sigmoid_bias": dict(topk_method="noaux_tc", scoring_func="sigmoid", n_group=4, topk_group=2,
                            norm_topk_prob=True, routed_scaling_factor=2.5, scale_after_norm=True),
    "v3_ungrouped_unnormalised": dict(topk_method="noaux_tc", scoring_func="sigmoid", n_group=1, topk_group=1,
                                      routed_scaling_factor=1.5, scale_after_norm=True),
    "v2_norm_no_scale": dict(topk_method="greedy", scoring_func="softmax", norm_topk_prob=True,
                             routed_scaling_factor=3.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_routing_matches_plain_reimplementation(case):
    r = DeepseekRouting(num_experts=16, top_k=4, **CASES[case])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 16, generator=g) * 2
    bias = torch.randn(16, generator=g) * 0.3
    got = r(logits, bias)
    assert got[0].dtype == torch.float32 and got[1].shape == (40, 4)
    _assert_same_routing(got, _plain(logits, r, bias))


def _hf_router(version, **kw):
    base = dict(hidden_size=32, num_experts_per_tok=3, n_routed_experts=12)
    if version == "v2":
        cfg = transformers.DeepseekV2Config(**base, **kw)
        router = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter(cfg)
    else:
        cfg = transformers.DeepseekV3Config(**base, **kw)
        router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if version == "v3":
            router.e_score_correction_bias.copy_(torch.randn(12, generator=g) * 0.5)
    return cfg, router


@pytest.mark.parametrize("version,kw", [
    ("v2", dict(topk_method="greedy", routed_scaling_factor=1.0)),
    ("v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=16.0)),
    ("v3", dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
    ("v3", dict(n_group=3, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)),
])
def test_routing_matches_transformers(version, kw):
    cfg, router = _hf_router(version, **kw)
    r = DeepseekRouting.from_hf_config(cfg)
    x = torch.randn(50, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, w_hf, ids_hf = router(x)
    bias = getattr(router, "e_score_correction_bias", None)
    _assert_same_routing(deepseek_topk(logits, r, bias), (w_hf, ids_hf))
    assert r.uses_correction_bias == (version == "v3")


def test_grouping_changes_the_choice():
    """The group limit is not a no-op on these logits (the tests above would pass vacuously otherwise)."""
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(3)) * 2
    grouped = DeepseekRouting(16, 4, "group_limited_greedy", n_group=4, topk_group=1)(logits)[1]
    greedy = DeepseekRouting(16, 4, "greedy")(logits)[1]
    assert any(set(a.tolist()) != set(b.tolist()) for a, b in zip(grouped, greedy))
    assert all(len({e // 4 for e in row.tolist()}) == 1 for row in grouped)  # one group each


@pytest.mark.parametrize("kw,field", [
    (dict(topk_method="bogus"), "topk_method"),
    (dict(scoring_func="tanh"), "scoring_func"),
    (dict(n_group=3), "n_group"),
    (dict(n_group=4, topk_group=5, topk_method="group_limited_greedy"), "topk_group"),
    (dict(n_group=8, topk_group=1, topk_method="group_limited_greedy"), "num_experts_per_tok"),
    (dict(n_group=16, topk_group=4, topk_method="noaux_tc"), "n_group"),
])
def test_bad_routing_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        DeepseekRouting(num_experts=16, top_k=4, **kw)


def test_noaux_tc_needs_the_bias():
    r = DeepseekRouting(16, 2, "noaux_tc", "sigmoid")
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        r(torch.randn(3, 16))


def test_load_frame_counts_tokens_per_expert():
    r = DeepseekRouting(8, 2, "group_limited_greedy", n_group=4, topk_group=1)
    ids = r(torch.randn(30, 8, generator=torch.Generator().manual_seed(5)))[1]
    df = r.load_frame(ids)
    assert list(df.columns) == ["expert", "group", "tokens"] and df["tokens"].sum() == 60
    assert df["tokens"].tolist() == [int((ids == e).sum()) for e in range(8)]
    assert df.groupby("group")["tokens"].sum().sum() == 60


@pytest.mark.parametrize("top_k", [1, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_layer_topk_chooses_as_deepseek_topk(case, top_k):
    """`to_topk()` (what DeepseekMoE's FusedMoE runs) gives deepseek_topk's experts and
    weights, V2's normalise-or-scale rule included (top_k 1 scales, top_k 4 normalises)."""
    kw = dict(CASES[case])
    if case == "v2_norm_no_scale":
        kw["scale_after_norm"] = False
    r = DeepseekRouting(num_experts=16, top_k=top_k, **kw)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 16, generator=g) * 2
    bias = torch.randn(16, generator=g) * 0.3 if r.uses_correction_bias else None
    topk = r.to_topk()
    got = topk(logits, bias)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.int64
    _assert_same_routing(got, r(logits, bias))
