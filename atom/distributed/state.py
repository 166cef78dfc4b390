"""`ParallelState`: one engine's tensor-parallel group, handed to the layers it builds.

    state = ParallelState.single()              # TP=1: every collective is the identity
    state = init_group(rank, world, host, port)  # atom.distributed.group: a real group
    with building(state):                        # layers built here shard for this rank
        model = LlamaForCausalLM(hf_config)

The state holds the process groups as objects (torch.distributed's `ProcessGroupGloo` /
`ProcessGroupNCCL`, built on a `TCPStore`, never the process-wide default group), so two
engines in one process each keep their own. Layers take it at construction from
`building(...)` (a context variable, like the per-forward attention context) and keep it as
`layer.tp`; nothing reads it later from a global.

Expert parallel (`expert_parallel`, from `enable_expert_parallel`): the MoE layers built
under this state give each rank `expert_range(E)` of the experts instead of a slice of every
expert's width; the expert-parallel group is this tensor-parallel group (EP size = TP size). With DP attention (`moe_group`, TP=1 replicas),
the MoE layers span every data-parallel replica instead (EP size = DP size x TP size): their
tokens gathered across it (`gather_rows`) and their sums brought back (`sum_rows`).

Collectives: `all_reduce` (sum, after row-parallel layers, the vocab-parallel
embedding and the MoE layers), `all_gather` (the vocab-parallel LM head's logits), `broadcast_object` (the
driver's step to the workers, once per step, over the CPU group), `min_int` (agreeing on the
KV block count). Under torch.compile they are left out of the graph (a graph break per
collective; CUDA graphs capture them eagerly).
"""
from __future__ import annotations

import contextlib
import contextvars
import pickle
from dataclasses import dataclass
from typing import Any, Optional

import torch

_BUILDING: contextvars.ContextVar[Optional["ParallelState"]] = contextvars.ContextVar("atom_tp_building",
                                                                                      default=None)


