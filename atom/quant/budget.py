"""Mixed precision under a size budget: a format per group from the explorer's tables.

    tables = [ex.run(f) for f in ("mxfp4", "ptpc_fp8")]     # one row per layer and format
    budget = ex.evaluate({"global_quant_config": "w4a16_g32"})["linear_bytes"]
    choice = choose_formats(tables, budget)
    ex.evaluate(mixed_config(choice))                        # the mix's own figures

Each group's options are the formats whose table holds it (status "ok") and, unless
`allow_unquantized=False`, leaving it as loaded ("as loaded": unquantized for a bf16
checkpoint). The KL of quantizing several groups is taken as the sum of each group's own KL
(the first-order picture the tables give; `evaluate` measures the real one). The choice
minimises that sum within the budget, greedily: every group starts at its smallest option,
then the upgrade with the most KL saved per added byte is taken while it fits, along each
group's lower convex hull of (bytes, KL). Where every step along the hulls adds the same
bytes this is the exact optimum; otherwise the sum is above the optimum by at most the KL
that the first upgrade which did not fit would have saved (the greedy solves the relaxed
problem up to it).
"""
from __future__ import annotations

import heapq
import math
import numbers
from typing import Iterable, Optional

import pandas as pd

from atom.quant_spec import ONLINE_QUANT_FORMATS

AS_LOADED = "as loaded"  # a group left as the checkpoint has it (KL 0 against the base)
CHOICE_COLUMNS = ["group", "layers", "format", "kl", "bytes", "bytes_smallest"]


def _options(tables: Iterable[pd.DataFrame], allow_unquantized: bool) -> dict[str, list[tuple[int, float, str]]]:
    """group -> [(bytes, kl, format)] over the tables' usable rows (and the loaded layer)."""
    out: dict[str, list[tuple[int, float, str]]] = {}
    seen_by = set()
    for df in tables:
        fmt = df.attrs.get("format")
        if fmt is None:
            raise ValueError("tables must be SensitivityExplorer.run() tables (their attrs name the format)")
        seen_by.add(df.attrs.get("by"))
        for row in df.itertuples(index=False):
            opts = out.setdefault(row.group, [])
            if allow_unquantized and not any(o[2] == AS_LOADED for o in opts):
                opts.append((int(row.bytes_before), 0.0, AS_LOADED))
            if row.status == "ok" and not math.isnan(row.kl):
                opts.append((int(row.bytes_after), float(row.kl), fmt))
    if len(seen_by) > 1:
        raise ValueError(f"tables group layers differently ({sorted(map(str, seen_by))}): pass tables of one `by`")
    empty = [g for g, o in out.items() if not o]
    if empty:
        raise ValueError(f"groups {empty[:4]} have no usable format and allow_unquantized=False")
    return out


def _hull(opts: list[tuple[int, float, str]]) -> list[tuple[int, float, str]]:
    """The options on the lower convex hull of (bytes, kl), by bytes: cheapest first, each
    next one saving KL at a falling rate per byte (dominated and concave options dropped)."""
    best: dict[int, tuple[int, float, str]] = {}
    for o in opts:
        if o[0] not in best or o[1] < best[o[0]][1]:
            best[o[0]] = o
    hull: list[tuple[int, float, str]] = []
    for o in sorted(best.values()):
        if hull and o[1] >= hull[-1][1]:
            continue  # bigger and no better
        while len(hull) >= 2:
            (b0, k0, _), (b1, k1, _) = hull[-2], hull[-1]
            # drop the middle point when the new one saves at least as much per byte from b0
            if (k0 - o[1]) * (b1 - b0) >= (k0 - k1) * (o[0] - b0):
                hull.pop()
            else:
                break
        hull.append(o)
    return hull


