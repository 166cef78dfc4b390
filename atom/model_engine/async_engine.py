"""`AsyncLLMEngine`: one `LLMEngine` stepped by a thread of its own, driven from asyncio.

    engine = AsyncLLMEngine(lambda: EngineArgs(model=...).create_engine())
    await engine.start()
    async for out in engine.generate(prompt, SamplingParams(max_tokens=8)):
        print(out.outputs[0].new_text, end="")          # DELTA outputs, one per step
    await engine.shutdown()

This is the guide's `asyncio_mode`: the engine keeps stepping while requests come and go.

Why a thread (and not `step()` between awaits on the event loop): a step on a GPU spends most
of its time waiting for the device, and torch releases the GIL while it waits; in a thread of
its own that wait overlaps the event loop parsing requests, tokenizing, and writing SSE
chunks for the previous step. On the loop itself every step would stall all HTTP traffic for
its whole duration. The engine is never touched by two threads: the engine thread is its
only user. The loop talks to it through a command queue (add / abort / stop, drained
between steps) and gets each step's outputs back in one `call_soon_threadsafe` per step,
which fans them out to per-request `asyncio.Queue`s. Idle, the thread blocks on the command
queue (no spinning). The engine is built in that thread too (`engine_factory`), so CUDA's
per-thread current device and anything captured at start-up (CUDA graphs) belong to it.

A request that cannot be served is refused in `add_request` (a ValueError / TypeError
naming why) and only its caller sees the exception; a request whose consumer goes away
(`generate` closed: a disconnected client) is aborted, freeing its KV blocks. An exception
escaping a step fails the requests then in flight (`EngineError`) and the loop goes on.

After every step and command the thread publishes an `EngineSnapshot` (running / waiting
requests, KV blocks, prefix-cache and preemption counters) that `/metrics` reads without
touching the engine. `on_step` (called in the engine thread with each step's outputs)
feeds latency histograms; aborted requests' outputs go to it too.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable

from atom.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from atom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while it ran this request (not the request's fault)."""


class EngineDeadError(RuntimeError):
    """The engine thread is not running (not started, stopped, or failed to start)."""


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


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt: Any
    params: SamplingParams
    future: "asyncio.Future"


_STOP = object()
_ABORTED = object()   # put in a request's queue by abort(): its stream ends


