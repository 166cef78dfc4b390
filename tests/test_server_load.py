"""The server under load (tiny random Llama, token-id prompts, a real server process):
200 streams from a client bounded to 64 connections (the rest queue at the client) all
complete once, with exactly the tokens `LLM.generate` gives;
bad requests in the middle fail alone; clients that leave mid-stream free their KV blocks;
`/metrics` counters move by what was served; a full queue is a 503 and SIGTERM drains."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from server_harness import ServerProcess, sse_chunks

pytestmark = pytest.mark.slow

KEY = "test-key-123"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerProcess(tiny_llama, "--served-model-name", MODEL, "--max-model-len", "256",
                        "--enable-prefix-caching", "--throughput-log-interval", "0.5",
                        api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy tokens from the offline engine on the same weights."""
    from atom import LLM, SamplingParams

    llm = LLM(tiny_llama, max_model_len=256, enforce_eager=True, enable_log_stats=False)

    def run(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        return [o.token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
    return run


def _requests(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 40))] for _ in range(n)]
    return prompts, [rng.randrange(4, 24) for _ in range(n)]


def _body(prompt, max_tokens, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}, **kw}


def test_api_key_is_required_on_v1(server):
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 2}
    url = server.url + "/v1/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(url, json=body, headers=server.headers)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