@dataclass(eq=False)
class ParallelState:
    """Rank `rank` of a tensor-parallel group of `world_size` ranks. `group` carries the
    tensors of the forward (NCCL on GPUs, gloo on CPUs); `cpu_group` (gloo) carries the
    pickled step from the driver; on a CPU they are one group."""

    rank: int = 0
    world_size: int = 1
    group: Any = None
    cpu_group: Any = None
    backend: str = "none"
    store: Any = None  # the TCPStore the group met on (kept alive with the group)
    expert_parallel: bool = False  # enable_expert_parallel: MoE layers split their experts over the ranks
    # enable_dp_attention: the group of all data-parallel replicas the MoE layers span (tokens
    # gathered across it, experts split over it); None: the MoE layers use this group
    moe_group: Optional["ParallelState"] = None

    @classmethod
    def single(cls) -> "ParallelState":
        return cls()

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def split(self, size: int, what: str = "size") -> int:
        """This rank's part of `size` (which the world size must divide)."""
        if size % self.world_size:
            raise ValueError(f"{what}={size} is not divisible by tensor_parallel_size={self.world_size}: "
                             "choose a tensor_parallel_size that divides it")
        return size // self.world_size

    def expert_range(self, num_experts: int, what: str = "") -> tuple[int, int]:
        """(first global expert id, experts) this rank holds under expert parallel: contiguous
        blocks in rank order, the first `num_experts % world_size` ranks one expert more
        (vLLM's linear placement). Every rank needs at least one."""
        w = self.world_size
        if num_experts < w:
            raise ValueError(f"{what} has {num_experts} experts, fewer than the {w} expert-parallel ranks "
                             "(tensor_parallel_size): every rank needs one; turn enable_expert_parallel off "
                             "or use fewer ranks")
        base, extra = divmod(num_experts, w)
        return self.rank * base + min(self.rank, extra), base + (self.rank < extra)

    def kv_heads(self, num_kv_heads: int, what: str = "") -> tuple[int, int]:
        """(KV heads on each rank, ranks sharing each KV head): KV heads split across the
        ranks, or, where ranks outnumber them, each replicated on world_size / num_kv_heads
        consecutive ranks."""
        w = self.world_size
        if num_kv_heads >= w:
            if num_kv_heads % w:
                raise ValueError(f"{what} num_key_value_heads={num_kv_heads} is not divisible by "
                                 f"tensor_parallel_size={w}")
            return num_kv_heads // w, 1
        if w % num_kv_heads:
            raise ValueError(f"{what} tensor_parallel_size={w} is not a multiple of num_key_value_heads="
                             f"{num_kv_heads}: KV heads can only be replicated evenly")
        return 1, w // num_kv_heads

    # --- collectives ----------------------------------------------------------------
    # The identity at TP=1 is decided before any torch.compiler.disable'd call, so that a model
    # compiled as one graph (level 3) traces straight through it; the collectives themselves
    # stay outside the graph.
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (in place; returned). Identity at TP=1."""
        if self.world_size == 1:
            return x
        return self._all_reduce(x)

    @torch.compiler.disable
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `x` concatenated along `dim`, rank order. Identity at TP=1."""
        if self.world_size == 1:
            return x
        return self._all_gather(x, dim)

    @torch.compiler.disable
    def _all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)

    @torch.compiler.disable
    def gather_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The ranks' `x` [n_r, ...] stacked along dim 0 in rank order, and every rank's n_r:
        the counts first (one small all-gather, a host sync), then `x` padded to the largest
        count (an all-gather needs equal sizes), the padding dropped."""
        if self.world_size == 1:
            return x, [x.shape[0]]
        n = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
        counts = [int(c) for c in self.all_gather(n, dim=0).tolist()]
        most = max(counts)
        if most == 0:
            return x, counts
        padded = x.new_zeros((most, *x.shape[1:]))
        padded[:x.shape[0]] = x
        full = self.all_gather(padded, dim=0)
        return torch.cat([full[r * most:r * most + c] for r, c in enumerate(counts)]), counts

    @torch.compiler.disable
    def sum_rows(self, y: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The inverse of `gather_rows` for partial sums: `y` [sum(counts), ...] summed over
        the ranks (all-reduce), this rank's rows returned. (A reduce-scatter would move 1/w of
        the data; gloo on CPUs has none for tensors of unequal parts, so this is one all-reduce.)"""
        if self.world_size == 1:
            return y
        start = sum(counts[:self.rank])
        return self.all_reduce(y.contiguous())[start:start + counts[self.rank]]

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value`."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.cpu_group.allreduce([t], opts).wait()
        return int(t.item())

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """`obj` of rank `src`, pickled once and sent to every rank (two broadcasts: the
        length, then the bytes). Other ranks pass nothing and get the object."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        size = torch.zeros(1, dtype=torch.int64)
        if self.rank == src:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                    dtype=torch.uint8)
            size[0] = data.numel()
        self.cpu_group.broadcast([size], opts).wait()
        if self.rank != src:
            data = torch.empty(int(size[0]), dtype=torch.uint8)
        self.cpu_group.broadcast([data], opts).wait()
        return obj if self.rank == src else pickle.loads(data.numpy().tobytes())

    def shutdown(self) -> None:
        """Release the groups (the process may host other engines)."""
        for g in {id(g): g for g in (self.group, self.cpu_group) if g is not None}.values():
            for name in ("shutdown", "abort"):
                fn = getattr(g, name, None)
                if fn is not None:
                    try:
                        fn()
                        break
                    except Exception:  # already broken (a peer died): nothing to release
                        pass
        self.group = self.cpu_group = self.store = None

    def __repr__(self) -> str:
        ep = ", expert_parallel=True" if self.expert_parallel else ""
        return f"ParallelState(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}{ep})"


@contextlib.contextmanager
def building(state: Optional[ParallelState]):
    """Layers constructed inside take `state` as their tensor-parallel group."""
    token = _BUILDING.set(state)
    try:
        yield state
    finally:
        _BUILDING.reset(token)


def current_parallel_state() -> ParallelState:
    """The group of the model being built (`building`), else a single rank."""
    state = _BUILDING.get()
    return state if state is not None else ParallelState.single()
