"""`AsyncLLMEngine` in process mode (tiny random Llama, the engine in a spawned child):
concurrent streams give `LLM.generate`'s greedy tokens, a refused request fails alone,
a client that leaves frees its blocks (the snapshot says so), the outputs' wire format
round-trips, a build error surfaces from `start()`, a child killed mid-run fails the open
streams with EngineDeadError (no hang), and a tensor-parallel engine runs inside the child
(its worker is the child's child) and shutdown reaps both; a program that exits without
shutting the engine down still exits, the child reaped on the way."""
from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from atom import LLM, SamplingParams
from atom.model_engine.arg_utils import EngineArgs
from atom.model_engine.async_engine import AsyncLLMEngine, EngineDeadError
from atom.model_engine.engine_process import (EngineTraceback, decode_outputs, encode_outputs,
                                              portable)
from atom.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine_scenarios import collect, refuse_one_and_leave_one
from parallel_helpers import PROMPTS, wait_gone

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the engine process inherits it
SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module (its engine's), run by a thread."""
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)
    loop.close()


def run(loop, coro, timeout: float = 120.0):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def _args(path, **kw) -> EngineArgs:
    return EngineArgs(model=path, max_model_len=kw.pop("max_model_len", 128), enforce_eager=True,
                      enable_log_stats=False, **kw)


@pytest.fixture(scope="module")
def seen():
    return []


@pytest.fixture(scope="module")
def eng(tiny_llama, loop, seen):
    e = AsyncLLMEngine.from_engine_args(_args(tiny_llama), on_step=lambda outs, now: seen.extend(outs))
    run(loop, e.start())
    yield e
    run(loop, e.shutdown())
    assert e._core.process.exitcode == 0 and not e.is_running


@pytest.fixture(scope="module")
def want(tiny_llama):
    """Greedy tokens of `PROMPTS` from the offline engine."""
    ref = LLM(tiny_llama, max_model_len=128, enforce_eager=True, enable_log_stats=False)
    return [o.token_ids for o in ref.generate(PROMPTS, SP, use_tqdm=False)]


def test_concurrent_streams_equal_generate(eng, loop, tiny_llama, want):
    async def main():
        return await asyncio.gather(*[collect(eng, p, SP) for p in PROMPTS])

    got = run(loop, main())
    assert [[t for o in outs for t in o.outputs[0].new_token_ids] for outs in got] == want
    for outs, prompt in zip(got, PROMPTS):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert all(o.prompt_token_ids == prompt for o in outs)   # put back after the first output
        assert outs[-1].metrics.ttft is not None and outs[-1].outputs[0].finish_reason == "length"
    assert eng.engine is None and eng.mode == "process" and eng.tokenizer is None  # no tokenizer in it
    assert (eng.info.model, eng.info.max_model_len, eng.info.max_num_seqs) == (tiny_llama, 128, 512)
    assert eng.info.pid == eng._core.process.pid != os.getpid()
    assert repr(eng).startswith("AsyncLLMEngine(running, EngineProcess(pid=") and "LLMEngine(" in repr(eng)
    assert eng.snapshot.num_free_blocks == eng.snapshot.num_blocks > 0 and eng.num_in_flight == 0


def test_refused_request_fails_alone_and_leaving_frees_the_blocks(eng, loop, seen):
    seen.clear()

    def idle() -> bool:
        s = eng.snapshot
        return s.num_free_blocks == s.num_blocks and s.num_running == 0 and any(
            o.finished and o.outputs[0].finish_reason == "abort" for o in seen)

    async def main():
        return await refuse_one_and_leave_one(eng, SP, idle)

    outs = run(loop, main())
    assert sum(len(o.outputs[0].new_token_ids) for o in outs) == 10
    s = eng.snapshot
    assert s.num_free_blocks == s.num_blocks and (s.num_running, s.num_waiting) == (0, 0)
    assert sorted(o.outputs[0].finish_reason for o in seen if o.finished) == ["abort", "length"]
    assert eng.num_in_flight == 0 and eng.is_running


def test_outputs_round_trip_the_wire_format():
    lp = [{7: Logprob(-0.5, 1, "a")}]
    first = RequestOutput("r", "hi", [1, 2, 3], [CompletionOutput(0, "a", [7], -0.5, lp, new_token_ids=[7],
                                                                 new_text="a")],
                          False, prompt_logprobs=[None, {2: Logprob(-1.0)}], num_cached_tokens=16,
                          metrics=RequestMetrics(1.0, 2.0, 3.0, ttft=2.0))
    last = RequestOutput("r", "hi", [1, 2, 3], [CompletionOutput(0, "ab", [7, 8], None, None, "length",
                                                                new_token_ids=[8], new_text="b")], True)
    sent, prompts = set(), {}
    rows = encode_outputs([first], sent) + encode_outputs([last], sent)
    assert rows[0][1] == ("hi", [1, 2, 3]) and rows[1][1] is None and not sent  # the prompt once
    back = decode_outputs(rows, prompts)
    assert not prompts   # forgotten with the final output
    for got, want in zip(back, [first, last]):
        assert vars(got).keys() == vars(want).keys()
        assert {k: v for k, v in vars(got).items() if k != "outputs" and k != "metrics"} == \
            {k: v for k, v in vars(want).items() if k != "outputs" and k != "metrics"}
        assert got.outputs == want.outputs and got.metrics == want.metrics


