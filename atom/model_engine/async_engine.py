"""`AsyncLLMEngine`: one `LLMEngine` stepped while requests come and go, driven from asyncio.

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=...))    # its own process
    engine = AsyncLLMEngine.from_engine(llm.engine)                     # a thread of this one
    await engine.start()
    async for out in engine.generate(prompt, SamplingParams(max_tokens=8)):
        print(out.outputs[0].new_text, end="")          # DELTA outputs, one per step
    await engine.shutdown()

This is the guide's `asyncio_mode`: the engine keeps stepping while requests come and go.
The stepping itself is `EngineLoop` (`engine_loop.py`), run in one of two places:

- process mode (`from_engine_args`, or `engine_args=`; the server's default): a child process
  builds the engine from `EngineArgs` and steps it (`engine_process.py`). The server's
  per-request Python work (JSON, SSE chunks, queues) and the engine's per-step work then
  hold two GILs, not one. `engine` is None here: what the server reads of the engine is
  `info` (`EngineInfo`: model, max_model_len, max_num_seqs) and `tokenizer` (loaded in
  this process from the model's folder). A script that uses it needs the
  `if __name__ == "__main__":` guard: the spawned child imports the main module again.
- thread mode (`from_engine(engine)` or an `engine_factory`: tests, notebooks): a thread of
  this process builds (`engine_factory`) and steps it; `engine` is that `LLMEngine`. A
  step on a GPU mostly waits for the device and torch releases the GIL meanwhile, so the
  event loop still overlaps it. The engine is built in that thread, so CUDA's per-thread
  current device and anything captured at start-up (CUDA graphs) belong to it.

Either way the engine has one user, the loop: requests reach it as commands (add / abort /
stop, drained between steps), and each round's outputs come back in one `Report`, handed
to the event loop at once (`call_soon_threadsafe`), which fans them out to per-request
`asyncio.Queue`s. Idle, the loop blocks on its commands (no spinning).

A request that cannot be served is refused in `add_request` (the engine's ValueError /
TypeError naming why) and only its caller sees the exception; a request whose consumer goes
away (`generate` closed: a disconnected client) is aborted, freeing its KV blocks. An
exception escaping a step fails the requests then in flight (`EngineError`) and the loop
goes on. An engine that stops (shutdown, a loop error, the engine process dying) fails
every open stream and waiting `add_request` with `EngineDeadError`; `is_running` turns False.

After every round the loop publishes an `EngineSnapshot` (running / waiting requests, KV
blocks, prefix-cache and preemption counters) that `/metrics` reads without touching the
engine. `on_step` (called off the event loop, with each round's outputs, aborted requests'
final outputs included) feeds latency histograms.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import logging
import queue
import threading
from typing import Any, AsyncIterator, Callable

from atom.model_engine.engine_loop import (STOP, EngineDeadError, EngineError, EngineInfo, EngineLoop,
                                           EngineSnapshot, Report)
from atom.outputs import CompletionOutput, RequestOutput
from atom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "EngineDeadError", "EngineError", "EngineInfo", "EngineSnapshot",
           "EngineThread", "merge_outputs"]

_ABORTED = object()   # put in a request's queue by abort(): its stream ends


class EngineThread:
    """Thread mode: the engine built by `factory` and stepped by a thread of this process."""

    def __init__(self, factory: Callable[[], Any], name: str = "atom-engine"):
        self.factory = factory
        self.name = name
        self.engine = None                  # the LLMEngine, once the thread built it
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._cuda_device = 0

    def __repr__(self) -> str:
        return f"EngineThread(alive={self.alive})"

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, on_ready, on_report) -> None:
        import torch
        # a runner on a bare "cuda" runs on the device the starting thread has selected
        self._cuda_device = torch.cuda.current_device() if torch.cuda.is_available() else 0
        self._thread = threading.Thread(target=self._run, args=(on_ready, on_report), name=self.name,
                                        daemon=True)
        self._thread.start()

    def send(self, cmd: tuple) -> None:
        self._commands.put(cmd)

    def stop(self, timeout: float | None = None) -> None:
        """STOP, then wait for the thread (a thread cannot be killed: `timeout` is not used)."""
        if self._thread is not None:
            self._commands.put(STOP)
            self._thread.join()

    def _run(self, on_ready, on_report) -> None:
        try:
            self.engine = self.factory()
            runner_device = getattr(self.engine.runner, "device", None)
            if runner_device is not None and runner_device.type == "cuda":
                import torch
                index = torch.device(runner_device).index
                torch.cuda.set_device(self._cuda_device if index is None else index)
        except BaseException as e:  # noqa: BLE001 - handed to start()'s caller
            on_ready(e)
            return
        loop = EngineLoop(self.engine, self._commands, on_report)
        on_ready((EngineInfo.of(self.engine), loop.snapshot, self.engine.tokenizer))
        loop.run()


class AsyncLLMEngine:
    def __init__(self, engine_factory: Callable[[], Any] | None = None, name: str = "atom-engine",
                 on_step: Callable[[list[RequestOutput], float], None] | None = None, *,
                 engine_args=None):
        """`engine_factory` (thread mode) or `engine_args` (an `EngineArgs`: process mode)."""
        if (engine_factory is None) == (engine_args is None):
            raise ValueError("AsyncLLMEngine needs exactly one of engine_factory (thread mode) and "
                             "engine_args (process mode)")
        if engine_args is None:
            self._core = EngineThread(engine_factory, name)
        else:
            from atom.model_engine.engine_process import EngineProcess
            self._core = EngineProcess(engine_args, name)
        self.name = name
        self.on_step = on_step
        self.info: EngineInfo | None = None   # once started
        self.tokenizer = None                 # the model's (None: prompts must be token ids)
        self.snapshot = EngineSnapshot()
        self.error: BaseException | None = None   # why the engine stopped, if it failed
        self._streams: dict[str, asyncio.Queue] = {}
        self._adding: dict[str, asyncio.Future] = {}   # adds the engine has not answered yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._started = False
        self._dead = False                    # the engine's last report came

    @classmethod
    def from_engine(cls, engine, **kwargs) -> "AsyncLLMEngine":
        """Wrap an engine built already (thread mode: tests, notebooks); it must not be
        stepped elsewhere."""
        return cls(lambda: engine, **kwargs)

    @classmethod
    def from_engine_args(cls, engine_args, process: bool = True, **kwargs) -> "AsyncLLMEngine":
        """An engine on `engine_args` (`create_engine(asyncio_mode=True)`): built in a process
        of its own (`process`), or in a thread of this one."""
        if process:
            return cls(engine_args=engine_args, **kwargs)
        return cls(lambda: engine_args.create_engine(asyncio_mode=True), **kwargs)

    @property
    def engine(self):
        """The `LLMEngine` (thread mode, once built); None in process mode."""
        return getattr(self._core, "engine", None)

    @property
    def mode(self) -> str:
        return "thread" if isinstance(self._core, EngineThread) else "process"

    def __repr__(self) -> str:
        state = "running" if self.is_running else "stopped"
        desc = self.info.description if self.info is not None else None
        return (f"AsyncLLMEngine({state}, {self._core!r}, in_flight={len(self._streams)}, "
                f"{self.snapshot}, engine={desc})")

    # --- life cycle --------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._core.alive and not self._dead

    async def start(self) -> None:
        """Start the engine; returns once it is built (raises what building it raised)."""
        if self._started:
            raise RuntimeError("AsyncLLMEngine.start() was called already")
        self._started = True
        loop = self._loop = asyncio.get_running_loop()
        ready: asyncio.Future = loop.create_future()
        self._core.start(lambda result: _call_soon(loop, _settle, ready, result), self._on_report)
        try:
            self.info, self.snapshot, self.tokenizer = await ready
        except BaseException as e:
            self.error = e
            await loop.run_in_executor(None, self._core.stop, 10.0)
            raise

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is in flight and stop the engine; wait for it (process mode: up to
        `timeout` seconds, then the process is killed)."""
        if self._started:
            await asyncio.get_running_loop().run_in_executor(None, self._core.stop, timeout)

    # --- requests ----------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_pending(self) -> int:
        return self.num_pending_with(0)

    def num_pending_with(self, num_new: int) -> int:
        """Requests waiting for a place in the running batch: those held beyond
        `max_num_seqs` (exact on arrival, whatever the engine has taken in yet), or the
        engine's own waiting queue when that is longer (KV blocks or the token budget are
        the limit)."""
        cap = self.info.max_num_seqs if self.info is not None else 0
        return max(len(self._streams) + num_new - cap, self.snapshot.num_waiting)

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def add_request(self, prompt, params: SamplingParams, request_id: str | None = None) -> str:
        """Submit a request (DELTA outputs); returns its id once the engine accepted it, or
        raises the engine's ValueError / TypeError. Read its outputs with `stream(id)`."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self.error!r})" if self.error
                                  else "the engine is not running")
        rid = request_id or self.new_request_id()
        if rid in self._streams:  # before replacing its stream: the first request keeps it
            raise ValueError(f"request_id={rid!r} is invalid: a request with that id is in flight")
        fut = self._loop.create_future()
        self._streams[rid] = asyncio.Queue()
        self._adding[rid] = fut
        self._core.send(("add", rid, prompt, params))
        try:
            await fut
        except BaseException:
            self._streams.pop(rid, None)
            if not fut.done() or fut.cancelled():  # cancelled while waiting: it may still land
                self.abort(rid)
            raise
        finally:
            if self._adding.get(rid) is fut:
                del self._adding[rid]
        return rid

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """The request's outputs until its final one. Leaving early (break, an exception, a
        cancelled task) aborts it. Outputs that queued up while the consumer was busy (a
        loaded server writing hundreds of streams) come as one (`merge_outputs`): their
        deltas joined, so a lagging stream sends one chunk per catch-up, not one per step."""
        q = self._streams.get(request_id)
        if q is None:
            raise KeyError(f"request {request_id!r} is not in flight")
        finished = False
        held = None  # an item taken while merging that is not an output (abort, error)
        try:
            while True:
                item, held = (held, None) if held is not None else (await q.get(), None)
                if item is _ABORTED:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                while not item.finished and not q.empty():
                    nxt = q.get_nowait()
                    if nxt is _ABORTED or isinstance(nxt, BaseException):
                        held = nxt
                        break
                    item = merge_outputs(item, nxt)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            self._streams.pop(request_id, None)

    async def generate(self, prompt, params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        rid = await self.add_request(prompt, params, request_id)
        async for out in self.stream(rid):
            yield out

    def abort(self, request_id: str) -> None:
        """Abort a request (returns at once; call it on the event loop); its blocks are freed
        between two steps, and a `stream` of it still waiting ends."""
        q = self._streams.pop(request_id, None)
        if q is not None:
            q.put_nowait(_ABORTED)
        if self.is_running:
            self._core.send(("abort", request_id))

    # --- reports, off the event loop and on it -----------------------------------------
    def _on_report(self, report: Report) -> None:
        """A round's report (the engine thread, or the engine process's reader thread)."""
        self.snapshot = report.snapshot
        outs = report.outputs + report.aborted if report.aborted else report.outputs
        if self.on_step is not None and outs:
            try:
                self.on_step(outs, report.now)
            except Exception:  # noqa: BLE001 - metrics must never stop the engine
                logger.exception("on_step hook failed")
        if report.for_requests:
            _call_soon(self._loop, self._receive, report)

    def _receive(self, report: Report) -> None:
        """On the event loop: answer adds, fan the outputs out, fail what the engine failed."""
        for rid in report.accepted:
            fut = self._adding.pop(rid, None)
            if fut is not None:
                _set_result(fut, rid)
        for rid, error in report.refused:
            fut = self._adding.pop(rid, None)
            if fut is not None:
                _set_exception(fut, error)
        for out in report.outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)
        if report.failed is not None:
            error, rids = report.failed
            for rid in rids:
                q = self._streams.get(rid)
                if q is not None:
                    q.put_nowait(error)
        if report.stopped is not None:
            self._dead = True
            if report.cause is not None:
                self.error = report.cause
            for q in self._streams.values():
                q.put_nowait(report.stopped)
            for fut in self._adding.values():
                _set_exception(fut, report.stopped)
            self._adding.clear()


def _merge_completion(p: CompletionOutput, c: CompletionOutput) -> CompletionOutput:
    new = dict(new_token_ids=p.new_token_ids + c.new_token_ids, new_text=p.new_text + c.new_text)
    if c.finished:  # a final output carries the whole completion already
        return dataclasses.replace(c, **new)
    lps = None if p.logprobs is None and c.logprobs is None else list(p.logprobs or []) + list(c.logprobs or [])
    return dataclasses.replace(c, text=p.text + c.text, token_ids=p.token_ids + c.token_ids, logprobs=lps, **new)


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One DELTA output standing for two consecutive ones of a request: per completion the
    deltas (`token_ids`, `text`, `logprobs`, `new_*`) joined, or the later final output with
    the joined `new_*`; completions only the earlier one carried are kept; the prompt's
    logprobs of the first output are kept."""
    prev = {c.index: c for c in earlier.outputs}
    outs = {c.index: _merge_completion(prev[c.index], c) if c.index in prev else c for c in later.outputs}
    for i, c in prev.items():
        outs.setdefault(i, c)
    merged = copy.copy(later)
    merged.outputs = [outs[i] for i in sorted(outs)]
    if merged.prompt_logprobs is None:
        merged.prompt_logprobs = earlier.prompt_logprobs
    return merged


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _settle(fut: asyncio.Future, result) -> None:
    if isinstance(result, BaseException):
        _set_exception(fut, result)
    else:
        _set_result(fut, result)


def _call_soon(loop: asyncio.AbstractEventLoop | None, fn, *args) -> None:
    """`fn(*args)` on `loop` from another thread (nothing once the loop is closed)."""
    if loop is None:
        return
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # closed meanwhile
        logger.debug("event loop closed: %s dropped", getattr(fn, "__name__", fn))
