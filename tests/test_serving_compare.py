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


def test_bench_args_carry_the_rates_and_lengths():
    args = sc.make_parser().parse_args(["--request-rate", "2", "inf", "--input-len", "64", "--output-len", "8",
                                        "--max-concurrency", "32"])
    b = sc.bench_args(args, "http://127.0.0.1:1", "atom")
    assert b.request_rate == [2.0, math.inf] and (b.input_len, b.output_len, b.max_concurrency) == (64, 8, 32)
    assert b.model == "model" and b.label == "atom"
