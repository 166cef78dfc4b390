"""The engine with the Triton attention op (under Triton's interpreter on CPU, natively on
a GPU) gives transformers' greedy tokens: the GPU glue is exercised in CI."""
import pytest
import torch
import transformers

from atom import LLM, SamplingParams
from conftest import hf_greedy

triton = pytest.importorskip("triton")


def test_triton_attention_op_in_the_engine(tiny_qwen3):
    from atom.model_ops.attention import triton_backend
    llm = LLM(tiny_qwen3, enable_log_stats=False, num_kvcache_blocks=32, max_num_batched_tokens=32)
    runner = llm.engine.runner
    for layer in runner.attn_layers:
        layer.backend = "triton"
    triton_backend.register_layers(runner.attn_layers, 64, runner.device)
    ps = [[5, 6, 7, 8, 9], list(range(10, 50))]  # the second is chunked: 32 + 8 tokens
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 5) for p in ps]
