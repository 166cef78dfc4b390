"""`/metrics`: Prometheus text, vLLM's metric names under an `atom:` prefix.

One `ServerMetrics` per server, on its own `CollectorRegistry` (no module globals: two
servers in a process never mix their counts). Two sources:

- the engine's state, read at scrape time from the `AsyncLLMEngine.snapshot` the engine
  publishes after every step (gauges: running / waiting requests, KV usage, free and
  total KV blocks; cumulative counters: prefix-cache queried and hit tokens, preemptions) —
  cumulative since start, never windowed (the status line's hit rate is the windowed one);
- each step's outputs, through `observe_step` (the engine's `on_step` hook, called off the
  event loop: in the engine thread, or in the reader thread of the engine process): prompt
  tokens (once per request, at its first output), generation tokens, finished requests by
  reason (aborts too: their final outputs come to the same hook), and the TTFT / inter-token / end-to-end / queue-time
  histograms (the engine's own timestamps; inter-token: between a completion's outputs,
  divided over the tokens they carried).
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "atom:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class _SnapshotCollector:
    """Gauges and counters read from the engine's latest snapshot at scrape time."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.labels = {"model_name": model_name}

    def collect(self):
        s = self.engine.snapshot
        names = list(self.labels)
        vals = list(self.labels.values())

        def gauge(name, doc, value):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            g.add_metric(vals, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(PREFIX + name, doc, labels=names)
            c.add_metric(vals, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", s.kv_usage)
        yield gauge("kv_cache_free_blocks", "KV-cache blocks free.", s.num_free_blocks)
        yield gauge("kv_cache_total_blocks", "KV-cache blocks in all.", s.num_blocks)
        yield gauge("num_requests_in_flight", "Requests the server holds (added, not finished).",
                    self.engine.num_in_flight)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_query_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      s.prefix_hit_tokens)
        yield counter("num_preemptions", "Sequences preempted (KV blocks taken back).",
                      s.num_preemptions)
        yield counter("engine_steps", "Engine steps run.", s.num_steps)


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name
        r = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests that "
                                     "produced output.", labels, registry=r).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.",
                                         labels, registry=r).labels(model_name)
        success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                          labels + ["finished_reason"], registry=r)
        self.finished = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._success = success
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token.",
                              labels, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Between two output tokens.",
                             labels, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to finish.",
                             labels, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                    "Arrival to first scheduled.", labels, buckets=E2E_BUCKETS,
                                    registry=r).labels(model_name)
        r.register(_SnapshotCollector(engine, model_name))
        self._seen: set[str] = set()              # requests that had their first output
        self._last: dict[tuple[str, int], float] = {}   # (request, completion) -> last output time
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ServerMetrics(model_name={self.model_name!r}, in_flight={len(self._seen)})"

    def observe_step(self, outputs, now: float) -> None:
        """One step's outputs (off the event loop)."""
        with self._lock:
            for out in outputs:
                rid = out.request_id
                m = out.metrics
                if rid not in self._seen and any(c.new_token_ids for c in out.outputs):
                    self._seen.add(rid)
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                    if m is not None and m.ttft is not None:
                        self.ttft.observe(m.ttft)
                for c in out.outputs:
                    new = len(c.new_token_ids)
                    if not new:
                        continue
                    self.generation_tokens.inc(new)
                    key = (rid, c.index)
                    last = self._last.get(key)
                    if last is not None:
                        dt = (now - last) / new
                        for _ in range(new):
                            self.itl.observe(dt)
                    self._last[key] = now
                if out.finished:
                    self._finish(out)

    def _finish(self, out) -> None:
        rid = out.request_id
        self._seen.discard(rid)
        for c in out.outputs:
            self._last.pop((rid, c.index), None)
        reason = out.outputs[0].finish_reason or "abort"
        (self.finished.get(reason) or self._success.labels(self.model_name, reason)).inc()
        m = out.metrics
        if m is None:
            return
        if m.e2e is not None:
            self.e2e.observe(m.e2e)
        if m.time_in_queue is not None:
            self.queue_time.observe(m.time_in_queue)

    def render(self) -> bytes:
        return generate_latest(self.registry)
