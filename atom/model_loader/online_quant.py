"""Online quantization at load time (`online_quant_config`, the guide's "Online quantization
at load time").

    plan = OnlineQuantPlan({"global_quant_config": "ptpc_fp8", "exclude_layer": ["re:.*down_proj"]})
    plan.check(model)             # before weights load: refusals name the layer and the field
    info = plan.apply(model)      # after loading: each targeted layer re-quantized in place
    plan.write_info(info, folder) # online_quant_info_<time>_<pid>.json

Which format a linear layer gets, in order: `exclude_layer` (an exact name, a parent
module's name (prefix), an fnmatch glob, or `re:<regex>` matched from the start of the
name) leaves it as loaded; then the first `layer_quant_config` pattern (fnmatch) that
matches; then `global_quant_config`; none of them: as loaded. A packed layer
(`qkv_proj`, `gate_up_proj`) answers to its own name and to the names of its checkpoint
shards (`q_proj` ...): excluding one shard leaves the whole packed matrix unquantized.
The LM head is not a linear layer here and is never quantized.

Weights load in the model dtype (or as FP8 blocks); `apply` then re-quantizes each targeted
layer into its format's checkpoint layout and method (`atom.model_ops.quant.online`).

A MoE layer (FusedMoE, e.g. `model.layers.0.mlp.experts`) answers to its own name: targeted
as ptpc_fp8 or mxfp4 its unquantized experts are re-quantized into that format's MoE method
(`atom.model_ops.moe.online`); a format with no MoE method (int8, int4, fp8 blocks) is refused
by name, as is MLA's `kv_b_proj` (the absorbed decode reads its weight as it is): exclude them.

Tensor parallelism (`tensor_parallel_size` > 1): every rank runs the same pass on its own
slices, layer by layer in the same order. For each targeted layer the rule
(`needs_gather`, on the layer's own group `layer.tp`) says whether quantizing the rank's
slice would give other scales than quantizing the full unpartitioned weight: if so, the ranks
all-gather the slices, quantize the full weight and each keeps its slice of the quantized
weight and scales (per-row scales of a row-parallel layer whole); if not, each quantizes its
slice alone, with no communication (`atom.model_ops.quant.online.requantize_layer`). With
ptpc_fp8 that is a gather for the row-parallel layers (o_proj, down_proj: a row's scale spans
every rank's columns) and none for the column-parallel ones (qkv, gate_up); MXFP4 gathers
nothing when a rank's columns are whole groups of 32 (a slice that cuts a group is refused
by name before loading: the rank's method cannot hold it). MoE experts split by width follow
the same rule per matrix (w2 gathers for ptpc_fp8); a MoE method that does not declare how
its tensors split (MXFP4's) is refused by name for them before loading; experts split whole
(expert parallel) need nothing (`atom.model_ops.moe.online`). The summary's `tp_split` /
`tp_gather` columns record each layer's split and decision (`tp_gather_parts` names a MoE
layer's gathered matrices); rank 0 alone (of the tensor-parallel group, in data-parallel
replica 0) writes the file.
"""
from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
import time
from typing import Any, Optional

import torch
from torch import nn

from atom.model_ops.linear import Linear
from atom.model_ops.moe.layer import FusedMoE
from atom.model_ops.moe.online import expert_refusal, requantize_experts
from atom.model_ops.quant.online import (FORMATS, check_source, gather_needed, refusal, requantize_layer,
                                         source_weight, target_for, tp_split)

logger = logging.getLogger(__name__)

FIELD = "online_quant_config"


