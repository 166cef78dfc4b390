"""Online serving benchmark against any OpenAI-compatible server (ours, `vllm serve`, ...).

    python -m atom.benchmarks.serving --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --input-len 512 --output-len 128 --request-rate 4 16 inf --max-concurrency 64 --out r.json

Requests: `--dataset random` (lengths uniform in [len*(1-r), len*(1+r)], `--range-ratio` r)
or `fixed` (exactly `--input-len` / `--output-len`), token-id prompts drawn from
[`--min-token-id`, `--vocab-size`) with `--seed` (or text prompts, `--text-prompts`: a
repeated word, for servers that take no token ids). Every request streams with
`ignore_eos` so it produces exactly its output length, and asks for usage in the last
chunk. Arrivals: Poisson at `--request-rate` requests/s (`inf`: all at once), at most
`--max-concurrency` in flight; one run per rate, in order, the same requests each time.

Per request: TTFT (send to the first chunk with a choice: a model without a tokenizer
streams empty text), ITL (between two such chunks: one token each, on both servers, unless
a step makes several), TPOT ((e2e - TTFT) / (output tokens - 1)), e2e. Per run:
mean / p50 / p99 of each, request and token throughput over the run's wall time, failures.
Where the server exposes Prometheus histograms of its own TTFT and queue time on `/metrics`
(ours as `atom:`, vLLM's as `vllm:`), each run also gets their means over its requests
(`server_ttft_ms_mean`, `server_queue_ms_mean`: the difference of `/metrics` read before and
after the run), so a client TTFT splits into the engine's part and the rest (HTTP, the
server's own work, the transport to the engine).
JSON (`--out`) names the commit and versions (`atom.benchmarks.provenance`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import re
import sys
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class BenchRequest:
    prompt: list[int] | str
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def make_requests(dataset: str, num: int, input_len: int, output_len: int, range_ratio: float,
                  vocab_size: int, min_token_id: int, seed: int, text: bool) -> list[BenchRequest]:
    if dataset not in ("random", "fixed"):
        raise ValueError(f"--dataset={dataset!r} is invalid: 'random' or 'fixed'")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio={range_ratio} is invalid: must be in [0, 1)")
    if input_len < 1 or output_len < 1 or num < 1:
        raise ValueError("--input-len, --output-len and --num-prompts must be >= 1")
    if not 0 <= min_token_id < vocab_size:
        raise ValueError(f"--min-token-id={min_token_id} must be in [0, --vocab-size={vocab_size})")
    rng = random.Random(seed)

    def length(n: int) -> int:
        if dataset == "fixed" or range_ratio == 0:
            return n
        return rng.randint(max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio))))

    out = []
    for _ in range(num):
        p, o = length(input_len), length(output_len)
        prompt = "hi " * p if text else [rng.randrange(min_token_id, vocab_size) for _ in range(p)]
        out.append(BenchRequest(prompt, p, o))
    return out


async def _one(client, url: str, model: str, req: BenchRequest, headers: dict) -> RequestResult:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult()
    t0 = time.perf_counter()
    last = None
    chunks_tokens = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                now = time.perf_counter()
                if chunk.get("usage") and not chunk.get("choices"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    continue
                if not chunk.get("choices"):
                    continue
                chunks_tokens += 1
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
        res.e2e = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or chunks_tokens
        res.ok = last is not None
        if not res.ok:
            res.error = "no output"
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        res.error = f"{type(e).__name__}: {e}"[:200]
    return res


def _percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan}
    s = sorted(xs)

    def q(p: float) -> float:
        k = (len(s) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)
    return {"mean": sum(s) / len(s), "p50": q(0.5), "p99": q(0.99)}


def summarize(reqs: list[BenchRequest], results: list[RequestResult], duration: float) -> dict:
    ok = [(q, r) for q, r in zip(reqs, results) if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for _, r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for _, r in ok)
    in_tokens = sum(q.prompt_len for q, _ in ok)
    ms = lambda d: {k: v * 1000 for k, v in d.items()}  # noqa: E731
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": ms(_percentiles([r.ttft for _, r in ok])), "tpot_ms": ms(_percentiles(tpot)),
        "itl_ms": ms(_percentiles([x for _, r in ok for x in r.itl])),
        "e2e_ms": ms(_percentiles([r.e2e for _, r in ok])),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


async def run_rate(url: str, model: str, reqs: list[BenchRequest], rate: float,
                   max_concurrency: int | None, headers: dict, seed: int, timeout: float) -> dict:
    import httpx
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or len(reqs),
                          max_keepalive_connections=max_concurrency or len(reqs))
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        async def go(req):
            if sem is None:
                return await _one(client, url, model, req, headers)
            async with sem:
                return await _one(client, url, model, req, headers)

        tasks = []
        t0 = time.perf_counter()
        for req in reqs:
            tasks.append(asyncio.create_task(go(req)))
            if rate != math.inf:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return {"request_rate": "inf" if rate == math.inf else rate,
            "max_concurrency": max_concurrency, **summarize(reqs, results, duration)}


def _model_name(base_url: str, headers: dict) -> str:
    import httpx
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m atom.benchmarks.serving", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="Model name to send (default: the server's first).")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", default="random", choices=["random", "fixed"])
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--vocab-size", type=int, default=10000, help="Token ids are drawn below this.")
    p.add_argument("--min-token-id", type=int, default=10)
    p.add_argument("--text-prompts", action="store_true", help="Send text instead of token ids.")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="Requests per second (Poisson); 'inf': all at once. Several: one run each.")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup", type=int, default=0, help="Requests sent (and not counted) first.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="Seconds per request.")
    p.add_argument("--label", default=None, help="Name of the server, in the JSON.")
    p.add_argument("--out", default=None, help="Write the JSON here.")
    return p


_HISTOGRAMS = {"time_to_first_token_seconds": "server_ttft_ms_mean", "request_queue_time_seconds": "server_queue_ms_mean"}
_SAMPLE = re.compile(r"^[A-Za-z_:][A-Za-z0-9_:]*?:(time_to_first_token_seconds|request_queue_time_seconds)"
                     r"_(sum|count)(?:\{[^}]*\})?\s+(\S+)$")


def parse_histograms(text: str) -> dict[tuple[str, str], float]:
    """{(histogram, "sum" | "count"): value} of the TTFT and queue-time histograms in a
    Prometheus text page (any `prefix:`), summed over their label sets."""
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m:
            key = (m.group(1), m.group(2))
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def server_histograms(base_url: str, headers: dict) -> dict[tuple[str, str], float]:
    """`parse_histograms` of the server's `/metrics` ({} where it has none or it fails)."""
    import httpx
    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=10)
    except httpx.HTTPError:
        return {}
    return parse_histograms(r.text) if r.status_code == 200 else {}


