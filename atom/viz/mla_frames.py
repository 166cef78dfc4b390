"""The MLA decode launch in notebooks: what `pick_mla_config` picks per batch, and the rows of
a `scripts/mla_decode_sweep.py` JSON (time and latent-cache bandwidth per configuration).

    from atom.viz.mla_frames import mla_launch_frame, mla_sweep_frame
    mla_launch_frame([1, 8, 32, 64, 128, 256])
    df = mla_sweep_frame("mla_sweep.json"); df[df.is_best]
"""
from __future__ import annotations

import json
from typing import Any, Iterable

import pandas as pd


def mla_launch_frame(batches: Iterable[int], num_heads: int = 16, kv_lora_rank: int = 512,
                     num_sms: int = 132, rope_dim: int = 64) -> pd.DataFrame:
    """One row a batch size: the launch `pick_mla_config` chooses (DeepSeek-V2-Lite's shape by
    default), its programs and programs per SM, the workspace slots the batch takes, and the
    latent tiles a program keeps in flight (num_stages - 1 copies issued ahead, at least one)
    with their shared memory (bf16 cache)."""
    from atom.model_ops.kernels.mla_decode import pick_mla_config
    rows = []
    for b in batches:
        cfg = pick_mla_config(int(b), num_heads, kv_lora_rank, num_sms)
        progs = int(b) * -(-num_heads // cfg["BLOCK_H"]) * cfg["num_splits"]
        tiles = max(1, cfg["num_stages"] - 1)
        rows.append(dict(batch=int(b), **cfg, programs=progs, programs_per_sm=round(progs / num_sms, 2),
                         workspace_slots=int(b) * cfg["num_splits"] if cfg["num_splits"] > 1 else 0,
                         tiles_in_flight=tiles,
                         tiles_kib=round(tiles * cfg["TILE_N"] * (kv_lora_rank + rope_dim) * 2 / 1024, 1)))
    return pd.DataFrame(rows)


def mla_sweep_frame(src: str | dict[str, Any]) -> pd.DataFrame:
    """Every timed configuration of a sweep (a JSON path or its loaded dict): case, config
    (as text), us, TB/s, share of the peak, and whether it is the default / the case's best."""
    data = json.load(open(src)) if isinstance(src, str) else src
    peak = float(data.get("peak_TBs", 4.3))
    rows = []
    for case, res in data["results"].items():
        best = res["best"][0]["config"] if res.get("best") else None
        for r in res["all"]:
            if "us" not in r:
                continue
            cfg = r["config"]
            rows.append(dict(case=case, config=cfg if isinstance(cfg, str) else json.dumps(cfg, sort_keys=True),
                             us=r["us"], TBs=r["TBs"], of_peak=round(r["TBs"] / peak, 3),
                             is_default=cfg == "default", is_best=cfg == best))
    return pd.DataFrame(rows, columns=["case", "config", "us", "TBs", "of_peak", "is_default", "is_best"])
