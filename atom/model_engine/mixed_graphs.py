"""CUDA graphs for steps with prefill tokens: one captured forward per token bucket.

A step of T tokens over B sequences (prefill chunks, with or without decodes beside them)
replays the graph of the smallest bucket (Tp >= T, Bp >= B). Every launch in the forward
depends only on shapes: the token count is Tp, the sequence count Bp, and the attention
kernel's grid is an upper bound over both (its spare programs return at once), its tile
picked for a query of Tp tokens. So the graph of a bucket holds the whole forward and
never breaks: the guide's TR_HYBRID token graph, whole because no launch reads host data,
and the mixed half of FULL. Sequence buckets (1, 4, 16, 64, 256, then the largest a token
bucket can hold, min(Tp, max_num_seqs)) keep the spare programs few: a grid sized for
hundreds of spare sequences slows a lone prefill's attention (docs/perf has the profile).
Padding: tokens T..Tp have cache slot -1 (nothing written, nothing read by a real token)
and belong to no sequence; rows B.. are sequences of no tokens and no context. The padding
tokens' rows hold garbage (the attention leaves them unwritten): row-wise layers never mix
it into the real rows, and the one statistic over rows, a dynamic per-tensor activation
scale, leaves them out (`AttentionMetadata.padded`, `quant.common.tensor_scale`).

Why: below a few thousand tokens an eager prefill step is bound by the host (Python and
kernel launches), not the GPU, and that is what a lone request's time to first token is
made of (docs/perf: where a lone request's TTFT went).

    mixed = MixedGraphRunner(runner, token_sizes=[16, 32, 64], max_seqs=16, max_blocks_per_seq=128)
    mixed.keys                           # [(16, 1), (16, 4), (16, 16), (32, 1), ...]
    mixed.capture()                      # on a GPU; replay(host, key) where key = bucket(host)
    mixed.fill(host, key)                # the padded inputs alone (what a CPU test checks)
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

#: token buckets of the mixed graphs, before capping at max_num_batched_tokens
DEFAULT_TOKEN_SIZES = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
#: sequence buckets below a token bucket's own largest row count
SEQ_SIZES = (1, 4, 16, 64, 256)


def token_buckets(max_num_batched_tokens: int, sizes=DEFAULT_TOKEN_SIZES) -> list[int]:
    """The buckets an engine captures: those a step can fill (a step holds at most
    `max_num_batched_tokens`; the smallest bucket above it still serves the last ones)."""
    out = [s for s in sorted(sizes) if s <= max_num_batched_tokens]
    if not out or out[-1] < max_num_batched_tokens:
        out += [s for s in sorted(sizes) if s > max_num_batched_tokens][:1]
    return out


def seq_buckets(size: int, max_seqs: int) -> list[int]:
    """Sequence-row buckets of token bucket `size` (a sequence has at least one token)."""
    cap = min(size, max_seqs)
    return [r for r in SEQ_SIZES if r < cap] + [cap]


def bucket_keys(max_num_batched_tokens: int, max_num_seqs: int) -> list[tuple[int, int]]:
    """The (tokens, sequence rows) graphs an engine with these limits captures."""
    return [(t, r) for t in token_buckets(max_num_batched_tokens) for r in seq_buckets(t, max_num_seqs)]


class MixedGraphRunner:
    def __init__(self, runner, token_sizes: list[int], max_seqs: int, max_blocks_per_seq: int):
        if not token_sizes:
            raise ValueError("MixedGraphRunner needs at least one token size")
        self.runner = runner
        self.sizes = sorted(set(int(s) for s in token_sizes))
        self.max_tokens = self.sizes[-1]
        self.max_seqs = int(max_seqs)
        self.rows_by_size = {t: seq_buckets(t, self.max_seqs) for t in self.sizes}
        dev = runner.device
        t, b = self.max_tokens, self.rows_by_size[self.max_tokens][-1]
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=dev)
        self.cu_seqlens_q = torch.zeros(b + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(b, max_blocks_per_seq, dtype=torch.int32, device=dev)
        # every graph copies its hidden states here: the graphs' own outputs need not outlive
        # their capture, so the memory pool holds one forward's activations, not one per bucket
        self.hidden = torch.empty(t, runner.config.hf_config.hidden_size, dtype=runner.dtype, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (tokens, sequence rows)
        self.replays: dict[tuple[int, int], int] = {k: 0 for k in self.keys}
        self.padded_tokens = 0  # padding tokens replayed
        self.last_size: int | None = None

    def __repr__(self) -> str:
        used = {k: n for k, n in self.replays.items() if n}
        return (f"MixedGraphRunner(token_sizes={self.sizes}, max_seqs={self.max_seqs}, "
                f"captured={len(self.graphs)}, replays={used})")

    @property
    def keys(self) -> list[tuple[int, int]]:
        return [(t, r) for t in self.sizes for r in self.rows_by_size[t]]

    def bucket(self, host) -> tuple[int, int] | None:
        """The (tokens, rows) bucket a step fits (None: too many tokens or sequences)."""
        t, n = int(host.cu_seqlens_q[-1]), len(host.query_lens)
        i = bisect.bisect_left(self.sizes, t)
        if i == len(self.sizes):
            return None
        size = self.sizes[i]
        rows = self.rows_by_size[size]
        j = bisect.bisect_left(rows, n)
        return (size, rows[j]) if j < len(rows) else None

    def meta(self, key: tuple[int, int]) -> AttentionMetadata:
        size, b = key
        return self.runner.bind(AttentionMetadata(
            self.cu_seqlens_q[:b + 1], self.seq_lens[:b], self.block_tables[:b], self.slot_mapping[:size],
            max_query_len=size, max_seq_len=self.runner.config.max_model_len, padded=True))

    def fill(self, host, key: tuple[int, int]) -> None:
        """The step's inputs into the persistent buffers, padded to bucket `key`."""
        size, b = key
        n, t = len(host.query_lens), int(host.cu_seqlens_q[-1])
        w = host.block_tables.shape[1]
        ids = np.zeros(size, np.int64)
        ids[:t] = host.input_ids
        pos = np.zeros(size, np.int64)
        pos[:t] = host.positions
        slots = np.full(size, -1, np.int64)
        slots[:t] = host.slot_mapping
        cu = np.full(b + 1, t, np.int32)
        cu[:n + 1] = host.cu_seqlens_q
        lens = np.zeros(b, np.int32)
        lens[:n] = host.seq_lens
        for buf, arr in ((self.input_ids, ids), (self.positions, pos), (self.slot_mapping, slots),
                         (self.cu_seqlens_q, cu), (self.seq_lens, lens)):
            copy_into(buf[:len(arr)], arr)
        copy_into(self.block_tables[:n, :w], host.block_tables.astype(np.int32))

    def forward(self, key: tuple[int, int]) -> torch.Tensor:
        """The engine's forward over the buffers of bucket `key` (what a graph captures)."""
        size = key[0]
        with forward_context(self.meta(key)):
            return self.runner.model_forward(self.input_ids[:size], self.positions[:size])

    def run(self, key: tuple[int, int]) -> None:
        """`forward` with its hidden states copied into `hidden` (what a graph holds)."""
        self.hidden[:key[0]].copy_(self.forward(key))

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every bucket, largest first, into one memory pool (`pool`: the decode
        graphs'; graphs replay one at a time, so they may share it). Capture inputs: one token
        per row, no cache writes."""
        from tqdm.auto import tqdm
        t0 = time.perf_counter()
        for key in tqdm(sorted(self.keys, reverse=True), desc="Capturing mixed-step CUDA graphs", unit="graph"):
            size, b = key
            self.cu_seqlens_q.copy_(torch.clamp(torch.arange(self.cu_seqlens_q.numel(), dtype=torch.int32), max=b))
            self.seq_lens[:b].fill_(1)
            self.slot_mapping.fill_(-1)
            self.run(key)  # warm-up: kernels compiled and tuned outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.run(key)
            pool = g.pool()
            self.graphs[key] = g
        torch.cuda.synchronize()
        self.seq_lens.zero_()
        logger.info("captured %d mixed-step CUDA graphs (tokens %s, up to %d sequences) in %.1f s",
                    len(self.graphs), self.sizes, self.max_seqs, time.perf_counter() - t0)

    def replay(self, host, key: tuple[int, int]) -> torch.Tensor:
        """Run a step in its bucket `key` (`bucket(host)`): its hidden states, one row per real token."""
        t = int(host.cu_seqlens_q[-1])
        self.fill(host, key)
        self.graphs[key].replay()
        self.replays[key] += 1
        self.padded_tokens += key[0] - t
        self.last_size = key[0]
        return self.hidden[:t]