def server_means(before: dict, after: dict) -> dict[str, float | None]:
    """Each histogram's mean in ms over the observations between two readings (None: absent)."""
    out = {}
    for name, key in _HISTOGRAMS.items():
        n = after.get((name, "count"), 0.0) - before.get((name, "count"), 0.0)
        total = after.get((name, "sum"), 0.0) - before.get((name, "sum"), 0.0)
        out[key] = 1e3 * total / n if n > 0 else None
    return out


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def run(args: argparse.Namespace) -> dict:
    from atom.benchmarks.provenance import provenance
    for r in args.request_rate:
        if not r > 0:
            raise ValueError(f"--request-rate={r} is invalid: must be > 0 (or inf)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency={args.max_concurrency} is invalid: must be >= 1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or _model_name(args.base_url, headers)
    url = args.base_url.rstrip("/") + args.endpoint
    reqs = make_requests(args.dataset, args.num_prompts, args.input_len, args.output_len,
                         args.range_ratio, args.vocab_size, args.min_token_id, args.seed, args.text_prompts)
    if args.warmup:
        warm = make_requests("fixed", args.warmup, min(args.input_len, 16), 4, 0, args.vocab_size,
                             args.min_token_id, args.seed + 1, args.text_prompts)
        asyncio.run(run_rate(url, model, warm, math.inf, args.max_concurrency, headers, 0, args.timeout))
    runs = []
    for rate in args.request_rate:
        before = server_histograms(args.base_url, headers)
        res = asyncio.run(run_rate(url, model, reqs, rate, args.max_concurrency, headers,
                                   args.seed, args.timeout))
        res.update(server_means(before, server_histograms(args.base_url, headers)))
        logger.info("rate %s: %d ok, %d failed, %.2f req/s, %.1f out tok/s, TTFT p50 %.1f ms (mean %.1f, "
                    "server's mean %s), TPOT p50 %.2f ms, ITL p50 %.2f ms", res["request_rate"], res["completed"],
                    res["failed"], res["request_throughput"], res["output_throughput"], res["ttft_ms"]["p50"],
                    res["ttft_ms"]["mean"], _ms(res["server_ttft_ms_mean"]), res["tpot_ms"]["p50"],
                    res["itl_ms"]["p50"])
        runs.append(res)
    config = {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf") for k, v in vars(args).items()
              if k != "api_key"}
    config["request_rate"] = ["inf" if math.isinf(r) else r for r in args.request_rate]
    report = {"benchmark": "serving", "server": args.label or args.base_url, "model": model,
              "config": config, "provenance": provenance(), "runs": runs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return report


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = make_parser().parse_args(argv)
    try:
        report = run(args)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    print(json.dumps(report["runs"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