def exclude_matches(name: str, entry: str) -> bool:
    """`entry` of an exclude list matches layer `name`: `re:` regex from the start, a glob,
    or the exact name / a parent module's name (`model.layers.1` or `model.layers.1.`: the
    layers of block 1, never those of block 10)."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    if any(c in entry for c in "*?["):
        return fnmatch.fnmatchcase(name, entry)
    parent = entry if entry.endswith(".") else entry + "."
    return name == entry or name.startswith(parent)


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every linear layer (`atom.model_ops.linear.Linear`: not the LM head), by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear)}


def moe_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every MoE layer (`atom.model_ops.moe.layer.FusedMoE`: its stacked experts), by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, FusedMoE)}


def layer_aliases(name: str, model: nn.Module) -> list[str]:
    """`name` and, for a packed layer, the checkpoint names of its shards."""
    out = [name]
    head, _, last = name.rpartition(".")
    for src, (dst, _shard) in getattr(model, "packed_modules_mapping", {}).items():
        if dst == last:
            out.append(f"{head}.{src}" if head else src)
    return out


class OnlineQuantPlan:
    """The target format of every linear layer, from an `online_quant_config` dict (as
    `Config` validated it: `exclude_layer` a list). `formats`: the names accepted (default:
    every format with a target or pending one; `Config` itself accepts the guide's two)."""

    def __init__(self, cfg: dict, formats: tuple[str, ...] = FORMATS):
        cfg = dict(cfg or {})
        unknown = sorted(set(cfg) - {"global_quant_config", "layer_quant_config", "exclude_layer"})
        if unknown:
            raise ValueError(f"{FIELD}={cfg!r} is invalid: unknown keys {unknown}")
        self.global_format: Optional[str] = cfg.get("global_quant_config")
        self.layer_formats: list[tuple[str, str]] = list((cfg.get("layer_quant_config") or {}).items())
        exclude = cfg.get("exclude_layer") or []
        self.exclude: list[str] = [exclude] if isinstance(exclude, str) else list(exclude)
        checks = [("global_quant_config", self.global_format)] if self.global_format is not None else []
        checks += [(f"layer_quant_config[{p!r}]", f) for p, f in self.layer_formats]
        for field, fmt in checks:
            if fmt not in formats:
                raise ValueError(f"{FIELD}.{field}={fmt!r} is invalid: must be one of {list(formats)}")
        for entry in self.exclude:
            if not isinstance(entry, str) or not entry:
                raise ValueError(f"{FIELD}.exclude_layer={entry!r} is invalid: entries are non-empty strings")
            if entry.startswith("re:"):
                try:
                    re.compile(entry[3:])
                except re.error as exc:
                    raise ValueError(f"{FIELD}.exclude_layer={entry!r} is invalid: bad regex ({exc})") from None

    @classmethod
    def from_config(cls, config) -> Optional["OnlineQuantPlan"]:
        cfg = getattr(config, "online_quant_config", None)
        return cls(cfg) if cfg else None

    @property
    def enabled(self) -> bool:
        return self.global_format is not None or bool(self.layer_formats)

    def to_dict(self) -> dict:
        return {"global_quant_config": self.global_format, "layer_quant_config": dict(self.layer_formats),
                "exclude_layer": list(self.exclude)}

    # -- per layer --------------------------------------------------------------------
    def field_for(self, names: list[str]) -> tuple[Optional[str], Optional[str]]:
        """(format, the config field that chose it) for a layer known by `names`;
        (None, "exclude_layer") when excluded, (None, None) when nothing targets it."""
        if any(exclude_matches(n, e) for n in names for e in self.exclude):
            return None, "exclude_layer"
        for pattern, fmt in self.layer_formats:
            if any(fnmatch.fnmatchcase(n, pattern) for n in names):
                return fmt, f"layer_quant_config[{pattern!r}]"
        if self.global_format is not None:
            return self.global_format, "global_quant_config"
        return None, None

    def format_for(self, name: str, model: nn.Module | None = None) -> Optional[str]:
        names = layer_aliases(name, model) if model is not None else [name]
        return self.field_for(names)[0]

    def targets(self, model: nn.Module) -> dict[str, tuple[Optional[str], Optional[str]]]:
        """Layer name -> (format, field) for every linear layer of `model`."""
        return {n: self.field_for(layer_aliases(n, model)) for n in linear_layers(model)}

    def targeted(self, model: nn.Module) -> set[str]:
        """Names of the linear and MoE layers this plan re-quantizes (a format, not excluded)."""
        moe = {n for n in moe_layers(model) if self.field_for([n])[0] is not None}
        return moe | {n for n, (fmt, _) in self.targets(model).items() if fmt is not None}

    def check(self, model: nn.Module) -> None:
        """Refuse, before any weight loads, a targeted layer whose format has no method here
        (NotImplementedError) or whose checkpoint format cannot be re-quantized (ValueError);
        both name the layer and the config field."""
        layers = linear_layers(model)
        kept = {id(m._kv_b[0]) for m in model.modules() if hasattr(m, "_kv_b")}  # MLA's kv_b_proj
        for name, m in moe_layers(model).items():
            fmt, field = self.field_for([name])
            if fmt is None:
                continue
            why = expert_refusal(target_for(fmt, name, f"{FIELD}.{field}"), m)
            if why is not None:
                raise NotImplementedError(f"{FIELD}.{field}={fmt!r} targets the MoE experts '{name}': {why}; "
                                          "exclude them (exclude_layer, e.g. 're:.*experts')")
        for name, (fmt, field) in self.targets(model).items():
            if fmt is None:
                continue
            if id(layers[name]) in kept:
                raise ValueError(f"{FIELD}.{field}={fmt!r} targets '{name}', whose weight MLA's absorbed "
                                 "decode reads as it is (unquantized); exclude it (exclude_layer)")
            target = target_for(fmt, name, f"{FIELD}.{field}")
            reason = check_source(layers[name])
            if reason is not None:
                raise ValueError(f"{FIELD}.{field}={fmt!r} targets layer '{name}', which cannot be "
                                 f"quantized online: {reason}; exclude it (exclude_layer)")
            why = refusal(target, layers[name])  # a shape the format cannot hold (e.g. int4 groups)
            if why is not None:
                raise NotImplementedError(f"{FIELD}.{field}={fmt!r} targets layer '{name}': {why}; "
                                          "exclude it (exclude_layer)")

    # -- the pass ---------------------------------------------------------------------------
    def apply(self, model: nn.Module, tp_size: Optional[int] = None, model_name: str = "") -> dict:
        """Re-quantize every targeted layer of the loaded `model` (this rank's slices, gathering
        where the rule says so: module docstring); the info summary (dict). Under tensor
        parallel every rank of the model's group runs it. `tp_size` (default: the linear
        layers' group size) is reported; each layer's decision follows its own group."""
        t0 = time.perf_counter()
        rows = []
        layers = linear_layers(model)
        if tp_size is None:
            tp_size = max((m.tp.world_size for m in layers.values()), default=1)
        for name, layer in layers.items():
            fmt, field = self.field_for(layer_aliases(name, model))
            row = {"layer": name, "source": layer.method.format(layer), "target": fmt, "chosen_by": field}
            if fmt is not None:
                target = target_for(fmt, name, f"{FIELD}.{field}")
                gather = gather_needed(target, layer)
                row["tp_split"], row["tp_gather"] = tp_split(layer), gather
                requantize_layer(layer, target, source_weight(layer), gather=gather)
            row["format"] = layer.method.format(layer)
            rows.append(row)
        for name, layer in moe_layers(model).items():
            fmt, field = self.field_for([name])
            row = {"layer": name, "source": layer.method.format(layer), "target": fmt, "chosen_by": field}
            if fmt is not None:
                gathered = requantize_experts(layer, target_for(fmt, name, f"{FIELD}.{field}"))
                row["tp_split"] = {"tensor": "width", "expert": "experts"}.get(layer.parallel_mode)
                row["tp_gather"], row["tp_gather_parts"] = bool(gathered), gathered
            row["format"] = layer.method.format(layer)
            rows.append(row)
        elapsed = time.perf_counter() - t0
        done = sum(r["target"] is not None for r in rows)
        logger.info("online quantization: %d of %d linear layers re-quantized in %.2f s", done, len(rows), elapsed)
        return {"model": model_name, "online_quant_config": self.to_dict(), "elapsed_s": elapsed,
                "tp_size": tp_size, "num_layers": len(rows), "num_quantized": done, "layers": rows}

    @staticmethod
    def write_info(info: dict, folder: str | None = None, rank: int = 0) -> Optional[str]:
        """Rank 0 writes `online_quant_info_<time>_<pid>.json` under `folder` (default:
        $ATOM_TORCH_PROFILER_DIR, else the working directory); the path, or None elsewhere."""
        if rank != 0:
            return None
        folder = folder or os.environ.get("ATOM_TORCH_PROFILER_DIR") or os.getcwd()
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"online_quant_info_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump(info, f, indent=1, default=str)
        logger.info("online quantization summary: %s", path)
        return path

    def __repr__(self) -> str:
        return (f"OnlineQuantPlan(global={self.global_format!r}, layers={dict(self.layer_formats)!r}, "
                f"exclude={self.exclude!r})")


def summary_rank(model: nn.Module, config=None) -> int:
    """This process's rank for the summary file: its tensor-parallel rank (the linear layers'
    group) within its data-parallel replica (`parallel_config.data_parallel_rank`); 0 on
    the first rank of the first replica only."""
    tp = next((m.tp for m in linear_layers(model).values()), None)
    tp_rank, tp_world = (tp.rank, tp.world_size) if tp is not None else (0, 1)
    pc = getattr(config, "parallel_config", None)
    dp_rank = getattr(pc, "data_parallel_rank", 0) or 0
    return dp_rank * tp_world + tp_rank


def apply_online_quant(model: nn.Module, config, plan: OnlineQuantPlan) -> dict:
    """What the model runner does after loading (on every rank): apply `plan`; rank 0
    writes the info file (`info_path`: None on the other ranks)."""
    info = plan.apply(model, tp_size=getattr(config, "tensor_parallel_size", 1) or 1,
                      model_name=str(getattr(config, "model", "")))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the replaced weights' memory, before the KV cache is sized
    info["info_path"] = plan.write_info(info, getattr(config, "torch_profiler_dir", None),
                                        rank=summary_rank(model, config))
    return info


__all__ = ["OnlineQuantPlan", "apply_online_quant", "exclude_matches", "layer_aliases", "linear_layers",
           "summary_rank"]
