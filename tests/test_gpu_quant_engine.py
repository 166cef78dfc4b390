"""Quantized models start on the GPU the way the benchmarks run them: the producer's
`quantization_config` block (`atom.benchmarks.quant_formats`; MXFP4 with dynamic MXFP4
activations as compressed-tensors writes it), dummy weights, CUDA graphs and
the start-up GEMM choice over the layers it times, then generate what the same engine run
eagerly would: each greedy token of the graphs is among eager's best at its place.

Dummy weights give flat next-token distributions (logprobs near -5 over 1,024 tokens, the best
two often within 0.02), so two correct engines with different bf16 sums may pick different
tokens at a near-tie: the check is that eager, teacher-forced on the graphs' tokens (a prefill
of prompt + tokens), puts each within TOL of its best logprob there (TOL_FP4_ACT with MXFP4
activations). A token from a wrong product lands near a random token's logprob, 1.5-3 below
the best. Skipped without a GPU; run on the lent H200."""
import json

import pytest
import transformers

from atom import LLM, SamplingParams
from atom.benchmarks.quant_formats import get_format

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TOL = 0.1
# MXFP4 activations: one bf16 sum that lands the other side of an e2m1 rounding bound moves a
# 4-bit activation by a whole step, and the logits with it. The same eager engine, decode steps
# against its own teacher-forced prefill, 64 tokens on CPU: 15 below the best, by up to 0.34
# (weight-only formats: none, or 0.008 for fp8).
TOL_FP4_ACT = 0.75


def _quantized_config(folder, fmt: str) -> str:
    # K = 256 / 512: whole groups of 128 (W4A16) and 32 (MXFP4)
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                                   tie_word_embeddings=False, torch_dtype="bfloat16",
                                   architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(folder)
    path = folder / "config.json"
    data = json.loads(path.read_text())
    if fmt == "mxfp4_w4a4":  # compressed-tensors' MXFP4 preset: the weights' args, dynamic, for the inputs
        block = get_format("mxfp4_w4a16").quantization_config()
        group = block["config_groups"]["group_0"]
        group["input_activations"] = dict(group["weights"], dynamic=True, observer=None)
    else:
        block = get_format(fmt).quantization_config()
    data["quantization_config"] = block
    path.write_text(json.dumps(data))
    return str(folder)


@pytest.mark.parametrize("fmt", ["w4a16", "mxfp4_w4a16", "mxfp4_w4a4", "fp8_dynamic"])
def test_quantized_dummy_model_runs_in_graphs_as_eager(tmp_path, fmt):
    folder = _quantized_config(tmp_path, fmt)
    llm = LLM(folder, load_dummy="xavier", num_kvcache_blocks=32, enable_log_stats=False)
    assert llm.engine.runner.graphs is not None  # decode steps replay CUDA graphs
    tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert [len(t) for t in tokens] == [8, 8]
    del llm
    eager = LLM(folder, load_dummy="xavier", enforce_eager=True, num_kvcache_blocks=32, enable_log_stats=False)
    full = [p + t for p, t in zip(PROMPTS, tokens)]
    outs = eager.generate(full, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    for o, p, t in zip(outs, PROMPTS, tokens):
        for i, tok in enumerate(t):
            place = o.prompt_logprobs[len(p) + i]  # the graphs' token and eager's best there
            best = max(lp.logprob for lp in place.values())
            assert place[tok].logprob >= best - (TOL_FP4_ACT if fmt == "mxfp4_w4a4" else TOL), (fmt, i, tok, place)
