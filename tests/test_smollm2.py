"""The embedded SmolLM2-135M-Instruct: ATOM's greedy tokens equal transformers'."""
import pytest
import torch
import transformers

from atom import LLM, SamplingParams
from conftest import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Explain gravity in one sentence.",
           "List three fruits."]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, max_model_len=1024, enable_log_stats=False)


def test_first_32_greedy_tokens_equal_transformers(llm, smollm2_path):
    tok = llm.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in PROMPTS]
    ids = [tok.encode(c) for c in chats]
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    ref = [hf_greedy(hf, p, 32) for p in ids]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == ref


def test_capital_of_france_is_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"          # stopped at <|im_end|>, not by length
    assert "<|im_end|>" not in out.text


def test_stop_strings_trim_text(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32, stop_strings=["Paris"]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and "Paris" not in out.text and out.text.startswith("The capital")
