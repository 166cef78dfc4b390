"""EngineArgs: every CLI flag of the guide, its spellings and defaults, and the Config it builds."""

from __future__ import annotations

import argparse
import sys
import types

import pytest
from config_fixtures import clean_atom_env, tiny_model_dir, write_llama_config  # noqa: F401

from atom.config import CUDAGraphMode, Config, SpeculativeConfig
from atom.model_engine.arg_utils import (
    DEFAULT_CUDAGRAPH_CAPTURE_SIZES,
    EngineArgs,
    parse_capture_sizes,
)


def parse(argv: list[str]) -> EngineArgs:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(argv))


GUIDE_DEFAULTS = {
    "model": "Qwen/Qwen3-0.6B",
    "trust_remote_code": False,
    "tensor_parallel_size": 1,
    "data_parallel_size": 1,
    "enforce_eager": False,
    "enable_prefix_caching": False,
    "enable_log_stats": True,
    "throughput_log_interval": 10.0,
    "port": 8006,
    "kv_cache_dtype": "bf16",
    "index_cache_dtype": None,
    "block_size": 16,
    "max_model_len": None,
    "cudagraph_capture_sizes": "[1,2,3,4,5,6,7,8,16,32,48,64,128,256,512]",
    "level": 3,
    "load_dummy": None,
    "enable_expert_parallel": False,
    "torch_profiler_dir": None,
    "enable_dp_attention": False,
    "method": None,
    "num_speculative_tokens": 1,
    "max_num_batched_tokens": 16384,
    "state_checkpoint_interval_tokens": 8192,
    "state_checkpoint_demand": True,
    "decoder_swa_bounded_replay": True,
    "encoder_swa_bounded_replay": True,
    "max_num_seqs": 512,
    "gpu_memory_utilization": 0.9,
    "scheduler_delay_factor": 0.0,
    "online_quant_config": None,
}
# Flags beyond the guide: vLLM's --dtype and --seed.
EXTRA_DEFAULTS = {"dtype": "auto", "seed": None}


def test_cli_defaults_match_guide():
    args = parse([])
    for name, expected in {**GUIDE_DEFAULTS, **EXTRA_DEFAULTS}.items():
        assert getattr(args, name) == expected, name
    assert args == EngineArgs()  # dataclass defaults and parser defaults agree


def test_dataclass_covers_every_flag():
    from dataclasses import fields

    assert {f.name for f in fields(EngineArgs)} == set(GUIDE_DEFAULTS) | set(EXTRA_DEFAULTS)


@pytest.mark.parametrize(
    "argv,field,value",
    [
        (["--model", "/m"], "model", "/m"),
        (["--trust-remote-code"], "trust_remote_code", True),
        (["--tensor-parallel-size", "4"], "tensor_parallel_size", 4),
        (["-tp", "2"], "tensor_parallel_size", 2),
        (["--data-parallel-size", "3"], "data_parallel_size", 3),
        (["-dp", "2"], "data_parallel_size", 2),
        (["--enforce-eager"], "enforce_eager", True),
        (["--enable_prefix_caching"], "enable_prefix_caching", True),
        (["--enable-prefix-caching"], "enable_prefix_caching", True),
        (["--enable-log-stats"], "enable_log_stats", True),
        (["--no-enable-log-stats"], "enable_log_stats", False),
        (["--throughput-log-interval", "2.5"], "throughput_log_interval", 2.5),
        (["--port", "9000"], "port", 9000),
        (["--kv_cache_dtype", "fp8"], "kv_cache_dtype", "fp8"),
        (["--kv-cache-dtype", "fp8"], "kv_cache_dtype", "fp8"),
        (["--index-cache-dtype", "fp4"], "index_cache_dtype", "fp4"),
        (["--index_cache_dtype", "bf16"], "index_cache_dtype", "bf16"),
        (["--block-size", "64"], "block_size", 64),
        (["--max-model-len", "128"], "max_model_len", 128),
        (["--cudagraph-capture-sizes", "[1,2,4]"], "cudagraph_capture_sizes", "[1,2,4]"),
        (["--level", "0"], "level", 0),
        (["--load_dummy"], "load_dummy", "empty"),
        (["--load_dummy", "zero"], "load_dummy", "zero"),
        (["--load_dummy=xavier"], "load_dummy", "xavier"),
        (["--load_dummy=empty"], "load_dummy", "empty"),
        (["--load-dummy", "zero"], "load_dummy", "zero"),
        (["--enable-expert-parallel"], "enable_expert_parallel", True),
        (["--torch-profiler-dir", "/tmp/p"], "torch_profiler_dir", "/tmp/p"),
        (["--enable-dp-attention"], "enable_dp_attention", True),
        (["--method", "mtp"], "method", "mtp"),
        (["--num-speculative-tokens", "1"], "num_speculative_tokens", 1),
        (["--max-num-batched-tokens", "4096"], "max_num_batched_tokens", 4096),
        (["--state-checkpoint-interval-tokens", "-1"], "state_checkpoint_interval_tokens", -1),
        (["--no-state-checkpoint-demand"], "state_checkpoint_demand", False),
        (["--state-checkpoint-demand"], "state_checkpoint_demand", True),
        (["--no-decoder-swa-bounded-replay"], "decoder_swa_bounded_replay", False),
        (["--enable-decoder-swa-bounded-replay"], "decoder_swa_bounded_replay", True),
        (["--no-encoder-swa-bounded-replay"], "encoder_swa_bounded_replay", False),
        (["--enable-encoder-swa-bounded-replay"], "encoder_swa_bounded_replay", True),
        (["--max-num-seqs", "8"], "max_num_seqs", 8),
        (["--gpu-memory-utilization", "0.5"], "gpu_memory_utilization", 0.5),
        (["--scheduler-delay-factor", "0.2"], "scheduler_delay_factor", 0.2),
        (["--online_quant_config", '{"global_quant_config": "mxfp4"}'], "online_quant_config",
         '{"global_quant_config": "mxfp4"}'),
    ],
)
def test_each_flag_spelling(argv, field, value):
    assert getattr(parse(argv), field) == value


