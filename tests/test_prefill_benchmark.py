"""`atom.benchmarks.prefill` on the CPU (a tiny model shape): one request at a time, the
floor from the roofline, vLLM's figure from the peer child (here a stand-in package)."""
import argparse
import json

import pytest

from atom.benchmarks import peer_vllm, prefill, roofline, workloads
from atom.benchmarks.peer_vllm import run_in_child
from test_peer_vllm import fake_vllm  # noqa: F401 - the stand-in vllm package fixture
from test_quant_benchmarks import TINY


def test_prefill_floor_is_compute_or_weights():
    cfg = workloads.MODEL_CONFIGS["qwen3-0.6b"]
    short, long = roofline.prefill_floor_ms(cfg, 1), roofline.prefill_floor_ms(cfg, 8192)
    c = roofline.model_cost(cfg)
    head = cfg["vocab_size"] * cfg["hidden_size"]
    assert cfg["tie_word_embeddings"]  # the table is read once, by the LM head
    assert short == pytest.approx(c.step_weight_bytes(1) / roofline.H200_BANDWIDTH * 1e3)  # one token: the bytes
    linear = 2 * ((c.token_matmul_params() - head) * 8192 + head)  # the LM head on the one sampled row only
    attention = 2 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * cfg["head_dim"] * 8192 ** 2
    assert long == pytest.approx((linear + attention) / roofline.H200_BF16_FLOPS * 1e3)  # many tokens: the FLOPs
    assert roofline.prefill_floor_ms(cfg, 512) < long
    untied = dict(cfg, tie_word_embeddings=False)  # the untied embedding table: a lookup, not read whole
    assert roofline.prefill_floor_ms(untied, 1) == pytest.approx(short)


def test_prefill_run_reports_each_length_beside_the_peer(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(workloads.MODEL_CONFIGS, "tiny", dict(TINY))
    seen = {}

    def peer(kind, path, vocab, args, extra):
        seen.update(kind=kind, extra=extra, limits=(args.max_model_len, args.max_num_batched_tokens))
        return {"ms": {"8": 2.0, "40": 4.0}, "vllm_version": "0.26.0"}, "vLLM"
    monkeypatch.setattr(peer_vllm, "peer_result", peer)
    out = tmp_path / "p.json"
    prefill.main(["--model", "tiny", "--prompt-lens", "8", "40", "--repeat", "3", "--peer", "vllm",
                  "--cache-dir", "", "--out", str(out)])
    res = json.load(open(out))
    assert seen == {"kind": "prefill", "extra": ["--prompt-lens", "8", "40"], "limits": (2048, 8192)}
    assert [r["prompt_len"] for r in res["results"]] == [8, 40] and res["peer"] == "vLLM 0.26.0"
    for r in res["results"]:
        assert r["steps"] == 3 and r["graph_steps"] == 0  # one prefill step a request; no graphs on the CPU
        assert r["ms"] >= r["step_ms"] > 0 and r["launch_ms"] <= r["step_ms"]
        assert r["floor_ms"] == pytest.approx(roofline.prefill_floor_ms(TINY, r["prompt_len"]))
        assert r["peer_ms"] == {8: 2.0, 40: 4.0}[r["prompt_len"]]
    assert "commit" in res
    table = capsys.readouterr().out
    assert "prefill of one request" in table and "vLLM" in table and "ATOM" in table


def test_prefill_rejects_bad_lengths():
    with pytest.raises(ValueError, match="--prompt-lens"):
        prefill.main(["--prompt-lens", "0"])


def test_prefill_peer_times_each_length(fake_vllm):  # noqa: F811
    args = argparse.Namespace(repeat=2, max_model_len=2048)
    res = run_in_child("prefill", workloads.write_model_config("qwen3-0.6b"), 151936, args,
                       ["--prompt-lens", "8", "32"])
    assert set(res["ms"]) == {"8", "32"} and all(v > 0 for v in res["ms"].values())
    reqs = workloads.prefill_requests(32, 3, 1000)
    assert [len(r.prompt_token_ids) for r in reqs] == [32] * 3 and {r.max_tokens for r in reqs} == {1}
    assert len({tuple(r.prompt_token_ids[:4]) for r in reqs}) == 3  # no shared prefix
