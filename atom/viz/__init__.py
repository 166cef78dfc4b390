"""Plots, DataFrames and tables of what the engine recorded.

    from atom.viz import steps_frame, plot_chunk_latency
    fig = plot_chunk_latency(llm)          # or a frame from load_frames(folder).steps
"""
from atom.viz.frames import (GraphUsage, Frames, graph_usage, load_frames, requests_frame, roofline_frame,
                             save_frames, steps_frame, windowed_hit_rate)
from atom.viz.expert_load import expert_load_frame, expert_load_summary, plot_expert_load
from atom.viz.engine_frames import kernel_plan_frame, kv_cache_frame, linear_methods_frame, moe_layers_frame
from atom.viz.plots import (plot_chunk_latency, plot_graph_capture_sizes, plot_kv_usage,
                            plot_prefix_cache_hit_rate, plot_roofline)
from atom.viz.serving_frames import metrics_frame, plot_serving, serving_frame
from atom.viz.tables import recipe_markdown, recipe_table, run_summary, summary_table

__all__ = [
    "kernel_plan_frame", "kv_cache_frame", "linear_methods_frame",
    "expert_load_frame", "expert_load_summary", "moe_layers_frame", "plot_expert_load",
    "Frames", "GraphUsage", "graph_usage", "load_frames", "requests_frame", "roofline_frame", "save_frames",
    "steps_frame", "windowed_hit_rate", "plot_chunk_latency", "plot_graph_capture_sizes", "plot_kv_usage",
    "plot_prefix_cache_hit_rate", "plot_roofline", "metrics_frame", "plot_serving", "serving_frame",
    "recipe_markdown", "recipe_table", "run_summary", "summary_table",
]
