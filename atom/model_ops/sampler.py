"""Sampling for the whole batch on the model's device; only the chosen ids come back.

Rows with temperature 0 take the argmax. Other rows divide by their temperature, keep
their top-k and top-p (nucleus) set, and sample by the exponential race
(argmax of p / E with E ~ Exp(1), which draws from p). A request with a seed draws its
noise from its own generator, so its tokens do not depend on its batch neighbours.
On a GPU, a batch without top-k, top-p or seeds is sampled by two Triton kernels that
read the logits once and then one 2048-column block a row (`kernels.sampling`: a block by
its mass, then a token in it, Gumbel-max at both levels: the same distribution); an
all-greedy batch takes the same kernels without the noise.
"""
from __future__ import annotations

import torch
from torch import nn

from atom.model_ops import kernel_backend


class SamplingTensors:
    """Per-row sampling parameters of one step, as device tensors."""

    def __init__(self, temperatures, top_ks=None, top_ps=None, generators=None):
        self.temperatures = temperatures          # float32 [S]; None when all rows are greedy
        self.top_ks = top_ks                      # int64 [S] (0 = off) or None
        self.top_ps = top_ps                      # float32 [S] (1.0 = off) or None
        self.generators = generators or {}        # row -> torch.Generator
        self.all_greedy = False


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None,
                      top_ps: torch.Tensor | None) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf."""
    if top_ks is None and top_ps is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    if top_ks is not None:
        k = torch.where(top_ks > 0, top_ks, logits.shape[-1])
        drop |= ranks[None, :] >= k[:, None]
    if top_ps is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        drop |= before > top_ps[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler(nn.Module):
    """Samples on the device with the kernels of `plan` (the engine's `KernelPlan`; None: the
    platform's choice)."""

    def __init__(self, plan=None):
        super().__init__()
        self.plan = plan

    def forward(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        kern = self.plan.kernels_for(logits) if self.plan is not None else kernel_backend.get(logits)
        if st.all_greedy:
            # on a GPU the split-vocab kernels without noise: faster than torch's argmax at 1-256
            # rows in the H200 probes (docs/perf, sixth and ninth sessions)
            return kern.gumbel_sample(logits, None) if kern is not None else logits.argmax(dim=-1)
        if kern is not None and st.top_ks is None and st.top_ps is None and not st.generators:
            # two-level Gumbel-max in Triton, the same distribution; a fresh seed from torch's RNG
            seed = int(torch.randint(0, 2**31 - 1, (1,)))
            return kern.gumbel_sample(logits, st.temperatures, seed)
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        temps = st.temperatures
        scaled = logits / torch.where(temps > 0, temps, 1.0)[:, None]
        scaled = apply_top_k_top_p(scaled, st.top_ks, st.top_ps)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, gen in st.generators.items():
            noise[row].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temps > 0, sampled, greedy)
