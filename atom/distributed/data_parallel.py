"""Data parallel: `data_parallel_size` engine replicas, each in its own process, behind a
router (`DPRouter`, the guide's `dp_load_balance`).

    engine = DataParallelEngine(config)      # LLM(..., data_parallel_size=2) builds this
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=8))
    while not engine.is_finished():
        for out in engine.step(): ...        # finished requests, each once
    engine.router.frame()                    # in-flight load per replica
    engine.shutdown()

Replicas meet the front end on a TCP store (torch.distributed's) the front end serves at
`data_parallel_master_ip`, port `data_parallel_master_port` (a single-host run, where
`data_parallel_size_local == data_parallel_size`, lets the OS pick the port so several runs
never collide). Requests go to a replica through its queue on the store, finished outputs
come back through one queue; the replicas also form one gloo group over the data-parallel
ranks (`replica.dp_group`). Under `enable_dp_attention` that group is formed first and the
model built over it: attention and the dense layers stay per replica (its own requests and
KV cache), the MoE layers span every replica (`FusedMoE` gathers their tokens; experts split
over the replicas with `enable_expert_parallel`, else each replica a slice of every expert's
width), and the replicas step in lockstep (`serve_in_lockstep`, dummy steps where idle).
This host runs `data_parallel_size_local` replicas, global ranks `data_parallel_rank` ..;
the front end lives on the host of rank 0, and other hosts start theirs with
`python -m atom.distributed.launch` (`serve_replicas`). Each replica is a whole `LLMEngine`
(its own tensor-parallel workers when `tensor_parallel_size > 1`; on GPUs replica i sees
GPUs i*tp .. i*tp + tp - 1).

Only final outputs come back (no per-step streaming through the router); each carries
`dp_rank`, the replica that served it. A replica that
dies or fails makes the next `step()` raise `ReplicaFailure` naming it; `shutdown()` (also
at collection / exit) stops and reaps every local replica.
"""
from __future__ import annotations

import copy
import logging
import multiprocessing as mp
import os
import pickle
import socket
import threading
import time
import traceback
import weakref

import torch.distributed as dist

from atom.distributed.group import DEFAULT_TIMEOUT_S, init_group, make_store
from atom.distributed.router import DPRouter
from atom.distributed.worker import _exit_now, _watch_parent

logger = logging.getLogger(__name__)

PREFIX = "atom-dp"
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 120.0  # a remote replica silent this long is taken for dead


class ReplicaFailure(RuntimeError):
    """A data-parallel replica died or failed; the engine cannot go on."""


def _req_key(rank: int) -> str:
    return f"{PREFIX}/req/{rank}"


_OUT_KEY = f"{PREFIX}/out"