def choose_formats(tables: Iterable[pd.DataFrame], budget_bytes: int, allow_unquantized: bool = True) -> pd.DataFrame:
    """One row per group: the chosen `format` (or "as loaded"), its table KL and bytes,
    and the group's smallest option's bytes. attrs: budget, bytes (the total), kl_sum (the
    predicted KL) and the formats considered. `budget_bytes`: the most weight bytes the
    groups may take together (e.g. a uniform configuration's `linear_bytes` minus the bytes
    of layers outside the tables)."""
    tables = list(tables)
    if not tables:
        raise ValueError("tables is empty: pass at least one SensitivityExplorer.run() table")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Real) or not budget_bytes > 0:
        raise ValueError(f"budget_bytes={budget_bytes!r} is invalid: must be a positive number of bytes")
    options = _options(tables, allow_unquantized)
    hulls = {g: _hull(o) for g, o in options.items()}
    at = {g: 0 for g in hulls}
    total = sum(h[0][0] for h in hulls.values())
    if total > budget_bytes:
        raise ValueError(f"budget_bytes={budget_bytes} is invalid: the smallest option of every group "
                         f"already takes {total} bytes")
    heap = []

    def push(g: str) -> None:
        h, i = hulls[g], at[g]
        if i + 1 < len(h):
            (b0, k0, _), (b1, k1, _) = h[i], h[i + 1]
            heapq.heappush(heap, (-(k0 - k1) / (b1 - b0), g))

    for g in hulls:
        push(g)
    while heap:
        _, g = heapq.heappop(heap)
        h, i = hulls[g], at[g]
        step = h[i + 1][0] - h[i][0]
        if total + step <= budget_bytes:
            total += step
            at[g] = i + 1
            push(g)
    layers = {row.group: int(row.layers) for df in tables for row in df.itertuples(index=False)}
    rows = [{"group": g, "layers": layers[g], "format": hulls[g][at[g]][2], "kl": hulls[g][at[g]][1],
             "bytes": hulls[g][at[g]][0], "bytes_smallest": hulls[g][0][0]} for g in options]
    out = pd.DataFrame(rows, columns=CHOICE_COLUMNS)
    out.attrs.update(budget=budget_bytes, bytes=int(out["bytes"].sum()), kl_sum=float(out["kl"].sum()),
                     formats=[df.attrs["format"] for df in tables], by=tables[0].attrs.get("by"))
    return out


def _pattern(group: str, by: Optional[str]) -> str:
    """The name pattern that selects `group`'s layers: the layer itself, a decoder layer's
    layers, or every layer of a projection kind."""
    return {"decoder": f"{group}.*", "kind": f"*.{group}"}.get(by, group)


def mixed_config(choice: pd.DataFrame, guide_formats: bool = True) -> dict:
    """The `online_quant_config` of a `choose_formats` table: its most common format global,
    the others per layer (`layer_quant_config`), the groups left as loaded in `exclude_layer`.
    `guide_formats`: refuse formats that `--online_quant_config` does not take (the guide's
    ptpc_fp8 and mxfp4); False keeps the explorer's others (for `SensitivityExplorer.evaluate`)."""
    by = choice.attrs.get("by")
    quantized = choice[choice["format"] != AS_LOADED]
    if guide_formats:
        bad = sorted(set(quantized["format"]) - set(ONLINE_QUANT_FORMATS))
        if bad:
            raise ValueError(f"format {bad[0]!r} is invalid for online_quant_config: must be one of "
                             f"{sorted(ONLINE_QUANT_FORMATS)} (pass guide_formats=False to evaluate it)")
    cfg: dict = {}
    if len(quantized):
        counts = quantized.groupby("format")["layers"].sum().sort_values(ascending=False, kind="stable")
        glob = counts.index[0]
        cfg["global_quant_config"] = glob
        others = quantized[quantized["format"] != glob]
        if len(others):
            cfg["layer_quant_config"] = {_pattern(r.group, by): r.format for r in others.itertuples(index=False)}
    left = choice[choice["format"] == AS_LOADED]
    if len(left):
        cfg["exclude_layer"] = [_pattern(g, by) for g in left["group"]]
    return cfg
