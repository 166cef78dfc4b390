"""Routing: router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64).

`TopK` is the selection a `FusedMoE` layer is handed. It is a pure function of the logits
(no parameters: the router's projection, and DeepSeek's `e_score_correction_bias`, belong to
the model's gate and are passed in), so a family adds a rule by passing `select_fn` instead
of editing this file. The built-in rules:

- scoring "softmax": probabilities over all experts, the k largest; `renormalize` divides
  them by their sum (Qwen3-MoE's `norm_topk_prob`, always on in Mixtral). This is the order
  transformers uses (softmax in fp32, top-k, optional renormalisation).
- scoring "sigmoid": independent sigmoid scores (DeepSeek-V3); a correction bias, when given,
  is added for the choice only (the weights stay the unbiased scores).
- grouped choice (`num_expert_group`, `topk_group`): experts are split into groups, each
  group scored by the sum of its two best (biased) scores with a correction bias, else by
  its best score; only the `topk_group` best groups compete (DeepSeek-V2/V3).
- `routed_scaling_factor` multiplies the final weights.

Bad settings raise a ValueError naming the field at construction (the model's build, before
any weight loads).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

SCORINGS = ("softmax", "sigmoid")

SelectFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def check_routing(num_experts: int, top_k: int, scoring: str = "softmax", num_expert_group: int | None = None,
                  topk_group: int | None = None, field_prefix: str = "") -> None:
    """ValueError naming the field when the routing cannot be run."""
    f = field_prefix
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{f}num_experts={num_experts!r} is invalid: a MoE layer needs an integer >= 1 experts")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"{f}num_experts_per_tok={top_k!r} is invalid: each token picks an integer "
                         f"number of experts in [1, num_experts={num_experts}]")
    if scoring not in SCORINGS:
        raise ValueError(f"{f}scoring_func={scoring!r} is unknown: choose one of {', '.join(SCORINGS)}")
    if (num_expert_group is None) != (topk_group is None):
        raise ValueError(f"{f}n_group={num_expert_group!r}, topk_group={topk_group!r}: grouped routing needs "
                         "both (or neither)")
    if num_expert_group is not None:
        if num_expert_group < 1 or num_experts % num_expert_group:
            raise ValueError(f"{f}n_group={num_expert_group} is invalid: it must divide num_experts={num_experts}")
        if not 1 <= topk_group <= num_expert_group:
            raise ValueError(f"{f}topk_group={topk_group} is invalid: must be in [1, n_group={num_expert_group}]")
        if top_k > topk_group * (num_experts // num_expert_group):
            raise ValueError(f"{f}num_experts_per_tok={top_k} is more than the {topk_group} chosen groups of "
                             f"{num_experts // num_expert_group} experts hold")


def scores_of(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    return logits.float().softmax(-1) if scoring == "softmax" else logits.float().sigmoid()


def topk_select(logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False,
                correction_bias: torch.Tensor | None = None, num_expert_group: int | None = None,
                topk_group: int | None = None, routed_scaling_factor: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The built-in rules of the module docstring: (weights fp32 [T, k], ids int64 [T, k])."""
    scores = scores_of(logits, scoring)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group is not None:
        T, E = choice.shape
        grouped = choice.view(T, num_expert_group, E // num_expert_group)
        if correction_bias is not None:
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        else:
            group_score = grouped.amax(-1)
        keep = group_score.topk(topk_group, dim=-1).indices
        mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.unsqueeze(-1).expand_as(grouped).reshape(T, E), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids


class TopK(nn.Module):
    """Expert choice per token (see the module docstring); `select_fn(logits, top_k, **kw)`
    replaces the built-in rules with the same return convention."""

    def __init__(self, num_experts: int, top_k: int, scoring: str = "softmax", renormalize: bool = False,
                 num_expert_group: int | None = None, topk_group: int | None = None,
                 routed_scaling_factor: float = 1.0, select_fn: SelectFn | None = None):
        super().__init__()
        check_routing(num_experts, top_k, scoring, num_expert_group, topk_group)
        self.num_experts, self.top_k, self.scoring = num_experts, top_k, scoring
        self.renormalize = bool(renormalize)
        self.num_expert_group, self.topk_group = num_expert_group, topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.select_fn = select_fn

    def forward(self, router_logits: torch.Tensor, correction_bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if router_logits.dim() != 2 or router_logits.shape[1] != self.num_experts:
            raise ValueError(f"router_logits must be [tokens, {self.num_experts}], got {tuple(router_logits.shape)}")
        fn = self.select_fn or topk_select
        return fn(router_logits, self.top_k, scoring=self.scoring, renormalize=self.renormalize,
                  correction_bias=correction_bias, num_expert_group=self.num_expert_group,
                  topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor)

    def extra_repr(self) -> str:
        grouped = f", groups={self.topk_group}/{self.num_expert_group}" if self.num_expert_group else ""
        custom = f", select_fn={getattr(self.select_fn, '__name__', self.select_fn)}" if self.select_fn else ""
        return (f"experts={self.num_experts}, top_k={self.top_k}, scoring={self.scoring}, "
                f"renormalize={self.renormalize}{grouped}, scale={self.routed_scaling_factor}{custom}")
