"""`EngineProcess`: the engine built and stepped by a process of its own (`AsyncLLMEngine`'s
process mode, the server's default).

    core = EngineProcess(EngineArgs(model=...))
    core.start(on_ready, on_report)   # spawns the child; on_ready((info, snapshot, tokenizer) or an error)
    core.send(("add", rid, prompt, params)); core.send(("abort", rid))
    core.stop(timeout=30.0)           # STOP, join; kill past the timeout

Why: the server's own Python work per request (JSON, SSE chunks, asyncio queues) and the
engine's per step (schedule, detokenize, build outputs) share one GIL in one process; under
load each waits for the other. In a child the engine steps with its own interpreter.

The child ('spawn': nothing is forked after torch or CUDA started) builds the engine from
the picklable `EngineArgs` (`create_engine(asyncio_mode=True)`), answers "ready" with the
`EngineInfo` and first snapshot (or the build's error: pickled when it survives pickling,
else a RuntimeError with its text; the child's traceback becomes its `__cause__`), then
runs `EngineLoop` on commands read from the pipe, sending one message per round: the
`Report`, its outputs as plain tuples (`encode_outputs`; a prompt's token ids only in a
request's first output, the parent puts them back). In the server process a reader thread
receives them, calls `on_report` (which runs the metrics hook there and hands the report to
the event loop), and a sender thread writes commands, so the event loop never blocks on
the pipe. The server loads the tokenizer itself, from `EngineInfo.model`.

Ends: STOP (the child aborts what is left, sends its last report, shuts the engine down
and exits 0); the pipe closing (the child died: the reader reports an EngineDeadError with
its exit status to every stream); the server process gone (the child watches its parent
and exits). The child ignores SIGINT / SIGTERM (a Ctrl-C or a SIGTERM to the process group
leaves the server to drain and then stop it). It is not daemonic, since a tensor-parallel
engine spawns its own workers, so the parent reaps it: in `stop()`, and at interpreter exit
before multiprocessing's own join.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import traceback
from collections import deque

from atom.model_engine.engine_loop import STOP, EngineDeadError, EngineInfo, EngineLoop, Report
from atom.outputs import CompletionOutput, RequestMetrics, RequestOutput

logger = logging.getLogger(__name__)

DEFAULT_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


class EngineTraceback(Exception):
    """The engine process's traceback, as text (the `__cause__` of an error it sent)."""

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.args[0]}\"\"\""


def portable(e: BaseException) -> BaseException:
    """`e` when it comes back from pickling as itself (type and message), else a
    RuntimeError carrying its type and message."""
    try:
        back = pickle.loads(pickle.dumps(e))
        if type(back) is type(e) and str(back) == str(e):
            return e
    except Exception:  # noqa: BLE001 - not picklable: sent as text
        pass
    return RuntimeError(f"{type(e).__name__}: {e}")


# --- outputs on the wire ------------------------------------------------------------------
def encode_outputs(outputs: list[RequestOutput], sent_prompts: set[str]) -> list[tuple]:
    """Plain tuples (they pickle several times faster than the dataclasses); the prompt only
    in a request's first output (`sent_prompts`: the requests whose prompt went already)."""
    rows = []
    for o in outputs:
        first = o.request_id not in sent_prompts
        if o.finished:
            sent_prompts.discard(o.request_id)
        elif first:
            sent_prompts.add(o.request_id)
        m = o.metrics
        rows.append((o.request_id, (o.prompt, o.prompt_token_ids) if first else None,
                     [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason,
                       c.stop_reason, c.new_token_ids, c.new_text) for c in o.outputs],
                     o.finished, o.prompt_logprobs, o.num_cached_tokens,
                     None if m is None else (m.arrival_time, m.first_scheduled_time, m.first_token_time,
                                             m.finished_time, m.ttft, m.tpot), o.error))
    return rows


