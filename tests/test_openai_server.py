"""The server on the embedded SmolLM2, driven by the official `openai` client and by lm-eval's
OpenAI-compatible completions client: completions and chat equal `LLM.generate` / `LLM.chat`
greedy (with `stop_token_ids`, chat `logprobs` / `top_logprobs` and `max_completion_tokens`
too), streamed text and logprobs equal non-streamed (UTF-8 safe), echo + logprobs scores the
prompt as transformers does, OpenAI's chat fields the server cannot use are accepted at their
neutral values, and lm-eval's loglikelihood / generate_until run on a local task."""
from __future__ import annotations

import json
import math

import pytest
import torch

from server_harness import ServerProcess

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

NAME = "smollm2"
PROMPTS = ["The capital of France is", "Water boils at a temperature of", "One, two, three,"]
CHATS = ["What is the capital of France?", "Write three emojis that show happiness:"]


@pytest.fixture(scope="module")
def server(smollm2_path):
    srv = ServerProcess(smollm2_path, "--served-model-name", NAME, "--max-model-len", "1024")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from atom import LLM
    return LLM(smollm2_path, max_model_len=1024, enable_log_stats=False, enforce_eager=True)


@pytest.fixture(scope="module")
def hf(smollm2_path):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [NAME]


def test_completions_equal_llm_generate_greedy(client, llm):
    from atom import SamplingParams
    ref = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    r = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=24, temperature=0,
                                  extra_body={"return_token_ids": True})
    choices = sorted(r.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [o.text for o in ref]
    assert [c.token_ids for c in choices] == [o.token_ids for o in ref]
    assert [c.finish_reason for c in choices] == [o.finish_reason for o in ref]
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in ref)
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in ref)


def test_streamed_completion_equals_non_streamed(client):
    kw = dict(model=NAME, prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=[" seven"])
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.text for ch in chunks for c in ch.choices)
    assert text == whole.text and " seven" not in text
    finishing = [c for ch in chunks for c in ch.choices if c.finish_reason is not None]
    assert len(finishing) == 1 and finishing[0].finish_reason == whole.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_chat_equals_llm_chat_and_streams_the_same_text(client, llm):
    from atom import SamplingParams
    refs = []
    for question in CHATS:
        messages = [{"role": "user", "content": question}]
        ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
        refs.append(ref.text)
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == ref.text
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason == ref.finish_reason
        chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=24,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        deltas = [c.delta.content or "" for ch in chunks for c in ch.choices]
        assert "".join(deltas) == ref.text
        assert chunks[0].choices[0].delta.role == "assistant"
        # UTF-8 safe: no half character in any chunk but (on a length finish) the model's own last
        assert not any("\ufffd" in d for d in deltas[:-1])
        finishing = [c for ch in chunks for c in ch.choices if c.finish_reason is not None]
        assert len(finishing) == 1
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert "Paris" in refs[0]
    assert "🌟" in refs[1]  # the second answer has multi-byte characters, split over tokens


def test_n_seeded_sampling_streams_what_it_returns(client):
    kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0.9, top_p=0.95,
              seed=7, n=2, extra_body={"top_k": 50})
    whole = client.completions.create(**kw)
    texts = {c.index: c.text for c in whole.choices}
    assert sorted(texts) == [0, 1]
    streamed = {0: "", 1: ""}
    finished = {0: 0, 1: 0}
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] += c.text
            finished[c.index] += c.finish_reason is not None
    assert streamed == texts and finished == {0: 1, 1: 1}


def test_echo_with_zero_max_tokens_scores_the_prompt_like_transformers(client, hf, llm):
    prompt = "The capital of France is Paris."
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                  temperature=0)
    c = r.choices[0]
    assert c.text == prompt and r.usage.completion_tokens == 0
    lp = c.logprobs
    ids = llm.tokenizer.encode(prompt)
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=2e-3)
    assert "".join(lp.tokens) == prompt
    for top, tok, got in zip(lp.top_logprobs[1:], lp.tokens[1:], lp.token_logprobs[1:]):
        assert top[tok] == got and max(top.values()) >= got


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_completion_logprobs_equal_non_streamed(client, llm, echo):
    """Streamed chunks' logprobs, concatenated, are the whole response's: `text_offset` counts
    on across chunks (from the echoed prompt's start), it does not restart in each."""
    kw = dict(model=NAME, prompt=PROMPTS[1], max_tokens=5, temperature=0, logprobs=2, echo=echo)
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = [c.logprobs for ch in client.completions.create(stream=True, **kw) for c in ch.choices
              if c.logprobs is not None]
    assert len(chunks) > 2  # several chunks carry logprobs, so an offset restarting would show
    tokens = [t for lp in chunks for t in lp.tokens]
    offsets = [o for lp in chunks for o in lp.text_offset]
    lps = [x for lp in chunks for x in lp.token_logprobs]
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert len(tokens) == 5 + (len(llm.tokenizer.encode(PROMPTS[1])) if echo else 0)
    assert offsets[0] == 0
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    assert (lps[0] is None) == echo and (whole.token_logprobs[0] is None) == echo
    assert [x for x in lps if x is not None] == pytest.approx(
        [x for x in whole.token_logprobs if x is not None], abs=1e-4)
    tops = [t for lp in chunks for t in lp.top_logprobs]
    assert [sorted(t) if t else t for t in tops] == [sorted(t) if t else t for t in whole.top_logprobs]


