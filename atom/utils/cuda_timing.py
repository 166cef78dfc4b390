"""GPU time of a list of calls as the engine runs them: captured in one CUDA graph, replayed.

Used by the kernel benchmark and by the start-up choice between cuBLAS and the Triton GEMV
(`atom.tuning.gemv_choice.choose_gemv_shapes`): timing replays leaves out the host's launch
cost, which a graph does not pay.
"""
from __future__ import annotations

import statistics

import torch


def graph_time(calls, iters: int = 25) -> float:
    """Median seconds per call, replaying all `calls` captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (Triton compiles, cuBLAS picks) outside the capture
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    del g
    return statistics.median(times) / len(calls)