@pytest.mark.parametrize(
    "argv",
    [
        ["--kv_cache_dtype", "fp4"],
        ["--index-cache-dtype", "int8"],
        ["--load_dummy", "ones"],
        ["--method", "eagle"],
        ["--tensor-parallel-size", "two"],
    ],
)
def test_parser_rejects_bad_choices(argv, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert "invalid" in capsys.readouterr().err


def test_from_cli_args_ignores_foreign_attributes():
    ns = argparse.Namespace(model="/x", port=1234, unrelated="ignored")
    args = EngineArgs.from_cli_args(ns)
    assert args.model == "/x" and args.port == 1234
    assert args.level == 3


# ---------------------------------------------------------------------------
# capture sizes
# ---------------------------------------------------------------------------


def test_parse_capture_sizes():
    assert parse_capture_sizes(DEFAULT_CUDAGRAPH_CAPTURE_SIZES) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 48, 64, 128, 256, 512]
    assert parse_capture_sizes("[8, 2, 2]") == [2, 8]
    assert parse_capture_sizes("(4, 1)") == [1, 4]
    assert parse_capture_sizes("16") == [16]


@pytest.mark.parametrize("text", ["[1, 'a']", "[]", "[0, 1]", "[-1]", "[1.5]", "not a list", "{'a': 1}", "[True]"])
def test_parse_capture_sizes_invalid(text):
    with pytest.raises(ValueError, match=r"--cudagraph-capture-sizes=.* is invalid"):
        parse_capture_sizes(text)


# ---------------------------------------------------------------------------
# create_engine_config
# ---------------------------------------------------------------------------


def test_create_engine_config_defaults(tiny_model_dir):
    cfg = EngineArgs(model=tiny_model_dir).create_engine_config()
    assert isinstance(cfg, Config)
    assert cfg.compilation_config.level == 3
    assert cfg.compilation_config.cudagraph_mode is CUDAGraphMode.TR_HYBRID
    assert cfg.capture_sizes == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 48, 64, 128, 256, 512]
    assert cfg.kv_cache_block_size == 16
    assert cfg.speculative_config is None
    assert cfg.online_quant_config is None
    assert cfg.torch_profiler_dir is None
    assert cfg.max_model_len == 256


def test_create_engine_config_maps_every_field(tmp_path):
    path = write_llama_config(tmp_path / "m")
    prof = tmp_path / "prof"
    args = parse([
        "--model", path, "--trust-remote-code", "-tp", "2", "-dp", "2",
        "--enable_prefix_caching", "--no-enable-log-stats", "--throughput-log-interval", "3",
        "--port", "9100", "--kv_cache_dtype", "fp8", "--index-cache-dtype", "fp4",
        "--block-size", "32", "--max-model-len", "100", "--cudagraph-capture-sizes", "[4,1,2]",
        "--level", "1", "--load_dummy", "--enable-expert-parallel",
        "--torch-profiler-dir", str(prof), "--enable-dp-attention",
        "--max-num-batched-tokens", "2048", "--state-checkpoint-interval-tokens", "64",
        "--no-state-checkpoint-demand", "--no-decoder-swa-bounded-replay",
        "--no-encoder-swa-bounded-replay", "--max-num-seqs", "4",
        "--gpu-memory-utilization", "0.5", "--scheduler-delay-factor", "0.25",
        "--online_quant_config", '{"global_quant_config": "ptpc_fp8"}',
    ])
    cfg = args.create_engine_config()
    assert cfg.model == path
    assert cfg.trust_remote_code is True
    assert cfg.tensor_parallel_size == 2
    assert cfg.parallel_config.data_parallel_size == 2
    assert cfg.parallel_config.world_size_across_dp == 4
    assert cfg.enable_prefix_caching is True
    assert cfg.enable_log_stats is False
    assert cfg.throughput_log_interval == 3.0
    assert cfg.port == 9100
    assert cfg.kv_cache_dtype == "fp8"
    assert cfg.index_cache_dtype == "fp4"
    assert cfg.kv_cache_block_size == 32
    assert cfg.max_model_len == 100
    assert cfg.capture_sizes == [1, 2, 4]
    assert cfg.compilation_config.level == 1
    assert cfg.load_dummy == "empty"
    assert cfg.enable_expert_parallel is True
    assert cfg.torch_profiler_dir == str(prof) and prof.is_dir()
    assert cfg.enable_dp_attention is True
    assert cfg.max_num_batched_tokens == 2048
    assert cfg.state_checkpoint_interval_tokens == 64
    assert cfg.state_checkpoint_demand is False
    assert cfg.enable_decoder_swa_bounded_replay is False
    assert cfg.enable_encoder_swa_bounded_replay is False
    assert cfg.max_num_seqs == 4
    assert cfg.gpu_memory_utilization == 0.5
    assert cfg.scheduler_delay_factor == 0.25
    assert cfg.online_quant_config["global_quant_config"] == "ptpc_fp8"