BAD = [  # (body or raw bytes, status, param named)
    (b"{not json", 400, None),
    ({"model": MODEL, "prompt": [5], "max_tokens": "8"}, 422, "max_tokens"),
    ({"model": MODEL, "prompt": [5], "frobnicate": 1}, 422, "frobnicate"),
    ({"model": MODEL}, 422, "prompt"),
    ({"model": MODEL, "prompt": [5, "x"]}, 422, "prompt"),        # not pydantic's "prompt.str"
    ({"model": MODEL, "prompt": [5], "stop": 5}, 422, "stop"),
    ({"model": MODEL, "prompt": [5], "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": [5], "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": [5], "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": [5], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": [5] * 300}, 400, "prompt"),
    ({"model": MODEL, "prompt": [5] * 200, "max_tokens": 100}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": [5, 100000]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "text"}, 400, "prompt"),          # the tiny model has no tokenizer
    ({"model": MODEL, "prompt": [5], "logprobs": 99}, 400, "logprobs"),
    ({"model": MODEL, "prompt": [5], "logit_bias": {"5": 1}}, 400, "logit_bias"),
    ({"model": "gpt-4", "prompt": [5]}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[f"{s}-{p}" for _, s, p in BAD])
def test_bad_input_gets_an_openai_error_naming_the_field(server, body, status, param):
    url = server.url + "/v1/completions"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={**server.headers, "Content-Type": "application/json"})
    else:
        r = httpx.post(url, json=body, headers=server.headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
    # and the server keeps serving
    ok = httpx.post(url, json={"model": MODEL, "prompt": [7, 8], "max_tokens": 1}, headers=server.headers)
    assert ok.status_code == 200


def test_unknown_route_and_chat_without_template_are_errors(server):
    r = httpx.get(server.url + "/v1/nothing", headers=server.headers)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_200_concurrent_streams_complete_once_with_the_offline_tokens(server, reference):
    prompts, max_tokens = _requests(200, seed=0)
    expected = reference(prompts, max_tokens)
    before = server.metrics()
    url = server.url + "/v1/completions"

    async def run():
        # fewer connections than requests: the rest wait in the client's pool, as a real
        # client's would, and each connection carries several streams one after the other
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
            good = [sse_chunks(client, url, _body(p, m), server.headers)
                    for p, m in zip(prompts, max_tokens)]
            bad = [client.post(url, json={"model": MODEL, "prompt": [5], "temperature": -1},
                               headers=server.headers),
                   client.post(url, content=b"{", headers=server.headers),
                   client.post(url, json={"model": MODEL, "prompt": [5] * 300}, headers=server.headers)]
            tasks = good[:100] + bad + good[100:]  # the bad ones in the middle of the load
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    bad = results[100:103]
    assert [r.status_code for r in bad] == [400, 400, 400]
    streams = results[:100] + results[103:]
    ids = set()
    for (status, chunks, done), want, prompt in zip(streams, expected, prompts):
        assert status == 200 and done
        ids.add(chunks[0]["id"])
        assert len({c["id"] for c in chunks}) == 1
        finishing = [c for c in chunks for ch in c["choices"] if ch["finish_reason"] is not None]
        assert len(finishing) == 1 and finishing[0]["choices"][0]["finish_reason"] == "length"
        got = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
        assert got == want                     # nothing lost, duplicated or crossed
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == []
        assert usage == {"prompt_tokens": len(prompt), "completion_tokens": len(want),
                         "total_tokens": len(prompt) + len(want)}
    assert len(ids) == 200
    after = server.wait_idle()
    assert after["atom:kv_cache_free_blocks"] == after["atom:kv_cache_total_blocks"] > 0
    assert after["atom:num_requests_in_flight"] == 0
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert d["atom:generation_tokens_total"] == sum(map(len, expected))
    assert d["atom:prompt_tokens_total"] == sum(map(len, prompts))
    assert d["atom:request_success_total{finished_reason=length}"] == 200
    assert d["atom:time_to_first_token_seconds_count"] == 200
    assert d["atom:e2e_request_latency_seconds_count"] == 200
    assert d["atom:request_queue_time_seconds_count"] == 200
    assert d["atom:inter_token_latency_seconds_count"] == sum(len(e) - 1 for e in expected)
    assert d["atom:prefix_cache_queries_total"] > 0


def test_clients_that_leave_mid_stream_free_their_blocks(server):
    url = server.url + "/v1/completions"
    prompts, _ = _requests(20, seed=1)
    before = server.metrics()

    async def run():
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
            return await asyncio.gather(*[
                sse_chunks(client, url, _body(p, 200), server.headers, stop_after=3) for p in prompts])

    results = asyncio.run(run())
    assert all(status == 200 and len(chunks) == 3 and not done for status, chunks, done in results)
    after = server.wait_idle()
    assert after["atom:kv_cache_free_blocks"] == after["atom:kv_cache_total_blocks"]
    assert after["atom:num_requests_in_flight"] == 0
    aborted = (after["atom:request_success_total{finished_reason=abort}"]
               - before["atom:request_success_total{finished_reason=abort}"])
    assert aborted == 20
    # a non-streaming client that leaves is aborted as well (unless it finished first)
    mid = server.metrics()
    try:  # a fast machine may finish it before the client leaves: both ends are checked below
        httpx.post(url, json={"model": MODEL, "prompt": [9, 10], "max_tokens": 250, "ignore_eos": True,
                              "temperature": 0}, headers=server.headers, timeout=0.3)
    except httpx.ReadTimeout:
        pass
    after = server.wait_idle()
    assert after["atom:kv_cache_free_blocks"] == after["atom:kv_cache_total_blocks"]
    ended = {r: after[f"atom:request_success_total{{finished_reason={r}}}"]
             - mid[f"atom:request_success_total{{finished_reason={r}}}"] for r in ("abort", "length")}
    assert sorted(ended.values()) == [0, 1]   # one end: aborted (on 2 CPU cores) or whole


def test_metrics_parse_and_prefix_cache_counters_move(server):
    url = server.url + "/v1/completions"
    prompt = list(range(10, 74))   # four full 16-token blocks
    before = server.metrics()
    for _ in range(2):
        r = httpx.post(url, json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0},
                       headers=server.headers)
        assert r.status_code == 200
    after = server.wait_idle()
    assert after["atom:prefix_cache_queries_total"] > before["atom:prefix_cache_queries_total"]
    assert after["atom:prefix_cache_hits_total"] - before["atom:prefix_cache_hits_total"] >= 48
    assert 0.0 <= after["atom:kv_cache_usage_perc"] <= 1.0
    assert "Engine: running" in server.log() and "[Cache Stats]" in server.log()


def _parse(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not (set(s.labels) - {"model_name"})}


def test_full_queue_is_503_and_sigterm_drains_under_load(tiny_llama):
    tokens = 700  # long enough that 4 still wait when the 9th request comes, on a fast machine too
    srv = ServerProcess(tiny_llama, "--max-model-len", "1024", "--max-num-seqs", "4",
                        "--max-waiting-requests", "4", "--shutdown-timeout", "60",
                        "--served-model-name", MODEL)
    url = srv.url + "/v1/completions"
    prompts, _ = _requests(8, seed=2)

    async def run():
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
            tasks = [asyncio.create_task(sse_chunks(client, url, _body(p, tokens))) for p in prompts]
            # wait until 4 run and 4 wait, then one more is refused with a 503
            deadline, full = time.monotonic() + 60, False
            while time.monotonic() < deadline and not full:
                m = _parse((await client.get(srv.url + "/metrics")).text)
                full = m["atom:num_requests_waiting"] == 4 and m["atom:num_requests_running"] == 4
                if not full:
                    await asyncio.sleep(0.05)
            assert full, m  # the state the 503 below is about
            r = await client.post(url, json={"model": MODEL, "prompt": [5], "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
            srv.terminate()                  # SIGTERM with 8 requests in flight
            await asyncio.sleep(0.5)
            try:
                late = await client.post(url, json={"model": MODEL, "prompt": [5], "max_tokens": 2})
                refused = late.status_code == 503
            except httpx.TransportError:
                refused = True               # the listener is closed
            return await asyncio.gather(*tasks), refused

    try:
        results, refused = asyncio.run(run())
        assert refused
        for status, chunks, done in results:   # every request in flight finished whole
            assert status == 200 and done
            assert sum(len(ch["token_ids"]) for c in chunks for ch in c["choices"]) == tokens
        assert srv.wait(60) == 0
    finally:
        srv.kill()
    assert "draining" in srv.log()


def test_serving_benchmark_smoke(server, tmp_path):
    from atom.benchmarks import serving
    out = tmp_path / "bench.json"
    rc = serving.main(["--base-url", server.url, "--api-key", KEY, "--num-prompts", "12",
                       "--input-len", "16", "--output-len", "6", "--vocab-size", "512",
                       "--request-rate", "inf", "40", "--max-concurrency", "6", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["model"] == MODEL and report["provenance"]["commit"]
    assert [r["request_rate"] for r in report["runs"]] == ["inf", 40.0]
    for r in report["runs"]:
        assert r["completed"] == 12 and r["failed"] == 0
        assert r["total_output_tokens"] == sum(q.output_len for q in serving.make_requests(
            "random", 12, 16, 6, 0.5, 512, 10, 0, False))
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert 0 < r[key]["p50"] <= r[key]["p99"]
        assert r["request_throughput"] > 0 and r["output_throughput"] > 0
    server.wait_idle()
    # and the report and a scrape as DataFrames / a plot, for notebooks
    import matplotlib
    matplotlib.use("Agg")
    from atom.viz import metrics_frame, plot_serving, serving_frame
    df = serving_frame(report)
    assert list(df["completed"]) == [12, 12] and "tpot_ms_p50" in df
    assert plot_serving(df).axes
    mf = metrics_frame(httpx.get(server.url + "/metrics").text)
    assert "atom:kv_cache_free_blocks" in set(mf["name"])