def test_an_error_that_does_not_pickle_becomes_a_runtime_error_with_its_text():
    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")

    assert isinstance(portable(ValueError("x=1 is invalid")), ValueError)
    e = portable(Odd(1, 2))
    assert type(e) is RuntimeError and str(e) == "Odd: 1/2"


def test_a_build_error_surfaces_from_start(loop, tmp_path):
    missing = str(tmp_path / "no-such-model")
    e = AsyncLLMEngine.from_engine_args(_args(missing))
    with pytest.raises(Exception) as info:
        run(loop, e.start())
    with pytest.raises(Exception) as here:   # the error building it in this process raises
        EngineArgs(model=missing).create_engine_config()
    assert type(info.value) is type(here.value) and str(info.value) == str(here.value)
    assert isinstance(info.value.__cause__, EngineTraceback) and "Traceback" in str(info.value.__cause__)
    assert e.error is info.value and not e.is_running and e._core.process.exitcode == 1
    with pytest.raises(EngineDeadError):
        run(loop, e.add_request([5], SP))


def test_a_killed_engine_process_fails_the_streams_without_a_hang(tiny_llama, loop):
    e = AsyncLLMEngine.from_engine_args(_args(tiny_llama, max_model_len=1024))
    long = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)

    async def main():
        await e.start()
        streams = [e.generate(p, long) for p in PROMPTS[:2]]
        for s in streams:
            await s.__anext__()       # both are running
        os.kill(e._core.process.pid, signal.SIGKILL)
        errors = []
        for s in streams:
            try:
                async for _ in s:
                    pass
            except EngineDeadError as err:
                errors.append(err)
        return errors

    errors = run(loop, main(), timeout=60)
    assert len(errors) == 2 and all("was killed by SIGKILL" in str(err) for err in errors)
    assert not e.is_running and isinstance(e.error, EngineDeadError) and e.num_in_flight == 0
    with pytest.raises(EngineDeadError, match="not running"):
        run(loop, e.add_request([5], SP))
    run(loop, e.shutdown(), timeout=30)
    assert e._core.process.exitcode == -signal.SIGKILL


def _spawned_children(pid: int) -> list[int]:
    """The processes `pid` spawned through multiprocessing (not its resource tracker)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    spawned = b"spawn_main" in f.read()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid and spawned:
                out.append(int(entry))
    return out


@pytest.mark.slow
def test_tensor_parallel_engine_in_the_process_and_shutdown_reaps_it(tiny_llama, loop, want):
    e = AsyncLLMEngine.from_engine_args(_args(tiny_llama, tensor_parallel_size=2))
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main():
        await e.start()
        got = await asyncio.gather(*[collect(e, p, SP) for p in PROMPTS])
        stream = e.generate([5, 6], long)
        await stream.__anext__()
        workers = _spawned_children(e._core.process.pid)
        await e.shutdown()             # with a request in flight: it ends with EngineDeadError
        with pytest.raises(EngineDeadError, match="the engine stopped"):
            async for _ in stream:
                pass
        return got, workers

    got, workers = run(loop, main())
    assert [[t for o in outs for t in o.outputs[0].new_token_ids] for outs in got] == want
    assert "tp_rank=0/2" in e.info.description and len(workers) == 1
    assert e._core.process.exitcode == 0 and wait_gone(workers) == [] and not e.is_running


EXIT_WITHOUT_SHUTDOWN = '''
import asyncio, sys
from atom.model_engine.arg_utils import EngineArgs
from atom.model_engine.async_engine import AsyncLLMEngine

async def main():
    e = AsyncLLMEngine.from_engine_args(EngineArgs(model=sys.argv[1], max_model_len=64, enforce_eager=True))
    await e.start()
    print(e._core.process.pid, flush=True)

if __name__ == "__main__":
    asyncio.run(main())   # no shutdown(): the engine process must not keep this one alive
'''


@pytest.mark.slow
def test_a_program_that_never_shuts_the_engine_down_still_exits_and_reaps_it(tiny_llama, tmp_path):
    import subprocess
    import sys

    from parallel_helpers import child_env
    script = tmp_path / "no_shutdown.py"
    script.write_text(EXIT_WITHOUT_SHUTDOWN)
    done = subprocess.run([sys.executable, str(script), tiny_llama], capture_output=True, text=True,
                          timeout=120, env=child_env())
    assert done.returncode == 0, done.stderr
    assert wait_gone([int(done.stdout.split()[0])], 10.0) == []
