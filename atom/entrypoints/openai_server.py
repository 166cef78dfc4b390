"""`python -m atom.entrypoints.openai_server`: the OpenAI-compatible HTTP server.

    python -m atom.entrypoints.openai_server --model embedded --server-port 8000
    curl localhost:8000/v1/completions -d '{"model": "embedded", "prompt": "Hi", "max_tokens": 8}'

Takes every engine flag (`EngineArgs`; the guide's `--port` stays the engine's internal port)
plus the server's own: `--host` (127.0.0.1), `--server-port` (8000), `--served-model-name`
(default: `--model`), `--chat-template` (a file, or the template text), `--api-key` (or
`$ATOM_API_KEY`), `--max-waiting-requests` (503 past it; default no limit) and
`--shutdown-timeout` (seconds SIGTERM waits for requests in flight) and
`--engine-process` / `--no-engine-process`. The engine runs with `asyncio_mode=True`
(`AsyncLLMEngine`): by default in a process of its own (`--engine-process`), so the HTTP
side's Python work and the engine's do not share one GIL; `--no-engine-process` steps it
in a thread of the server process instead. The engine process ignores SIGINT / SIGTERM (the
server drains, then stops it) and exits with the server. SIGTERM / Ctrl-C: new requests get
a 503 (and new connections are refused once the listener closes), requests in flight finish
within the timeout, then what is left is aborted and the process exits (0).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

logger = logging.getLogger("atom.entrypoints.openai_server")


def make_parser() -> argparse.ArgumentParser:
    from atom.model_engine.arg_utils import EngineArgs
    p = argparse.ArgumentParser(prog="python -m atom.entrypoints.openai_server",
                                description="ATOM's OpenAI-compatible server.")
    EngineArgs.add_cli_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    g.add_argument("--server-port", type=int, default=8000, help="HTTP port to listen on.")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="Model name(s) clients use (default: --model).")
    g.add_argument("--chat-template", default=None,
                   help="Chat template: a Jinja file, or the template text itself.")
    g.add_argument("--api-key", default=os.environ.get("ATOM_API_KEY"),
                   help="Require 'Authorization: Bearer <key>' on /v1 (default: $ATOM_API_KEY).")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="Answer 503 once this many requests wait to be scheduled (default: no limit).")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="Seconds SIGTERM lets requests in flight finish.")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="Run the engine in a process of its own (default), or with "
                        "--no-engine-process in a thread of the server process.")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    return p


def check_server_args(args: argparse.Namespace) -> None:
    """Server flags checked before the model loads (ValueError naming the flag)."""
    if not 0 < args.server_port < 65536:
        raise ValueError(f"--server-port={args.server_port} is invalid: must be in [1, 65535]")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests={args.max_waiting_requests} is invalid: "
                         "must be >= 1 (leave it out for no limit)")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout={args.shutdown_timeout} is invalid: must be >= 0")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key='' is invalid: give a non-empty key or leave it out")


def read_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template={value!r} is neither a file nor a Jinja template")
    return value


def build(args: argparse.Namespace):
    """(app, engine) for parsed arguments; the engine is built when the app starts."""
    from atom.entrypoints.openai.app import ServerOptions, build_app
    from atom.model_engine.arg_utils import EngineArgs
    from atom.model_engine.async_engine import AsyncLLMEngine
    from atom.model_engine.supported import unsupported_settings

    check_server_args(args)
    eargs = EngineArgs.from_cli_args(args)
    found = unsupported_settings(eargs._config_kwargs())
    if eargs.create_engine_config().parallel_config.data_parallel_size > 1:  # ATOM_DP_* included
        found.append("data_parallel_size > 1 is not implemented in the server yet: one engine serves; "
                     "run one server per replica behind a load balancer, or use LLM(..., data_parallel_size=N)")
    if found:
        raise ValueError("; ".join(found))
    template = read_chat_template(args.chat_template)

    engine = AsyncLLMEngine.from_engine_args(eargs, process=args.engine_process)
    names = args.served_model_name or [args.model]
    options = ServerOptions(names, api_key=args.api_key, chat_template=template,
                            max_waiting_requests=args.max_waiting_requests)
    return build_app(engine, options), engine


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    app, _ = build(args)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            """SIGTERM / SIGINT: refuse new requests, let uvicorn drain; a second SIGINT
            exits at once. Unlike uvicorn's own, the signal is not raised again afterwards:
            a clean drain exits 0."""
            serving = getattr(app.state, "serving", None)
            if serving is not None and not serving.draining:
                serving.draining = True
                logger.info("signal %s: draining (at most %.0f s), refusing new requests",
                            sig, args.shutdown_timeout)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

    config = uvicorn.Config(app, host=args.host, port=args.server_port, access_log=False,
                            log_level=args.uvicorn_log_level, lifespan="on",
                            timeout_graceful_shutdown=args.shutdown_timeout, log_config=None)
    server = Server(config)
    logger.info("listening on http://%s:%d", args.host, args.server_port)
    server.run()
    if not server.started:   # the engine failed to build, or the port was taken
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    from prometheus_client import disable_created_metrics

    from atom.utils.log_setup import ensure_visible
    disable_created_metrics()   # this process's /metrics: no `_created` series (as vLLM)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    ensure_visible()
    args = make_parser().parse_args(argv)
    try:
        serve(args)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