def decode_outputs(rows: list[tuple], prompts: dict[str, tuple]) -> list[RequestOutput]:
    """The outputs `encode_outputs` gave; `prompts` keeps each request's prompt meanwhile."""
    outs = []
    for rid, prompt, comps, finished, plp, cached, m, error in rows:
        if prompt is None:
            prompt = prompts.pop(rid, (None, [])) if finished else prompts.get(rid, (None, []))
        elif not finished:
            prompts[rid] = prompt
        outs.append(RequestOutput(rid, prompt[0], prompt[1], [CompletionOutput(*c) for c in comps], finished,
                                  prompt_logprobs=plp, num_cached_tokens=cached,
                                  metrics=None if m is None else RequestMetrics(*m), error=error))
    return outs


# --- the child ----------------------------------------------------------------------------
class PipeCommands:
    """The child's command source: batches from the server, one command at a time through
    `get(timeout)` / `get_nowait()` (what `EngineLoop` reads); STOP once the server is gone."""

    def __init__(self, conn):
        self.conn = conn
        self._buf: deque = deque()

    def get(self, timeout: float | None = None):
        if not self._buf:
            try:
                if not self.conn.poll(timeout):
                    raise queue.Empty
                self._buf.extend(self.conn.recv())
            except (EOFError, OSError):
                self._buf.append(STOP)
        return self._buf.popleft()

    def get_nowait(self):
        return self.get(0)


def log_setup() -> tuple:
    """(root level, `atom` level, format, date format) of this process's logging, for the child."""
    root = logging.getLogger()
    fmt = next((h.formatter for h in root.handlers if h.formatter is not None), None)
    return (root.level, logging.getLogger("atom").getEffectiveLevel(),
            fmt._fmt if fmt is not None else DEFAULT_FORMAT, fmt.datefmt if fmt is not None else "%H:%M:%S")


def _configure_logging(setup: tuple) -> None:
    """The parent's levels and format, to stderr (the parent's, inherited); a handler the
    main module added on its import here is kept instead."""
    root_level, atom_level, fmt, datefmt = setup
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(fmt, datefmt))
        root.addHandler(handler)
    root.setLevel(root_level)
    logging.getLogger("atom").setLevel(atom_level)


def engine_process_main(engine_args, conn, parent_pid: int, logging_setup: tuple) -> None:
    """The child: build the engine, say "ready" (or send the error), serve until STOP."""
    from atom.distributed.worker import _exit_now, _watch_parent
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    _configure_logging(logging_setup)
    try:
        engine = engine_args.create_engine(asyncio_mode=True)
    except BaseException as e:  # noqa: BLE001 - handed to start()'s caller
        try:
            conn.send(("error", portable(e), traceback.format_exc()))
        except OSError:
            pass
        _exit_now(1)
    sent: set[str] = set()

    def emit(report: Report) -> None:
        report.outputs = encode_outputs(report.outputs, sent)
        report.aborted = encode_outputs(report.aborted, sent)
        report.refused = [(rid, portable(e)) for rid, e in report.refused]
        if report.cause is not None:
            report.cause = portable(report.cause)
        conn.send(report)

    loop = EngineLoop(engine, PipeCommands(conn), emit)
    conn.send(("ready", EngineInfo.of(engine), loop.snapshot))
    loop.run()
    _exit_now(0)


# --- the server's side --------------------------------------------------------------------
def _reap(process, conn, timeout: float) -> None:
    """STOP to the child (if it still listens), wait `timeout`, then kill it."""
    if process.is_alive():
        try:
            conn.send([STOP])
        except (OSError, ValueError):
            pass
        process.join(timeout)
    if process.is_alive():
        logger.warning("the engine process (pid %d) did not stop: killing it", process.pid)
        process.kill()
        process.join(10.0)


