"""KV-cache specs (what one attention layer stores per token) and the manager that sizes,
allocates and binds them.

Each attention layer declares a spec through its backend (`Attention.kv_cache_spec()`):
full keys and values per KV head (`FullAttentionSpec`; a sliding-window layer says its window,
and still keeps every token's entries), or one latent vector per token
(`LatentAttentionSpec`, as multi-head latent attention stores it). All layers share the
block ids the `BlockManager` hands out, so one block costs the sum of every layer's page
(a spec's dtype sets its element size: an FP8 cache, `kv_cache_dtype_of("fp8", ...)`, halves
a bf16 page, so the same memory holds twice the blocks);
the manager turns one memory budget into a block count, allocates one tensor per group of
layers with equal specs and binds each layer's view (`spec.bind`).

    manager = KVCacheManager({layer_num: (layer, spec), ...}, block_size=16, device="cpu")
    n = manager.num_blocks_for(budget_bytes)
    manager.allocate(n)           # layers now hold their views
    manager.kv_cache_config()     # the guide's KVCacheConfig / KVCacheTensor of what was allocated
    manager.to_frame()            # one row per layer
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from atom.parallel_config import KVCacheConfig, KVCacheTensor

logger = logging.getLogger(__name__)


KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn}  # kv_cache_dtype -> storage dtype ("bf16": the model's)


def kv_cache_dtype_of(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of the KV cache: "bf16" keeps the model's dtype (bf16, or fp32 / fp16
    when the model runs in those), "fp8" stores e4m3 keys and values with per-layer scales."""
    if kv_cache_dtype == "bf16":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is invalid: choose 'bf16' or 'fp8'")
    return KV_CACHE_DTYPES[kv_cache_dtype]


@dataclass(frozen=True)
class FullAttentionSpec:
    """Keys and values of every KV head: a page is [2, block_size, num_kv_heads, head_dim].
    `sliding_window`: the layer attends its last W tokens only (all tokens stay cached)."""
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_window: int | None = None

    @property
    def kind(self) -> str:
        return "full" if self.sliding_window is None else f"sliding({self.sliding_window})"

    def page_shape(self, block_size: int) -> tuple[int, ...]:
        return (2, block_size, self.num_kv_heads, self.head_dim)

    def page_bytes(self, block_size: int) -> int:
        return 2 * block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def group_shape(self, num_layers: int, num_blocks: int, block_size: int) -> tuple[int, ...]:
        # K and V outermost: each layer's k / v view is one contiguous [blocks, bs, H, D] tensor
        return (2, num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def bind(self, layer, group: torch.Tensor, i: int) -> KVCacheTensor:
        layer.k_cache, layer.v_cache = group[0, i], group[1, i]
        return KVCacheTensor(layer_num=layer.layer_idx, k_cache=layer.k_cache, v_cache=layer.v_cache)

    def unbind(self, layer) -> None:
        layer.k_cache = layer.v_cache = torch.empty(0)


@dataclass(frozen=True)
class LatentAttentionSpec:
    """One latent vector per token (compressed KV + rope dims): a page is [block_size, dim]."""
    latent_dim: int
    dtype: torch.dtype
    kind = "latent"

    def page_shape(self, block_size: int) -> tuple[int, ...]:
        return (block_size, self.latent_dim)

    def page_bytes(self, block_size: int) -> int:
        return block_size * self.latent_dim * self.dtype.itemsize

    def group_shape(self, num_layers: int, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_layers, num_blocks, block_size, self.latent_dim)

    def bind(self, layer, group: torch.Tensor, i: int) -> KVCacheTensor:
        layer.kv_cache = group[i]
        return KVCacheTensor(layer_num=layer.layer_idx, k_cache=layer.kv_cache)

    def unbind(self, layer) -> None:
        layer.kv_cache = torch.empty(0)


def _scales(layer, spec) -> dict:
    """An FP8 cache's per-layer scales and where they came from (checkpoint, computed or the
    default); an MLA layer has one (k_scale, its latent's), so its v_scale is left empty."""
    if spec.dtype.itemsize != 1 or not hasattr(layer, "k_scale"):
        return {}
    v_scale = getattr(layer, "v_scale", None)
    return {"k_scale": float(layer.k_scale), "v_scale": None if v_scale is None else float(v_scale),
            "scale_source": getattr(layer, "kv_scale_source", "default 1.0")}


class KVCacheManager:
    """Sizes all layers' caches from one budget, allocates them and binds each layer's view.

    `layers`: {layer_num: (layer, spec)}; the layer receives its view through `spec.bind`."""

    def __init__(self, layers: dict[int, tuple[object, object]], block_size: int, device="cpu"):
        if not layers:
            raise ValueError("KVCacheManager needs at least one attention layer")
        self.layers = dict(sorted(layers.items()))
        self.block_size = block_size
        self.device = torch.device(device)
        self.num_blocks = 0
        self.tensors: list[torch.Tensor] = []   # one per group of equal specs
        self._config: KVCacheConfig | None = None

    def groups(self) -> dict[object, list[int]]:
        """Layers by spec, in layer order: each group is one allocation."""
        out: dict[object, list[int]] = {}
        for num, (_, spec) in self.layers.items():
            out.setdefault(spec, []).append(num)
        return out

    @property
    def bytes_per_block(self) -> int:
        """What one block id costs over all layers."""
        return sum(spec.page_bytes(self.block_size) for _, spec in self.layers.values())

    def num_blocks_for(self, budget_bytes: float) -> int:
        return int(budget_bytes // self.bytes_per_block)

    def allocate(self, num_blocks: int) -> KVCacheConfig:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid: must be >= 1")
        self.release()
        tensors = []
        for spec, nums in self.groups().items():
            group = torch.zeros(spec.group_shape(len(nums), num_blocks, self.block_size), dtype=spec.dtype,
                                device=self.device)
            self.tensors.append(group)
            for i, num in enumerate(nums):
                tensors.append(spec.bind(self.layers[num][0], group, i))
        self.num_blocks = num_blocks
        self._config = KVCacheConfig(sorted(tensors, key=lambda t: t.layer_num))
        return self._config

    def release(self) -> None:
        """Drop the allocation (the layers' views become empty)."""
        for layer, spec in self.layers.values():
            spec.unbind(layer)
        self.tensors, self._config, self.num_blocks = [], None, 0

    def kv_cache_config(self) -> KVCacheConfig:
        if self._config is None:
            raise RuntimeError("the KV cache is not allocated: call allocate(num_blocks)")
        return self._config

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def rows(self) -> list[dict]:
        return [{"layer": num, "kind": spec.kind, "dtype": str(spec.dtype).removeprefix("torch."),
                 "page_shape": spec.page_shape(self.block_size),
                 "bytes_per_token": spec.page_bytes(self.block_size) // self.block_size,
                 "bytes_per_block": spec.page_bytes(self.block_size),
                 "bytes": spec.page_bytes(self.block_size) * self.num_blocks, **_scales(layer, spec)}
                for num, (layer, spec) in self.layers.items()]

    def to_frame(self):
        import pandas as pd
        return pd.DataFrame(self.rows())

    def __repr__(self) -> str:
        kinds = ", ".join(f"{len(nums)}x{spec.kind}" for spec, nums in self.groups().items())
        return (f"KVCacheManager(layers={len(self.layers)} ({kinds}), blocks={self.num_blocks}x{self.block_size}, "
                f"{self.bytes_per_block} B/block, {self.nbytes / 2**30:.2f} GiB)")