def test_enforce_eager_via_cli(tiny_model_dir):
    cfg = parse(["--model", tiny_model_dir, "--enforce-eager"]).create_engine_config()
    assert cfg.enforce_eager is True and cfg.capture_sizes == []


def test_profiler_dir_falls_back_to_env(tiny_model_dir, tmp_path, clean_atom_env):
    clean_atom_env.setenv("ATOM_TORCH_PROFILER_DIR", str(tmp_path / "envprof"))
    cfg = EngineArgs(model=tiny_model_dir).create_engine_config()
    assert cfg.torch_profiler_dir == str(tmp_path / "envprof")


def test_method_builds_speculative_config(tmp_path):
    import transformers

    transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, max_position_embeddings=512,
    ).save_pretrained(tmp_path / "ds")
    cfg = parse(["--model", str(tmp_path / "ds"), "--method", "mtp"]).create_engine_config()
    assert isinstance(cfg.speculative_config, SpeculativeConfig)
    assert cfg.speculative_config.method == "mtp"
    assert cfg.speculative_config.num_speculative_tokens == 1
    assert cfg.speculative_config.model == str(tmp_path / "ds")
    assert cfg.speculative_config.draft_model_hf_config.model_type == "deepseek_mtp"


def test_num_speculative_tokens_must_be_one(tiny_model_dir):
    args = parse(["--model", tiny_model_dir, "--method", "mtp", "--num-speculative-tokens", "2"])
    with pytest.raises(ValueError, match="num_speculative_tokens=2 is invalid: must be 1"):
        args.create_engine_config()


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--block-size", "24"], "kv_cache_block_size=24 is invalid"),
        (["-tp", "9"], "tensor_parallel_size=9 is invalid"),
        (["--level", "5"], "level=5 is invalid"),
        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization=1.5 is invalid"),
        (["--throughput-log-interval", "0"], "throughput_log_interval=0.0 is invalid"),
        (["--cudagraph-capture-sizes", "[0]"], "--cudagraph-capture-sizes='\\[0\\]' is invalid"),
        (["--online_quant_config", "{oops"], "--online_quant_config='{oops' is invalid"),
        (["--online_quant_config", "[1]"], "must be a JSON object"),
        (["-dp", "0"], "data_parallel_size=0 is invalid"),
        (["--state-checkpoint-interval-tokens", "-3"], "state_checkpoint_interval_tokens=-3 is invalid"),
    ],
)
def test_invalid_values_raise_clear_errors(argv, match):
    with pytest.raises(ValueError, match=match):
        parse(["--model", "/nowhere", *argv]).create_engine_config()


def test_online_quant_empty_object_is_off(tiny_model_dir):
    cfg = parse(["--model", tiny_model_dir, "--online_quant_config", "{}"]).create_engine_config()
    assert cfg.online_quant_config is None


def test_missing_model_error_names_model():
    with pytest.raises(ValueError, match="model='/no/such/model' is invalid"):
        EngineArgs(model="/no/such/model").create_engine_config()


def test_create_engine_hands_config_to_llm_engine(tiny_model_dir, monkeypatch):
    created = {}

    class FakeEngine:
        def __init__(self, config):
            created["config"] = config

    fake = types.ModuleType("atom.model_engine.llm_engine")
    fake.LLMEngine = FakeEngine
    monkeypatch.setitem(sys.modules, "atom.model_engine.llm_engine", fake)
    engine = EngineArgs(model=tiny_model_dir, level=0).create_engine()
    assert isinstance(engine, FakeEngine)
    assert isinstance(created["config"], Config)
    assert created["config"].model == tiny_model_dir
    assert created["config"].compilation_config.level == 0
