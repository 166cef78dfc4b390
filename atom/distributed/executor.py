"""`TensorParallelExecutor`: the driver's side of a tensor-parallel engine.

    ex = TensorParallelExecutor(config)   # spawns ranks 1..tp-1, joins as rank 0, loads its shard
    ex.runner                             # rank 0's ModelRunner (the engine steps it as usual)
    ex.workers                            # [WorkerHandle(rank, pid, alive)]
    ex.shutdown()                         # "stop" to the workers, join, kill what is left

Ranks meet on a TCP store the driver serves at `master_addr`, port
`parallel_config.data_parallel_base_port` (0: the OS picks one). Workers are spawned
processes (`atom.distributed.worker`); each watches its parent and exits with it. A rank
that dies or raises makes the driver's next collective fail; the executor turns that into
a `WorkerFailure` naming the rank, its pid and exit status (or its traceback) and what the
engine was doing, shuts down the rest, and every later step raises the same error.
Shutdown runs on `shutdown()`, when the executor is collected, and at interpreter exit.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import weakref
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch

from atom.distributed.group import DEFAULT_TIMEOUT_S, init_group, make_store
from atom.distributed.worker import worker_main

logger = logging.getLogger(__name__)


class WorkerFailure(RuntimeError):
    """A tensor-parallel rank died or raised; the engine cannot go on."""


@dataclass
class WorkerHandle:
    rank: int
    process: mp.process.BaseProcess
    conn: object

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def __repr__(self) -> str:
        return f"WorkerHandle(rank={self.rank}, pid={self.pid}, alive={self.alive})"


def _exit_status(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _reap(workers: list[WorkerHandle], grace_s: float = 5.0) -> None:
    """Join every worker (they got "stop" or lost the group), then kill what is left."""
    for w in workers:
        w.process.join(grace_s)
    for w in workers:
        if w.process.is_alive():
            logger.warning("tensor-parallel rank %d (pid %d) did not stop: killing it", w.rank, w.pid)
            w.process.kill()
            w.process.join(grace_s)


def check_tensor_parallel(config) -> None:
    """Refuse, before any process starts, a model family whose layers do not split across
    ranks (`supports_tensor_parallel` on its class), naming it."""
    from atom.models.registry import resolve_architecture
    model_cls = resolve_architecture(config.hf_config)
    if config.tensor_parallel_size > 1 and not getattr(model_cls, "supports_tensor_parallel", False):
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} is not implemented for "
                         f"{model_cls.__name__} in this build yet: its layers do not split across ranks; use 1")


def device_for_rank(base: torch.device, rank: int) -> torch.device:
    """cuda:r for rank r on a GPU host (from the driver's device index); the CPU otherwise."""
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


class TensorParallelExecutor:
    def __init__(self, config, device: torch.device | str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        from atom import platform
        from atom.model_engine.model_runner import ModelRunner
        self.config = config
        self.world_size = config.tensor_parallel_size
        check_tensor_parallel(config)
        self.device = torch.device(device) if device is not None else platform.default_device()
        if self.device.type == "cuda" and torch.cuda.device_count() < (self.device.index or 0) + self.world_size:
            raise ValueError(f"tensor_parallel_size={self.world_size} needs {self.world_size} GPUs; "
                             f"this host has {torch.cuda.device_count()}")
        self.failure: WorkerFailure | None = None
        self.workers: list[WorkerHandle] = []
        self.parallel = None
        self.runner = None
        host = config.master_addr
        self.store = make_store(host, config.parallel_config.data_parallel_base_port, self.world_size, True, timeout_s)
        ctx = mp.get_context("spawn")
        for rank in range(1, self.world_size):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_main, name=f"atom-tp-rank{rank}", daemon=True,
                            args=(config, rank, self.world_size, host, self.store.port,
                                  str(device_for_rank(self.device, rank)), child, os.getpid(), "tp", timeout_s))
            p.start()
            child.close()
            self.workers.append(WorkerHandle(rank, p, parent))
        self._finalizer = weakref.finalize(self, _reap, list(self.workers))
        try:
            self.parallel = self._while_watching(
                lambda: init_group(0, self.world_size, self.store, self.device, "tp", timeout_s), "joining the group")
            self.runner = ModelRunner(config, self.device, self.parallel)
            self._wait_ready()
        except BaseException as e:
            failure = self.explain(e, "loading the model")
            self.shutdown()
            if failure is e:
                raise
            raise failure from e
        self.runner.on_failure = self.explain
        logger.info("tensor parallel: %d ranks (%s), workers %s", self.world_size, self.parallel.backend,
                    [w.pid for w in self.workers])

    # --- start-up -----------------------------------------------------------------------
    def _while_watching(self, fn, doing: str):
        """Run `fn` (which blocks until every rank joins) while watching the workers: a
        worker that dies first raises its WorkerFailure here instead of a long timeout."""
        result: dict = {}

        def target():
            try:
                result["value"] = fn()
            except BaseException as e:  # noqa: BLE001
                result["error"] = e

        t = threading.Thread(target=target, daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.2)
            if t.is_alive() and self._dead_worker() is not None:
                raise self._failure(doing)
        if "error" in result:
            raise result["error"]
        return result["value"]

    def _wait_ready(self) -> None:
        pending = {w.conn: w for w in self.workers}
        while pending:
            for ready in wait(list(pending) + [w.process.sentinel for w in pending.values()], timeout=1.0):
                w = pending.get(ready)
                if w is None:  # a sentinel: that process ended
                    raise self._failure("loading the model")
                message = w.conn.recv()
                if message[0] != "ready":
                    raise self._failure("loading the model", message)
                pending.pop(ready)

    # --- failures -----------------------------------------------------------------------
    def _dead_worker(self) -> WorkerHandle | None:
        return next((w for w in self.workers if w.process.exitcode is not None), None)

    def _reports(self) -> list[tuple]:
        out = []
        for w in self.workers:
            try:
                while w.conn.poll():
                    out.append(w.conn.recv())
            except (EOFError, OSError):
                pass
        return out

    def _failure(self, doing: str, report: tuple | None = None) -> WorkerFailure:
        reports = ([report] if report is not None else []) + self._reports()
        errors = [r for r in reports if r[0] == "error"]
        if errors:
            _, rank, worker_doing, tb = errors[0]
            w = self.workers[rank - 1]
            msg = (f"tensor-parallel rank {rank} (pid {w.pid}) failed while {worker_doing}, the engine "
                   f"{doing}: {tb.strip().splitlines()[0]}\n{tb}")
        else:
            for w in self.workers:  # a peer's death reaches the driver first; give its status a moment
                w.process.join(0.5 if w.process.exitcode is None else 0)
            dead = [w for w in self.workers if w.process.exitcode is not None]
            if dead:
                w = dead[0]
                msg = (f"tensor-parallel rank {w.rank} (pid {w.pid}) {_exit_status(w.process.exitcode)} while "
                       f"the engine was {doing}")
            else:
                msg = f"the tensor-parallel group broke while the engine was {doing} (no worker exited)"
        return WorkerFailure(msg)

    def explain(self, error: BaseException, doing: str) -> BaseException:
        """The error to raise for `error`, raised by a step or a collective. A step that
        fails anywhere leaves the ranks out of step (the others wait in a collective the
        driver never reaches), so the engine stops: a WorkerFailure naming the rank that
        died or raised, or, when none did, the driver (rank 0) and its error; the executor
        shuts down and every later step raises the same. A KeyboardInterrupt propagates as
        it is (the engine stops all the same)."""
        if isinstance(error, WorkerFailure):
            self.failure = self.failure or error
            return error
        if self.failure is not None:
            return self.failure
        failure = self._failure(doing)
        if "no worker exited" in str(failure):
            failure = WorkerFailure(f"tensor-parallel rank 0 (the driver) raised {type(error).__name__}: {error} "
                                    f"while the engine was {doing}; the ranks are out of step, so the engine stopped")
        self.failure = failure
        self.shutdown()
        return error if isinstance(error, KeyboardInterrupt) else failure

    # --- shutdown -----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the workers (a "stop" step when the group is intact), reap them, release the group."""
        stopped = False
        if self.runner is not None and self.failure is None and all(w.alive for w in self.workers):
            try:
                self.runner.publish(("stop",))
                stopped = True
            except Exception:  # the group broke on the way: the workers are killed below
                logger.debug("could not send stop to the workers", exc_info=True)
        _reap(self.workers, 10.0 if stopped else 0.2)
        if self.parallel is not None:
            self.parallel.shutdown()
        self.store = None
        self._finalizer.detach()

    def frame(self):
        """A DataFrame: one row per rank (0: the driver) with its pid, device and state."""
        import pandas as pd
        rows = [{"rank": 0, "pid": os.getpid(), "device": str(self.device), "alive": self.failure is None,
                 "exitcode": None}]
        rows += [{"rank": w.rank, "pid": w.pid, "device": str(device_for_rank(self.device, w.rank)),
                  "alive": w.alive, "exitcode": w.process.exitcode} for w in self.workers]
        return pd.DataFrame(rows)

    def __repr__(self) -> str:
        return f"TensorParallelExecutor(world_size={self.world_size}, workers={self.workers})"

