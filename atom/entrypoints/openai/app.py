"""The FastAPI app: routes, API-key check, OpenAI-style errors, engine start and stop.

    app = build_app(AsyncLLMEngine.from_engine_args(eargs), ServerOptions(served_model_names=["m"]))
    uvicorn.run(app, ...)           # the engine starts in the app's lifespan

The app needs of the engine only `AsyncLLMEngine`'s own surface: start / shutdown,
is_running, `info` (EngineInfo: model, max_model_len) and `tokenizer` once started,
`snapshot`, `on_step`, and the request calls `serving.py` makes; never the `LLMEngine`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models` (the `/v1`
ones behind `--api-key` when set: a missing or wrong bearer token is a 401), `GET /health`
(503 once draining or when the engine is not running), `GET /metrics` (Prometheus text).
Bodies are parsed here, not by FastAPI's injection, so every error has one form (`errors`).
An unexpected exception in a handler is a 500 for that request only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from atom.entrypoints.openai.errors import APIError, from_validation
from atom.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from atom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from atom.entrypoints.openai.serving import OpenAIServing

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ServerOptions:
    served_model_names: list[str]
    api_key: str | None = None
    chat_template: str | None = None          # the template's text (overrides the tokenizer's)
    max_waiting_requests: int | None = None   # 503 past this many waiting requests


def build_app(engine, options: ServerOptions) -> FastAPI:
    """An app serving `engine` (an `AsyncLLMEngine`, started by the app's lifespan)."""
    metrics = ServerMetrics(engine, options.served_model_names[0])
    engine.on_step = metrics.observe_step
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        serving = OpenAIServing(engine, options.served_model_names, options.chat_template,
                                options.max_waiting_requests)
        state["serving"] = serving
        app.state.serving = serving
        logger.info("serving %s: %r", options.served_model_names, engine)
        try:
            yield
        finally:
            await engine.shutdown()
            logger.info("engine stopped")

    app = FastAPI(title="ATOM OpenAI-compatible server", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.metrics = metrics
    created = int(time.time())

    def serving() -> OpenAIServing:
        s = state.get("serving")
        if s is None:
            raise APIError(503, "the engine is still starting", type="service_unavailable")
        return s

    def check_key(request: Request) -> None:
        key = options.api_key
        if key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")

    async def parse(request: Request, model):
        body = await request.body()
        try:
            return model.model_validate_json(body or b"")
        except ValidationError as e:
            raise from_validation(e, model) from None

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        if exc.status >= 500:
            logger.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        type=kind).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("%s %s failed", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                        type="internal_error").response()

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_key(request)
        s = serving()
        return await s.completions(await parse(request, CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_key(request)
        s = serving()
        return await s.chat_completions(await parse(request, ChatCompletionRequest), request)

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        s = serving()
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "atom",
             "root": engine.info.model, "max_model_len": s.max_model_len}
            for name in options.served_model_names]}

    @app.get("/health")
    async def health():
        s = state.get("serving")
        if s is None or s.draining or not engine.is_running:
            why = "draining" if s is not None and s.draining else "engine not running"
            return JSONResponse({"status": why}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
