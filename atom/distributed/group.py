"""Forming a group: ranks meet on a `TCPStore` and build their own process groups.

    store = make_store(host, port, is_master=True)       # port 0: the OS picks one (store.port)
    state = init_group(rank, world_size, store, device)   # a ParallelState of real groups

Groups are built from the store directly (`ProcessGroupGloo`, and `ProcessGroupNCCL` on
GPUs), not through `init_process_group`, so they are objects an engine owns: a process may
hold several engines, each with its own group. `prefix` keeps the groups of several engines
on one store apart. A peer that dies makes the next collective raise (gloo: "Connection
closed by peer"); `timeout` bounds the rest (a peer that never answers).
"""
from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from atom.distributed.state import ParallelState

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0


def make_store(host: str, port: int, world_size: int, is_master: bool,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """The TCP store ranks meet on (`is_master`: this process serves it; port 0 picks one)."""
    return dist.TCPStore(host, port, world_size, is_master, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def init_group(rank: int, world_size: int, store: dist.Store, device: torch.device | str = "cpu",
               prefix: str = "tp", timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelState:
    """Rank `rank`'s `ParallelState` over `store`: a gloo group (CPU tensors, pickled steps)
    and, on a CUDA device, an NCCL group for the forward's tensors."""
    device = torch.device(device)
    timeout = timedelta(seconds=timeout_s)
    cpu = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/gloo", store), rank, world_size, timeout)
    group, backend = cpu, "gloo"
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(dist.PrefixStore(f"{prefix}/nccl", store), rank, world_size, opts)
        backend = "nccl"
    logger.info("tensor-parallel rank %d/%d joined (%s)", rank, world_size, backend)
    return ParallelState(rank, world_size, group, cpu, backend, store)
