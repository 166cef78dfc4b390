"""Host arrays to the device through page-locked memory (`atom.utils.host_copy`)."""
import time

import numpy as np
import pytest
import torch

from atom.utils.host_copy import copy_into, pinned, to_device


@pytest.mark.parametrize("array,dtype", [(np.arange(7, dtype=np.int64), None), ([0.5, 1.0, 2.0], torch.float32),
                                         (np.arange(6, dtype=np.int64)[::2], torch.int32), ([3, 4], torch.int64)])
def test_values_and_dtype_survive(array, dtype):
    want = torch.as_tensor(np.asarray(array), dtype=dtype)
    got = to_device(array, torch.device("cpu"), dtype)
    assert got.dtype == want.dtype and torch.equal(got, want)
    dst = torch.zeros(len(want), dtype=want.dtype)
    copy_into(dst, array if dtype is None else want.numpy())
    assert torch.equal(dst, want)


def test_pinned_keeps_the_values_on_a_machine_without_cuda():
    a = np.array([[1, 2], [3, 4]], np.int32).T  # not contiguous
    t = pinned(a)
    assert torch.equal(t, torch.from_numpy(a.copy()))
    assert t.is_pinned() == torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_host_does_not_wait_for_the_running_kernel():
    """A step's input copies behind a long kernel return at once and land in order."""
    dev = torch.device("cuda")
    big = np.arange(1 << 20, dtype=np.int32)  # 4 MiB: more than a staging copy inlines
    dst = torch.zeros(big.size, dtype=torch.int32, device=dev)
    to_device(big, dev)  # the pinned allocator's first block
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(2_000_000_000 // 1000 * 200)  # ~0.2 s of GPU cycles at ~2 GHz
    t0 = time.perf_counter()
    copy_into(dst, big)
    out = to_device(big[:5], dev, torch.int64)
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    gpu_s = time.perf_counter() - t0
    assert host_s < 0.25 * gpu_s, (host_s, gpu_s)
    assert torch.equal(dst.cpu(), torch.from_numpy(big)) and out.tolist() == [0, 1, 2, 3, 4]
