"""CUDA graphs for decode steps: one captured forward per (batch size, query tokens per sequence).

A decode batch of n sequences with q query tokens each (1, or 1 + q - 1 draft tokens in a
multi-token step) replays the graph of the smallest batch size >= n captured for that q,
its inputs copied into persistent buffers; the rows past n are padding (query length 0,
slots -1: the attention kernel and the cache write skip them). Larger batches, batches
with prefill tokens or with unequal q, and q without graphs run without a graph. Only q=1
is captured today (`query_lens`); capturing is possible because the attention launch
depends only on shapes (max_query_len = q), never on sequence lengths read on the host.
"""
from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from atom.model_ops.attention import AttentionMetadata, forward_context
from atom.utils.host_copy import copy_into

logger = logging.getLogger(__name__)


class CUDAGraphRunner:
    def __init__(self, runner, capture_sizes: list[int], max_blocks_per_seq: int,
                 query_lens: tuple[int, ...] = (1,)):
        self.runner = runner
        self.sizes = sorted(capture_sizes)
        self.max_bs = self.sizes[-1]
        self.query_lens = tuple(sorted(query_lens))  # q values captured, each at every size
        self.sizes_by_q: dict[int, list[int]] = {q: self.sizes for q in self.query_lens}
        dev = runner.device
        n, t = self.max_bs, self.max_bs * self.query_lens[-1]
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=dev)
        self.arange = torch.arange(n + 1, dtype=torch.int32, device=dev)
        # query offsets per q (a graph keeps the address it was captured with): q * row
        self.cu_seqlens_q = {q: self.arange * q for q in self.query_lens}
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}   # (batch size, q)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.replays: dict[int, int] = {s: 0 for s in self.sizes}       # by batch size, any q
        self.replays_by_key: dict[tuple[int, int], int] = {}
        self.padded_tokens = 0  # padding rows replayed
        self.last_size: int | None = None
        self.last_q: int | None = None
        self.pool = None

    def __repr__(self) -> str:
        return (f"CUDAGraphRunner(sizes={self.sizes}, q={list(self.query_lens)}, captured={len(self.graphs)}, "
                f"replays={self.replays})")

    def _meta(self, bs: int, q: int = 1) -> AttentionMetadata:
        return self.runner.bind(AttentionMetadata(  # with the engine's plan and attention backend
            self.cu_seqlens_q[q][:bs + 1], self.seq_lens[:bs], self.block_tables[:bs], self.slot_mapping[:bs * q],
            max_query_len=q, max_seq_len=self.runner.config.max_model_len, padded=True))

    @torch.inference_mode()
    def capture(self) -> None:
        from tqdm.auto import tqdm
        t0 = time.perf_counter()
        pool = None
        keys = [(bs, q) for q in self.query_lens for bs in sorted(self.sizes_by_q[q], reverse=True)]
        for bs, q in tqdm(keys, desc="Capturing CUDA graphs", unit="graph"):
            self.seq_lens.fill_(q)  # warm-up/capture inputs: q tokens of context per row
            meta, t = self._meta(bs, q), bs * q
            with forward_context(meta):
                self.runner.decode_forward(self.input_ids[:t], self.positions[:t])  # warm-up
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = self.runner.decode_forward(self.input_ids[:t], self.positions[:t])
            pool = g.pool()
            self.graphs[bs, q], self.outputs[bs, q] = g, out
            self.replays_by_key[bs, q] = 0
        torch.cuda.synchronize()
        self.pool = pool  # the memory pool of these graphs (the mixed-step graphs share it)
        self.seq_lens.zero_()
        logger.info("captured %d CUDA graphs (batch %d..%d, q %s) in %.1f s", len(self.graphs),
                    self.sizes[0], self.max_bs, list(self.query_lens), time.perf_counter() - t0)

    def can_run(self, host) -> bool:
        """A pure decode batch, every sequence with the same q, that a captured (bs, q) fits."""
        q = host.decode_q
        sizes = self.sizes_by_q.get(q) if q else None
        return sizes is not None and len(host.query_lens) <= sizes[-1]

    def replay(self, host, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay for a decode step; `input_ids` (device) replaces the host's token ids."""
        n, q = len(host.query_lens), host.decode_q
        sizes = self.sizes_by_q[q]
        bs = sizes[bisect.bisect_left(sizes, n)]
        t, w = n * q, host.block_tables.shape[1]
        cu = self.cu_seqlens_q[q]
        if input_ids is not None:  # a look-ahead step's tokens, on the device already
            self.input_ids[:t].copy_(input_ids, non_blocking=True)
        else:
            copy_into(self.input_ids[:t], host.input_ids)
        copy_into(self.positions[:t], host.positions)
        copy_into(self.slot_mapping[:t], host.slot_mapping)
        copy_into(self.seq_lens[:n], host.seq_lens.astype(np.int32))
        copy_into(self.block_tables[:n, :w], host.block_tables.astype(np.int32))
        if bs > n:  # padding rows: no query tokens, no cache writes
            cu[n + 1:bs + 1].fill_(t)
            self.slot_mapping[t:bs * q].fill_(-1)
            self.seq_lens[n:bs].zero_()
        self.graphs[bs, q].replay()
        if bs > n:
            cu[n + 1:bs + 1].copy_(self.arange[n + 1:bs + 1] * q if q > 1 else self.arange[n + 1:bs + 1])
        self.replays[bs] += 1
        self.replays_by_key[bs, q] += 1
        self.padded_tokens += bs - n
        self.last_size, self.last_q = bs, q
        return self.outputs[bs, q][:t]

