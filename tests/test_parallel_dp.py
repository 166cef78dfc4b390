"""Data parallel on a CPU: the router's three strategies on scripted loads (as the guide
defines them), DP=2 replicas in their own processes returning every request once, in order,
routed as the strategy says, a replica killed mid-run named in the engine's error, the
ParallelConfig / ATOM_DP_* overrides, and two launcher processes ("hosts" on loopback
addresses) forming one group and serving."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from atom import LLM, SamplingParams
from atom.config import ParallelConfig
from atom.distributed.data_parallel import ReplicaFailure
from atom.distributed.router import DPRouter
from parallel_helpers import child_env, wait_gone

os.environ.setdefault("OMP_NUM_THREADS", "1")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


# --- the router on scripted loads ---------------------------------------------------------
def replay(router, script):
    """Run ("add", id, tokens) / ("done", id) events; the ranks the adds went to."""
    out = []
    for event in script:
        if event[0] == "add":
            out.append(router.route(event[1], event[2]))
        else:
            router.finish(event[1])
    return out


SCRIPT = [("add", "a", 100), ("add", "b", 10), ("add", "c", 10), ("done", "a"), ("add", "d", 5),
          ("add", "e", 500), ("add", "f", 1)]


def test_round_robin_takes_ranks_in_turn_whatever_the_load():
    assert replay(DPRouter(3, "round_robin"), SCRIPT) == [0, 1, 2, 0, 1, 2]


def test_least_requests_fewest_in_flight_then_lighter_prompt_load():
    r = DPRouter(2, "least_requests")
    # a->0 (tie, lower rank); b->1 (0 has one); c: 1 each, rank 1 lighter (10 < 100) -> 1;
    # a done: 0 has none -> d->0; e: 0 has 1 (5 tokens), 1 has 2 -> 0; f: 2 (505) vs 2 (20) -> 1
    assert replay(r, SCRIPT) == [0, 1, 1, 0, 0, 1]
    assert (r.num_reqs, r.prompt_tokens) == ([2, 3], [505, 21])


def test_least_tokens_is_prompt_tokens_plus_req_equiv_per_request(monkeypatch):
    monkeypatch.setenv("ATOM_DP_LB_REQ_EQUIV", "50")
    r = DPRouter(2, "least_tokens")  # the cost per request from ATOM_DP_LB_REQ_EQUIV
    assert r.req_equiv == 50
    # a->0 (0 vs 0); b: 150 vs 0 -> 1; c: 150 vs 60 -> 1; a done: 0 vs 120 -> d->0;
    # e: 55 vs 120 -> 0; f: 605 vs 120 -> 1
    assert replay(r, SCRIPT) == [0, 1, 1, 0, 0, 1]
    four = SCRIPT[:3] + [("add", "d", 5)]
    r0 = DPRouter(2, "least_tokens", req_equiv=0)  # tokens alone: d: 100 vs 20 -> 1
    assert replay(r0, four) == [0, 1, 1, 1]
    big = DPRouter(2, "least_tokens", req_equiv=1000)  # the request count weighs: d: 1100 vs 2020 -> 0
    assert replay(big, four) == [0, 1, 1, 0]
    assert list(big.frame()["score"]) == [105 + 2000, 20 + 2000]


def test_router_refuses_bad_input():
    with pytest.raises(ValueError, match="dp_load_balance='fastest' is invalid"):
        DPRouter(2, "fastest")
    r = DPRouter(2)
    r.route("x", 3)
    with pytest.raises(ValueError, match="'x' is already in flight on rank 0"):
        r.route("x", 3)
    assert r.finish("x") == 0 and r.finish("x") is None


def test_parallel_config_takes_the_atom_dp_overrides(monkeypatch):
    for var, value in {"ATOM_DP_SIZE": "4", "ATOM_DP_SIZE_LOCAL": "2", "ATOM_DP_RANK": "2",
                       "ATOM_DP_MASTER_IP": "10.1.2.3", "ATOM_DP_MASTER_PORT": "29611"}.items():
        monkeypatch.setenv(var, value)
    pc = ParallelConfig(data_parallel_size=1)
    assert (pc.data_parallel_size, pc.data_parallel_size_local, pc.data_parallel_rank,
            pc.data_parallel_master_ip, pc.data_parallel_master_port) == (4, 2, 2, "10.1.2.3", 29611)


def test_llm_takes_data_parallel_size_into_parallel_config():
    from atom.llm import _with_dp_size
    assert _with_dp_size(None, 2) == {"data_parallel_size": 2}
    assert _with_dp_size({"data_parallel_rank": 0}, 3) == {"data_parallel_rank": 0, "data_parallel_size": 3}
    pc = _with_dp_size(ParallelConfig(data_parallel_master_port=29601), 2)
    assert (pc.data_parallel_size, pc.data_parallel_size_local, pc.data_parallel_master_port) == (2, 2, 29601)


def test_the_front_end_refuses_a_host_that_is_not_rank_0(tiny_llama):
    from atom.config import Config
    from atom.distributed.data_parallel import DataParallelEngine
    cfg = Config(tiny_llama, parallel_config=ParallelConfig(data_parallel_size=2, data_parallel_size_local=1,
                                                            data_parallel_rank=1))
    with pytest.raises(ValueError, match=r"data_parallel_rank=1: the front end runs on the host of rank 0.*launch"):
        DataParallelEngine(cfg)


# --- replicas in processes ----------------------------------------------------------------
def expected_routes(strategy, lengths, req_equiv=512):
    """The guide's rules, written again here: every request is added before any finishes."""
    reqs, toks, out = [0, 0], [0, 0], []
    for i, n in enumerate(lengths):
        if strategy == "round_robin":
            r = i % 2
        elif strategy == "least_requests":
            r = min((0, 1), key=lambda k: (reqs[k], toks[k], k))
        else:
            r = min((0, 1), key=lambda k: (toks[k] + req_equiv * reqs[k], k))
        reqs[r] += 1
        toks[r] += n
        out.append(r)
    return out


