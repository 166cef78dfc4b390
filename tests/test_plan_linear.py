"""`atom::plan_linear`: the plan's product choice as one op inside compiled graphs."""
import gc

import pytest

import torch
import torch.nn.functional as F

from atom.model_ops.quant import unquantized  # noqa: F401 - registers atom::plan_linear
from atom.tuning.plan import KernelPlan, plan_for


def test_each_plan_has_its_own_handle_for_as_long_as_it_lives():
    a, b = KernelPlan(), KernelPlan()
    assert a.handle != b.handle and plan_for(a.handle) is a and plan_for(b.handle) is b
    h = b.handle
    del b
    gc.collect()
    assert plan_for(h) is None and plan_for(a.handle) is a


def test_plan_linear_traces_into_a_full_graph_and_matches_f_linear():
    plan = KernelPlan()
    x, w, bias = torch.randn(5, 8), torch.randn(3, 8), torch.randn(3)

    def f(x, w, bias):
        return torch.ops.atom.plan_linear(torch.relu(x), w, bias, plan.handle) * 2

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, bias)
    torch.testing.assert_close(got, F.linear(torch.relu(x), w, bias) * 2)
    # a plan that is gone falls back to the library product
    torch.testing.assert_close(torch.ops.atom.plan_linear(x, w, None, 10 ** 9), F.linear(x, w))


@pytest.mark.gpu
def test_dense_under_compile_consults_the_plan_when_it_runs():
    """On a GPU, `dense` in a compiled graph runs atom::plan_linear, which asks the engine's
    plan at run time (a stub cuBLASLt choice here returns a marker)."""
    from atom.model_ops.quant.unquantized import dense
    plan = KernelPlan()
    plan.lt_product = lambda x, w: torch.full((x.shape[0], w.shape[0]), 7.0, device=x.device, dtype=x.dtype)
    x, w = torch.randn(4, 8, device="cuda"), torch.randn(3, 8, device="cuda")
    got = torch.compile(lambda x, w: dense(x, w, None, plan), fullgraph=True)(x, w)
    assert torch.all(got == 7.0)
