"""The throughput benchmark's split of a run's wall time into prompt and decode steps."""
from types import SimpleNamespace

import pytest

from atom.benchmarks.throughput import step_breakdown
from atom.model_engine.stats import EngineStats


def _stats(rows):
    st = EngineStats(log_stats=False)
    for r in rows:
        st.record_step(dict(r, num_sampled=r["num_seqs"]))
    return SimpleNamespace(stats=st)


def test_breakdown_splits_prompt_and_decode_steps_by_start_times():
    llm = _stats([
        dict(time=0.0, latency=0.9, prefill_tokens=500, decode_tokens=0, num_seqs=2),  # warm-up run
        dict(time=1.0, latency=0.2, prefill_tokens=300, decode_tokens=0, num_seqs=3),
        dict(time=1.5, latency=0.1, prefill_tokens=0, decode_tokens=3, num_seqs=3),
        dict(time=1.6, latency=0.1, prefill_tokens=100, decode_tokens=2, num_seqs=3),
        dict(time=2.0, latency=0.05, prefill_tokens=0, decode_tokens=100, num_seqs=100),
    ])
    b = step_breakdown(llm, first_step=1)
    assert b["steps"] == 4 and b["prefill_steps"] == 2 and b["decode_steps"] == 2
    assert b["prompt_tokens"] == 400
    assert b["prefill_s"] == pytest.approx(0.5 + 0.4)  # each step runs to the next one's start
    assert b["decode_s"] == pytest.approx(0.1 + 0.05)  # the last one: its own latency
    assert b["decode_ms_by_batch"] == {"1-16": {"steps": 1, "mean_ms": pytest.approx(100.0)},
                                       "65-128": {"steps": 1, "mean_ms": pytest.approx(50.0)}}


def test_breakdown_of_no_steps_is_empty():
    assert step_breakdown(_stats([]), 0) == {}
    llm = _stats([dict(time=0.0, latency=0.1, prefill_tokens=1, decode_tokens=0, num_seqs=1)])
    assert step_breakdown(llm, 1) == {}


def test_gemm_choices_lists_the_plans_start_up_products():
    import torch

    from atom.benchmarks.throughput import gemm_choices
    from atom.tuning.plan import KernelPlan
    plan = KernelPlan()
    plan.gemv_timings[(4096, 4096, torch.bfloat16, "plain")] = (15.0, 12.0)
    plan.lt_timings[(160, 4096, 4096, torch.float8_e4m3fn)] = (14.3, 9.8, 12)
    rows = gemm_choices(SimpleNamespace(engine=SimpleNamespace(runner=SimpleNamespace(plan=plan))))
    assert rows == [{"kind": "gemm", "rows": 160, "n": 4096, "k": 4096, "dtype": "float8_e4m3fn",
                     "variant": "plain", "library_us": 14.3, "best_us": 9.8, "runs": "library", "tried": 12}]
    assert gemm_choices(SimpleNamespace(engine=SimpleNamespace())) == []  # the model in another process
