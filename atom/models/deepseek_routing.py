"""DeepSeek's expert routing: which `top_k` experts each token goes to, and their weights.

    routing = DeepseekRouting.from_hf_config(hf_config)   # validated; ValueError names the field
    weights, ids = routing(router_logits)                  # [T, top_k] fp32, [T, top_k] int64

The ways DeepSeek-V2 and V3 choose (as their HF configs name them, `topk_method`):

- `"greedy"` (V2, V2-Lite): softmax over all experts, the top_k largest.
- `"group_limited_greedy"` (V2): softmax; experts form `n_group` groups, a group scores its
  best expert, only the `topk_group` best groups are eligible; the top_k among them.
- `"noaux_tc"` (V3, the only one transformers' V3 runs): sigmoid scores; the choice is made on
  scores + `e_score_correction_bias` (the bias balances load and never enters the weights); a
  group scores the sum of its two best biased scores; weights are the unbiased scores.

Then `norm_topk_prob` renormalises the chosen weights to sum to 1, and `routed_scaling_factor`
multiplies them. V3 scales after normalising. V2 as DeepSeek wrote it scales only when it does
not normalise (transformers 5.24's V2 never normalises; the published V2 configs set
`norm_topk_prob=false`, where both agree).

A pure function of the logits. `to_topk()` expresses it as the fused MoE layer's `TopK`
(every rule above has a TopK equivalent: V2's groups score by their best softmax score, V3's
by the sum of their two best biased scores; the "normalise or scale" rule becomes
renormalise with scale 1, or scale without renormalising), which `DeepseekMoE` runs;
`deepseek_topk` stays the written-out reference the tests hold the TopK to, and notebooks
use it directly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING = ("softmax", "sigmoid")


@dataclass(frozen=True)
class DeepseekRouting:
    num_experts: int
    top_k: int
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    scale_after_norm: bool = True  # V3; False: DeepSeek-V2's "normalise or scale"

    def __post_init__(self):
        def bad(field, value, allowed):
            raise ValueError(f"{field}={value!r} is invalid: {allowed}")
        if self.topk_method not in TOPK_METHODS:
            bad("topk_method", self.topk_method, f"choose one of {', '.join(TOPK_METHODS)}")
        if self.scoring_func not in SCORING:
            bad("scoring_func", self.scoring_func, f"choose one of {', '.join(SCORING)}")
        if not 1 <= self.top_k <= self.num_experts:
            bad("num_experts_per_tok", self.top_k, f"must be in [1, n_routed_experts={self.num_experts}]")
        if self.n_group < 1 or self.num_experts % self.n_group:
            bad("n_group", self.n_group, f"must divide n_routed_experts={self.num_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            bad("topk_group", self.topk_group, f"must be in [1, n_group={self.n_group}]")
        per_group = self.num_experts // self.n_group
        if self.topk_method != "greedy" and self.top_k > self.topk_group * per_group:
            bad("num_experts_per_tok", self.top_k,
                f"must be at most topk_group * experts per group = {self.topk_group * per_group}")
        if self.topk_method == "noaux_tc" and per_group < 2:
            bad("n_group", self.n_group, "noaux_tc scores a group by its two best experts: needs >= 2 per group")

    @classmethod
    def from_hf_config(cls, cfg) -> "DeepseekRouting":
        """V3 configs (model_type deepseek_v3) route by noaux_tc with sigmoid scores; V2 by its
        `topk_method` with softmax."""
        v3 = getattr(cfg, "model_type", "") == "deepseek_v3"
        method = getattr(cfg, "topk_method", None) or ("noaux_tc" if v3 else "greedy")
        scoring = getattr(cfg, "scoring_func", None) or ("sigmoid" if method == "noaux_tc" else "softmax")
        return cls(num_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, topk_method=method,
                   scoring_func=scoring, n_group=getattr(cfg, "n_group", None) or 1,
                   topk_group=getattr(cfg, "topk_group", None) or 1,
                   norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", False)),
                   routed_scaling_factor=float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0),
                   scale_after_norm=v3)

    @property
    def uses_correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"

    def to_topk(self):
        """The `atom.model_ops.moe.TopK` that chooses as `deepseek_topk` does."""
        from atom.model_ops.moe import TopK
        grouped = self.topk_method != "greedy" and self.n_group > 1
        normalise = self.norm_topk_prob and (self.top_k > 1 or self.scale_after_norm)
        scale = self.routed_scaling_factor if (self.scale_after_norm or not normalise) else 1.0
        return TopK(self.num_experts, self.top_k, scoring=self.scoring_func, renormalize=normalise,
                    num_expert_group=self.n_group if grouped else None, topk_group=self.topk_group if grouped else None,
                    routed_scaling_factor=scale)

    def __call__(self, router_logits: torch.Tensor, correction_bias: torch.Tensor | None = None):
        return deepseek_topk(router_logits, self, correction_bias)

    def load_frame(self, ids: torch.Tensor):
        """A DataFrame of how many tokens each expert (and its group) got from `ids` [T, top_k]:
        for a notebook, e.g. `routing.load_frame(routing(logits)[1]).plot.bar(x="expert", y="tokens")`."""
        import pandas as pd
        counts = torch.bincount(ids.flatten().cpu(), minlength=self.num_experts).tolist()
        per_group = self.num_experts // self.n_group
        return pd.DataFrame({"expert": range(self.num_experts), "group": [e // per_group for e in range(self.num_experts)],
                             "tokens": counts})


def _group_mask(choice: torch.Tensor, r: DeepseekRouting) -> torch.Tensor:
    """[T, E] bool: experts in the `topk_group` best groups of each token."""
    T = choice.shape[0]
    grouped = choice.view(T, r.n_group, -1)
    if r.topk_method == "noaux_tc":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    best = group_scores.topk(r.topk_group, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return mask[:, :, None].expand_as(grouped).reshape(T, -1)


def deepseek_topk(router_logits: torch.Tensor, r: DeepseekRouting,
                  correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, top_k] fp32, expert ids [T, top_k] int64)."""
    if router_logits.dim() != 2 or router_logits.shape[1] != r.num_experts:
        raise ValueError(f"router_logits must be [tokens, {r.num_experts}], got {tuple(router_logits.shape)}")
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if r.scoring_func == "softmax" else logits.sigmoid()
    if r.uses_correction_bias:
        if correction_bias is None:
            raise ValueError("noaux_tc routing needs e_score_correction_bias")
        choice = scores + correction_bias.float()
        if r.n_group > 1:
            choice = choice.masked_fill(~_group_mask(choice, r), float("-inf"))
        ids = choice.topk(r.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    else:
        if r.topk_method == "group_limited_greedy" and r.n_group > 1:
            scores = scores.masked_fill(~_group_mask(scores, r), 0.0)
        weights, ids = scores.topk(r.top_k, dim=-1)
    # V3 (transformers) normalises even one weight; DeepSeek-V2 only from two
    normalise = r.norm_topk_prob and (r.top_k > 1 or r.scale_after_norm)
    if normalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if r.scale_after_norm or not normalise:
        weights = weights * r.routed_scaling_factor
    return weights, ids
