"""`EngineLoop`: one `LLMEngine` stepped while requests come and go, wherever it runs.

    loop = EngineLoop(engine, commands, emit)     # commands: get(timeout) / get_nowait()
    loop.run()                                    # until ("stop",) or an error; then engine.shutdown()

`AsyncLLMEngine` runs it in a thread of the server (thread mode) or in a process of its own
(`engine_process`); both feed it the same commands and read the same `Report`s. A round:
wait for a command while the engine is idle (no spinning; a last status line once it went
idle), drain every command queued, run one step when there is work, then hand over one
`Report` with everything the round did: adds accepted or refused (a ValueError / TypeError
of `add_request`, the request's own), the step's outputs, the final outputs of requests
aborted, and the `EngineSnapshot` after it. A step that raises fails the requests the
engine held then (`Report.failed`) and the loop goes on; anything else that escapes ends
the loop: every request is aborted and the last report carries `stopped`.

Commands are tuples, so they cross a pipe as they are: `("add", request_id, prompt,
params)`, `("abort", request_id)`, `STOP`.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import time
from typing import Callable

from atom.outputs import RequestOutput, RequestOutputKind

logger = logging.getLogger(__name__)

STOP = ("stop",)


class EngineError(RuntimeError):
    """The engine failed while it ran this request (not the request's fault)."""


class EngineDeadError(RuntimeError):
    """The engine is not running (not started, stopped, or failed to start)."""


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """What the engine looked like after its latest step or command (read by `/metrics`)."""
    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_usage: float = 0.0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What the server reads of the engine, known once it is built (no engine needed)."""
    model: str            # the resolved model folder (the server loads its tokenizer from there)
    max_model_len: int
    max_num_seqs: int
    description: str      # the engine's repr
    pid: int              # the process the engine runs in

    @classmethod
    def of(cls, engine) -> "EngineInfo":
        c = engine.config
        return cls(c.model, c.max_model_len, c.max_num_seqs, repr(engine), os.getpid())


@dataclasses.dataclass
class Report:
    """One round of the loop, handed over in one piece."""
    snapshot: EngineSnapshot
    now: float = 0.0                                  # time.perf_counter() after the step
    accepted: list[str] = dataclasses.field(default_factory=list)
    refused: list[tuple[str, BaseException]] = dataclasses.field(default_factory=list)
    outputs: list[RequestOutput] = dataclasses.field(default_factory=list)
    aborted: list[RequestOutput] = dataclasses.field(default_factory=list)  # their final outputs
    failed: tuple[BaseException, list[str]] | None = None  # a step raised: the error, the requests it failed
    stopped: BaseException | None = None   # the loop ended: what every open stream gets
    cause: BaseException | None = None     # why it ended, when it failed

    @property
    def for_requests(self) -> bool:
        """Whether it carries anything for a request (not just the snapshot)."""
        return bool(self.accepted or self.refused or self.outputs or self.aborted or self.failed
                    or self.stopped)


def snapshot_of(engine) -> EngineSnapshot:
    bm, sched = engine.block_manager, engine.scheduler
    return EngineSnapshot(
        num_running=len(sched.running), num_waiting=len(sched.waiting),
        num_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks, kv_usage=bm.usage,
        prefix_query_tokens=bm.num_query_tokens, prefix_hit_tokens=bm.num_hit_tokens,
        num_preemptions=sched.num_preemptions, num_steps=engine.stats.num_steps)


class EngineLoop:
    def __init__(self, engine, commands, emit: Callable[[Report], None]):
        self.engine = engine
        self.commands = commands
        self.emit = emit
        self.snapshot = snapshot_of(engine)

    def __repr__(self) -> str:
        return f"EngineLoop({self.snapshot}, engine={self.engine!r})"

    def run(self) -> None:
        """Serve until STOP (or the command source says the other side is gone); then abort
        what is left, hand over the last report and shut the engine down."""
        cause = None
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - the last report says why
            logger.exception("the engine loop stopped")
            cause = e
        last = Report(self.snapshot, cause=cause, stopped=EngineDeadError(
            "the engine stopped" if cause is None else f"the engine stopped: {type(cause).__name__}: {cause}"))
        try:
            last.aborted, _ = self._abort_everything()
            last.snapshot = self.snapshot = snapshot_of(self.engine)
        except Exception:  # noqa: BLE001 - stopping anyway
            logger.exception("could not abort the requests in flight")
        last.now = time.perf_counter()
        try:
            self.emit(last)
        except Exception:  # noqa: BLE001 - the other side may be gone
            logger.debug("could not hand over the last report", exc_info=True)
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:  # reap tensor-parallel workers now, not at interpreter exit
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - stopping anyway
                logger.exception("engine shutdown failed")

    def _serve(self) -> None:
        engine, stats = self.engine, self.engine.stats
        logged_idle = True
        while True:
            report = Report(self.snapshot)
            cmds = []
            if engine.is_finished():  # idle: block until a command (or the next status line)
                try:
                    cmds.append(self.commands.get(timeout=None if logged_idle else stats.log_interval))
                except queue.Empty:
                    self._log_status()
                    logged_idle = True
                    continue
            while True:  # everything queued, before the next step
                try:
                    cmds.append(self.commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in cmds:
                if cmd == STOP:
                    if report.for_requests:
                        self.emit(report)
                    return
                self._handle(cmd, report)
            if not engine.is_finished():
                try:
                    report.outputs = engine.step()
                except Exception as e:  # noqa: BLE001 - a bug: fail what is in flight, keep serving
                    logger.exception("engine step failed; aborting the requests in flight")
                    aborted, rids = self._abort_everything()
                    report.aborted += aborted
                    report.failed = (EngineError(f"the engine failed: {type(e).__name__}: {e}"), rids)
                else:
                    logged_idle = False
            report.now = time.perf_counter()
            report.snapshot = self.snapshot = snapshot_of(engine)
            self.emit(report)

    def _handle(self, cmd: tuple, report: Report) -> None:
        engine = self.engine
        kind, rid = cmd[0], cmd[1]
        if kind == "add":
            try:
                engine.add_request(cmd[2], cmd[3], request_id=rid)
                engine.set_output_kind(rid, RequestOutputKind.DELTA)
            except Exception as e:  # noqa: BLE001 - the request's own error, for its caller
                report.refused.append((rid, e))
            else:
                report.accepted.append(rid)
        elif kind == "abort":
            out = engine.abort(rid)
            if out is not None:
                logger.debug("aborted %s", rid)
                report.aborted.append(out)
        else:
            raise ValueError(f"engine command {cmd!r} is unknown: must be add, abort or stop")

    def _abort_everything(self) -> tuple[list[RequestOutput], list[str]]:
        """Abort every request the engine holds: (their final outputs, their ids)."""
        outs, rids = [], list(self.engine.requests)
        for rid in rids:
            try:
                out = self.engine.abort(rid)
                if out is not None:
                    outs.append(out)
            except Exception:  # noqa: BLE001 - keep freeing the others
                logger.exception("could not abort %s", rid)
        return outs, rids

    def _log_status(self) -> None:
        s = self.snapshot
        self.engine.stats.maybe_log(s.num_running, s.num_waiting, s.kv_usage, force=True,
                                    prefix_cache=(s.prefix_hit_tokens, s.prefix_query_tokens))
