"""Recipes: schema validation, the CLI (list / show / run), exit codes and written files."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from atom.recipes import RecipeError, find_recipe, list_recipes, parse_recipe, recipes_dir
from atom.recipes.__main__ import main
from atom.recipes.schema import Expectation

SHIPPED = ["llama-3.1-8b-latency-h200", "prefix-cache-shared-system-prompt", "quantization-accuracy",
           "qwen3-0.6b-throughput-h200", "smollm2-cpu-quickstart"]

BASE = {
    "name": "demo",
    "description": "a demo",
    "hardware": {"device": "cpu"},
    "model": {"embedded": True},
    "workload": {"kind": "random", "num_prompts": 2, "input_len": [8, 16], "output_len": 4},
    "metrics": ["throughput_tok_s", "output_tokens"],
    "expected": {"output_tokens": {"value": 8}},
}


def with_(path: str, value, base=BASE) -> dict:
    """BASE with one field (dotted path) set; value None deletes it."""
    d = copy.deepcopy(base)
    *parents, last = path.split(".")
    node = d
    for p in parents:
        node = node.setdefault(p, {})
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value
    return d


# --- schema ---------------------------------------------------------------------------
def test_base_recipe_parses():
    r = parse_recipe(BASE)
    assert r.name == "demo" and r.status == "ready" and r.hardware.device == "cpu"
    assert r.workload.input_len == (8, 16) and r.workload.output_len == (4, 4)
    assert r.expected["output_tokens"] == Expectation(value=8.0)


@pytest.mark.parametrize("path,value,message", [
    ("workload", None, "field 'workload' is missing"),
    ("colour", "red", "recipe.colour is not a known field"),
    ("hardware.device", "tpu", "hardware.device='tpu' is invalid: must be one of cpu, cuda, nvidia-h200"),
    ("hardware.min_gpus", -1, "hardware.min_gpus=-1 is invalid: must be an integer >= 0"),
    ("model.path", "/somewhere", "give exactly one of path:, embedded: true, architecture:"),
    ("model", {"architecture": "gpt-5"}, "model.architecture='gpt-5' is invalid: must be one of"),
    ("engine", {"max_num_seqz": 4}, "engine.max_num_seqz is not an atom.Config field"),
    ("workload.kind", "poetry", "workload.kind='poetry' is invalid: must be one of chat, random"),
    ("workload.input_len", [16, 8], "workload.input_len=[16, 8] is invalid: must be an integer >= 1 or a range"),
    ("workload.sampling", {"temperature": -1}, "workload.sampling: temperature=-1 is invalid"),
    ("workload.repeat", 0, "workload.repeat=0 is invalid: must be an integer >= 1"),
    ("metrics", ["throughput_tok_s", "speed"], "metrics[1]='speed' is invalid: must be one of"),
    ("metrics", [], "metrics=[] is invalid: must be a non-empty list"),
    ("expected.ttft_ms", {"max": 5}, "expected.ttft_ms={'max': 5} is invalid: names no metric of this recipe"),
    ("expected.output_tokens", {"min": 9, "max": 3}, "expected.output_tokens"),
    ("expected.output_tokens", {"rel_tol": 0.1}, "rel_tol / abs_tol need a value"),
    ("expected.output_tokens", {"value": "many"}, "expected.output_tokens.value='many' is invalid: must be a number"),
    ("expected.output_tokens", {"around": 3}, "expected.output_tokens.around is not a known field"),
    ("status", "someday", "status='someday' is invalid: must be one of ready, pending"),
    ("status", "pending", "pending_reason='' is invalid"),
])
def test_schema_errors_name_the_field(path, value, message):
    with pytest.raises(RecipeError, match=None) as e:
        parse_recipe(with_(path, value), "demo.yaml")
    assert message in str(e.value)
    assert str(e.value).startswith("demo.yaml: ")


def test_schema_cross_field_checks():
    chat = with_("workload", {"kind": "chat", "prompts": ["hi"]})
    with pytest.raises(RecipeError, match="accuracy.*needs chat prompts with expect_contains"):
        parse_recipe(with_("metrics", ["accuracy"], chat | {"expected": {}}))
    with pytest.raises(RecipeError, match="needs engine.enable_prefix_caching: true"):
        parse_recipe(with_("metrics", ["time_saved_vs_no_prefix_cache"], BASE | {"expected": {}}))
    with pytest.raises(RecipeError, match="roofline metrics need model.architecture"):
        parse_recipe(with_("metrics", ["roofline_fraction"], BASE | {"expected": {}}))
    with pytest.raises(RecipeError, match="kind chat needs a non-empty list of prompts"):
        parse_recipe(with_("workload", {"kind": "chat"}))
    with pytest.raises(RecipeError, match=r"workload.prompts\[0\].content=None"):
        parse_recipe(with_("workload", {"kind": "chat", "prompts": [{"expect_contains": "x"}]}))


def test_load_errors(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(RecipeError, match="broken.yaml: not valid YAML"):
        find_recipe(str(bad))
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(BASE))
    with pytest.raises(RecipeError, match=r"name='demo' is invalid: must match the file name \('other'\)"):
        find_recipe(str(other))
    with pytest.raises(RecipeError, match="no recipe named 'nope'.*smollm2-cpu-quickstart"):
        find_recipe("nope")


def test_expectation_check():
    assert Expectation(min=2).check(2.0) == (True, "ok")
    assert Expectation(min=2).check(1.0)[1] == "1 < min 2"
    assert Expectation(max=4.3).check(5.0)[1] == "5 > max 4.3"
    assert Expectation(value=100, rel_tol=0.1).check(109)[0]
    assert not Expectation(value=100, rel_tol=0.1).check(111)[0]
    assert Expectation(value=1.0).check(1.0)[0]
    assert Expectation(value=0, abs_tol=0.5).check(-0.4)[0]
    assert Expectation(min=0).check(float("nan")) == (False, "not measured")


def test_shipped_recipes_validate():
    recipes = {r.name: r for r in list_recipes()}
    assert sorted(recipes) == SHIPPED
    assert recipes["quantization-accuracy"].status == "pending"
    assert recipes["qwen3-0.6b-throughput-h200"].expected["throughput_tok_s"].min == 25000
    assert recipes["llama-3.1-8b-latency-h200"].expected["decode_ms_per_token"].max == 4.3
    assert recipes["qwen3-0.6b-throughput-h200"].hardware.device == "nvidia-h200"
    assert {r.hardware.device for r in recipes.values() if r.name in
            ("smollm2-cpu-quickstart", "prefix-cache-shared-system-prompt")} == {"cpu"}
    assert os.path.exists(os.path.join(recipes_dir(), "README.md"))


# --- CLI ------------------------------------------------------------------------------
def test_cli_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in SHIPPED:
        assert name in out
    assert "pending quantization-accuracy: no quantized linear kernels yet" in out


def test_cli_show(capsys):
    assert main(["show", "llama-3.1-8b-latency-h200"]) == 0
    out = capsys.readouterr().out
    assert "decode_ms_per_token" in out and "<= 4.3" in out and "nvidia-h200" in out
    assert "kind: random" in out  # the file itself


def test_cli_run_pending(capsys, tmp_path):
    assert main(["run", "quantization-accuracy", "--out", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert "pending" in err and "no quantized linear kernels yet" in err
    assert not os.listdir(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cli_run_cuda_recipe_on_cpu_is_refused():
    proc = subprocess.run([sys.executable, "-m", "atom.recipes", "run", "qwen3-0.6b-throughput-h200"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "hardware mismatch" in proc.stderr
    assert "needs nvidia-h200 with 1 GPU; this machine has no GPU" in proc.stderr.replace("\n", " ")
    assert "Traceback" not in proc.stderr + proc.stdout


def test_cli_unknown_recipe(capsys):
    assert main(["run", "nope"]) == 2
    assert "no recipe named 'nope'" in capsys.readouterr().err


# --- running (tiny model: fast) ---------------------------------------------------------
def tiny_recipe(tmp_path, model_path: str, expected: dict, name: str = "tiny") -> str:
    d = {
        "name": name, "description": "tiny random llama",
        "hardware": {"device": "cpu"}, "model": {"path": model_path},
        "engine": {"max_model_len": 128, "max_num_batched_tokens": 32, "enable_prefix_caching": True},
        "workload": {"kind": "shared-prefix", "num_prompts": 4, "system_prompt_len": 40,
                     "question_len": [3, 6], "sampling": {"temperature": 0, "max_tokens": 4, "ignore_eos": True}},
        "metrics": ["output_tokens", "throughput_tok_s", "prefix_hit_rate", "time_saved_vs_no_prefix_cache",
                    "ttft_ms", "tpot_ms", "decode_ms_per_token"],
        "expected": expected,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d))
    return str(path)


def test_run_tiny_recipe_passes_and_writes_files(tmp_path, tiny_llama, capsys):
    recipe = tiny_recipe(tmp_path, tiny_llama, {"output_tokens": {"value": 16}, "prefix_hit_rate": {"min": 0.7}})
    out = tmp_path / "out"
    assert main(["run", recipe, "--out", str(out)]) == 0
    assert "tiny" in capsys.readouterr().out
    files = set(os.listdir(out))
    assert {"results.json", "results.md", "steps.jsonl", "requests.jsonl", "meta.json", "chunk_latency.png",
            "kv_usage.png", "prefix_cache_hit_rate.png"} <= files
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "pass" and res["metrics"]["output_tokens"] == 16
    # 40 shared tokens = 2 full blocks; the first request looks them up and misses, 3 others hit
    assert res["metrics"]["prefix_hit_rate"] == pytest.approx(0.75)
    assert len(res["runs_prefix_off_s"]) == 1
    assert "| output_tokens | 16 |" in (out / "results.md").read_text()


def test_run_impossible_expectation_fails(tmp_path, tiny_llama, capsys):
    recipe = tiny_recipe(tmp_path, tiny_llama, {"throughput_tok_s": {"min": 1e12}}, name="impossible")
    out = tmp_path / "out"
    assert main(["run", recipe, "--out", str(out)]) == 1
    text = capsys.readouterr().out
    assert "FAIL throughput_tok_s" in text and "< min 1e+12" in text
    assert json.loads((out / "results.json").read_text())["status"] == "fail"


def test_run_engine_error_is_a_clear_message(tmp_path, tiny_llama, capsys):
    recipe = tiny_recipe(tmp_path, tiny_llama, {}, name="badengine")
    d = yaml.safe_load(open(recipe))
    d["engine"]["max_num_seqs"] = 0
    open(recipe, "w").write(yaml.safe_dump(d))
    assert main(["run", recipe, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "engine:" in err and "max_num_seqs=0 is invalid" in err


# --- running the shipped CPU recipes --------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name,extra", [
    ("smollm2-cpu-quickstart", set()),
    ("prefix-cache-shared-system-prompt", {"prefix_cache_hit_rate.png"}),
])
def test_run_cpu_recipe(name, extra, tmp_path, capsys):
    out = tmp_path / name
    code = main(["run", name, "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert {"results.json", "results.md", "steps.jsonl", "requests.jsonl", "chunk_latency.png",
            "kv_usage.png"} | extra <= set(os.listdir(out))
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "pass"
    assert set(res["metrics"]) == set(find_recipe(name).metrics)
    assert res["hardware"]["found"]["device"] in ("cpu", "cuda")
