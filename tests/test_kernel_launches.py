"""`atom.tuning.launches.KernelLaunches`: the Triton launches of a block of code, in order,
under Triton's interpreter on the CPU; the launch entry is put back on exit."""
from __future__ import annotations

import pytest
import torch

from atom.model_ops.kernels.triton_import import HAS_TRITON
from atom.tuning.launches import KernelLaunches

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (interpreter on CPU)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_records_launches_in_order_and_restores_the_entry():
    from triton.runtime.jit import KernelInterface

    from atom.model_ops.kernels.act_quant import act_quant
    from atom.model_ops.kernels.act_quant_fused import silu_quant
    entry = KernelInterface.__getitem__
    x = torch.randn(3, 64).to(DEV)
    trace = KernelLaunches()
    with trace:
        act_quant(x, "fp8", 64, 448.0)
        silu_quant(x, "int8", 127.0)
        act_quant(x, "int8", 32, 127.0)
        with pytest.raises(RuntimeError, match="already recording"):
            trace.__enter__()
    assert KernelInterface.__getitem__ is entry
    frame = trace.frame()
    assert list(frame["kernel"]) == ["_act_quant_kernel", "_silu_quant_kernel", "_act_quant_kernel"]
    assert frame["grid"].iloc[0] == "(3, 1)" and frame["grid"].iloc[2] == "(3, 2)"
    assert trace.counts().to_dict() == {"_act_quant_kernel": 2, "_silu_quant_kernel": 1} and len(trace) == 3
    act_quant(x, "fp8", 64, 448.0)  # after the block: not recorded
    assert len(trace) == 3 and repr(trace) == "KernelLaunches(3 launches of 2 kernels, stopped)"
