"""CUDA graphs for decode steps: one captured forward per batch size.

A decode batch of n sequences replays the graph of the smallest captured size >= n, its
inputs copied into persistent buffers; the rows past n are padding (query length 0, slot
-1: the attention kernel and the cache write skip them). Larger batches, and batches with
prefill tokens, run without a graph. Capturing is possible because the attention launch
depends only on shapes, never on sequence lengths read on the host.
"""
from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from atom.model_ops.attention import AttentionMetadata, forward_context

logger = logging.getLogger(__name__)


class CUDAGraphRunner:
    def __init__(self, runner, capture_sizes: list[int], max_blocks_per_seq: int):
        self.runner = runner
        self.sizes = sorted(capture_sizes)
        self.max_bs = self.sizes[-1]
        dev = runner.device
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.arange = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = self.arange.clone()
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays: dict[int, int] = {s: 0 for s in self.sizes}
        self.padded_tokens = 0
        self.last_size: int | None = None

    def __repr__(self) -> str:
        return f"CUDAGraphRunner(sizes={self.sizes}, captured={len(self.graphs)}, replays={self.replays})"

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(self.cu_seqlens_q[:bs + 1], self.seq_lens[:bs], self.block_tables[:bs],
                                 self.slot_mapping[:bs], max_query_len=1,
                                 max_seq_len=self.runner.config.max_model_len)

    @torch.inference_mode()
    def capture(self) -> None:
        from tqdm.auto import tqdm
        from atom.model_ops.attention import triton_backend
        t0 = time.perf_counter()
        # the graphs keep the attention scratch they were captured with alive, even if another
        # engine in this process registers its own
        self.attention_workspace = triton_backend.current_workspace()
        pool = None
        self.seq_lens.fill_(1)  # warm-up/capture inputs: one token of context per row
        for bs in tqdm(sorted(self.sizes, reverse=True), desc="Capturing CUDA graphs", unit="graph"):
            meta = self._meta(bs)
            with forward_context(meta):
                self.runner.model_forward(self.input_ids[:bs], self.positions[:bs])  # warm-up
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = self.runner.model_forward(self.input_ids[:bs], self.positions[:bs])
            pool = g.pool()
            self.graphs[bs], self.outputs[bs] = g, out
        torch.cuda.synchronize()
        self.seq_lens.zero_()
        logger.info("captured %d CUDA graphs (batch %d..%d) in %.1f s", len(self.graphs),
                    self.sizes[0], self.max_bs, time.perf_counter() - t0)

    def can_run(self, host) -> bool:
        return host.is_decode and len(host.query_lens) <= self.max_bs

    def replay(self, host, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay for a decode step; `input_ids` (device) replaces the host's token ids."""
        n = len(host.query_lens)
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        w = host.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids if input_ids is not None else torch.from_numpy(host.input_ids),
                                 non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(host.positions), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.from_numpy(host.slot_mapping), non_blocking=True)
        self.seq_lens[:n].copy_(torch.from_numpy(host.seq_lens.astype(np.int32)), non_blocking=True)
        self.block_tables[:n, :w].copy_(torch.from_numpy(host.block_tables.astype(np.int32)), non_blocking=True)
        if bs > n:  # padding rows: no query tokens, no cache writes
            self.cu_seqlens_q[n + 1:bs + 1].fill_(n)
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].zero_()
        self.graphs[bs].replay()
        if bs > n:
            self.cu_seqlens_q[n + 1:bs + 1].copy_(self.arange[n + 1:bs + 1])
        self.replays[bs] += 1
        self.padded_tokens += bs - n
        self.last_size = bs
        return self.outputs[bs][:n]

