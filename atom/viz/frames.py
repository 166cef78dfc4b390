"""Analysis frames: what the engine recorded, as pandas DataFrames ready to plot.

    steps = steps_frame(llm)              # one row per step, plus derived columns
    reqs = requests_frame(llm)            # one row per finished request
    windowed_hit_rate(reqs, window=8)     # prefix-cache hit rate over a sliding window
    graph_usage(steps, [1, 2, 4, 8])      # CUDA-graph sizes used and padding wasted
    save_frames(llm, "run1"); load_frames("run1")   # JSON lines, reloadable anywhere

Every function accepts a live `LLM`, `LLMEngine` or `EngineStats`, or a DataFrame
(e.g. one loaded with `load_frames`).
"""
from __future__ import annotations

import bisect
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

import pandas as pd

logger = logging.getLogger(__name__)

STEP_COLUMNS = ["step", "time", "latency", "schedule_s", "run_s", "num_seqs", "prefill_tokens",
                "decode_tokens", "num_sampled", "chunk_sizes", "kv_usage", "prefix_hit_tokens",
                "prefix_query_tokens", "preemptions", "graph_size", "mixed_graph_tokens"]
REQUEST_COLUMNS = ["request_id", "prompt_tokens", "output_tokens", "cached_tokens", "preemptions",
                   "ttft", "tpot", "e2e", "finish_reason"]


def _stats_of(src: Any):
    """The `EngineStats` behind an `LLM`, `LLMEngine` or `EngineStats`, else None."""
    if hasattr(src, "step_rows") and hasattr(src, "request_rows"):
        return src
    for attr in ("stats", "engine"):
        inner = getattr(src, attr, None)
        if inner is not None and inner is not src:
            found = _stats_of(inner)
            if found is not None:
                return found
    return None


_KEY_COLUMNS = {"steps": ["latency", "num_seqs", "prefill_tokens", "decode_tokens"],
                "requests": ["prompt_tokens", "output_tokens", "cached_tokens"]}


def _raw_frame(src: Any, kind: str, columns: list[str]) -> pd.DataFrame:
    if isinstance(src, pd.DataFrame):
        df = src.copy()
        missing = [c for c in _KEY_COLUMNS[kind] if c not in df.columns]
        if len(df.columns) and missing:
            raise ValueError(f"this DataFrame is not a {kind} frame: it lacks columns {missing} "
                             f"(has {list(df.columns)[:8]}...)")
    elif isinstance(src, (list, tuple)):
        df = pd.DataFrame(list(src))
    else:
        stats = _stats_of(src)
        if stats is None:
            raise TypeError(f"cannot read {kind} from {type(src).__name__}: pass an LLM, LLMEngine, "
                            f"EngineStats or a DataFrame")
        df = pd.DataFrame(stats.step_rows if kind == "steps" else stats.request_rows)
    for c in columns:
        if c not in df.columns:
            df[c] = pd.Series(dtype="object" if c in ("chunk_sizes", "graph_size", "mixed_graph_tokens", "request_id",
                                                       "finish_reason") else "float64")
    return df


def _as_list(x: Any) -> list[int]:
    if isinstance(x, str):  # a CSV round trip turns lists into their repr
        x = json.loads(x) if x.strip() else []
    if x is None or (isinstance(x, float) and pd.isna(x)):
        return []
    return [int(v) for v in x]


def steps_frame(src: Any) -> pd.DataFrame:
    """One row per engine step, with derived columns:

    `tokens` (prefill + decode tokens run), `max_chunk` (largest prefill chunk, 0 for a
    decode-only step), `is_decode` (no prefill tokens), `elapsed` (s since the first step),
    `latency_ms`, `tok_per_s` (tokens run / step latency).
    """
    df = _raw_frame(src, "steps", STEP_COLUMNS)
    if df.empty:
        for c in ("tokens", "max_chunk", "elapsed", "latency_ms", "tok_per_s"):
            df[c] = pd.Series(dtype="float64")
        df["is_decode"] = pd.Series(dtype="bool")
        return df
    df["chunk_sizes"] = df["chunk_sizes"].map(_as_list)
    for c in ("graph_size", "mixed_graph_tokens"):  # decode graph's batch size / mixed graph's token bucket
        df[c] = df[c].map(lambda g: None if g is None or pd.isna(g) else int(g))
    df = df.sort_values("step").reset_index(drop=True) if df["step"].notna().all() else df
    df["tokens"] = df["prefill_tokens"] + df["decode_tokens"]
    df["max_chunk"] = df["chunk_sizes"].map(lambda c: max(c) if c else 0)
    df["is_decode"] = df["prefill_tokens"] == 0
    df["elapsed"] = df["time"] - df["time"].min()
    df["latency_ms"] = df["latency"] * 1e3
    df["tok_per_s"] = df["tokens"] / df["latency"].where(df["latency"] > 0)
    return df


