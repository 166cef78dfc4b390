"""A real `atom.entrypoints.openai_server` process on a free loopback port, for tests.

    with ServerProcess(model_path, "--max-model-len", "256") as srv:
        httpx.get(srv.url + "/health")

Start-up waits for `/health` (bounded); a server that dies while starting fails with its
log. `stop()` sends SIGTERM and waits (then SIGKILL, so nothing is left behind). Traffic goes
to 127.0.0.1 only. `metrics()` parses `/metrics` with prometheus_client's own parser.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, *args: str, api_key: str | None = None, start_timeout: float = 180.0):
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_file = tempfile.NamedTemporaryFile("w+", prefix="atom-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "atom.entrypoints.openai_server", "--model", model,
               "--server-port", str(self.port), "--enforce-eager", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("ATOM_API_KEY", None)
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env=env,
                                     cwd=str(ROOT))
        self._wait_ready(start_timeout)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.kill()
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self.log_file.flush()
        return Path(self.log_file.name).read_text(errors="replace")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self, timeout: float = 60.0) -> int | None:
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def metrics(self) -> dict[str, float]:
        """`{"atom:name{label=value,...}": value}` from /metrics, parsed by prometheus_client."""
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Poll /metrics until no request is held and every KV block is free (bounded)."""
        deadline = time.monotonic() + timeout
        m = self.metrics()
        while time.monotonic() < deadline:
            if (m["atom:num_requests_in_flight"] == 0 and m["atom:num_requests_running"] == 0
                    and m["atom:num_requests_waiting"] == 0
                    and m["atom:kv_cache_free_blocks"] == m["atom:kv_cache_total_blocks"]):
                return m
            time.sleep(0.2)
            m = self.metrics()
        return m

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


async def sse_chunks(client: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None,
                     stop_after: int | None = None) -> tuple[int, list[dict], bool]:
    """POST a streaming request; (status, parsed data chunks, saw [DONE]). `stop_after`: close
    the connection after that many chunks (a client that goes away)."""
    import json
    chunks: list[dict] = []
    async with client.stream("POST", url, json=body, headers=headers or {}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, [r.json()], False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return 200, chunks, True
            chunks.append(json.loads(data))
            if stop_after is not None and len(chunks) >= stop_after:
                return 200, chunks, False
    return 200, chunks, False
