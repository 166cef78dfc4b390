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


def checked_graph_time(call, out: torch.Tensor, ref: torch.Tensor | None, repeat: int = 4, iters: int = 25,
                       tol: float = 2e-2):
    """One configuration of a kernel sweep: runs `call` (which writes `out`), compares `out`
    with `ref` (the first configuration's output; None: this one is the reference, cloned) and
    times `repeat` calls in CUDA-graph replays. Returns (seconds a call, or an error string: the
    exception the call raised, e.g. a tile out of shared memory, or a mismatch; the reference)."""
    try:
        call()
    except Exception as e:  # out of resources, a tile the kernel does not take
        return f"{type(e).__name__}: {str(e)[:120]}", ref
    if ref is None:
        ref = out.clone()
    elif not torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol):
        return "mismatch against the first configuration", ref
    return graph_time([call] * repeat, iters=iters), ref
