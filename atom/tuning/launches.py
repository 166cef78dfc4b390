"""Which Triton kernels a piece of code launches, in order: what a kernel-plan fusion saves,
counted rather than assumed.

    with KernelLaunches() as trace:
        llm.generate(prompts, params)          # an eager engine (enforce_eager=True)
    trace.frame()                              # one row per launch: kernel, grid
    trace.counts()                             # launches per kernel

While the context is open every `kernel[grid](...)` launch in the process is recorded (the
class-level launch entry of Triton's kernels, compiled or interpreted, is wrapped and put
back on exit). What it cannot see: launches replayed by a CUDA graph (no Python runs then:
trace an eager engine) and kernels that are not Triton's (cuBLAS products, torch ops).
"""
from __future__ import annotations

from typing import Any

import pandas as pd


def _kernel_name(kernel: Any) -> str:
    """The Python name of a Triton kernel object (a jit / interpreted function, or an
    autotuner around one)."""
    fn = kernel
    while hasattr(fn, "fn"):
        fn = fn.fn
    return getattr(fn, "__name__", type(kernel).__name__)


class KernelLaunches:
    """A context manager recording Triton kernel launches (see the module docstring)."""

    def __init__(self):
        self.launches: list[tuple[str, str]] = []
        self._saved = None

    def __enter__(self) -> "KernelLaunches":
        from triton.runtime.jit import KernelInterface
        if self._saved is not None:
            raise RuntimeError("this KernelLaunches is already recording")
        original = KernelInterface.__getitem__
        record = self.launches

        def getitem(kernel, grid):
            launch = original(kernel, grid)

            def run(*args, **kwargs):
                record.append((_kernel_name(kernel), "fn" if callable(grid) else str(tuple(grid))))
                return launch(*args, **kwargs)
            return run

        self._saved = (KernelInterface, original)
        KernelInterface.__getitem__ = getitem
        return self

    def __exit__(self, *exc) -> None:
        cls, original = self._saved
        cls.__getitem__ = original
        self._saved = None

    def frame(self) -> pd.DataFrame:
        """One row per launch, in order: kernel (its Python name) and grid."""
        return pd.DataFrame(self.launches, columns=["kernel", "grid"])

    def counts(self) -> pd.Series:
        """Launches per kernel, most first."""
        return self.frame()["kernel"].value_counts()

    def __len__(self) -> int:
        return len(self.launches)

    def __repr__(self) -> str:
        kinds = len({k for k, _ in self.launches})
        state = "recording" if self._saved is not None else "stopped"
        return f"KernelLaunches({len(self.launches)} launches of {kinds} kernels, {state})"
