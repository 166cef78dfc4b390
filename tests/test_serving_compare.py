"""The serving comparison's commands and table (the servers themselves run on the H200)."""
import math

import pytest

from atom.benchmarks import serving_compare as sc


def test_server_commands_give_both_servers_the_same_model_and_limits():
    a = sc.server_command("atom", "/m", 9001, 4096, ["--level", "0"])
    v = sc.server_command("vllm", "/m", 9002, 4096, [])
    assert a[1:3] == ["-m", "atom.entrypoints.openai_server"] and a[-2:] == ["--level", "0"]
    assert v[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for cmd, port in ((a, "9001"), (v, "9002")):
        assert cmd[cmd.index("--model") + 1] == "/m" and cmd[cmd.index("--max-model-len") + 1] == "4096"
        assert port in cmd and cmd[cmd.index("--served-model-name") + 1] == "model"
    assert a[a.index("--load_dummy") + 1] == "xavier" and v[v.index("--load-format") + 1] == "dummy"
    assert "--skip-tokenizer-init" in v and "--no-enable-prefix-caching" in v
    with pytest.raises(ValueError, match="'sglang' is unknown"):
        sc.server_command("sglang", "/m", 1, 1, [])


def _run(rate, ttft, tpot, tput):
    p = lambda v: {"mean": v, "p50": v, "p99": v}  # noqa: E731
    return {"request_rate": rate, "ttft_ms": p(ttft), "tpot_ms": p(tpot), "itl_ms": p(tpot),
            "output_throughput": tput, "failed": 0}


def test_table_prints_each_rate_and_atoms_ratio():
    reports = {"atom": {"runs": [_run(4.0, 10.0, 2.0, 500.0), _run("inf", 100.0, 4.0, 9000.0)]},
               "vllm": {"runs": [_run(4.0, 20.0, 3.0, 490.0), _run("inf", 150.0, 5.0, 8000.0)]}}
    text = sc.table(reports)
    assert "TTFT 2.00x, TPOT 1.50x, throughput 1.02x (ATOM vs vllm)" in text
    assert "TTFT 1.50x, TPOT 1.25x, throughput 1.12x (ATOM vs vllm)" in text
    assert sc.table({"atom": {"runs": []}, "vllm": {"error": "x", "runs": []}}).count("\n") == 0
    split = {"atom": {"runs": [dict(_run(4.0, 10.0, 2.0, 500.0), server_ttft_ms_mean=6.25)]}}
    assert sc.table(split).splitlines()[1].split()[5:7] == ["10.0", "6.2"]  # client mean, server's
    assert sc.table(reports).splitlines()[1].split()[6] == "-"  # a server without the histogram
    idle = {"atom": {"runs": [_run(4.0, 10.0, 2.0, 500.0)]}, "vllm": {"runs": [_run(4.0, 20.0, 3.0, 0.0)]}}
    assert "ratio" not in sc.table(idle)  # a server that completed nothing: no ratio, no crash


def test_stop_ends_the_whole_process_group(tmp_path):
    import os
    import subprocess
    import sys
    import time
    # a parent that ignores SIGTERM and a child that would outlive it (its pid in a file)
    pidfile = tmp_path / "child.pid"
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pidfile)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    t0 = time.monotonic()
    while not pidfile.exists() and time.monotonic() - t0 < 30:
        time.sleep(0.1)
    child = int(pidfile.read_text())
    sc.stop(proc, grace=1.0)
    assert proc.poll() is not None
    time.sleep(0.5)
    try:  # gone, or a zombie waiting for init to reap it
        state = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z", "X"), state


def test_bench_args_carry_the_rates_and_lengths():
    args = sc.make_parser().parse_args(["--request-rate", "2", "inf", "--input-len", "64", "--output-len", "8",
                                        "--max-concurrency", "32"])
    b = sc.bench_args(args, "http://127.0.0.1:1", "atom")
    assert b.request_rate == [2.0, math.inf] and (b.input_len, b.output_len, b.max_concurrency) == (64, 8, 32)
    assert b.model == "model" and b.label == "atom"


def test_server_histograms_split_a_run_by_the_difference_of_two_readings():
    from atom.benchmarks.serving import parse_histograms, server_means
    page = (
        '# HELP atom:time_to_first_token_seconds Arrival to first token.\n'
        'atom:time_to_first_token_seconds_bucket{le="0.1",model_name="model"} 3.0\n'
        'atom:time_to_first_token_seconds_sum{model_name="model"} {ttft}\n'
        'atom:time_to_first_token_seconds_count{model_name="model"} {n}\n'
        'vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.02\n'
        'vllm:request_queue_time_seconds_sum{engine="1",model_name="m"} 0.01\n'
        'vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 2\n'
        'vllm:request_queue_time_seconds_count{engine="1",model_name="m"} 1\n')
    before = parse_histograms(page.replace("{ttft}", "0.5").replace("{n}", "10"))
    after = parse_histograms(page.replace("{ttft}", "0.9").replace("{n}", "18"))
    assert before[("request_queue_time_seconds", "count")] == 3.0  # summed over label sets
    means = server_means(before, after)
    assert means["server_ttft_ms_mean"] == pytest.approx(50.0)  # 0.4 s over 8 requests
    assert means["server_queue_ms_mean"] is None  # no new observation between the readings
    assert server_means({}, {}) == {"server_ttft_ms_mean": None, "server_queue_ms_mean": None}


def test_preflight_names_the_server_whose_module_does_not_import(monkeypatch):
    """A server whose entry module fails to import stops the comparison before any server
    starts, with the import's error; one that imports passes."""
    monkeypatch.setitem(sc.SERVER_MODULES, "vllm", "a_module_that_is_not_installed_here")
    with pytest.raises(SystemExit, match=r"(?s)--servers vllm: .*a_module_that_is_not_installed_here.*No module named"):
        sc.preflight(["vllm"])
    monkeypatch.setitem(sc.SERVER_MODULES, "vllm", "json")
    sc.preflight(["vllm"])
    monkeypatch.setattr(sc, "run_server", lambda *a, **k: pytest.fail("a server was started"))
    monkeypatch.setitem(sc.SERVER_MODULES, "atom", "a_module_that_is_not_installed_here")
    with pytest.raises(SystemExit, match="--servers atom"):
        sc.main(["--servers", "atom"])
