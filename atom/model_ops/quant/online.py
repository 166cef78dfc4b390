"""Quantizing a loaded linear layer in place: the target formats, their round-to-nearest
producers, and the swap of a layer's method.

A target format (`TARGETS`) names a `LayerQuantConfig` and a producer: a function that turns
one checkpoint shard's weight (fp32 [rows, in]) into the tensors that format's checkpoint
holds (`weight` + `weight_scale` for ptpc fp8, `weight_packed` + ... for int4). The layer is
then rebuilt by the method the checkpoint would have used (`create_weights`), the tensors go
in through the parameters' own `weight_loader`s, shard by shard, and
`process_weights_after_loading` runs: an online-quantized layer is indistinguishable from one
loaded from a checkpoint of that format, and the same `LinearMethod` computes it.

    undo = requantize_layer(layer, target_for("ptpc_fp8", layer.prefix))
    ...                       # layer now holds fp8 weights, per-channel scales
    undo()                    # the layer's previous method and parameters, as they were

Formats: `ptpc_fp8` and `mxfp4` are the guide's `online_quant_config` targets; `fp8_block`,
`w8a8_int8`, `w4a16_g32`, `w4a16_g64` are the other formats this build runs, used by the
sensitivity explorer (`atom.quant`) and `atom.benchmarks.quant_accuracy`. Producers are
plain RTN: scale = amax / qmax (per row, per group or per block), q = round(w / scale).

Sources: a layer holding its weight in the model dtype (the unquantized method) or as FP8
128x128 blocks (`weight_scale_inv`, QuantType.per_1x128), which is dequantized first
(`source_weight`). Anything else is refused by name (`check_source`).

Tensor parallelism (`needs_gather`, `gather_needed`): a rank holds a slice of each weight
(column-parallel layers split the output rows of every shard, row-parallel ones the input
columns). Quantizing the slice gives the same scales as quantizing the full weight exactly
when every scale group lies inside one slice (ptpc / int8 per-row scales of a
column-parallel layer, MXFP4's 32 inputs when the local width is a multiple of 32): then
each rank quantizes its slice and nothing is sent. Otherwise (a per-row scale spanning a
row-parallel layer's columns, a block or group cut by the split) `requantize_layer` first
all-gathers the slices over the layer's tensor-parallel group (`layer.tp`; for a packed
layer shard by shard, a KV head replicated over several ranks taken once), the producer
quantizes the full unpartitioned weight, and the layer's own `rank_slice` (what its loaders
do with a full checkpoint tensor) keeps this rank's part of every tensor it made: its columns
of the weight and of group scales, its rows of per-row scales, per-row scales of a
row-parallel layer whole. Either way a rank's tensors equal the matching slice of the
one-rank layer's, bit for bit.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from atom.model_ops.kernels.kv_cache import quantize_fp8
from atom.model_ops.quant.common import _AMAX_MIN, FP8_MAX, INT8_MAX, shards
from atom.quant_spec import DTYPE_KEYS, LayerQuantConfig, QuantType, online_quant_spec

logger = logging.getLogger(__name__)


# --- producers: fp32 [rows, in] -> the format's checkpoint tensors --------------------------
def _fp8(x: torch.Tensor) -> torch.Tensor:
    return quantize_fp8(x, None, torch.float8_e4m3fn)


def produce_ptpc_fp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """FP8 E4M3 per output channel: scale [rows, 1] = amax(row) / 448."""
    s = w.abs().amax(dim=1, keepdim=True).clamp(min=_AMAX_MIN) / FP8_MAX
    return {"weight": _fp8(w / s), "weight_scale": s}


def produce_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:
    """FP8 E4M3 in bn x bk blocks (partial blocks at the edges): `weight_scale_inv`
    [ceil(rows/bn), ceil(in/bk)] = amax(block) / 448, as DeepSeek stores it."""
    bn, bk = block
    rows, cols = w.shape
    pr, pc = -(-rows // bn) * bn, -(-cols // bk) * bk
    padded = torch.zeros(pr, pc, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w
    blocks = padded.reshape(pr // bn, bn, pc // bk, bk)
    s = blocks.abs().amax(dim=(1, 3)).clamp(min=_AMAX_MIN) / FP8_MAX
    full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:rows, :cols]
    return {"weight": _fp8(w / full), "weight_scale_inv": s}


def produce_w8a8_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Symmetric int8 per output channel: scale [rows, 1] = amax(row) / 127."""
    s = w.abs().amax(dim=1, keepdim=True).clamp(min=_AMAX_MIN) / INT8_MAX
    return {"weight": torch.round(w / s).clamp(-128, 127).to(torch.int8), "weight_scale": s}


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int [R, C] of values 0..15 -> int32 [R, ceil(C/8)]: nibble i of column j holds
    element 8j + i (compressed-tensors' pack-quantized order); the tail is zero-padded."""
    rows, cols = q.shape
    padded = torch.zeros(rows, -(-cols // 8) * 8, dtype=torch.int64, device=q.device)
    padded[:, :cols] = q.to(torch.int64)
    shifts = torch.arange(8, device=q.device, dtype=torch.int64) * 4
    packed = (padded.reshape(rows, -1, 8) << shifts).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def produce_w4a16(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """Symmetric int4 per group of `group` input columns: scale [rows, in/group] =
    amax(group) / 7, q = clamp(round(w / scale), -8, 7), stored q + 8 and packed."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    s = g.abs().amax(dim=-1, keepdim=True).clamp(min=_AMAX_MIN) / 7.0
    q = torch.round(g / s).clamp(-8, 7).reshape(rows, cols) + 8
    return {"weight_packed": pack_int4(q), "weight_scale": s.squeeze(-1),
            "weight_shape": torch.tensor([rows, cols], dtype=torch.int64)}


def produce_mxfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """MXFP4 weight-only: e2m1 values two per byte, an E8M0 scale per 32 inputs (the MXFP4
    method's own numerics, so online and checkpoint layers are bit-identical)."""
    from atom.model_ops.quant.mxfp4 import quantize_mxfp4
    packed, scales = quantize_mxfp4(w)
    return {"weight": packed, "weight_scale": scales}


# --- targets --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """A target format: its spec (what the method reads), its producer, and the scale
    granularity along (rows, input columns): an int per group, None for the whole dimension
    (used by the tensor-parallel rule)."""
    name: str
    spec: LayerQuantConfig
    produce: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    granularity: tuple[Optional[int], Optional[int]]

    def method(self, prefix: str):
        """A new method for the layer at `prefix` (its refusals name the layer)."""
        from atom.model_ops.quant import linear_method_for
        return linear_method_for(_OneSpec(self.spec), prefix)

    def moe_method(self, prefix: str):
        """A new MoE method for the experts at `prefix` (its refusals name the layer)."""
        from atom.model_ops.moe.method import moe_method_for
        return moe_method_for(_OneSpec(self.spec), prefix)

    def __repr__(self) -> str:
        return f"Target({self.name})"


class _OneSpec:
    """A quantization config answering one spec for every layer."""

    def __init__(self, spec: LayerQuantConfig):
        self.spec = spec

    def get_layer_quant_config(self, prefix: str) -> LayerQuantConfig:
        return self.spec


def _w4a16(group: int) -> Target:
    spec = LayerQuantConfig(QuantType.per_Token, DTYPE_KEYS["i4x2"], True, "compressed-tensors",
                            group_size=group, symmetric=True, act_scheme="none")
    return Target(f"w4a16_g{group}", spec, lambda w: produce_w4a16(w, group), (1, group))


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("ptpc_fp8", online_quant_spec("ptpc_fp8"), produce_ptpc_fp8, (1, None)),
    Target("fp8_block", LayerQuantConfig(QuantType.per_1x128, DTYPE_KEYS["fp8"], True, "online",
                                         block_size=(128, 128), act_scheme="group", act_group_size=128),
           produce_fp8_block, (128, 128)),
    Target("w8a8_int8", LayerQuantConfig(QuantType.per_Token, DTYPE_KEYS["i8"], True, "online",
                                         symmetric=True, act_scheme="token"), produce_w8a8_int8, (1, None)),
    Target("mxfp4", online_quant_spec("mxfp4"), produce_mxfp4, (1, 32)),
    _w4a16(32), _w4a16(64),
)}
FORMATS = tuple(TARGETS)


def target_for(fmt: str, prefix: str = "", field: str = "format") -> Target:
    """The one place a format name becomes a target (method + producer). `field` names the
    setting the format came from, for the errors."""
    if fmt not in TARGETS:
        raise ValueError(f"{field}={fmt!r} is invalid: must be one of {list(FORMATS)}")
    return TARGETS[fmt]


# --- sources --------------------------------------------------------------------------------
def check_source(layer: nn.Module) -> Optional[str]:
    """Why `layer`'s current weights cannot be re-quantized (None: they can)."""
    from atom.model_ops.quant import Fp8LinearMethod, UnquantizedLinearMethod
    m = layer.method
    if isinstance(m, UnquantizedLinearMethod):
        return None
    if isinstance(m, Fp8LinearMethod) and m.weight_scheme == "block":
        return None
    return (f"its checkpoint holds {m.format_spec() if hasattr(m, 'format_spec') else m.name}; online "
            "quantization starts from unquantized weights or FP8 block (per_1x128) weights")


def source_weight(layer: nn.Module) -> torch.Tensor:
    """The layer's weight in fp32 [out, in]: as loaded, or FP8 blocks dequantized."""
    reason = check_source(layer)
    if reason is not None:
        raise ValueError(f"layer '{layer.prefix}' cannot be quantized online: {reason}")
    m = layer.method
    return layer.weight.float() if m.name == "unquantized" else m.dequantized_weight(layer)


def refusal(target: Target, layer: nn.Module) -> Optional[str]:
    """Why `target`'s method cannot hold `layer`'s shape (None: it can), found by building
    its parameters on the meta device (nothing is allocated)."""
    probe = _Probe(layer)
    try:
        with torch.device("meta"):
            target.method(layer.prefix).create_weights(probe, layer.in_features, layer.out_features, False)
    except NotImplementedError as exc:
        if _tp_size(layer) > 1 and tp_split(layer) is not None:  # the shape it refused is a rank's slice
            return f"{exc} (one {tp_split(layer)}-parallel slice of tensor_parallel_size={_tp_size(layer)})"
        return str(exc)
    if _tp_size(layer) > 1 and tp_split(layer) is not None:  # its tensors are narrowed per rank
        loose = [n for n, p in probe.named_parameters()  # the rule of Linear's own rank loaders
                 if not hasattr(p, "output_dim") and not hasattr(p, "input_dim")]
        if loose:
            return (f"the {target.name} method does not declare how {loose} split across tensor-parallel "
                    f"ranks (output_dim / input_dim), so it cannot run with tensor_parallel_size={_tp_size(layer)}")
        cut = _cut_group(target, layer)
        if cut is not None:
            return cut
    return None


def _cut_group(target: Target, layer: nn.Module) -> Optional[str]:
    """Why this rank's slice cannot hold its part of the full weight's `target` tensors: a
    scale group (a block's rows, a group's columns) that the tensor-parallel split cuts would
    belong to two ranks, so no rank could keep its own part of that scale (None: it can).
    Refused before any weight loads: a rank that found it out after the gather would leave
    the others waiting in the next layer's collective."""
    split, world = tp_split(layer), _tp_size(layer)
    group = target.granularity[0 if split == "column" else 1]
    if group is None:  # one scale along the whole split dimension: each rank keeps it whole
        return None
    sizes = [size for _, _, size in shards(layer)] if split == "column" else [layer.in_features]
    bad = [n for n in sizes if n % group]
    if not bad:
        return None
    what = "rows" if split == "column" else "input columns"
    return (f"{target.name} keeps one scale per {group} {what}, and tensor_parallel_size={world} gives this "
            f"{split}-parallel layer {bad[0]} {what} per rank, which cuts a group between two ranks; choose "
            f"a size that keeps whole groups per rank, or exclude the layer (exclude_layer)")


class _Probe(nn.Module):
    """A stand-in with `layer`'s name, shape and shards, for a method's shape refusals."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.prefix, self.in_features, self.out_features = layer.prefix, layer.in_features, layer.out_features
        self.shard_ids, self.shard_range = layer.shard_ids, layer.shard_range
        self.checkpoint_shape = layer.checkpoint_shape  # a shard's shape before a tensor-parallel split
        self.weight_loader = layer.weight_loader


# --- the swap ---------------------------------------------------------------------------------
def requantize_layer(layer: nn.Module, target: Target, weight: torch.Tensor | None = None,
                     gather: Optional[bool] = None) -> Callable[[], None]:
    """Rebuild `layer` with `target`'s method, filled with its producer's tensors for
    `weight` (default: `source_weight(layer)`: this rank's slice under tensor parallel); the
    bias is kept as it is. `gather`: True gathers the full weight over `layer.tp` first,
    quantizes it and keeps this rank's slice of the tensors (module docstring), a collective
    every rank of the group must reach (`OnlineQuantPlan.apply` runs on every rank); False
    quantizes the slice as it is; None (a caller on one rank, e.g. the sensitivity explorer)
    quantizes the slice where that gives the full weight's scales (`gather_needed`) and refuses
    a layer that would need its other ranks (a gather from one rank would wait for them).
    Returns a function that puts the previous method, parameters and buffers back."""
    w32 = source_weight(layer) if weight is None else weight.float()
    if gather is None and gather_needed(target, layer):
        raise ValueError(f"layer '{layer.prefix}' ({tp_split(layer)}-parallel over tensor_parallel_size="
                         f"{_tp_size(layer)}): {target.name} needs the full weight gathered from every rank "
                         "(its slice alone gives other scales); quantize it in a pass every rank runs "
                         "(gather=True, as OnlineQuantPlan.apply does)")
    gather = bool(gather)
    # communication first, before the layer is touched: a rank that fails later fails alone
    pieces = full_shards(layer, w32) if gather else [(sid, w32[start:start + size])
                                                     for sid, start, size in shards(layer)]
    method = target.method(layer.prefix)
    saved = (layer.method, dict(layer._parameters), dict(layer._buffers))
    bias = layer.bias
    layer._parameters.clear()
    layer._buffers.clear()
    try:
        with torch.device(w32.device):
            method.create_weights(layer, layer.in_features, layer.out_features, False)
        if bias is not None:
            layer.bias = bias
        for sid, w in pieces:
            for name, t in target.produce(w).items():
                p = getattr(layer, name)
                if gather:  # a full checkpoint tensor: this rank's part, as the layer's loaders narrow it
                    t = layer.rank_slice(name, p, t, sid)
                p.weight_loader(p, t.to(p.device), sid)
        method.process_weights_after_loading(layer)
    except Exception:
        _restore(layer, saved)
        raise
    layer.method = method

    def undo() -> None:
        _restore(layer, saved)
    return undo


def _restore(layer: nn.Module, saved) -> None:
    method, params, buffers = saved
    layer._parameters.clear()
    layer._buffers.clear()
    layer._parameters.update(params)
    layer._buffers.update(buffers)
    layer.method = method


# --- tensor parallelism -----------------------------------------------------------------------
def tp_split(layer: nn.Module) -> Optional[str]:
    """How a tensor-parallel build splits `layer`: "column" (output rows: q/k/v, gate/up
    and other packed layers), "row" (input columns: o_proj, down_proj), None (not split: a
    replicated `Linear`). A linear layer says it (`tp_mode`); a stand-in without one is
    judged by its name."""
    declared = getattr(layer, "tp_split", None)
    if declared is not None:
        return declared
    if hasattr(layer, "tp_mode"):
        return layer.tp_mode
    name = layer.prefix.rsplit(".", 1)[-1]
    if name in ("o_proj", "down_proj", "out_proj", "dense_4h_to_h"):
        return "row"
    return "column"


def needs_gather(target: Target, split: Optional[str], full_size: int, tp_size: int) -> bool:
    """Whether ranks must gather the full weight before quantizing it to `target` so that
    their scales equal the unpartitioned weight's: True when the split dimension (`split`:
    "column" splits the `full_size` output rows, "row" the input columns) cuts a scale group,
    i.e. the format has one scale across that whole dimension (ptpc / int8 per-channel scales
    span a row: row-parallel layers gather) or a group that does not divide the local size
    (fp8 128x128 blocks, int4 groups, MXFP4's 32). Never for tp_size 1 or an unsplit layer."""
    if tp_size == 1 or split is None:
        return False
    if full_size % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide the split dimension ({full_size})")
    group = target.granularity[0 if split == "column" else 1]
    return group is None or (full_size // tp_size) % group != 0


def _tp_size(layer: nn.Module) -> int:
    tp = getattr(layer, "tp", None)
    return tp.world_size if tp is not None else 1


def split_size(layer: nn.Module, split: Optional[str]) -> int:
    """The full (unpartitioned) size of `layer`'s split dimension: its ranks' output rows
    ("column") or input columns ("row") together."""
    return (layer.out_features if split == "column" else layer.in_features) * _tp_size(layer)


def gather_needed(target: Target, layer: nn.Module) -> bool:
    """`needs_gather` for `layer` on its own tensor-parallel group (`layer.tp`): a packed
    column-parallel layer asks it of every shard (each is split per rank, a 128-row block
    may be cut in one and not in another)."""
    split, world = tp_split(layer), _tp_size(layer)
    if split == "column":
        return any(needs_gather(target, split, size * world, world) for _, _, size in shards(layer))
    return needs_gather(target, split, split_size(layer, split), world)


def full_shards(layer: nn.Module, w32: torch.Tensor) -> list[tuple[object, torch.Tensor]]:
    """(shard_id, the shard's full unpartitioned weight) for each shard of `layer`, from this
    rank's fp32 slice `w32` and the other ranks' (all-gathers over `layer.tp`, every rank of
    the group must call it): a row-parallel layer's columns in rank order; a column-parallel
    layer's rows shard by shard, a slice held by several consecutive ranks (KV heads
    replicated where ranks outnumber them) taken once."""
    split, tp = tp_split(layer), layer.tp
    if split == "row":
        full = tp.all_gather(w32.contiguous(), dim=1)
        return [(sid, full[start:start + size]) for sid, start, size in shards(layer)]
    if split != "column":
        raise ValueError(f"layer '{layer.prefix}' is not split across tensor-parallel ranks (tp_split={split!r}): "
                         "it has nothing to gather")
    out = []
    for sid, start, size in shards(layer):
        every = tp.all_gather(w32[start:start + size].contiguous(), dim=0)  # [size * world, in], rank order
        rows = layer.checkpoint_shape(sid)[0]
        if size == 0 or rows % size or tp.world_size % (rows // size):
            raise ValueError(f"layer '{layer.prefix}' shard {sid!r}: {tp.world_size} ranks of {size} rows do not "
                             f"make its {rows} checkpoint rows")
        holders = tp.world_size // (rows // size)  # consecutive ranks holding the same rows
        out.append((sid, torch.cat(every.split(size)[::holders])))
    return out


def scales_of(target: Target, w: torch.Tensor) -> torch.Tensor:
    """The scale tensor `target`'s producer writes for `w` (what the gather rule protects)."""
    out = target.produce(w.float())
    return next(v for k, v in out.items() if k.startswith("weight_scale"))


__all__ = ["TARGETS", "FORMATS", "Target", "target_for", "refusal", "check_source", "source_weight", "requantize_layer",
           "tp_split", "needs_gather", "gather_needed", "full_shards", "split_size", "scales_of", "pack_int4",
           "produce_ptpc_fp8", "produce_fp8_block", "produce_w8a8_int8", "produce_w4a16"]
