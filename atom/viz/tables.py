"""`rich` tables for command-line summaries.

    Console().print(summary_table(llm))          # what a run did
    Console().print(recipe_table(result))        # a recipe's figures against expectations
"""
from __future__ import annotations

import json
import math
from typing import Any

from rich.table import Table

from atom.viz.frames import requests_frame, steps_frame


def run_summary(src: Any) -> dict[str, float]:
    """The headline figures of a run, as a dict (what `summary_table` shows)."""
    steps, reqs = steps_frame(src), requests_frame(src)
    wall = float(steps["time"].max() + steps.loc[steps["time"].idxmax(), "latency"] - steps["time"].min()) \
        if len(steps) else 0.0
    out_tokens = int(reqs["output_tokens"].sum()) if len(reqs) else 0
    query = float(steps["prefix_query_tokens"].sum()) if len(steps) else 0.0
    return {
        "steps": len(steps),
        "requests": len(reqs),
        "prompt_tokens": int(reqs["prompt_tokens"].sum()) if len(reqs) else 0,
        "output_tokens": out_tokens,
        "wall_s": wall,
        "output_tok_s": out_tokens / wall if wall > 0 else float("nan"),
        "mean_ttft_ms": float(reqs["ttft_ms"].mean()) if len(reqs) else float("nan"),
        "mean_tpot_ms": float(reqs["tpot_ms"].mean()) if len(reqs) else float("nan"),
        "prefix_hit_rate": float(steps["prefix_hit_tokens"].sum()) / query if query else 0.0,
        "preemptions": int(steps["preemptions"].sum()) if len(steps) else 0,
        "peak_kv_usage": float(steps["kv_usage"].max()) if len(steps) else 0.0,
    }


def format_value(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v)


_LABELS = {
    "steps": "steps", "requests": "requests", "prompt_tokens": "prompt tokens",
    "output_tokens": "output tokens", "wall_s": "wall time (s)", "output_tok_s": "output tok/s",
    "mean_ttft_ms": "mean TTFT (ms)", "mean_tpot_ms": "mean TPOT (ms)",
    "prefix_hit_rate": "prefix-cache hit rate", "preemptions": "preemptions",
    "peak_kv_usage": "peak KV usage",
}


def summary_table(src: Any, title: str = "run summary") -> Table:
    """Two-column table of `run_summary(src)`."""
    s = run_summary(src)
    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in s.items():
        if k in ("prefix_hit_rate", "peak_kv_usage"):
            t.add_row(_LABELS[k], f"{v:.1%}")
        else:
            t.add_row(_LABELS[k], format_value(v))
    return t


def format_expected(exp: dict | None) -> str:
    if not exp:
        return "-"
    parts = []
    if "value" in exp:
        tol = [f"{exp['rel_tol']:.0%}"] if exp.get("rel_tol") else []
        tol += [format_value(exp["abs_tol"])] if exp.get("abs_tol") else []
        parts.append(f"{format_value(exp['value'])} ± {' or '.join(tol)}" if tol
                     else f"= {format_value(exp['value'])}")
    if "min" in exp:
        parts.append(f">= {format_value(exp['min'])}")
    if "max" in exp:
        parts.append(f"<= {format_value(exp['max'])}")
    return ", ".join(parts)


def recipe_table(results: dict) -> Table:
    """A recipe result (what `atom.recipes.runner.run_recipe` returns, or its JSON): one
    row per metric with the value, the expectation and pass/fail."""
    checks = {c["metric"]: c for c in results.get("checks", [])}
    status = results.get("status", "?")
    colour = {"pass": "green", "fail": "red"}.get(status, "yellow")
    t = Table(title=f"recipe {results.get('name', '?')} — [{colour}]{status}[/]")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column("unit")
    t.add_column("expected")
    t.add_column("check")
    units = results.get("units", {})
    for name, value in results.get("metrics", {}).items():
        c = checks.get(name)
        mark = "-" if c is None else ("[green]ok[/]" if c["ok"] else "[red]FAIL[/]")
        t.add_row(name, format_value(value), units.get(name, ""), format_expected(c and c.get("expected")), mark)
    return t


def recipe_markdown(result: dict) -> str:
    """A recipe result as a Markdown report (what `run` writes to results.md)."""
    checks = {c["metric"]: c for c in result["checks"]}
    hw = result["hardware"]["found"]
    lines = [f"# {result['name']}: {result['status'].upper()}", "", result["description"].strip(), "",
             f"- model: {result['model']}", f"- hardware: {hw['name']} ({hw['device']}, {hw['gpus']} GPUs)",
             f"- engine: `{json.dumps(result['engine'])}`", f"- requests: {result['requests']}, "
             f"runs: {', '.join(f'{s:.2f} s' for s in result['runs_s'])}", f"- date: {result['date']}", "",
             "| metric | value | unit | expected | check |", "| --- | ---: | --- | --- | --- |"]
    for k, v in result["metrics"].items():
        c = checks.get(k)
        mark = "" if c is None else ("ok" if c["ok"] else f"**FAIL** ({c['why']})")
        lines.append(f"| {k} | {format_value(v)} | {result['units'].get(k, '')} | "
                     f"{format_expected(c and c['expected'])} | {mark} |")
    if result.get("outputs"):
        lines += ["", "## Answers", ""]
    for o in result.get("outputs", []):
        verdict = "" if o["ok"] is None else (" (ok)" if o["ok"] else " (wrong)")
        lines.append(f"- *{o['prompt']}* → {o['text']!r}{verdict}")
    lines += [""] + [f"![{p}]({p})" for p in result.get("plots", [])]
    return "\n".join(lines) + "\n"
