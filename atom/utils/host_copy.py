"""Host arrays to the device without making the host wait for the GPU.

A copy from pageable host memory goes through the driver's staging buffer, and the driver
may synchronise with the stream first: a step's input copies then wait for the step still
running, and the look-ahead step (`async_scheduling`) is enqueued only after the GPU ran
dry. Copying from page-locked memory is a plain DMA in stream order. The pinned blocks come
from torch's caching host allocator, which does not hand a block out again until the copies
that read it have run (it records an event on each non-blocking copy), so a step may reuse
memory while an earlier step's copy is still queued.
"""
from __future__ import annotations

import numpy as np
import torch


def pinned(array, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A CPU tensor with `array`'s values, page-locked where a CUDA device can use it (not
    while a CUDA graph is being captured: that allocation is not allowed then)."""
    if isinstance(array, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(array))
        t = t if dtype is None else t.to(dtype)
    else:
        t = torch.as_tensor(array, dtype=dtype)
    if torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing():
        t = t.pin_memory()
    return t


def to_device(array, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`array` (numpy, list or CPU tensor) on `device`, copied without a host wait on CUDA."""
    if torch.device(device).type != "cuda":
        return torch.as_tensor(array, dtype=dtype).to(device)
    return pinned(array, dtype).to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, array) -> None:
    """dst.copy_(array) from the host, without a host wait where `dst` is on a CUDA device."""
    if dst.device.type != "cuda":
        dst.copy_(torch.as_tensor(array))
        return
    dst.copy_(pinned(array), non_blocking=True)