@pytest.fixture(scope="module")
def dp_llm(tiny_llama):
    llm = LLM(tiny_llama, data_parallel_size=2, num_kvcache_blocks=64, enable_log_stats=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    # a long prompt first, then short ones: the three strategies route them three ways
    # (round robin 0 1 0 1 0 1, least_requests 0 1 1 0 1 0, least_tokens 0 1 1 1 0 1)
    prompts = [[7] * 600, [8, 9], [1, 2, 3], [5, 6, 7, 8], [300, 301, 302, 303, 304], list(range(9, 15))]
    llm = LLM(tiny_llama, num_kvcache_blocks=64, enable_log_stats=False)
    return prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("strategy", ["round_robin", "least_requests", "least_tokens"])
def test_dp2_returns_every_request_once_in_order_routed_by_strategy(dp_llm, reference, strategy):
    engine = dp_llm.engine
    engine.router = DPRouter(2, strategy)
    prompts, ref = reference
    outs = dp_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert len({o.request_id for o in outs}) == len(prompts) and all(o.finished for o in outs)
    routes = expected_routes(strategy, [len(p) for p in prompts])
    assert routes == {"round_robin": [0, 1, 0, 1, 0, 1], "least_requests": [0, 1, 1, 0, 1, 0],
                      "least_tokens": [0, 1, 1, 1, 0, 1]}[strategy]  # the script tells them apart
    assert [o.dp_rank for o in outs] == routes
    assert engine.is_finished() and engine.router.num_reqs == [0, 0]


def test_dp2_replicas_are_processes_of_one_group(dp_llm):
    engine = dp_llm.engine
    pids = {r: p.pid for r, p in engine.procs.items()}
    assert sorted(pids) == [0, 1] and os.getpid() not in pids.values() and len(set(pids.values())) == 2
    assert all(info["group_size"] == 2 for info in engine.replicas.values())
    assert {r: info["pid"] for r, info in engine.replicas.items()} == pids


def test_a_request_a_replica_refuses_comes_back_as_an_error(dp_llm):
    dp_llm.engine.router = DPRouter(2, "round_robin")
    outs = dp_llm.generate([[5, 6], [10 ** 6], [7, 8]], GREEDY, use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "prompt token ids [1000000] are invalid" in outs[1].error


def test_killing_a_replica_mid_run_ends_the_engine_with_its_error(dp_llm):
    """Last of the replica tests: it breaks the shared engine."""
    engine = dp_llm.engine
    engine.router = DPRouter(2, "round_robin")
    victim = engine.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(ReplicaFailure, match=rf"replica 1 \(pid {victim.pid}\) was killed by SIGKILL while the engine "
                                             r"was waiting for \d+ requests"):
        dp_llm.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=False)
    with pytest.raises(ReplicaFailure, match="replica 1"):
        dp_llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    survivor = engine.procs[0].pid
    dp_llm.shutdown()
    assert wait_gone([victim.pid, survivor]) == []


# --- two hosts ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launchers_on_loopback_form_one_group_and_serve(tiny_llama, reference, tmp_path):
    """Each "host" runs one replica of two tensor-parallel ranks (-tp 2): four model ranks."""
    port = free_port()
    common = [sys.executable, "-m", "atom.distributed.launch", "--model", tiny_llama, "-dp", "2", "-tp", "2",
              "--data-parallel-size-local", "1", "--data-parallel-master-ip", "127.0.0.1",
              "--data-parallel-master-port", str(port)]
    # host B's output goes to files: a pipe nobody reads until host A is done could fill and block it
    b_log = tmp_path / "host_b.log"
    with open(b_log, "w") as log:
        host_b = subprocess.Popen(common + ["--data-parallel-rank", "1", "--master-addr", "127.0.0.2"],
                                  stdout=log, stderr=subprocess.STDOUT, text=True, env=child_env())
    try:
        prompts, ref = reference
        ids = [arg for p in prompts[:4] for arg in ("--prompt-ids", ",".join(map(str, p)))]
        head = subprocess.run(common + ["--data-parallel-rank", "0", "--temperature", "0", "--max-tokens", "6",
                                        "--ignore-eos", "--dp-load-balance", "round_robin"] + ids,
                              capture_output=True, text=True, timeout=300, env=child_env())
        host_b.wait(timeout=60)
    finally:
        if host_b.poll() is None:
            host_b.kill()
    assert head.returncode == 0, head.stderr[-2000:]
    b_err = b_log.read_text()
    assert host_b.returncode == 0, b_err[-2000:]
    assert "2 replicas (round_robin) in a group of 2" in head.stderr
    assert "data-parallel replicas [1] started" in b_err and "tensor parallel: 2 ranks (gloo)" in b_err
    lines = [json.loads(line) for line in head.stdout.strip().splitlines()]
    assert [line["token_ids"] for line in lines] == ref[:4]


def test_keywords_the_replicas_cannot_take_are_refused(tiny_llama):
    for kw in ({"seed": 3}, {"record_expert_load": True}, {"async_scheduling": False}):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=f"{name}=.* is not implemented with data_parallel_size=2"):
            LLM(tiny_llama, data_parallel_size=2, **kw)
