"""Request validation of the OpenAI server, without starting one: a 422 names the field the
user wrote (not pydantic's union branch, dict key or an index into the value), and the chat
fields OpenAI has but this server cannot use (`parallel_tool_calls`, `store`, `metadata`,
`service_tier`, a message's `tool_call_id`) are accepted at their neutral values, else
refused with a 400 naming them."""
from __future__ import annotations

import json
import types

import pytest

pytest.importorskip("fastapi")

from pydantic import ValidationError  # noqa: E402

from atom.entrypoints.openai.errors import APIError, from_validation  # noqa: E402
from atom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from atom.entrypoints.openai.serving import OpenAIServing  # noqa: E402


def _error(model, body: dict) -> APIError:
    with pytest.raises(ValidationError) as e:
        model.model_validate_json(json.dumps(body))
    return from_validation(e.value, model)


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("model,body,param", [
    (CompletionRequest, {"prompt": [1, "a"]}, "prompt"),            # a list mixing ints and strings
    (CompletionRequest, {"prompt": [[1, "a"]]}, "prompt"),
    (CompletionRequest, {"prompt": 5}, "prompt"),
    (CompletionRequest, {"prompt": [5], "stop": 5}, "stop"),
    (CompletionRequest, {"prompt": [5], "stop_token_ids": [1, "x"]}, "stop_token_ids"),
    (CompletionRequest, {"prompt": [5], "logit_bias": {"5": "x"}}, "logit_bias"),
    (CompletionRequest, {"prompt": [5], "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
    (CompletionRequest, {"prompt": [5], "stream_options": {"x": 1}}, "stream_options.x"),
    (CompletionRequest, {"prompt": [5], "frobnicate": 1}, "frobnicate"),
    (CompletionRequest, {}, "prompt"),
    (ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    (ChatCompletionRequest, {"messages": [*MSG, {"role": "user", "content": 5}]}, "messages.1.content"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages.0.content"),
    (ChatCompletionRequest, {"messages": [{"role": "tool", "content": "4", "tool_call_id": 7}]},
     "messages.0.tool_call_id"),
    (ChatCompletionRequest, {"messages": MSG, "metadata": {"run": 1}}, "metadata"),
    (ChatCompletionRequest, {"messages": MSG, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    (ChatCompletionRequest, {"messages": MSG, "service_tier": 1}, "service_tier"),
    (ChatCompletionRequest, {"messages": []}, "messages"),
])
def test_a_422_names_the_field_the_user_wrote(model, body, param):
    err = _error(model, {"model": "m", **body})
    assert (err.status, err.param) == (422, param), err.message
    assert err.message.startswith("invalid request: ")


def test_without_the_model_the_param_is_pydantics_loc():
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"model": "m", "prompt": 5})
    assert from_validation(e.value).param == "prompt.str"


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_path)


def _serving(tokenizer, template=None) -> OpenAIServing:
    engine = types.SimpleNamespace(tokenizer=tokenizer, info=types.SimpleNamespace(max_model_len=64),
                                   is_running=True)
    return OpenAIServing(engine, ["m"], chat_template=template)


def _chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps({"model": "m", **body}))


def test_chat_accepts_openais_fields_at_their_neutral_values(tokenizer):
    template = "{% for m in messages %}{{ m.role }}:{{ m.content }}:{{ m.tool_call_id }};{% endfor %}"
    s = _serving(tokenizer, template)
    messages = [*MSG, {"role": "tool", "content": "4", "tool_call_id": "call_1"}]
    for extra in [{}, {"parallel_tool_calls": True}, {"parallel_tool_calls": False},
                  {"store": False}, {"store": None}, {"metadata": {"run": "a", "who": "b"}},
                  {"store": False, "metadata": {}}, {"service_tier": "auto"},
                  {"service_tier": "default"}, {"service_tier": None}]:
        job = s.chat_job(_chat(messages=messages, **extra))
        assert job.prompts[0].text == "user:hi:;tool:4:call_1;", extra   # tool_call_id reaches it


@pytest.mark.parametrize("body,param,says", [
    ({"store": True}, "store", "store=true is not supported"),
    ({"store": True, "metadata": {"run": "a"}}, "store", "store=true"),
    ({"service_tier": "flex"}, "service_tier", "service_tier='flex' is not supported"),
    ({"service_tier": "priority"}, "service_tier", "'auto' or 'default'"),
])
def test_chat_refuses_what_it_cannot_honour_naming_the_field(tokenizer, body, param, says):
    with pytest.raises(APIError) as e:
        _serving(tokenizer).chat_job(_chat(messages=MSG, **body))
    assert (e.value.status, e.value.param) == (400, param) and says in e.value.message
