"""DataFrames and a plot of serving: benchmark reports and `/metrics` scrapes.

    from atom.viz import serving_frame, plot_serving, metrics_frame
    df = serving_frame(json.load(open("atom.json")), json.load(open("vllm.json")))
    fig = plot_serving(df)                     # p50 TTFT and TPOT against request rate
    metrics_frame(httpx.get(url + "/metrics").text)
"""
from __future__ import annotations

import math


def serving_frame(*reports: dict):
    """One row per (server, request rate) of `atom.benchmarks.serving` reports; latency
    columns flattened (`ttft_ms_p50`, `tpot_ms_p99`, ...)."""
    import pandas as pd
    rows = []
    for rep in reports:
        for run in rep["runs"]:
            row = {"server": rep.get("server"), "commit": rep.get("provenance", {}).get("commit")}
            for k, v in run.items():
                if isinstance(v, dict):
                    row.update({f"{k}_{q}": x for q, x in v.items()})
                elif k != "errors":
                    row[k] = v
            rate = row["request_rate"]
            row["request_rate"] = math.inf if rate == "inf" else float(rate)
            rows.append(row)
    return pd.DataFrame(rows)


def metrics_frame(text: str):
    """A Prometheus text scrape (`/metrics`) as rows of (name, labels, value)."""
    import pandas as pd
    from prometheus_client.parser import text_string_to_metric_families
    rows = [{"name": s.name, "labels": dict(s.labels), "value": s.value}
            for fam in text_string_to_metric_families(text) for s in fam.samples]
    return pd.DataFrame(rows, columns=["name", "labels", "value"])


def plot_serving(frame, metrics: tuple[str, ...] = ("ttft_ms_p50", "tpot_ms_p50", "output_throughput")):
    """One panel per metric against request rate (inf drawn past the largest finite rate),
    a line per server."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.5), squeeze=False)
    finite = frame.loc[frame["request_rate"] != math.inf, "request_rate"]
    inf_x = (finite.max() * 2) if len(finite) else 1.0
    for ax, metric in zip(axes[0], metrics):
        for server, df in frame.groupby("server", sort=False):
            x = df["request_rate"].replace(math.inf, inf_x)
            ax.plot(x, df[metric], marker="o", label=str(server))
        ax.set_xlabel("request rate (req/s; rightmost: all at once)")
        ax.set_title(metric)
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    return fig