def test_stop_token_ids_end_the_output_as_llm_generate(client, llm):
    from atom import SamplingParams
    kw = dict(model=NAME, prompt=PROMPTS[2], max_tokens=8, temperature=0,
              extra_body={"return_token_ids": True})
    free = client.completions.create(**kw).choices[0].token_ids
    stop = free[4]
    at = free.index(stop)
    assert stop != llm.tokenizer.eos_token_id and at < len(free) - 1
    ref = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop]),
                       use_tqdm=False)[0]
    kw["extra_body"]["stop_token_ids"] = [stop]
    c = client.completions.create(**kw).choices[0]
    assert c.finish_reason == "stop" == ref.finish_reason and c.stop_reason == stop
    assert c.token_ids == ref.token_ids and c.text == ref.text
    assert c.token_ids == free[:len(c.token_ids)] and len(c.token_ids) <= at + 1


def test_chat_logprobs_and_max_completion_tokens_equal_llm_chat(client, llm):
    from atom import SamplingParams
    messages = [{"role": "user", "content": CHATS[0]}]
    k, limit = 3, 4
    ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=limit, logprobs=k),
                   use_tqdm=False)[0]
    r = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=limit,
                                       temperature=0, logprobs=True, top_logprobs=k)
    c = r.choices[0]
    assert c.finish_reason == "length" == ref.finish_reason   # the answer is longer than that
    assert r.usage.completion_tokens == limit == len(ref.token_ids)
    assert c.message.content == ref.text
    content = c.logprobs.content
    assert len(content) == limit
    for got, tid, want in zip(content, ref.token_ids, ref.outputs[0].logprobs):
        assert got.token == want[tid].decoded_token and got.bytes == list(got.token.encode())
        assert got.logprob == pytest.approx(want[tid].logprob, abs=1e-4)
        tops = sorted((v for v in want.values() if v.rank <= k), key=lambda v: v.rank)
        assert [t.token for t in got.top_logprobs] == [v.decoded_token for v in tops]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([v.logprob for v in tops], abs=1e-4)
        assert len(got.top_logprobs) == k and got.top_logprobs[0].token == got.token   # greedy
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, stream=True,
                                                 max_completion_tokens=limit, temperature=0,
                                                 logprobs=True, top_logprobs=k))
    streamed = [e for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    assert [len(e.top_logprobs) for e in streamed] == [k] * limit


def test_chat_accepts_openai_fields_it_cannot_use_at_their_neutral_values(client):
    messages = [{"role": "user", "content": "What is 2+2?"},
                {"role": "tool", "content": "4", "tool_call_id": "call_1"}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, temperature=0,
                                       parallel_tool_calls=False, store=False, metadata={"run": "x"},
                                       service_tier="auto")
    assert r.usage.completion_tokens == 2
    for kw, param in [({"store": True}, "store"), ({"service_tier": "flex"}, "service_tier")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, **kw)
        assert e.value.body.get("error", e.value.body)["param"] == param


def test_bad_requests_raise_the_clients_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=1, temperature=-0.5)
    body = e.value.body
    assert body.get("error", body)["param"] == "temperature"
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=NAME, messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="word " * 1100, max_tokens=1)
    assert client.completions.create(model=NAME, prompt="ok", max_tokens=1).choices[0].finish_reason


# --- lm-eval ------------------------------------------------------------------------------
MC_DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " Berlin", " Rome"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " seven", " blue"], "answer": 0},
    {"question": "The sky on a clear day is", "choices": [" green", " blue", " loud"], "answer": 1},
]
GEN_DOCS = [{"question": "Q: What is the capital of France?\nA:", "answer": "Paris"},
            {"question": "Q: What color is the sky?\nA:", "answer": "blue"}]


def _write_tasks(tmp_path) -> None:
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    (tmp_path / "atom_mc.yaml").write_text(f"""task: atom_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (tmp_path / "atom_gen.yaml").write_text(f"""task: atom_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
""")


def test_lm_eval_loglikelihood_and_generate_until(server, smollm2_path, tmp_path, hf, llm):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    from atom import SamplingParams
    _write_tasks(tmp_path)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": server.url + "/v1/completions", "model": NAME,
                    "tokenizer": smollm2_path, "tokenizer_backend": "huggingface",
                    "tokenized_requests": True, "num_concurrent": 2, "max_retries": 1,
                    "max_length": 1024},
        tasks=["atom_mc", "atom_gen"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True, limit=None)
    tok = llm.tokenizer
    # loglikelihood: each choice's score is transformers' sum of continuation logprobs
    for sample in results["samples"]["atom_mc"]:
        doc = sample["doc"]
        for choice, resp in zip(doc["choices"], sample["resps"]):
            got = resp[0][0]
            ctx = tok.encode(doc["question"])
            whole = tok.encode(doc["question"] + choice)
            with torch.inference_mode():
                ref = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), -1)
            want = sum(ref[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))
            assert got == pytest.approx(want, abs=5e-3)
            assert math.isfinite(got)
    assert results["results"]["atom_mc"]["acc,none"] >= 2 / 3
    # generate_until: what LLM.generate gives greedy with the same stop and length
    for sample in results["samples"]["atom_gen"]:
        prompt = sample["arguments"][0][0] if isinstance(sample["arguments"][0], (list, tuple)) \
            else sample["arguments"][0]
        ref = llm.generate([tok.encode(prompt)], SamplingParams(temperature=0, max_tokens=16,
                                                               stop_strings=["\n"]), use_tqdm=False)[0]
        assert sample["resps"][0][0] == ref.text
    assert "exact_match,none" in results["results"]["atom_gen"]
