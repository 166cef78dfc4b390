"""Tile configurations of the experts' grouped GEMM, per (experts, width, hidden, dtype, GPU).

One JSON file per shape and GPU in `atom/model_ops/moe/configs/`, written by the tuning
command (`python -m atom.tuning.moe_tune`), named

    E=<experts>,I=<width>,H=<hidden>,dtype=<dtype>,device=<GPU name, spaces as _>.json

and holding `configs` (token count -> BLOCK_M/N/K, GROUP_M, num_warps, num_stages), the
timings that chose them, and `unsorted_max_tokens`: the largest token count at which the
unsorted small-batch path measured faster than sorting (see `experts_triton`).

Selection for T tokens (`TileTable.config_for`): the entry of the smallest tuned count >= T,
else the largest one; a shape without a file uses `default_config` and the documented
small-batch rule. The engine's `KernelPlan` reads a file once per shape (`plan.moe_tiles`).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


def device_label(name: str) -> str:
    return name.replace(" ", "_").replace("/", "_").replace(",", "_")


def config_file_name(experts: int, width: int, hidden: int, dtype: torch.dtype | str, device_name: str) -> str:
    dt = str(dtype).removeprefix("torch.")
    return f"E={experts},I={width},H={hidden},dtype={dt},device={device_label(device_name)}.json"


def default_config(tokens: int, top_k: int, experts: int) -> dict:
    """Tiles for a shape nobody tuned: BLOCK_M grows with the average rows per expert
    (tokens * top_k / experts), so that few tiles are padding."""
    per_expert = tokens * top_k / max(experts, 1)
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=3)
    if per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def check_tile(cfg: dict, where: str) -> dict:
    missing = [k for k in TILE_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"{where}: a tile configuration lacks {missing} (it needs {', '.join(TILE_KEYS)})")
    bad = [k for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if cfg[k] < 16 or cfg[k] & (cfg[k] - 1)]
    if bad:
        raise ValueError(f"{where}: {', '.join(f'{k}={cfg[k]}' for k in bad)} must be powers of two >= 16")
    return {k: int(cfg[k]) for k in TILE_KEYS}


@dataclass
class TileTable:
    """The tuned tiles of one shape (or none: defaults) and where they came from."""
    experts: int
    width: int
    hidden: int
    dtype: str
    device: str
    configs: dict[int, dict] = field(default_factory=dict)
    unsorted_max_tokens: int | None = None  # None: the rule of `experts_triton.skips_sorting`; 0: never
    source: str | None = None               # the file, None: defaults

    def config_for(self, tokens: int, top_k: int) -> dict:
        if not self.configs:
            return default_config(tokens, top_k, self.experts)
        keys = sorted(self.configs)
        key = next((k for k in keys if k >= tokens), keys[-1])
        return self.configs[key]

    def to_dict(self, timings: dict | None = None) -> dict:
        return {"experts": self.experts, "width": self.width, "hidden": self.hidden, "dtype": self.dtype,
                "device": self.device, "unsorted_max_tokens": self.unsorted_max_tokens,
                "configs": {str(k): v for k, v in sorted(self.configs.items())}, "timings_us": timings or {}}

    def save(self, folder: str | Path = CONFIG_DIR, timings: dict | None = None) -> Path:
        path = Path(folder) / config_file_name(self.experts, self.width, self.hidden, self.dtype, self.device)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")  # whole or not at all: a tuner killed mid-write
        tmp.write_text(json.dumps(self.to_dict(timings), indent=1) + "\n")
        os.replace(tmp, path)
        return path

    def to_json(self) -> str:
        """The table as one string (what the `atom::moe_experts` op takes; its source kept)."""
        return json.dumps({**self.to_dict(), "source": self.source}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TileTable":
        table = cls.from_data(json.loads(text), "a tile table")
        table.source = json.loads(text).get("source")
        return table

    @classmethod
    def from_file(cls, path: str | Path) -> "TileTable":
        path = Path(path)
        table = cls.from_data(json.loads(path.read_text()), f"MoE tile file {path}")
        table.source = str(path)
        return table

    @classmethod
    def from_data(cls, data: dict, where: str) -> "TileTable":
        try:
            configs = {int(k): check_tile(v, f"{where} [{k}]") for k, v in data["configs"].items()}
            umt = data.get("unsorted_max_tokens")
            return cls(int(data["experts"]), int(data["width"]), int(data["hidden"]), str(data["dtype"]),
                       str(data["device"]), configs, None if umt is None else int(umt))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where} is malformed ({e}): rewrite it with python -m atom.tuning.moe_tune") from e


def tiles_frame(path: str | Path):
    """A tile file as a DataFrame (pandas), one row per tuned token count: the tile, which path
    runs there (`unsorted_max_tokens`), the tuner's sorted / unsorted timings (us) and how
    many tiles it timed."""
    import pandas as pd
    data = json.loads(Path(path).read_text())
    table = TileTable.from_data(data, f"MoE tile file {path}")
    timings = data.get("timings_us", {})
    umt = table.unsorted_max_tokens
    rows = []
    for T, cfg in sorted(table.configs.items()):
        path_ = "the T*k <= E rule" if umt is None else ("unsorted" if T <= umt else "sorted")
        t = timings.get(str(T), {})
        rows.append({"tokens": T, **cfg, "path": path_,
                     "sorted_us": t.get("sorted_us"), "unsorted_us": t.get("unsorted_us"), "tried": t.get("tried")})
    return pd.DataFrame(rows)


def find_tiles(experts: int, width: int, hidden: int, dtype: torch.dtype | str, device_name: str,
               folders: tuple[str | Path, ...] = ()) -> TileTable:
    """The table from the first of `folders` (then the package's configs/) holding this shape's
    file, else a table of defaults."""
    name = config_file_name(experts, width, hidden, dtype, device_name)
    for folder in (*folders, CONFIG_DIR):
        path = Path(os.path.expanduser(str(folder))) / name
        if path.is_file():
            table = TileTable.from_file(path)
            logger.info("MoE tiles for E=%d I=%d H=%d from %s", experts, width, hidden, path)
            return table
    logger.info("no tuned MoE tiles %s: default tiles (python -m atom.tuning.moe_tune writes them)", name)
    return TileTable(experts, width, hidden, str(dtype).removeprefix("torch."), device_name)
