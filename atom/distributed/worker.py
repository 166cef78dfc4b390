"""A tensor-parallel worker: one process per rank other than the driver (rank 0).

    worker_main(config, rank, world_size, host, port, device, conn, parent_pid)

It joins the group on the driver's TCP store, builds its `ModelRunner` (its shard of every
layer), says "ready" on `conn`, then `serve`s: each step the driver broadcasts the
scheduled sequences once (`ModelRunner.publish`), and the worker runs the same forward on
them (its collectives pair with the driver's). It exits on "stop", when the group breaks
(the driver died: the next collective raises), or when its parent process is gone. An
exception is reported on `conn` (rank, what it was doing, traceback) before it exits.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback

logger = logging.getLogger(__name__)


def _watch_parent(parent_pid: int) -> None:
    """Exit this process once the parent is gone (no orphan workers)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(3)


def _exit_now(code: int) -> None:
    """End a worker process once its engine is shut down: flush, then skip the interpreter's
    teardown (seconds of native destructors on a loaded host; nothing of it is needed)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def worker_main(config, rank: int, world_size: int, host: str, port: int, device: str, conn,
                parent_pid: int | None = None, prefix: str = "tp", timeout_s: float | None = None) -> None:
    if parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    import torch
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    from atom.distributed.group import DEFAULT_TIMEOUT_S, init_group, make_store
    from atom.model_engine.model_runner import ModelRunner
    doing = "joining the group"
    state, progress = None, {}
    try:
        store = make_store(host, port, world_size, False, timeout_s or DEFAULT_TIMEOUT_S)
        state = init_group(rank, world_size, store, device, prefix, timeout_s or DEFAULT_TIMEOUT_S)
        doing = "loading the model"
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(torch.device(device))
        runner = ModelRunner(config, device, state)
        conn.send(("ready", rank, os.getpid()))
        doing = "serving steps"
        serve(runner, progress)
    except BaseException as e:  # noqa: BLE001  (reported, then the process exits non-zero)
        if doing == "serving steps":
            doing = progress.get("doing", doing)
        try:
            conn.send(("error", rank, doing, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except Exception:  # the driver is gone
            pass
        code = 1
    else:
        code = 0
    if state is not None:
        state.shutdown()
    _exit_now(code)


def serve(runner, progress: dict | None = None) -> int:
    """Run the driver's steps until it says "stop"; returns the number of steps run.
    `progress["doing"]` says what the loop is at (for the error report)."""
    steps = 0
    progress = progress if progress is not None else {}
    while True:
        progress["doing"] = f"waiting for step {runner.num_steps + 1}"
        message = runner.parallel.broadcast_object()
        kind = message[0]
        if kind == "stop":
            return steps
        if kind == "step":
            _, seqs, released = message
            for seq_id in released:
                runner.release(seq_id)
            progress["doing"] = f"running step {runner.num_steps + 1} ({len(seqs)} sequences)"
            runner.run(seqs)
            steps += 1
        elif kind == "call":  # a runner method without collectives (start_profile / stop_profile)
            _, name, args = message
            getattr(runner, name)(*args)
        else:
            raise ValueError(f"tensor-parallel worker got an unknown message {kind!r}")
