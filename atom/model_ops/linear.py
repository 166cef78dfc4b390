"""Linear layers, with the packed (fused) variants the models load into, and their
tensor-parallel forms.

Each layer gets its method from the quantization config by its module prefix
(`quant.linear_method_for`): the method creates the parameters, post-processes them after
loading and computes the product. `weight_loader(param, tensor, shard_id)` copies a
checkpoint tensor (or one shard of a packed layer) into a parameter. `plan` is the engine's
`KernelPlan`, set by the runner (None: the library product).

Tensor parallel (`layer.tp`, the `ParallelState` of the model being built,
`atom.distributed.building`): a column-parallel layer (`ColumnParallelLinear`, `QKVLinear`,
`MergedLinear`) holds its rank's output rows of every shard, a row-parallel one
(`RowParallelLinear`) its rank's input columns, followed by an all-reduce; `Linear` itself
is replicated. The method creates the rank-local shapes (it is handed the local
in / out features), and each parameter declares how it shards: `output_dim` (with
`rows_per_entry`, e.g. 128 for a block scale) and `input_dim` (with `input_pack`, e.g. 8
int4 values per int32, or the group size of a group scale); None: the same on every rank.
The layer's loader narrows the checkpoint tensor to the rank's slice before the method's
loader copies it, so every method shards without knowing about ranks. A row-parallel bias
is added once: rank 0 holds it, the others zeros.
"""
from __future__ import annotations

import torch
from torch import nn

from atom.distributed.state import current_parallel_state
from atom.model_ops.quant import dense, linear_method_for  # noqa: F401  (dense: the functional form)


class Linear(nn.Module):
    """y = x W^T (+ b) through the layer's method, replicated on every rank. `one_row` names
    how a decoder layer calls it at batch 1 ("plain", or the fused variants `fusions.install`
    declares), for the start-up GEMV choice."""

    one_row = "plain"
    tp_mode = None  # "column" / "row": how the layer splits across tensor-parallel ranks

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant_config=None, prefix: str = "", tp=None):
        super().__init__()
        self.prefix = prefix
        self.tp = tp if tp is not None else current_parallel_state()
        self.full_in_features, self.full_out_features = in_features, out_features
        self.in_features, self.out_features = self.local_features(in_features, out_features)
        self.method = linear_method_for(quant_config, prefix)  # refuses formats without a kernel
        self.plan = None
        self.method.create_weights(self, self.in_features, self.out_features, bias)
        if self.tp.world_size > 1:
            for name, p in self.named_parameters(recurse=False):
                p.weight_loader = self._rank_loader(name, p, getattr(p, "weight_loader", None))

    def local_features(self, in_features: int, out_features: int) -> tuple[int, int]:
        """(in, out) this rank holds."""
        return in_features, out_features

    # packed layers override shard_ids and shard_range
    def shard_ids(self) -> list:
        """The checkpoint shards packed into this layer, in row order (None: one matrix)."""
        return [None]

    def shard_range(self, shard_id) -> tuple[int, int]:
        """(first row, rows) of a shard in this rank's weight."""
        return 0, self.out_features

    def checkpoint_rows(self, shard_id) -> tuple[int, int]:
        """(first row, rows) of this rank's part within the checkpoint tensor of `shard_id`."""
        return 0, self.shard_range(shard_id)[1]

    def checkpoint_shape(self, shard_id) -> tuple[int, int]:
        """(rows, in_features) of the checkpoint tensor of `shard_id` (before any split)."""
        return self.shard_range(shard_id)[1], self.in_features

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        start, size = self.shard_range(shard_id) if shard_id is not None else (0, param.shape[0])
        if loaded.shape[0] != size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"{self.prefix}: checkpoint tensor shape {tuple(loaded.shape)} does not fit "
                             f"rows [{start}, {start + size}) of {tuple(param.shape)}")
        param.data[start:start + size].copy_(loaded)

    # --- tensor parallel: the rank's slice of a checkpoint tensor ---------------------
    def _rank_loader(self, name: str, param: nn.Parameter, loader):
        if loader is None:
            raise ValueError(f"{self.prefix}.{name}: the {self.method.name} method gives it no weight_loader; "
                             "tensor parallel needs one that the layer can narrow")
        if self.tp_mode is not None and not hasattr(param, "output_dim") and not hasattr(param, "input_dim"):
            raise NotImplementedError(
                f"{self.prefix}.{name}: the {self.method.name} method does not declare how it shards "
                "(output_dim / input_dim on the parameter), so it cannot run with tensor_parallel_size="
                f"{self.tp.world_size}")

        def load(p: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            loader(p, self.rank_slice(name, p, loaded, shard_id), shard_id)

        return load

    def rank_slice(self, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> torch.Tensor:
        """The part of checkpoint tensor `loaded` (for `param`, shard `shard_id`) this rank holds."""
        if self.tp_mode == "column" and getattr(param, "output_dim", None) is not None:
            if shard_id is None and len(self.shard_ids()) > 1:
                raise ValueError(f"{self.prefix}.{name}: a checkpoint tensor of the whole packed layer cannot be "
                                 "split per shard across tensor-parallel ranks; give the shards separately")
            start, size = self.checkpoint_rows(shard_id if shard_id is not None else self.shard_ids()[0])
            return _narrow(self, name, loaded, param.output_dim, start, size, getattr(param, "rows_per_entry", 1))
        if self.tp_mode == "row":
            if getattr(param, "input_dim", None) is not None:
                loaded = _narrow(self, name, loaded, param.input_dim, self.tp.rank * self.in_features,
                                 self.in_features, getattr(param, "input_pack", 1))
            if param is self.bias and self.tp.rank != 0:
                loaded = torch.zeros_like(loaded)  # added once, by rank 0
        return loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def forward_quantized(self, xq: torch.Tensor, xs: torch.Tensor, out_dtype: torch.dtype,
                          lock: torch.Tensor | None = None, defer_sum: bool = False):
        """The layer on an input a kernel in front already quantized as `method.input_quant`
        says (a kernel-plan fusion): q [M, K], scales [M, 1] -> [M, N] in `out_dtype`
        (`defer_sum`: a split-K product may come back as a `kernels.split_k.PendingSum`). xq
        may be a `kernels.pending_quant.PendingQuant` (xs None): rows the product quantizes."""
        return self.method.apply_quantized(self, xq, xs, out_dtype, lock, defer_sum)

    def extra_repr(self) -> str:
        tp = f", tp={self.tp_mode}:{self.tp.rank}/{self.tp.world_size}" if self.tp.world_size > 1 else ""
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
                f"method={self.method.name}{tp}")


def _narrow(layer, name: str, t: torch.Tensor, dim: int, start: int, size: int, per_entry: int) -> torch.Tensor:
    """Rows / columns [start, start + size) of a tensor whose entries along `dim` each cover
    `per_entry` of them (a block scale: 128 rows; packed int4: 8 columns)."""
    if start % per_entry:
        raise ValueError(f"{layer.prefix}.{name}: this rank's slice starts at {start}, inside an entry of "
                         f"{per_entry}: tensor_parallel_size={layer.tp.world_size} splits a quantization "
                         "block / group / pack; choose a size whose slices are whole blocks")
    first, n = start // per_entry, -(-size // per_entry)
    if first + n > t.shape[dim]:
        raise ValueError(f"{layer.prefix}.{name}: checkpoint tensor shape {tuple(t.shape)} has no entries "
                         f"[{first}, {first + n}) along dim {dim} for this rank")
    return t.narrow(dim, first, n)


class ColumnParallelLinear(Linear):
    """Output features split across ranks: rank r holds rows [r * out / tp, (r + 1) * out / tp);
    the output stays split (the next row-parallel layer reads it)."""

    tp_mode = "column"

    def local_features(self, in_features, out_features):
        return in_features, self.tp.split(out_features, f"{self.prefix} out_features")

    def checkpoint_rows(self, shard_id):
        size = self.shard_range(shard_id)[1]
        return self.tp.rank * size, size

    def checkpoint_shape(self, shard_id):
        return self.shard_range(shard_id)[1] * self.tp.world_size, self.in_features


class RowParallelLinear(Linear):
    """Input features split across ranks (rank r: columns [r * in / tp, ...)); the partial
    products are summed over the ranks (one all-reduce), the bias added once.
    `reduce_results=False` leaves the sum to the caller (a MoE layer's shared experts, summed
    with the routed experts in one all-reduce)."""

    tp_mode = "row"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant_config=None,
                 prefix: str = "", tp=None, reduce_results: bool = True):
        self.reduce_results = reduce_results
        super().__init__(in_features, out_features, bias, quant_config, prefix, tp)

    def local_features(self, in_features, out_features):
        return self.tp.split(in_features, f"{self.prefix} in_features"), out_features

    def checkpoint_shape(self, shard_id):
        return self.out_features, self.in_features * self.tp.world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return self.tp.all_reduce(y) if self.reduce_results else y

    def forward_quantized(self, xq, xs, out_dtype, lock=None, defer_sum=False):
        if self.reduce_results and self.tp.world_size > 1:
            defer_sum = False  # the all-reduce takes the summed product
        y = self.method.apply_quantized(self, xq, xs, out_dtype, lock, defer_sum)
        return self.tp.all_reduce(y) if self.reduce_results else y


class QKVLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix: rows [q | k | v] (this rank's heads of each).
    Query heads split across ranks; KV heads too, or, where ranks outnumber them, each KV
    head is replicated on tp / num_kv_heads consecutive ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, quant_config=None, prefix: str = "", tp=None):
        tp = tp if tp is not None else current_parallel_state()
        self.head_dim = head_dim
        self.num_heads = tp.split(num_heads, f"{prefix} num_attention_heads")
        self.num_kv_heads, self.kv_replicas = tp.kv_heads(num_kv_heads, prefix)
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp.world_size, bias,
                         quant_config, prefix, tp)

    def local_features(self, in_features, out_features):
        return in_features, self.q_size + 2 * self.kv_size

    def shard_ids(self) -> list:
        return ["q", "k", "v"]

    def shard_range(self, shard_id) -> tuple[int, int]:
        return {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                "v": (self.q_size + self.kv_size, self.kv_size)}[shard_id]

    def checkpoint_rows(self, shard_id):
        if shard_id == "q":
            return self.tp.rank * self.q_size, self.q_size
        return (self.tp.rank // self.kv_replicas) * self.kv_size, self.kv_size

    def checkpoint_shape(self, shard_id):
        size = self.shard_range(shard_id)[1]
        n = self.tp.world_size if shard_id == "q" else self.tp.world_size // self.kv_replicas
        return size * n, self.in_features


class MergedLinear(ColumnParallelLinear):
    """Several projections of the same input stacked by rows (gate_up: [gate | up]); each
    rank holds its part of every one."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 quant_config=None, prefix: str = "", tp=None):
        tp = tp if tp is not None else current_parallel_state()
        self.out_sizes = [tp.split(n, f"{prefix} output size") for n in out_sizes]
        super().__init__(in_features, sum(out_sizes), bias, quant_config, prefix, tp)

    def local_features(self, in_features, out_features):
        return in_features, sum(self.out_sizes)

    def shard_ids(self) -> list:
        return list(range(len(self.out_sizes)))

    def shard_range(self, shard_id) -> tuple[int, int]:
        return sum(self.out_sizes[:shard_id]), self.out_sizes[shard_id]