class AsyncLLMEngine:
    def __init__(self, engine_factory: Callable[[], Any], name: str = "atom-engine",
                 on_step: Callable[[list[RequestOutput], float], None] | None = None):
        self._factory = engine_factory
        self.name = name
        self.on_step = on_step
        self.engine = None                  # the LLMEngine, once the thread built it
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.snapshot = EngineSnapshot()
        self.error: BaseException | None = None   # why the thread stopped, if it failed
        self._cuda_device = 0

    @classmethod
    def from_engine(cls, engine, **kwargs) -> "AsyncLLMEngine":
        """Wrap an engine built already (tests, notebooks); it must not be stepped elsewhere."""
        return cls(lambda: engine, **kwargs)

    def __repr__(self) -> str:
        state = "running" if self.is_running else "stopped"
        return (f"AsyncLLMEngine({state}, in_flight={len(self._streams)}, {self.snapshot}, "
                f"engine={self.engine!r})")

    # --- life cycle --------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def start(self) -> None:
        """Start the engine thread; returns once the engine is built (raises what building it
        raised)."""
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine.start() was called already")
        self._loop = asyncio.get_running_loop()
        import torch
        # a runner on a bare "cuda" runs on the device the starting thread has selected
        self._cuda_device = torch.cuda.current_device() if torch.cuda.is_available() else 0
        ready: asyncio.Future = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=self.name, daemon=True)
        self._thread.start()
        await ready

    async def shutdown(self) -> None:
        """Abort what is in flight, stop the thread and wait for it."""
        if self._thread is None:
            return
        self._commands.put(_STOP)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # --- requests ----------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_pending(self) -> int:
        return self.num_pending_with(0)

    def num_pending_with(self, num_new: int) -> int:
        """Requests waiting for a place in the running batch: those held beyond
        `max_num_seqs` (exact on arrival, whatever the engine thread has taken in yet), or the
        engine's own waiting queue when that is longer (KV blocks or the token budget are
        the limit)."""
        cap = self.engine.config.max_num_seqs if self.engine is not None else 0
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
        self._commands.put(_Add(rid, prompt, params, fut))
        try:
            await fut
        except BaseException:
            self._streams.pop(rid, None)
            if not fut.done() or fut.cancelled():  # cancelled while waiting: it may still land
                self.abort(rid)
            raise
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
            self._commands.put(("abort", request_id))

    # --- the engine thread ---------------------------------------------------------------
    def _run(self, ready: asyncio.Future) -> None:
        loop = self._loop
        try:
            self.engine = self._factory()
            if getattr(self.engine.runner, "device", None) is not None and \
                    self.engine.runner.device.type == "cuda":
                import torch
                index = torch.device(self.engine.runner.device).index
                torch.cuda.set_device(self._cuda_device if index is None else index)
        except BaseException as e:  # noqa: BLE001 - handed to start()'s caller
            self.error = e
            loop.call_soon_threadsafe(_set_exception, ready, e)
            return
        self._publish()
        loop.call_soon_threadsafe(_set_result, ready, None)
        try:
            self._loop_body()
        except BaseException as e:  # noqa: BLE001 - logged, requests failed below
            logger.exception("the engine thread stopped")
            self.error = e
        finally:
            self._abort_all(EngineDeadError("the engine stopped"))
            shutdown = getattr(self.engine, "shutdown", None)
            if shutdown is not None:  # reap tensor-parallel workers now, not at interpreter exit
                try:
                    shutdown()
                except Exception:  # noqa: BLE001 - stopping anyway
                    logger.exception("engine shutdown failed")

    def _loop_body(self) -> None:
        engine = self.engine
        stats = engine.stats
        logged_idle = True
        while True:
            if engine.is_finished():  # idle: block until a command (or the next status line)
                timeout = stats.log_interval if not logged_idle else None
                try:
                    cmd = self._commands.get(timeout=timeout)
                except queue.Empty:
                    self._log_status(force=True)
                    logged_idle = True
                    continue
                if not self._handle(cmd):
                    return
            while True:  # everything queued, before the next step
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if not self._handle(cmd):
                    return
            if engine.is_finished():
                self._publish()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - a bug: fail what is in flight, keep serving
                logger.exception("engine step failed; aborting the requests in flight")
                self._abort_all(EngineError(f"the engine failed: {type(e).__name__}: {e}"))
                continue
            logged_idle = False
            now = time.perf_counter()
            self._publish()
            self._notify(outputs, now)
            if outputs:
                self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _handle(self, cmd) -> bool:
        """Run one command in the engine thread; False: stop."""
        engine = self.engine
        if cmd is _STOP:
            return False
        if isinstance(cmd, _Add):
            try:
                engine.add_request(cmd.prompt, cmd.params, request_id=cmd.request_id)
                engine.set_output_kind(cmd.request_id, RequestOutputKind.DELTA)
            except Exception as e:  # noqa: BLE001 - the request's own error, for its caller
                self._loop.call_soon_threadsafe(_set_exception, cmd.future, e)
            else:
                self._loop.call_soon_threadsafe(_set_result, cmd.future, cmd.request_id)
            return True
        kind, rid = cmd
        if kind == "abort":
            out = engine.abort(rid)
            if out is not None:
                logger.debug("aborted %s", rid)
                self._notify([out], time.perf_counter())
            self._publish()
        return True

    def _notify(self, outputs: list[RequestOutput], now: float) -> None:
        if self.on_step is not None and outputs:
            try:
                self.on_step(outputs, now)
            except Exception:  # noqa: BLE001 - metrics must never stop the engine
                logger.exception("on_step hook failed")

    def _publish(self) -> None:
        e = self.engine
        bm, sched = e.block_manager, e.scheduler
        self.snapshot = EngineSnapshot(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks, kv_usage=bm.usage,
            prefix_query_tokens=bm.num_query_tokens, prefix_hit_tokens=bm.num_hit_tokens,
            num_preemptions=sched.num_preemptions, num_steps=e.stats.num_steps)

    def _log_status(self, force: bool = False) -> None:
        s = self.snapshot
        self.engine.stats.maybe_log(s.num_running, s.num_waiting, s.kv_usage, force=force,
                                    prefix_cache=(s.prefix_hit_tokens, s.prefix_query_tokens))

    def _abort_all(self, error: BaseException) -> None:
        """Abort every request the engine holds and fail their streams with `error`."""
        engine = self.engine
        if engine is not None:
            for rid in list(engine.requests):
                try:
                    out = engine.abort(rid)
                    if out is not None:
                        self._notify([out], time.perf_counter())
                except Exception:  # noqa: BLE001 - keep freeing the others
                    logger.exception("could not abort %s", rid)
            try:
                self._publish()
            except Exception:  # noqa: BLE001
                logger.exception("could not read the engine's state")
        while True:  # refuse adds still queued
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                self._loop.call_soon_threadsafe(_set_exception, cmd.future, error)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_streams, error)

    # --- on the event loop ---------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _fail_streams(self, error: BaseException) -> None:
        for q in self._streams.values():
            q.put_nowait(error)


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