class EngineProcess:
    def __init__(self, engine_args, name: str = "atom-engine"):
        self.engine_args = engine_args
        self.name = name
        self.process = None
        self._conn = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._ended = False        # the last report (or the pipe's end) was read
        self._at_exit = None

    def __repr__(self) -> str:
        pid = self.process.pid if self.process is not None else None
        return f"EngineProcess(pid={pid}, alive={self.alive})"

    @property
    def alive(self) -> bool:
        return self.process is not None and not self._ended and self.process.is_alive()

    def start(self, on_ready, on_report) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=engine_process_main, name=self.name, daemon=False,
                                   args=(self.engine_args, child, os.getpid(), log_setup()))
        self.process.start()
        child.close()
        self._at_exit = lambda p=self.process, c=self._conn: _reap(p, c, 10.0)
        atexit.register(self._at_exit)   # after multiprocessing's own (which joins): runs first
        self._threads = [threading.Thread(target=self._read, args=(on_ready, on_report),
                                          name=f"{self.name}-reader", daemon=True),
                         threading.Thread(target=self._write, name=f"{self.name}-writer", daemon=True)]
        for t in self._threads:
            t.start()

    def send(self, cmd: tuple) -> None:
        self._outbox.put(cmd)

    def stop(self, timeout: float = 30.0) -> None:
        """STOP, wait up to `timeout` for the child to exit, then kill it; join the threads."""
        if self.process is None:
            return
        self.send(STOP)
        self.process.join(timeout)
        _reap(self.process, self._conn, 0.0)
        for t in self._threads:
            t.join(5.0)
        self._conn.close()
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None

    def _status(self) -> str:
        from atom.distributed.executor import _exit_status
        self.process.join(2.0)
        return f"the engine process (pid {self.process.pid}) {_exit_status(self.process.exitcode)}"

    def _read(self, on_ready, on_report) -> None:
        """`_serve_reports`; an error of its own (a message that does not unpickle, say)
        ends the engine: the child is killed and start() or every stream gets the error."""
        state = {"ready": False}
        try:
            self._serve_reports(on_ready, on_report, state)
        except BaseException as e:  # noqa: BLE001 - handed to start() or the streams
            logger.exception("reading the engine process's messages failed")
            self._ended = True
            self.process.kill()
            if not state["ready"]:
                on_ready(e)
            else:
                dead = EngineDeadError(f"reading the engine process's messages failed: {type(e).__name__}: {e}")
                on_report(Report(state["snapshot"], stopped=dead, cause=e))

    def _serve_reports(self, on_ready, on_report, state: dict) -> None:
        """Wait for "ready", load the tokenizer, then hand over every report until the last."""
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            self._ended = True
            on_ready(RuntimeError(f"{self._status()} before the engine was built"))
            return
        if msg[0] == "error":
            _, error, tb = msg
            error.__cause__ = EngineTraceback(tb)
            self._ended = True
            self.process.join(10.0)
            on_ready(error)
            return
        _, info, snapshot = msg
        from atom.model_engine.llm_engine import load_tokenizer
        tokenizer = load_tokenizer(info.model)
        state.update(ready=True, snapshot=snapshot)
        on_ready((info, snapshot, tokenizer))
        prompts: dict[str, tuple] = {}
        while True:
            try:
                report = self._conn.recv()
            except (EOFError, OSError):
                dead = EngineDeadError(self._status())
                self._ended = True
                on_report(Report(snapshot, stopped=dead, cause=dead))
                return
            report.outputs = decode_outputs(report.outputs, prompts)
            report.aborted = decode_outputs(report.aborted, prompts)
            snapshot = state["snapshot"] = report.snapshot
            if report.stopped is not None:
                self._ended = True
            on_report(report)
            if report.stopped is not None:
                return

    def _write(self) -> None:
        """Send queued commands, everything queued at once; ends after STOP or a closed pipe."""
        while True:
            batch = [self._outbox.get()]
            while True:
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            try:
                self._conn.send(batch)
            except (OSError, ValueError):  # the child is gone: the reader reports it
                return
            if STOP in batch:
                return
