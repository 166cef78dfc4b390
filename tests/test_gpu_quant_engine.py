"""Quantized models start on the GPU the way the benchmarks run them: the producer's
`quantization_config` block (`atom.benchmarks.quant_formats`), dummy weights, CUDA graphs and
the start-up GEMM choice over the layers it times. The graphs' greedy tokens equal those of
the same engine run eagerly. Skipped without a GPU; run on the lent H200."""
import json

import pytest
import transformers

from atom import LLM, SamplingParams
from atom.benchmarks.quant_formats import get_format

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _quantized_config(folder, fmt: str) -> str:
    # K = 256 / 512: whole groups of 128 (W4A16) and 32 (MXFP4)
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                                   tie_word_embeddings=False, torch_dtype="bfloat16",
                                   architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(folder)
    path = folder / "config.json"
    data = json.loads(path.read_text())
    data["quantization_config"] = get_format(fmt).quantization_config()
    path.write_text(json.dumps(data))
    return str(folder)


@pytest.mark.parametrize("fmt", ["w4a16", "mxfp4_w4a16", "fp8_dynamic"])
def test_quantized_dummy_model_runs_in_graphs_as_eager(tmp_path, fmt):
    folder = _quantized_config(tmp_path, fmt)
    got = {}
    for eager in (False, True):
        llm = LLM(folder, load_dummy="xavier", enforce_eager=eager, num_kvcache_blocks=32, enable_log_stats=False)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        got[eager] = [o.token_ids for o in outs]
        assert [len(t) for t in got[eager]] == [8, 8]
        del llm
    assert got[False] == got[True]
