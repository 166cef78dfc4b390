"""Our OpenAI server and `vllm serve` on the same model folder, driven by the same client
(`atom.benchmarks.serving`) at the same rates, one server after the other, in one command.

    python -m atom.benchmarks.serving_compare --model qwen3-0.6b --servers atom vllm \\
        --request-rate 4 16 64 inf --num-prompts 200 --input-len 512 --output-len 128 --out s.json

Each server is started as a child process on its own loopback port with dummy weights
(ATOM `--load_dummy xavier`, vLLM `--load-format dummy`), the same `max_model_len`, without
a tokenizer (the prompts are token ids; vLLM gets `--skip-tokenizer-init`, both then stream
empty text, one chunk per token), prefix caching off (the runs repeat the same prompts),
waited for on `/health`, benchmarked, then stopped (SIGTERM, then kill). The table prints
per rate each server's TTFT / TPOT / ITL p50 and output throughput, and ATOM's ratio to the
other; the JSON holds both servers' full reports and the commands that started them.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time

logger = logging.getLogger(__name__)


# the module each server's command runs: importing it first finds a missing dependency (vLLM's
# server imports `watchfiles`, which its offline engine does not) before any server is started
SERVER_MODULES = {"atom": "atom.entrypoints.openai_server", "vllm": "vllm.entrypoints.openai.api_server"}


def server_command(kind: str, model_dir: str, port: int, max_model_len: int, extra: list[str]) -> list[str]:
    """The command line that starts `kind` ("atom" or "vllm") on `port`."""
    if kind == "atom":
        return [sys.executable, "-m", SERVER_MODULES["atom"], "--model", model_dir,
                "--load_dummy", "xavier", "--server-port", str(port), "--max-model-len", str(max_model_len),
                "--no-enable-log-stats", "--served-model-name", "model", *extra]
    if kind == "vllm":
        return [sys.executable, "-m", SERVER_MODULES["vllm"], "--model", model_dir,
                "--load-format", "dummy", "--port", str(port), "--host", "127.0.0.1",
                "--max-model-len", str(max_model_len), "--skip-tokenizer-init", "--no-enable-prefix-caching",
                "--served-model-name", "model", *extra]
    raise ValueError(f"server {kind!r} is unknown: choose {' or '.join(SERVER_MODULES)}")


def preflight(kinds: list[str], timeout: float = 300.0) -> None:
    """Imports each server's entry module in a child process of this Python; SystemExit naming
    the server and the import's last error lines where one fails, so that a comparison does
    not spend minutes on the first server to find the second cannot start."""
    for kind in kinds:
        proc = subprocess.run([sys.executable, "-c", f"import {SERVER_MODULES[kind]}"],
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
            raise SystemExit(f"--servers {kind}: `import {SERVER_MODULES[kind]}` failed here, so the "
                             f"server cannot start (install what it names, or leave {kind} out):\n{tail}")


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    """Polls `url`/health until it answers 200; RuntimeError if the process exits first or
    `timeout` seconds pass."""
    import httpx
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server was not healthy after {timeout:.0f} s")


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the server's process group (vLLM's engine processes too), then SIGKILL to
    what is left after `grace` seconds, so that the next server finds the GPU free."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        try:  # the parent is gone; its children may not be
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(1.0)


def bench_args(args, base_url: str, label: str) -> argparse.Namespace:
    from atom.benchmarks.serving import make_parser
    argv = ["--base-url", base_url, "--model", "model", "--dataset", args.dataset,
            "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--range-ratio", str(args.range_ratio),
            "--vocab-size", str(args.vocab_size), "--warmup", str(args.warmup), "--seed", str(args.seed),
            "--label", label, "--request-rate", *[str(r) for r in args.request_rate]]
    if args.max_concurrency:
        argv += ["--max-concurrency", str(args.max_concurrency)]
    return make_parser().parse_args(argv)


def run_server(kind: str, args, model_dir: str, port: int) -> dict:
    from atom.benchmarks.serving import run
    extra = (args.atom_args if kind == "atom" else args.vllm_args).split()
    cmd = server_command(kind, model_dir, port, args.max_model_len, extra)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    log = open(os.path.join(args.log_dir, f"server-{kind}.log"), "w") if args.log_dir else subprocess.DEVNULL
    logger.info("starting %s: %s", kind, " ".join(cmd))
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, args.startup_timeout)
        startup = time.monotonic() - t0
        logger.info("%s healthy after %.0f s", kind, startup)
        report = run(bench_args(args, base, kind))
        report.update(command=cmd, startup_s=startup)
        return report
    except RuntimeError as e:
        logger.error("%s: %s", kind, e)
        return {"server": kind, "command": cmd, "error": str(e), "runs": []}
    finally:
        stop(proc)
        if log is not subprocess.DEVNULL:
            log.close()


def table(reports: dict[str, dict]) -> str:
    """One line per (rate, server): TTFT / TPOT / ITL p50 (ms), the client's TTFT mean beside
    the server's own (its `/metrics` histogram: "-" where it has none), output tok/s, failures,
    and ATOM's ratio to each other server (their time over ours: > 1 means ATOM is faster)."""
    lines = [f"{'rate':>6} {'server':>6} {'TTFT p50':>9} {'TPOT p50':>9} {'ITL p50':>8} {'TTFT mean':>10} "
             f"{'srv mean':>9} {'out tok/s':>10} {'failed':>6}"]
    by_rate: dict[str, dict[str, dict]] = {}
    for kind, rep in reports.items():
        for r in rep.get("runs", []):
            by_rate.setdefault(str(r["request_rate"]), {})[kind] = r
    for rate, runs in by_rate.items():
        for kind, r in runs.items():
            srv = r.get("server_ttft_ms_mean")
            lines.append(f"{rate:>6} {kind:>6} {r['ttft_ms']['p50']:9.1f} {r['tpot_ms']['p50']:9.2f} "
                         f"{r['itl_ms']['p50']:8.2f} {r['ttft_ms']['mean']:10.1f} "
                         f"{'-' if srv is None else f'{srv:.1f}':>9} {r['output_throughput']:10.0f} {r['failed']:6d}")
        if "atom" in runs:
            a = runs["atom"]
            for kind, r in runs.items():
                vals = (r["ttft_ms"]["p50"], a["ttft_ms"]["p50"], r["tpot_ms"]["p50"], a["tpot_ms"]["p50"],
                        a["output_throughput"], r["output_throughput"])
                if kind != "atom" and all(v > 0 for v in vals):  # (NaN compares False: skipped too)
                    lines.append(f"{'':>6} {'ratio':>6} TTFT {r['ttft_ms']['p50'] / a['ttft_ms']['p50']:.2f}x, "
                                 f"TPOT {r['tpot_ms']['p50'] / a['tpot_ms']['p50']:.2f}x, throughput "
                                 f"{a['output_throughput'] / r['output_throughput']:.2f}x (ATOM vs {kind})")
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    from atom.benchmarks.workloads import MODEL_CONFIGS
    p = argparse.ArgumentParser(prog="python -m atom.benchmarks.serving_compare", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODEL_CONFIGS))
    p.add_argument("--model-dir", default=None, help="a local model folder instead of --model's config")
    p.add_argument("--servers", nargs="+", default=["atom", "vllm"], choices=["atom", "vllm"])
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--dataset", default="random", choices=["random", "fixed"])
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--vocab-size", type=int, default=10000)
    p.add_argument("--request-rate", type=float, nargs="+", default=[4.0, 16.0, math.inf])
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8123, help="first port; each server gets the next one")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--atom-args", default="", help="extra flags for ATOM's server (one string)")
    p.add_argument("--vllm-args", default="", help="extra flags for vllm serve (one string)")
    p.add_argument("--log-dir", default=None, help="write each server's output here")
    p.add_argument("--out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    args = make_parser().parse_args(argv)
    preflight(args.servers)
    from atom.benchmarks.provenance import provenance
    from atom.benchmarks.workloads import write_model_config
    model_dir = args.model_dir or write_model_config(args.model)
    reports = {kind: run_server(kind, args, model_dir, args.port + i) for i, kind in enumerate(args.servers)}
    result = {"benchmark": "serving_compare", "model": args.model, "provenance": provenance(), "servers": reports}
    if args.out:  # before the table: a report that cannot be tabled is still kept
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    text = table(reports)
    logger.info("\n%s", text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(result, table=text), f, indent=2)
    return 0 if all(r.get("runs") for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