def _push(store, key: str, message) -> None:
    store.queue_push(key, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _pop(store, key: str):
    """The next message of queue `key`, or None when it is empty."""
    try:
        return pickle.loads(store.queue_pop(key, False))
    except dist.QueueEmptyError:
        return None


def replica_config(config, dp_rank: int, local_rank: int):
    """The config a replica runs: its ranks set, one data-parallel group of its own, and,
    under tensor parallel with an explicit base port, a port of its own for its TP store."""
    cfg = copy.copy(config)
    pc = copy.copy(config.parallel_config)  # not dataclasses.replace: no env override again
    pc.data_parallel_rank, pc.data_parallel_rank_local = dp_rank, local_rank
    if pc.data_parallel_base_port:
        pc.data_parallel_base_port += 1 + dp_rank
    cfg.parallel_config = pc
    return cfg


def _visible_devices(local_rank: int, tp: int) -> str | None:
    """CUDA_VISIBLE_DEVICES for replica `local_rank` (None on a host without GPUs)."""
    import torch
    if not torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    mine = ids[local_rank * tp:(local_rank + 1) * tp]
    if len(mine) < tp:
        raise ValueError(f"data_parallel_size_local x tensor_parallel_size needs {(local_rank + 1) * tp} GPUs; "
                         f"this host has {len(ids)}")
    return ",".join(mine)


# --- the replica process ------------------------------------------------------------------
def replica_main(config, dp_rank: int, host: str, port: int, parent_pid: int | None,
                 devices: str | None, timeout_s: float = DEFAULT_TIMEOUT_S, exit_process: bool = True) -> None:
    """A replica: its engine, the data-parallel group, then requests until "stop". Ends the
    process (`exit_process`, a spawned replica) or raises SystemExit(1) on a failure."""
    if parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    import torch
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    from atom.model_engine.llm_engine import LLMEngine
    dp_size = config.parallel_config.data_parallel_size
    store = make_store(host, port, dp_size + 1, False, timeout_s)
    engine = group = None
    doing, code = "loading the model", 0
    lockstep = bool(getattr(config, "enable_dp_attention", False))
    try:
        if lockstep:  # the MoE layers span the replicas: the group first, the model built over it
            doing = "joining the data-parallel group"
            group = init_group(dp_rank, dp_size, store, "cpu", f"{PREFIX}/group", timeout_s)
            doing = "loading the model"
            cfg = copy.copy(config)
            cfg.enforce_eager = True  # a CUDA graph would freeze the gathered token counts
            engine = LLMEngine(cfg, async_scheduling=False, moe_group=group)
        else:
            engine = LLMEngine(config)
            doing = "joining the data-parallel group"
            group = init_group(dp_rank, dp_size, store, "cpu", f"{PREFIX}/group", timeout_s)
        members = group.all_reduce(torch.ones(1)).item() if dp_size > 1 else 1
        engine.dp_group = group
        _push(store, _OUT_KEY, ("ready", dp_rank, os.getpid(), socket.gethostname(), int(members)))
        doing = "serving requests"
        if lockstep:
            serve_in_lockstep(engine, store, dp_rank, group)
        else:
            serve_requests(engine, store, dp_rank)
    except BaseException as e:  # noqa: BLE001
        try:
            _push(store, _OUT_KEY, ("error", dp_rank, doing, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except Exception:
            pass
        code = 1
    finally:
        if engine is not None:
            engine.shutdown()
        if group is not None:
            group.shutdown()
    if exit_process:
        _exit_now(code)
    if code:
        raise SystemExit(code)


def _take_messages(engine, store, dp_rank: int) -> bool:
    """Apply the queued requests and aborts of this replica; True when told to stop."""
    from atom.outputs import RequestOutput, RequestOutputKind
    key = _req_key(dp_rank)
    while (message := _pop(store, key)) is not None:
        kind = message[0]
        if kind == "stop":
            return True
        if kind == "add":
            _, rid, ids, sp = message
            try:
                engine.add_request(ids, sp, request_id=rid)
                engine.set_output_kind(rid, RequestOutputKind.FINAL_ONLY)
            except (ValueError, TypeError) as e:
                _push(store, _OUT_KEY, ("outputs", dp_rank, [
                    RequestOutput(rid, None, list(ids), finish_reason="error", error=str(e))]))
        elif kind == "abort":
            engine.abort(message[1])
    return False


def _beat(store, dp_rank: int, last: float) -> float:
    now = time.monotonic()
    if now - last > HEARTBEAT_S:
        store.add(f"{PREFIX}/hb/{dp_rank}", 1)
        return now
    return last


def _send_finished(engine_outputs, store, dp_rank: int) -> int:
    done = [out for out in engine_outputs if out.finished]
    if done:
        _push(store, _OUT_KEY, ("outputs", dp_rank, done))
    return len(done)


def serve_requests(engine, store, dp_rank: int) -> int:
    """A replica's loop: take new requests from its queue, step, send finished outputs;
    returns the number of requests served when told to stop."""
    served, beat = 0, 0.0
    while True:
        beat = _beat(store, dp_rank, beat)
        if _take_messages(engine, store, dp_rank):
            return served
        if engine.is_finished():
            time.sleep(0.002)
            continue
        served += _send_finished(engine.step(), store, dp_rank)


def serve_in_lockstep(engine, store, dp_rank: int, group) -> int:
    """A replica's loop under DP attention: every round the replicas agree (one all-reduce
    over `group`) whether any has work or was told to stop; when one has work, all step
    together, those with none (or whose scheduler ran nothing) a dummy step
    (`ModelRunner.dummy_moe_step`), so every MoE layer's collectives pair up. A stop seen by
    one replica stops all in the same round. Returns the number of requests served."""
    import torch
    served, beat = 0, 0.0
    runner = engine.runner
    while True:
        beat = _beat(store, dp_rank, beat)
        stop = _take_messages(engine, store, dp_rank)
        flags = group.all_reduce(torch.tensor([0.0 if engine.is_finished() else 1.0, float(stop)]))
        if flags[1] > 0:
            return served
        if flags[0] == 0:
            time.sleep(0.002)
            continue
        before = runner.num_steps
        if not engine.is_finished():
            served += _send_finished(engine.step(), store, dp_rank)
        if runner.num_steps == before:
            runner.dummy_moe_step()
        elif runner.num_steps != before + 1:
            raise RuntimeError(f"DP attention: replica {dp_rank} ran {runner.num_steps - before} forwards in one "
                               "step; the replicas are out of step")


def start_replicas(config, ranks: list[int], host: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S):
    """Spawn the replicas of global ranks `ranks` (this host's), connecting to the store at
    host:port; returns {rank: process}."""
    ctx = mp.get_context("spawn")
    first = ranks[0] if ranks else 0
    procs = {}
    for rank in ranks:
        local = rank - first
        cfg = replica_config(config, rank, local)
        p = ctx.Process(target=replica_main, name=f"atom-dp-rank{rank}",
                        args=(cfg, rank, host, port, os.getpid(),
                              _visible_devices(local, config.tensor_parallel_size), timeout_s))
        p.start()
        procs[rank] = p
    return procs


def _reap(procs: dict, grace_s: float = 10.0) -> None:
    for p in procs.values():
        p.join(grace_s)
    for rank, p in procs.items():
        if p.is_alive():
            logger.warning("data-parallel replica %d (pid %d) did not stop: killing it", rank, p.pid)
            p.kill()
            p.join(grace_s)


def serve_replicas(config, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """A host other than rank 0's: run this host's replicas until the front end stops them;
    returns 0 when all stopped cleanly, 1 otherwise."""
    pc = config.parallel_config
    ranks = list(range(pc.data_parallel_rank, pc.data_parallel_rank + pc.data_parallel_size_local))
    if len(ranks) == 1:  # one replica on this host: it runs in this process
        logger.info("data-parallel replicas %s started (pids [%d]), front end at %s:%d", ranks, os.getpid(),
                    pc.data_parallel_master_ip, pc.data_parallel_master_port)
        try:
            replica_main(replica_config(config, ranks[0], 0), ranks[0], pc.data_parallel_master_ip,
                         pc.data_parallel_master_port, None, _visible_devices(0, config.tensor_parallel_size), timeout_s,
                         exit_process=False)
        except SystemExit as e:
            return int(e.code or 0)
        return 0
    procs = start_replicas(config, ranks, pc.data_parallel_master_ip, pc.data_parallel_master_port, timeout_s)
    logger.info("data-parallel replicas %s started (pids %s), front end at %s:%d", ranks,
                [p.pid for p in procs.values()], pc.data_parallel_master_ip, pc.data_parallel_master_port)
    try:
        for p in procs.values():
            p.join()
    finally:
        _reap(procs, 0.5)
    return 0 if all(p.exitcode == 0 for p in procs.values()) else 1


# --- the front end ------------------------------------------------------------------------
class DataParallelEngine:
    def __init__(self, config, tokenizer=None, timeout_s: float = DEFAULT_TIMEOUT_S):
        from atom.model_engine.llm_engine import load_tokenizer
        from atom.model_engine.stats import EngineStats
        from atom.model_engine.supported import check_supported
        check_supported(config)  # refusals before any replica starts
        pc = config.parallel_config
        self.config = config
        self.size = pc.data_parallel_size
        if pc.data_parallel_rank != 0:
            raise ValueError(f"parallel_config.data_parallel_rank={pc.data_parallel_rank}: the front end runs on the "
                             "host of rank 0; start the other hosts with `python -m atom.distributed.launch`")
        self.router = DPRouter(self.size, config.dp_load_balance)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model)
        self.stats = EngineStats(False, False)
        self.failure: ReplicaFailure | None = None
        single_host = pc.data_parallel_size_local == self.size
        host = pc.data_parallel_master_ip
        self.store = make_store(host, 0 if single_host else pc.data_parallel_master_port, self.size + 1, True, timeout_s)
        self.local_ranks = list(range(pc.data_parallel_size_local))
        self.procs = start_replicas(config, self.local_ranks, host, self.store.port, timeout_s)
        self._finalizer = weakref.finalize(self, _stop_and_reap, self.store, self.size, dict(self.procs))
        self.replicas: dict[int, dict] = {}
        self._ids = 0
        self._beats: dict[int, tuple[int, float]] = {}
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.shutdown()
            raise
        logger.info("data parallel: %d replicas (%s) in a group of %d, host and pid of each: %s", self.size,
                    config.dp_load_balance, min(i["group_size"] for i in self.replicas.values()),
                    {r: (i["host"], i["pid"]) for r, i in sorted(self.replicas.items())})

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.replicas) < self.size:
            message = _pop(self.store, _OUT_KEY)
            if message is None:
                self._check_alive("loading the model")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.size)) - set(self.replicas))
                    raise ReplicaFailure(f"data-parallel replicas {missing} did not report within {timeout_s:.0f} s "
                                         "(are the other hosts' launchers running?)")
                time.sleep(0.01)
                continue
            if message[0] == "error":
                raise self._failure(message, "loading the model")
            if message[0] == "ready":
                _, rank, pid, host, members = message
                self.replicas[rank] = {"pid": pid, "host": host, "group_size": members}

    # --- failures -----------------------------------------------------------------------
    def _failure(self, message: tuple, doing: str) -> ReplicaFailure:
        _, rank, replica_doing, tb = message
        self.failure = ReplicaFailure(f"data-parallel replica {rank} failed while {replica_doing} (the engine was "
                                      f"{doing}): {tb.strip().splitlines()[0]}\n{tb}")
        return self.failure

    def _check_alive(self, doing: str) -> None:
        from atom.distributed.executor import _exit_status
        for rank, p in self.procs.items():
            if p.exitcode is not None:
                message = _pop(self.store, _OUT_KEY)
                if message is not None and message[0] == "error":
                    raise self._failure(message, doing)
                self.failure = ReplicaFailure(
                    f"data-parallel replica {rank} (pid {p.pid}) {_exit_status(p.exitcode)} while the engine was "
                    f"{doing} ({self.router.num_reqs[rank]} requests in flight there)")
                raise self.failure
        now = time.monotonic()
        for rank in range(self.size):
            if rank in self.procs or rank not in self.replicas:
                continue
            count = int(self.store.add(f"{PREFIX}/hb/{rank}", 0))
            last = self._beats.get(rank)
            if last is None or last[0] != count:
                self._beats[rank] = (count, now)
            elif now - last[1] > HEARTBEAT_TIMEOUT_S:
                self.failure = ReplicaFailure(f"data-parallel replica {rank} on {self.replicas[rank]['host']} sent no "
                                              f"heartbeat for {HEARTBEAT_TIMEOUT_S:.0f} s while the engine was {doing}")
                raise self.failure

    # --- the engine API LLM.generate uses -------------------------------------------------
    def add_request(self, prompt, sampling_params=None, request_id: str | None = None) -> str:
        from atom.model_engine.prompts import as_sampling_params, parse_prompt
        from atom.sampling_params import SamplingParams
        if self.failure is not None:
            raise self.failure
        sp = SamplingParams() if sampling_params is None else as_sampling_params(sampling_params)
        sp.__post_init__()
        p = parse_prompt(prompt)
        ids = p.token_ids
        if ids is None:
            if not p.text:
                raise ValueError("prompt='' is invalid: a prompt needs at least one token")
            if self.tokenizer is None:
                raise ValueError("prompt is text but the model has no tokenizer: pass token ids")
            ids = self.tokenizer.encode(p.text)
        if not ids:
            raise ValueError("prompt is empty: a prompt needs at least one token")
        if request_id is None:
            request_id = f"dp-{self._ids}"
            self._ids += 1
        rank = self.router.route(request_id, len(ids))
        _push(self.store, _req_key(rank), ("add", request_id, list(ids), sp))
        return request_id

    def set_output_kind(self, request_id: str, kind) -> None:
        """Replicas send final outputs only (FINAL_ONLY); other kinds are not streamed here."""
        if self.router.rank_of(request_id) is None:
            raise ValueError(f"request_id={request_id!r} is not in the engine")

    def abort(self, request_id: str):
        rank = self.router.finish(request_id)
        if rank is not None and self.failure is None:
            _push(self.store, _req_key(rank), ("abort", request_id))
        return None

    def is_finished(self) -> bool:
        return not self.router.in_flight

    def has_unfinished_requests(self) -> bool:
        return not self.is_finished()

    def step(self, wait_s: float = 0.05) -> list:
        """The requests that finished since the last call (each once), waiting up to
        `wait_s` for one when requests are in flight."""
        if self.failure is not None:
            raise self.failure
        outputs, deadline = [], time.monotonic() + wait_s
        while self.router.in_flight:
            message = _pop(self.store, _OUT_KEY)
            if message is None:
                if outputs or time.monotonic() > deadline:
                    break
                self._check_alive(f"waiting for {len(self.router.in_flight)} requests")
                time.sleep(0.001)
                continue
            if message[0] == "error":
                raise self._failure(message, "serving requests")
            if message[0] == "outputs":
                for out in message[2]:
                    if self.router.finish(out.request_id) is not None:  # not aborted meanwhile
                        out.dp_rank = message[1]  # the replica that served it
                        outputs.append(out)
        return outputs

    def shutdown(self) -> None:
        """Stop every replica (local and remote) and reap the local ones."""
        self._finalizer.detach()
        _stop_and_reap(self.store, self.size, self.procs)

    def __repr__(self) -> str:
        return f"DataParallelEngine(size={self.size}, local={self.local_ranks}, {self.router!r})"


def _stop_and_reap(store, size: int, procs: dict) -> None:
    for rank in range(size):
        try:
            _push(store, _req_key(rank), ("stop",))
        except Exception:  # the store is gone: the replicas lose it and their parent watch ends them
            break
    _reap(procs)
