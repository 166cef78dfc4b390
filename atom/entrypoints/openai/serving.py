"""`/v1/completions` and `/v1/chat/completions` on an `AsyncLLMEngine`.

A request becomes one engine request per prompt (`n` completions each): the prompt is
tokenized here, `SamplingParams` built and validated here (a 400 naming the field before the
engine sees anything), then the engine's DELTA outputs are either collected (one JSON body)
or written as server-sent events as they come: per choice, text chunks (the engine's UTF-8
safe `new_text`, stop strings held back), exactly one chunk carrying `finish_reason`, then a
usage chunk when `stream_options.include_usage`, then `data: [DONE]`. A choice's streamed
completions `logprobs`, concatenated, are the non-streamed ones: `text_offset` counts on
across its chunks (from the echoed prompt's start when `echo`).

Choice `i * n + j` is completion j of prompt i. Scoring (`echo` with `max_tokens` 0, or
lm-eval's `max_tokens` 1): the prompt comes back with its logprobs (`prompt_logprobs`);
with 0 the one token the engine must sample is dropped. A client that goes away aborts its
requests (their KV blocks are freed between two steps).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from atom.entrypoints.openai.errors import APIError, from_value_error
from atom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from atom.model_engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineError
from atom.model_engine.prompts import Prompt
from atom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
MAX_LOGPROBS = 20
MIN_LOGPROB = -9999.0                # JSON has no -inf
SERVICE_TIERS = (None, "auto", "default")   # the chat service_tier values that change nothing


@dataclass
class _Job:
    """One request as the engine will see it."""
    prompts: list[Prompt]
    params: SamplingParams
    n: int
    echo: bool = False
    score_only: bool = False          # max_tokens 0: drop the sampled token
    logprobs: int | None = None
    rids: list[str] = field(default_factory=list)


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str],
                 chat_template: str | None = None, max_waiting_requests: int | None = None):
        self.engine = engine            # reads: tokenizer, info (EngineInfo), requests
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.info.max_model_len
        self.served_model_names = list(served_model_names)
        self.chat_template = chat_template
        self.max_waiting_requests = max_waiting_requests
        self.draining = False           # SIGTERM: refuse new requests

    def __repr__(self) -> str:
        return (f"OpenAIServing(models={self.served_model_names}, max_model_len={self.max_model_len}, "
                f"max_waiting_requests={self.max_waiting_requests}, draining={self.draining})")

    # --- shared checks -------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name not in self.served_model_names:
            raise APIError(404, f"model={name!r} does not exist: this server serves "
                                f"{self.served_model_names}", param="model", code="model_not_found")

    def check_accepting(self, num_new: int) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down and takes no new requests",
                           type="service_unavailable", code="shutting_down")
        if not self.engine.is_running:
            raise APIError(503, "the engine is not running", type="service_unavailable",
                           code="engine_dead")
        limit = self.max_waiting_requests
        if limit is not None and self.engine.num_pending_with(num_new) > limit:
            raise APIError(503, f"the waiting queue is full ({self.engine.num_pending} waiting, "
                                f"max_waiting_requests={limit}): retry later",
                           type="service_unavailable", code="queue_full")

    def _tokenize(self, text: str, param: str) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, f"{param} is text but the model has no tokenizer: send token ids",
                           param=param)
        return self.tokenizer.encode(text)

    def _max_tokens(self, asked: int | None, prompts: list[Prompt], default: int | None,
                    param: str) -> int:
        """The request's max_tokens, checked against every prompt's room in max_model_len."""
        longest = max(len(p.token_ids) for p in prompts)
        if longest >= self.max_model_len:
            raise APIError(400, f"prompt has {longest} tokens: this model's max_model_len="
                                f"{self.max_model_len} leaves no room for output", param="prompt")
        room = self.max_model_len - longest
        if asked is None:
            return room if default is None else min(default, room)
        if asked < 0:
            raise APIError(400, f"{param}={asked} is invalid: must be an integer >= 0", param=param)
        if asked > room:
            raise APIError(400, f"{param}={asked} is too large: the prompt has {longest} tokens "
                                f"and max_model_len={self.max_model_len} leaves {room}", param=param)
        return asked

    def _params(self, req, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None
                ) -> SamplingParams:
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server: leave it unset",
                           param="logit_bias")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed with stream=true",
                           param="stream_options")
        stop = req.stop
        if isinstance(stop, list) and not stop:
            stop = None
        try:
            return SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                max_tokens=max(max_tokens, 1), ignore_eos=req.ignore_eos, stop_strings=stop,
                seed=req.seed, stop_token_ids=req.stop_token_ids, n=req.n, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                min_tokens=req.min_tokens)
        except (ValueError, TypeError) as e:
            raise from_value_error(e) from None

    # --- /v1/completions -----------------------------------------------------------------
    def completion_job(self, req: CompletionRequest) -> _Job:
        self.check_model(req.model)
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported by this server", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, f"best_of={req.best_of} is not supported: only best_of == n",
                           param="best_of")
        prompts = self._completion_prompts(req.prompt)
        k = req.logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs={k} is invalid: must be in [0, {MAX_LOGPROBS}]",
                           param="logprobs")
        max_tokens = self._max_tokens(req.max_tokens, prompts, DEFAULT_COMPLETION_MAX_TOKENS,
                                      "max_tokens")
        if max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens=0 is only allowed with echo=true (scoring the prompt)",
                           param="max_tokens")
        prompt_lp = k if (req.echo and k is not None) else None
        params = self._params(req, max_tokens, k, prompt_lp)
        return _Job(prompts, params, req.n, echo=req.echo, score_only=max_tokens == 0, logprobs=k)

    def _completion_prompts(self, prompt) -> list[Prompt]:
        if isinstance(prompt, str):
            items = [prompt]
        elif not prompt:
            raise APIError(400, "prompt=[] is invalid: give a string, a list of strings, token ids "
                                "or a list of token-id lists", param="prompt")
        elif isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        out = []
        for i, p in enumerate(items):
            where = "prompt" if len(items) == 1 else f"prompt[{i}]"
            if isinstance(p, str):
                if not p:
                    raise APIError(400, f"{where}='' is invalid: a prompt needs at least one token",
                                   param="prompt")
                out.append(Prompt(p, self._tokenize(p, "prompt")))
            else:
                if not p:
                    raise APIError(400, f"{where}=[] is invalid: a prompt needs at least one token",
                                   param="prompt")
                text = self.tokenizer.decode(p) if self.tokenizer is not None else None
                out.append(Prompt(text, list(p)))
        return out

    # --- /v1/chat/completions ------------------------------------------------------------
    def chat_job(self, req: ChatCompletionRequest) -> _Job:
        self.check_model(req.model)
        for name in ("tools", "response_format"):
            if getattr(req, name):
                raise APIError(400, f"{name} is not supported by this server", param=name)
        if req.store:
            raise APIError(400, "store=true is not supported: this server stores no completions "
                                "(leave store unset or false)", param="store")
        if req.service_tier not in SERVICE_TIERS:
            raise APIError(400, f"service_tier={req.service_tier!r} is not supported: this server "
                                "has one tier (leave it unset, or give 'auto' or 'default')",
                           param="service_tier")
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so no chat template: use "
                                "/v1/completions with token ids", param="messages")
        conversation = [{"role": m.role, "content": m.text(),
                         **({"name": m.name} if m.name else {}),
                         **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})}
                        for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                chat_template=self.chat_template, **(req.chat_template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - a template error is the request's problem
            raise APIError(400, f"the chat template failed on these messages: {e}",
                           param="messages") from None
        prompts = [Prompt(text, self._tokenize(text, "messages"))]
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both",
                           param="max_completion_tokens")
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._max_tokens(asked, prompts, None, param)
        if max_tokens == 0:
            raise APIError(400, f"{param}=0 is invalid for chat: must be >= 1", param=param)
        k = None
        if req.logprobs:
            k = req.top_logprobs or 0
            if not 0 <= k <= MAX_LOGPROBS:
                raise APIError(400, f"top_logprobs={k} is invalid: must be in [0, {MAX_LOGPROBS}]",
                               param="top_logprobs")
        elif req.top_logprobs is not None:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return _Job(prompts, self._params(req, max_tokens, k, None), req.n, logprobs=k)

    # --- running a job -------------------------------------------------------------------
    async def submit(self, job: _Job) -> None:
        """Add the job's engine requests; on any refusal abort those added and raise a 400."""
        self.check_accepting(len(job.prompts))
        try:
            for p in job.prompts:
                job.rids.append(await self.engine.add_request(
                    {"prompt": p.text, "prompt_token_ids": p.token_ids} if p.text is not None
                    else {"prompt_token_ids": p.token_ids}, job.params))
        except (ValueError, TypeError) as e:
            self.cancel(job)
            raise from_value_error(e, "prompt") from None
        except EngineDeadError as e:
            self.cancel(job)
            raise APIError(503, str(e), type="service_unavailable", code="engine_dead") from None
        except BaseException:
            self.cancel(job)
            raise

    def cancel(self, job: _Job) -> None:
        for rid in job.rids:
            self.engine.abort(rid)

    async def outputs(self, job: _Job) -> AsyncIterator[tuple[int, Any]]:
        """(prompt index, RequestOutput) of all the job's requests as they come."""
        if len(job.rids) == 1:
            async for out in self.engine.stream(job.rids[0]):
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, rid: str) -> None:
            try:
                async for out in self.engine.stream(rid):
                    q.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                q.put_nowait((i, e))
            q.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, rid)) for i, rid in enumerate(job.rids)]
        try:
            left = len(tasks)
            while left:
                i, item = await q.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def collect(self, job: _Job, raw_request) -> list:
        """The final output of each prompt; aborts everything if the client goes away."""
        finals: list = [None] * len(job.prompts)

        async def run():
            async for i, out in self.outputs(job):
                if out.finished:
                    finals[i] = out

        task = asyncio.create_task(run())
        watch = asyncio.create_task(_wait_disconnect(raw_request))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():   # the client left (or we were cancelled): stop generating
                task.cancel()
                self.cancel(job)
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise asyncio.CancelledError()
        exc = task.exception()
        if isinstance(exc, EngineError):
            raise APIError(500, str(exc), type="internal_error") from None
        if isinstance(exc, EngineDeadError):
            raise APIError(503, str(exc), type="service_unavailable", code="engine_dead") from None
        if exc is not None:
            raise exc
        return finals

    # --- bodies --------------------------------------------------------------------------
    def _tok(self, tid: int, entry) -> str:
        lp = entry.get(tid) if entry else None
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        if self.tokenizer is not None:
            return self.tokenizer.decode([tid])
        return f"token_id:{tid}"

    def completion_logprobs(self, ids: list[int], entries: list, offset: int = 0) -> dict:
        """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens, lps, tops, offsets = [], [], [], []
        for tid, entry in zip(ids, entries):
            s = self._tok(tid, entry)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            if entry is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(max(entry[tid].logprob, MIN_LOGPROB))
            top: dict[str, float] = {}
            for k, v in entry.items():
                key = self._tok(k, {k: v})
                top[key] = max(top.get(key, MIN_LOGPROB), max(v.logprob, MIN_LOGPROB))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, ids: list[int], entries: list, k: int) -> dict:
        content = []
        for tid, entry in zip(ids, entries):
            s = self._tok(tid, entry)
            top = sorted((v.rank or 0, t, v) for t, v in entry.items() if v.rank is not None
                         and 1 <= v.rank <= k)
            content.append({
                "token": s, "logprob": max(entry[tid].logprob, MIN_LOGPROB),
                "bytes": list(s.encode("utf-8")),
                "top_logprobs": [{"token": self._tok(t, {t: v}), "logprob": max(v.logprob, MIN_LOGPROB),
                                  "bytes": list(self._tok(t, {t: v}).encode("utf-8"))}
                                 for _, t, v in top]})
        return {"content": content}

    def _prompt_part(self, job: _Job, i: int, out) -> tuple[str, list[int], list]:
        """Echo: the prompt's text, ids and logprob entries (None for the first token)."""
        p = job.prompts[i]
        text = p.text if p.text is not None else ""
        entries = out.prompt_logprobs or [None] * len(p.token_ids)
        return text, list(p.token_ids), list(entries)

    def completion_body(self, job: _Job, finals: list, model: str, rid: str,
                        return_token_ids: bool) -> dict:
        choices = []
        prompt_tokens = completion_tokens = 0
        for i, out in enumerate(finals):
            prompt_tokens += len(job.prompts[i].token_ids)
            for c in out.outputs:
                text, ids, lps = c.text, list(c.token_ids), list(c.logprobs or [])
                if job.score_only:
                    text, ids, lps = "", [], []
                completion_tokens += len(ids)
                ptext, pids, pent = self._prompt_part(job, i, out) if job.echo else ("", [], [])
                choice = {"index": i * job.n + c.index, "text": ptext + text, "logprobs": None,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if job.logprobs is not None:
                    choice["logprobs"] = self.completion_logprobs(pids + ids, pent + lps)
                if return_token_ids:
                    choice["token_ids"] = ids
                    choice["prompt_token_ids"] = list(job.prompts[i].token_ids)
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}

    def chat_body(self, job: _Job, finals: list, model: str, rid: str, return_token_ids: bool) -> dict:
        out = finals[0]
        choices = []
        completion_tokens = 0
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            choice = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                      "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if job.logprobs is not None:
                choice["logprobs"] = self.chat_logprobs(list(c.token_ids), list(c.logprobs or []),
                                                        job.logprobs)
            if return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices,
                "usage": _usage(len(job.prompts[0].token_ids), completion_tokens)}

    # --- streaming -----------------------------------------------------------------------
    async def stream_events(self, job: _Job, model: str, rid: str, chat: bool,
                            include_usage: bool, continuous_usage: bool,
                            return_token_ids: bool) -> AsyncIterator[bytes]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        started: set[int] = set()
        done: set[int] = set()
        text_offset: dict[int, int] = {}   # per choice: where its next chunk's logprobs start
        prompt_tokens = sum(len(p.token_ids) for p in job.prompts)
        completion_tokens = 0

        def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
            body = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return _sse(body)

        try:
            async for i, out in self.outputs(job):
                batch = []
                for c in out.outputs:
                    index = i * job.n + c.index
                    if index in done:
                        continue
                    ids = list(c.new_token_ids)
                    text = c.new_text
                    lps = list(c.logprobs or [])
                    lps = lps[len(lps) - len(ids):] if ids else []
                    if job.score_only:
                        text, ids, lps = "", [], []
                    completion_tokens += len(ids)
                    first = index not in started
                    started.add(index)
                    if c.finish_reason is not None:
                        done.add(index)
                    if not first and not text and not ids and c.finish_reason is None:
                        continue
                    if chat:
                        delta = {"role": "assistant", "content": text} if first else (
                            {"content": text} if text or c.finish_reason is None else {})
                        choice = {"index": index, "delta": delta, "logprobs": None,
                                  "finish_reason": c.finish_reason}
                        if job.logprobs is not None and ids:
                            choice["logprobs"] = self.chat_logprobs(ids, lps, job.logprobs)
                    else:
                        pids, pent = [], []
                        if first and job.echo:
                            ptext, pids, pent = self._prompt_part(job, i, out)
                            text = ptext + text
                        choice = {"index": index, "text": text, "logprobs": None,
                                  "finish_reason": c.finish_reason}
                        if job.logprobs is not None:
                            start = text_offset.get(index, 0)
                            lp = self.completion_logprobs(pids + ids, pent + lps, start)
                            text_offset[index] = start + sum(map(len, lp["tokens"]))
                            choice["logprobs"] = lp
                    if c.finish_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    if return_token_ids:
                        choice["token_ids"] = ids
                    batch.append(choice)
                if batch:
                    usage = _usage(prompt_tokens, completion_tokens) if continuous_usage else None
                    yield chunk(batch, usage)
            if include_usage:
                body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                        "usage": _usage(prompt_tokens, completion_tokens)}
                yield _sse(body)
        except (EngineError, EngineDeadError) as e:
            logger.warning("request %s failed in the engine: %s", rid, e)
            yield _sse(APIError(500, str(e), type="internal_error").body())
        finally:
            self.cancel(job)  # a disconnect closes this generator: abort what still runs
        yield b"data: [DONE]\n\n"

    # --- the endpoints -------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw_request):
        job = self.completion_job(req)
        return await self._respond(job, req, raw_request, chat=False)

    async def chat_completions(self, req: ChatCompletionRequest, raw_request):
        job = self.chat_job(req)
        return await self._respond(job, req, raw_request, chat=True)

    async def _respond(self, job: _Job, req, raw_request, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        await self.submit(job)
        if req.stream:
            opts = req.stream_options
            events = self.stream_events(job, req.model, rid, chat,
                                        include_usage=bool(opts and opts.include_usage),
                                        continuous_usage=bool(opts and opts.include_usage
                                                              and opts.continuous_usage_stats),
                                        return_token_ids=req.return_token_ids)
            return _EventStream(events, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache"})
        finals = await self.collect(job, raw_request)
        build = self.chat_body if chat else self.completion_body
        return JSONResponse(build(job, finals, req.model, rid, req.return_token_ids))


class _EventStream(StreamingResponse):
    """A StreamingResponse that always closes its generator (whose `finally` aborts the job),
    however the response ends: done, client gone, or server shutting down."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _wait_disconnect(raw_request) -> None:
    """Returns when the client closed the connection (the body was read already)."""
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
