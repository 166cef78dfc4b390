"""Routing statistics: (token, expert) pairs per MoE layer, counted on the device.

An `ExpertLoadRecorder` belongs to one engine's runner; while it is attached, each
`FusedMoE` adds its step's expert choices into one [layers, experts] int64 buffer
(`scatter_add_`, no host sync, no per-engine state anywhere else). `take()` hands the
buffer's contents over (a device copy) and zeroes it, once per step; the engine brings it to
the host with the step's tokens. Detached (the default), a layer pays one attribute check.
"""
from __future__ import annotations

import torch
from torch import nn


class ExpertLoadRecorder:
    def __init__(self, layers: list[nn.Module], device: torch.device | str):
        if not layers:
            raise ValueError("routing statistics need a model with MoE layers: this one has none")
        self.layers = list(layers)
        self.layer_ids = [m.layer_idx if m.layer_idx is not None else i for i, m in enumerate(self.layers)]
        self.num_experts = [m.num_experts for m in self.layers]
        self.counts = torch.zeros(len(self.layers), max(self.num_experts), dtype=torch.int64, device=device)

    def attach(self) -> "ExpertLoadRecorder":
        for i, m in enumerate(self.layers):
            m.recorder, m.record_row = self, i
        return self

    def detach(self) -> None:
        for m in self.layers:
            if m.recorder is self:
                m.recorder = None

    def record(self, layer: nn.Module, topk_ids: torch.Tensor) -> None:
        flat = topk_ids.reshape(-1).to(torch.int64)
        self.counts[layer.record_row].scatter_add_(0, flat, torch.ones_like(flat))

    def take(self) -> torch.Tensor:
        """This step's counts [layers, experts] (a copy on the device); the buffer restarts at 0."""
        out = self.counts.clone()
        self.counts.zero_()
        return out

    def __repr__(self) -> str:
        on = any(m.recorder is self for m in self.layers)
        return f"ExpertLoadRecorder(layers={self.layer_ids}, experts={max(self.num_experts)}, attached={on})"