def requests_frame(src: Any) -> pd.DataFrame:
    """One row per finished request (in finishing order), with derived columns:
    `cached_fraction` (cached / prompt tokens), `ttft_ms`, `tpot_ms`, `e2e_ms`."""
    df = _raw_frame(src, "requests", REQUEST_COLUMNS).reset_index(drop=True)
    prompt = df["prompt_tokens"].astype("float64")
    df["cached_fraction"] = (df["cached_tokens"] / prompt.where(prompt > 0)).fillna(0.0)
    for c in ("ttft", "tpot", "e2e"):
        df[f"{c}_ms"] = pd.to_numeric(df[c], errors="coerce") * 1e3
    return df


def windowed_hit_rate(df: pd.DataFrame | Any, window: int = 1000,
                      block_size: int | None = None) -> pd.DataFrame:
    """Prefix-cache hit rate over the last `window` rows (requests or steps).

    From a steps frame (`prefix_hit_tokens` / `prefix_query_tokens`: the block manager's
    own counters). From a requests frame: `cached_tokens` over the looked-up tokens, which
    are the full blocks before the last prompt token when `block_size` is given (what the
    engine's status line uses), else all prompt tokens. Returns columns `index`,
    `hit_tokens`, `query_tokens`, `hit_rate` (windowed) and `cumulative_hit_rate` (NaN
    while nothing was looked up).
    """
    if window < 1:
        raise ValueError(f"window={window} is invalid: must be >= 1")
    if not isinstance(df, pd.DataFrame):
        df = requests_frame(df)
    if "prefix_query_tokens" in df.columns and "prefix_hit_tokens" in df.columns:
        hit = df["prefix_hit_tokens"].astype("float64")
        query = df["prefix_query_tokens"].astype("float64")
    elif "cached_tokens" in df.columns:
        hit = df["cached_tokens"].astype("float64")
        p = df["prompt_tokens"].astype("int64")
        query = (((p - 1) // block_size) * block_size if block_size else p).astype("float64")
    else:
        raise ValueError("windowed_hit_rate needs a requests frame (cached_tokens, prompt_tokens) "
                         "or a steps frame (prefix_hit_tokens, prefix_query_tokens)")
    h = hit.rolling(window, min_periods=1).sum()
    q = query.rolling(window, min_periods=1).sum()
    out = pd.DataFrame({"index": range(len(df)), "hit_tokens": hit.to_numpy(),
                        "query_tokens": query.to_numpy()})
    out["hit_rate"] = (h / q.where(q > 0)).to_numpy()  # NaN where nothing was looked up
    ch, cq = hit.cumsum(), query.cumsum()
    out["cumulative_hit_rate"] = (ch / cq.where(cq > 0)).to_numpy()
    return out


@dataclass
class GraphUsage:
    """What CUDA graphs a run used (or would use under a capture plan)."""
    steps: pd.DataFrame     # step, batch_size, is_decode, graph_size, padded_tokens
    by_size: pd.DataFrame   # graph_size, replays, real_tokens, padded_tokens
    totals: dict

    def __repr__(self) -> str:
        t = self.totals
        return (f"GraphUsage(steps={t['steps']}, graph_steps={t['graph_steps']}, "
                f"padded_tokens={t['padded_tokens']}, padding_fraction={t['padding_fraction']:.1%})")


def graph_usage(steps: pd.DataFrame | Iterable[int] | Any, capture_sizes: Iterable[int]) -> GraphUsage:
    """Batch sizes seen against the captured sizes, and the padding each replay wastes.

    `steps` is a steps frame (or an LLM / EngineStats) or a plain trace of decode batch
    sizes. A decode-only step of `n` sequences replays the smallest captured size >= n
    (`n` larger than all: no graph); prefill steps run without a graph. Where the frame
    recorded a real `graph_size` (a GPU run) that value is used instead of the plan.
    """
    sizes = sorted({int(s) for s in capture_sizes})
    if isinstance(steps, pd.DataFrame) or _stats_of(steps) is not None:
        df = steps_frame(steps)
        trace = pd.DataFrame({"step": df["step"], "batch_size": df["num_seqs"].astype("int64"),
                              "is_decode": df["is_decode"].astype(bool), "recorded": df["graph_size"]})
    else:
        bs = [int(b) for b in steps]
        trace = pd.DataFrame({"step": range(1, len(bs) + 1), "batch_size": bs, "is_decode": True,
                              "recorded": [None] * len(bs)})

    def plan(row) -> int | None:
        if row["recorded"] is not None and not pd.isna(row["recorded"]):
            return int(row["recorded"])
        if not row["is_decode"] or not sizes:
            return None
        i = bisect.bisect_left(sizes, row["batch_size"])
        return sizes[i] if i < len(sizes) else None

    graph = [plan(r) for _, r in trace.iterrows()]
    out = trace.drop(columns="recorded").copy()
    out["graph_size"] = pd.array(graph, dtype="Int64")
    out["padded_tokens"] = [g - b if g is not None else 0 for g, b in zip(graph, out["batch_size"])]
    used = out[out["graph_size"].notna()]
    by_size = pd.DataFrame({"graph_size": sizes})
    agg = used.groupby("graph_size").agg(replays=("batch_size", "size"), real_tokens=("batch_size", "sum"),
                                         padded_tokens=("padded_tokens", "sum"))
    by_size = by_size.merge(agg, left_on="graph_size", right_index=True, how="left").fillna(0)
    by_size[["replays", "real_tokens", "padded_tokens"]] = by_size[
        ["replays", "real_tokens", "padded_tokens"]].astype("int64")
    real, pad = int(used["batch_size"].sum()), int(used["padded_tokens"].sum())
    totals = {"steps": len(out), "graph_steps": len(used), "eager_steps": len(out) - len(used),
              "real_tokens": real, "padded_tokens": pad,
              "padding_fraction": pad / (real + pad) if real + pad else 0.0,
              "max_batch_size": int(out["batch_size"].max()) if len(out) else 0,
              "capture_sizes": sizes}
    return GraphUsage(out, by_size, totals)


class Frames(NamedTuple):
    steps: pd.DataFrame
    requests: pd.DataFrame
    meta: dict


def save_frames(src: Any, folder: str, meta: dict | None = None) -> list[str]:
    """Write `steps.jsonl`, `requests.jsonl` and `meta.json` (JSON lines: no pyarrow needed;
    lists such as `chunk_sizes` survive). Returns the paths written."""
    os.makedirs(folder, exist_ok=True)
    if isinstance(src, Frames):
        steps, reqs = src.steps, src.requests
    else:  # the recorded columns first, then whatever else the engine records
        steps = _ordered(_raw_frame(src, "steps", STEP_COLUMNS), STEP_COLUMNS)
        reqs = _ordered(_raw_frame(src, "requests", REQUEST_COLUMNS), REQUEST_COLUMNS)
    paths = []
    for name, df in (("steps", steps), ("requests", reqs)):
        path = os.path.join(folder, f"{name}.jsonl")
        with open(path, "w") as f:
            for row in df.to_dict(orient="records"):
                row = {k: None if isinstance(v, float) and v != v else v for k, v in row.items()}
                f.write(json.dumps(row, default=_json_default) + "\n")
        paths.append(path)
    path = os.path.join(folder, "meta.json")
    with open(path, "w") as f:
        json.dump(meta or {}, f, indent=1, default=_json_default)
    paths.append(path)
    logger.info("saved %d steps and %d requests to %s", len(steps), len(reqs), folder)
    return paths


def _ordered(df: pd.DataFrame, first: list[str]) -> pd.DataFrame:
    return df[first + [c for c in df.columns if c not in first]]


def load_frames(folder: str) -> Frames:
    """Read what `save_frames` wrote, as `Frames(steps, requests, meta)` (raw columns;
    pass them to `steps_frame` / `requests_frame` or straight to the plots)."""
    def read(name: str, columns: list[str]) -> pd.DataFrame:
        path = os.path.join(folder, f"{name}.jsonl")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found: was the folder written by save_frames?")
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return pd.DataFrame(rows, columns=columns) if not rows else pd.DataFrame(rows)
    meta_path = os.path.join(folder, "meta.json")
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
    return Frames(read("steps", STEP_COLUMNS), read("requests", REQUEST_COLUMNS), meta)


def roofline_frame(points: Iterable[dict] | pd.DataFrame) -> pd.DataFrame:
    """Measured figures against their physical bound, one row each: `name`, `measured`,
    `bound`, `unit`, `fraction` (of the bound: higher is closer to the limit).

    Rows are dicts with `name`, `measured`, `bound` and `unit` ("tok/s": the bound is a
    ceiling; "ms/token" or "s": the bound is a floor), or the JSON that
    `python -m atom.benchmarks.throughput --out` writes (`atom_tok_s`, `roofline_tok_s`).
    """
    rows = []
    for p in (points.to_dict(orient="records") if isinstance(points, pd.DataFrame) else points):
        if "atom_tok_s" in p and "roofline_tok_s" in p:
            p = {"name": f"{p.get('model', '?')} ({p.get('device', '?')})", "measured": p["atom_tok_s"],
                 "bound": p["roofline_tok_s"], "unit": "tok/s"}
        missing = [k for k in ("name", "measured", "bound") if k not in p]
        if missing:
            raise ValueError(f"roofline point {p!r} lacks {missing}: give name, measured, bound (and unit)")
        unit = p.get("unit", "tok/s")
        m, b = float(p["measured"]), float(p["bound"])
        frac = (m / b if unit == "tok/s" else b / m) if m > 0 and b > 0 else float("nan")
        rows.append({"name": str(p["name"]), "measured": m, "bound": b, "unit": unit, "fraction": frac})
    return pd.DataFrame(rows, columns=["name", "measured", "bound", "unit", "fraction"])


def _json_default(x: Any):
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, float) and x != x:
        return None
    return str(x)
