"""Samplers: greedy, temperature, top-k, top-p, per-request seeds; and through the engine."""
import pytest
import torch

from atom import LLM, SamplingParams
from atom.model_ops.sampler import Sampler, SamplingTensors, apply_top_k_top_p


def st(temps, top_ks=None, top_ps=None, gens=None):
    s = SamplingTensors(torch.tensor(temps, dtype=torch.float32),
                        None if top_ks is None else torch.tensor(top_ks),
                        None if top_ps is None else torch.tensor(top_ps, dtype=torch.float32), gens)
    s.all_greedy = all(t == 0 for t in temps)
    return s


def test_greedy_rows_take_argmax():
    logits = torch.randn(4, 50)
    out = Sampler()(logits, st([0, 0, 0, 0]))
    assert torch.equal(out, logits.argmax(-1))
    mixed = Sampler()(logits, st([0, 1.0, 0, 1.0]))
    assert mixed[0] == logits[0].argmax() and mixed[2] == logits[2].argmax()


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(8, 100)
    assert torch.equal(Sampler()(logits, st([1.0] * 8, top_ks=[1] * 8)), logits.argmax(-1))
    assert torch.equal(Sampler()(logits, st([1.0] * 8, top_ps=[1e-6] * 8)), logits.argmax(-1))


def test_top_k_top_p_masks():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    k2 = apply_top_k_top_p(logits, torch.tensor([2]), None)
    assert torch.isinf(k2[0, 2:]).all() and torch.isfinite(k2[0, :2]).all()
    probs = logits.softmax(-1)[0]  # ~[0.64, 0.24, 0.09, 0.03]
    p = apply_top_k_top_p(logits, None, torch.tensor([0.7]))
    assert torch.isfinite(p[0, :2]).all() and torch.isinf(p[0, 2:]).all()
    assert probs[0] < 0.7 < probs[0] + probs[1]


def test_temperature_sampling_follows_the_distribution():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(20000, 1)
    out = Sampler()(logits, st([1.0] * 20000))
    freq = torch.bincount(out, minlength=3).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.02)


def test_seeded_rows_are_reproducible_and_batch_independent():
    logits = torch.randn(3, 1000)
    def draw(rows):
        gens = {r: torch.Generator().manual_seed(123) for r in rows}
        return Sampler()(logits, st([1.0] * 3, gens=gens))
    a, b = draw([0, 1, 2]), draw([0, 1, 2])
    assert torch.equal(a, b)
    solo = Sampler()(logits[1:2], st([1.0], gens={0: torch.Generator().manual_seed(123)}))
    assert solo[0] == a[1]


def test_engine_seed_reproducible(tiny_llama):
    llm = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=64)
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=7, ignore_eos=True)
    a = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids
    b = llm.generate([[5, 6, 7], [9, 9, 9, 9]], [sp, SamplingParams(temperature=1.0, max_tokens=12)],
                     use_tqdm=False)[0].token_ids
    assert a == b and len(a) == 12


def test_plain_temperature_batches_take_the_fused_kernel(monkeypatch):
    """With GPU kernels on (faked here, the kernel runs under Triton's interpreter), a batch
    without top-k/top-p/seeds is sampled by `kernels.gumbel_sample`; others keep the torch path."""
    pytest.importorskip("triton")
    from atom.model_ops import kernel_backend, kernels
    calls = []
    real = kernels.gumbel_sample
    monkeypatch.setattr(kernel_backend, "get", lambda x: kernels)
    monkeypatch.setattr(kernels, "gumbel_sample", lambda *a: calls.append(a[2]) or real(*a))
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels need GPU tensors
    logits = torch.randn(3, 50, device=dev)
    temps = torch.tensor([0.0, 0.9, 0.0], device=dev)
    out = Sampler()(logits, SamplingTensors(temps))
    assert len(calls) == 1 and out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    Sampler()(logits, SamplingTensors(temps, top_ks=torch.tensor([0, 5, 0], device=dev)))
    assert len(calls) == 1  # top-k: the torch path
