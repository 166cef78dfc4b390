"""The server's command line and request building, without starting a server: every engine
flag is there beside the server's own, bad server flags are refused naming the flag, and a
`--chat-template` replaces the tokenizer's."""
from __future__ import annotations

import types

import pytest

pytest.importorskip("fastapi")

from atom.entrypoints import openai_server  # noqa: E402
from atom.entrypoints.openai.errors import APIError  # noqa: E402
from atom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from atom.entrypoints.openai.serving import OpenAIServing  # noqa: E402
from atom.model_engine.arg_utils import EngineArgs  # noqa: E402


def test_parser_takes_every_engine_flag_and_the_servers():
    import argparse
    engine = argparse.ArgumentParser()
    EngineArgs.add_cli_args(engine)
    p = openai_server.make_parser()
    flags = {s for a in p._actions for s in a.option_strings}
    assert {s for a in engine._actions for s in a.option_strings} <= flags
    args = p.parse_args(["--model", "m"])
    assert (args.host, args.server_port, args.port) == ("127.0.0.1", 8000, 8006)
    assert args.max_waiting_requests is None and args.served_model_name is None
    args = p.parse_args(["--server-port", "9001", "--served-model-name", "a", "b",
                         "--max-waiting-requests", "3", "--api-key", "k"])
    assert (args.server_port, args.served_model_name, args.max_waiting_requests, args.api_key) == (
        9001, ["a", "b"], 3, "k")


@pytest.mark.parametrize("argv,named", [
    (["--server-port", "0"], "--server-port=0"),
    (["--max-waiting-requests", "0"], "--max-waiting-requests=0"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout=-1"),
    (["--api-key", ""], "--api-key=''"),
])
def test_bad_server_flags_are_refused_before_the_model_loads(argv, named):
    args = openai_server.make_parser().parse_args(argv)
    with pytest.raises(ValueError, match=named):
        openai_server.check_server_args(args)


def test_unsupported_engine_settings_are_refused_before_the_model_loads():
    args = openai_server.make_parser().parse_args(["--model", "embedded", "-dp", "2"])
    with pytest.raises(ValueError, match="data_parallel_size > 1 is not implemented in the server"):
        openai_server.build(args)
    args = openai_server.make_parser().parse_args(["--model", "embedded", "--method", "mtp",
                                                   "--num-speculative-tokens", "1"])
    with pytest.raises(ValueError, match="speculative_config=.*is not implemented in this build"):
        openai_server.build(args)


def test_chat_template_file_or_text(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert openai_server.read_chat_template(str(f)) == "{{ messages[0]['content'] }}"
    assert openai_server.read_chat_template("{{ x }}") == "{{ x }}"
    with pytest.raises(ValueError, match="--chat-template"):
        openai_server.read_chat_template("no-such-file")


def _serving(tokenizer, template=None):
    engine = types.SimpleNamespace(tokenizer=tokenizer, info=types.SimpleNamespace(max_model_len=64),
                                   is_running=True)
    return OpenAIServing(engine, ["m"], chat_template=template)


def test_chat_template_overrides_the_tokenizers(smollm2_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    own = _serving(tok).chat_job(req)
    assert "<|im_start|>user\nhi<|im_end|>" in own.prompts[0].text
    custom = _serving(tok, "{% for m in messages %}<<{{ m.content }}>>{% endfor %}").chat_job(req)
    assert custom.prompts[0].text == "<<hi>>"
    assert custom.prompts[0].token_ids == tok.encode("<<hi>>")
    assert custom.params.max_tokens == 64 - len(custom.prompts[0].token_ids)  # chat: the room left


def test_completion_jobs_check_lengths_and_scoring():
    s = _serving(None)
    job = s.completion_job(CompletionRequest.model_validate(
        {"model": "m", "prompt": [[1, 2], [3, 4, 5]], "max_tokens": 0, "echo": True, "logprobs": 1}))
    assert job.score_only and job.params.max_tokens == 1 and job.params.prompt_logprobs == 1
    assert [p.token_ids for p in job.prompts] == [[1, 2], [3, 4, 5]]
    assert s.completion_job(CompletionRequest.model_validate(
        {"model": "m", "prompt": [1] * 60})).params.max_tokens == 4   # default 16, 4 fit
    for body, param in [({"prompt": [1] * 64}, "prompt"), ({"prompt": [1], "max_tokens": 64}, "max_tokens"),
                        ({"prompt": [1], "stop": ["x"], "stream_options": {"include_usage": True}},
                         "stream_options"),
                        ({"prompt": [1], "best_of": 3}, "best_of"), ({"prompt": []}, "prompt")]:
        with pytest.raises(APIError) as e:
            s.completion_job(CompletionRequest.model_validate({"model": "m", **body}))
        assert e.value.param == param and e.value.status == 400


def test_the_engine_runs_in_its_own_process_unless_told_otherwise(tiny_llama):
    p = openai_server.make_parser()
    assert p.parse_args([]).engine_process is True and "--no-engine-process" in p.format_help()
    _, engine = openai_server.build(p.parse_args(["--model", tiny_llama]))
    assert engine.mode == "process" and not engine.is_running and engine.engine is None
    _, engine = openai_server.build(p.parse_args(["--model", tiny_llama, "--no-engine-process"]))
    assert engine.mode == "thread"


def test_a_thread_mode_app_serves_the_offline_tokens(tiny_llama):
    """`--no-engine-process`: the app on an engine thread of this process (driven in-process
    through its lifespan) answers as `LLM.generate` does."""
    import asyncio

    import httpx

    from atom import LLM, SamplingParams
    args = openai_server.make_parser().parse_args(["--model", tiny_llama, "--max-model-len", "128",
                                                   "--enforce-eager", "--no-engine-process",
                                                   "--served-model-name", "tiny"])
    app, engine = openai_server.build(args)
    want = LLM(tiny_llama, max_model_len=128, enforce_eager=True, enable_log_stats=False).generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                health = (await c.get("/health")).status_code
                models = (await c.get("/v1/models")).json()
                r = await c.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6,
                                                          "temperature": 0, "ignore_eos": True,
                                                          "return_token_ids": True})
                return health, models, r.json()
    health, models, body = asyncio.run(main())
    assert health == 200 and models["data"][0]["root"] == tiny_llama and models["data"][0]["max_model_len"] == 128
    assert body["choices"][0]["token_ids"] == want.token_ids
    assert engine.engine is not None and not engine.is_running   # stopped with the app
