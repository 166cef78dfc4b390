"""Config, CompilationConfig, CUDAGraphMode, ParallelConfig, SpeculativeConfig, KV cache."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
import transformers
from config_fixtures import (  # noqa: F401  (fixtures)
    clean_atom_env,
    tiny_model_dir,
    tiny_model_dir_no_gen,
    write_llama_config,
    write_raw_config,
)

import atom.config as config_mod
from atom.config import (
    CompilationConfig,
    CompilationLevel,
    Config,
    CUDAGraphMode,
    KVCacheConfig,
    KVCacheTensor,
    ParallelConfig,
    QuantizationConfig,
    SpeculativeConfig,
    check_dynamic_chunking,
    get_generation_config,
    get_hf_config,
    get_text_config,
)

# ---------------------------------------------------------------------------
# Config defaults and derivations
# ---------------------------------------------------------------------------

GUIDE_DEFAULTS = {
    "trust_remote_code": False,
    "max_num_batched_tokens": 16384,
    "scheduler_delay_factor": 0.0,
    "max_num_seqs": 512,
    "gpu_memory_utilization": 0.9,
    "tensor_parallel_size": 1,
    "enforce_eager": False,
    "kv_cache_block_size": 16,
    "num_kvcache_blocks": -1,
    "kv_cache_dtype": "bf16",
    "enable_prefix_caching": False,
    "enable_log_stats": True,
    "throughput_log_interval": 10.0,
    "cache_hit_rate_window": 1000,
    "enable_dynamic_chunking": False,
    "dynamic_chunking_smooth_factor": None,
    "dynamic_chunking_min_chunk_size": 4096,
    "state_checkpoint_interval_tokens": 8192,
    "state_checkpoint_demand": True,
    "enable_decoder_swa_bounded_replay": True,
    "enable_encoder_swa_bounded_replay": True,
    "min_final_prefill_rows": 0,
    "replay_history_tokens": 0,
    "state_replay_tokens": 0,
    "port": 8006,
    "torch_profiler_dir": None,
    "asyncio_mode": False,
    "load_dummy": None,
    "enable_expert_parallel": False,
    "master_addr": "127.0.0.1",
    "enable_dp_attention": False,
    "dp_load_balance": "least_requests",
    "speculative_config": None,
    "pool_entries": {},
    "pool_entries_per_req": {},
}


def test_config_guide_defaults(tiny_model_dir):
    cfg = Config(tiny_model_dir)
    for name, expected in GUIDE_DEFAULTS.items():
        assert getattr(cfg, name) == expected, name
    assert isinstance(cfg.parallel_config, ParallelConfig)
    assert cfg.parallel_config.data_parallel_size == 1
    assert isinstance(cfg.compilation_config, CompilationConfig)
    assert cfg.compilation_config.level == 0


def test_config_field_defaults_declared():
    # Declared (pre-derivation) defaults, straight from the dataclass.
    declared = {f.name: f.default for f in dataclasses.fields(Config)}
    assert declared["max_model_len"] is None
    assert declared["index_cache_dtype"] is None
    assert declared["capture_sizes"] is None
    assert declared["quant_config"] is None
    assert declared["bos_token_id"] == -1
    assert declared["eos_token_id"] == -1
    assert dataclasses.fields(Config)[0].name == "model"
    assert dataclasses.fields(Config)[0].default is dataclasses.MISSING


def test_max_model_len_defaults_to_max_position_embeddings(tiny_model_dir):
    assert Config(tiny_model_dir).max_model_len == 256


def test_max_model_len_kept_when_smaller(tiny_model_dir):
    assert Config(tiny_model_dir, max_model_len=100).max_model_len == 100


def test_max_model_len_capped(tiny_model_dir):
    assert Config(tiny_model_dir, max_model_len=10_000).max_model_len == 256


def test_max_model_len_required_without_positions():
    hf = transformers.PretrainedConfig()
    with pytest.raises(ValueError, match="max_model_len"):
        Config("x", hf_config=hf)
    assert Config("x", hf_config=hf, max_model_len=77).max_model_len == 77


def test_stop_tokens_from_generation_config(tiny_model_dir):
    cfg = Config(tiny_model_dir)
    assert cfg.generation_config is not None
    assert cfg.stop_token_ids == [1, 2]
    assert cfg.eos_token_id == 2  # LlamaConfig default
    assert cfg.bos_token_id == 1


def test_stop_tokens_extend_without_duplicates(tiny_model_dir):
    cfg = Config(tiny_model_dir, stop_token_ids=[2, 7])
    assert cfg.stop_token_ids == [2, 7, 1]


def test_single_int_generation_eos(tmp_path):
    path = write_llama_config(tmp_path / "m", generation_eos=5)
    assert Config(path).stop_token_ids == [5]


def test_missing_generation_config_is_none(tiny_model_dir_no_gen):
    cfg = Config(tiny_model_dir_no_gen)
    assert cfg.generation_config is None
    assert cfg.stop_token_ids == []
    assert get_generation_config(tiny_model_dir_no_gen) is None


def test_explicit_token_ids_kept(tiny_model_dir):
    cfg = Config(tiny_model_dir, eos_token_id=9, bos_token_id=8)
    assert (cfg.eos_token_id, cfg.bos_token_id) == (9, 8)


def test_hf_eos_list_first_is_eos_rest_are_stops(tmp_path):
    path = write_llama_config(tmp_path / "m", eos_token_id=[3, 4])
    cfg = Config(path)
    assert cfg.eos_token_id == 3
    assert cfg.stop_token_ids == [4]


def test_torch_dtype_fallback_bf16(tiny_model_dir):
    assert Config(tiny_model_dir).torch_dtype == torch.bfloat16


def test_torch_dtype_from_hf_config(tmp_path):
    path = write_llama_config(tmp_path / "m", dtype="float16")
    cfg = Config(path)
    assert cfg.torch_dtype == torch.float16
    assert cfg.quant_config.torch_dtype == torch.float16


def test_torch_dtype_from_legacy_string_attribute():
    from types import SimpleNamespace

    assert config_mod._config_dtype(SimpleNamespace(torch_dtype="float32")) == torch.float32
    assert config_mod._config_dtype(SimpleNamespace(dtype="auto")) is None


def test_quant_config_auto_detected(tiny_model_dir):
    cfg = Config(tiny_model_dir)
    assert isinstance(cfg.quant_config, QuantizationConfig)
    assert cfg.quant_config.get_name() == ""


def test_quant_config_given_is_kept(tiny_model_dir):
    qc = QuantizationConfig(None)
    assert Config(tiny_model_dir, quant_config=qc).quant_config is qc


def test_hf_config_supplied_skips_disk():
    hf = transformers.LlamaConfig(max_position_embeddings=64)
    cfg = Config("not/a/real/path", hf_config=hf)
    assert cfg.hf_config is hf
    assert cfg.max_model_len == 64
    assert cfg.generation_config is None


def test_model_path_resolved_through_embedded(monkeypatch, tiny_model_dir):
    import atom.model_loader.embedded as embedded

    monkeypatch.setattr(embedded, "resolve_model", lambda m: tiny_model_dir if m == "alias" else m)
    assert Config("alias").model == tiny_model_dir


def test_missing_local_path_errors(tmp_path):
    bad = str(tmp_path / "nope")
    with pytest.raises(ValueError) as exc:
        Config(bad)
    msg = str(exc.value)
    assert msg.startswith(f"model={bad!r} is invalid")
    assert "local folder" in msg and "config.json" in msg


def test_unknown_hub_id_errors():
    with pytest.raises(ValueError, match=r"model='no-such-org/no-such-model-xyz' is invalid.*config\.json"):
        Config("no-such-org/no-such-model-xyz")


def test_folder_without_config_json_errors(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        get_hf_config(str(tmp_path))


def test_empty_model_errors():
    with pytest.raises(ValueError, match="model=''"):
        Config("")


def test_unknown_model_type_loads_raw(tmp_path, caplog):
    path = write_raw_config(
        tmp_path / "m", model_type="zz_unknown_arch", architectures=["ZzForCausalLM"],
        max_position_embeddings=128,
    )
    with caplog.at_level(logging.WARNING, logger="atom.config"):
        hf = get_hf_config(path)
    assert hf.architectures == ["ZzForCausalLM"]
    assert hf.max_position_embeddings == 128
    assert "raw config.json" in caplog.text
    assert Config(path).max_model_len == 128


def test_multimodal_text_config_extracted(tmp_path):
    transformers.Qwen3_5Config(architectures=["Qwen3_5ForConditionalGeneration"]).save_pretrained(
        tmp_path / "mm"
    )
    cfg = Config(str(tmp_path / "mm"), max_model_len=512)
    assert cfg.hf_config.model_type == "qwen3_5_text"
    assert cfg.hf_config.architectures == ["Qwen3_5ForConditionalGeneration"]
    assert cfg.max_model_len == 512


def test_get_text_config_plain_config_is_itself():
    hf = transformers.LlamaConfig()
    assert get_text_config(hf) is hf


def test_parallel_world_size_follows_tp(tiny_model_dir):
    cfg = Config(tiny_model_dir, tensor_parallel_size=4, parallel_config=ParallelConfig(data_parallel_size=2))
    assert cfg.parallel_config.world_size == 4
    assert cfg.parallel_config.world_size_across_dp == 8


def test_subconfigs_accept_dicts(tiny_model_dir):
    cfg = Config(
        tiny_model_dir,
        compilation_config={"level": 3},
        parallel_config={"data_parallel_size": 2},
    )
    assert cfg.compilation_config.cudagraph_mode is CUDAGraphMode.TR_HYBRID
    assert cfg.parallel_config.data_parallel_size == 2


def test_subconfig_wrong_type_errors(tiny_model_dir):
    with pytest.raises(ValueError, match="compilation_config=3 is invalid"):
        Config(tiny_model_dir, compilation_config=3)
    with pytest.raises(ValueError, match="quant_config='fp8' is invalid"):
        Config(tiny_model_dir, quant_config="fp8")


def test_repr_is_short_and_names_model_type(tiny_model_dir):
    cfg = Config(tiny_model_dir)
    text = repr(cfg)
    assert "model_type='llama'" in text
    assert "vocab_size" not in text  # the hf_config is summarised, not dumped
    assert text.startswith("Config(model=")


def test_compute_hash_stable_and_sensitive(tiny_model_dir):
    a = Config(tiny_model_dir).compute_hash()
    assert a == Config(tiny_model_dir).compute_hash()
    assert a != Config(tiny_model_dir, kv_cache_dtype="fp8").compute_hash()
    assert len(a) == 64


# ---------------------------------------------------------------------------
# Config validation: every rule names the field, the value and what is allowed
# ---------------------------------------------------------------------------

INVALID = [
    ("kv_cache_block_size", 24, "must be a multiple of 16 or exactly 1"),
    ("kv_cache_block_size", 0, "multiple of 16"),
    ("kv_cache_block_size", 8, "multiple of 16"),
    ("tensor_parallel_size", 0, r"\[1, 8\]"),
    ("tensor_parallel_size", 9, r"\[1, 8\]"),
    ("gpu_memory_utilization", 0.0, r"\(0, 1\]"),
    ("gpu_memory_utilization", 1.01, r"\(0, 1\]"),
    ("gpu_memory_utilization", float("nan"), r"\(0, 1\]"),
    ("max_num_seqs", 0, ">= 1"),
    ("max_num_batched_tokens", 0, ">= 1"),
    ("max_num_batched_tokens", 1.5, ">= 1"),
    ("max_model_len", 0, ">= 1"),
    ("num_kvcache_blocks", 0, "-1"),
    ("num_kvcache_blocks", -2, "-1"),
    ("kv_cache_dtype", "fp4", r"\['bf16', 'fp8'\]"),
    ("index_cache_dtype", "int8", r"\['bf16', 'fp8', 'fp4'\]"),
    ("dp_load_balance", "random", "round_robin"),
    ("load_dummy", "ones", r"\['empty', 'zero', 'xavier'\]"),
    ("throughput_log_interval", 0, "> 0"),
    ("throughput_log_interval", -1.0, "> 0"),
    ("cache_hit_rate_window", 0, ">= 1"),
    ("state_checkpoint_interval_tokens", -2, "-1"),
    ("state_checkpoint_interval_tokens", 100, "multiple of kv_cache_block_size=16"),
    ("scheduler_delay_factor", -0.5, ">= 0"),
    ("port", 0, r"\[1, 65535\]"),
    ("port", 70000, r"\[1, 65535\]"),
    ("bos_token_id", -2, ">= -1"),
    ("eos_token_id", -5, ">= -1"),
    ("stop_token_ids", [-1], "integers >= 0"),
    ("stop_token_ids", 3, "integers >= 0"),
    ("capture_sizes", [0, 4], "integers >= 1"),
    ("master_addr", "", "non-empty"),
    ("torch_profiler_dir", "", "directory"),
    ("enforce_eager", "yes", "True or False"),
    ("enable_prefix_caching", 1, "True or False"),
    ("enable_log_stats", None, "True or False"),
    ("trust_remote_code", "no", "True or False"),
    ("min_final_prefill_rows", -1, ">= 0"),
    ("replay_history_tokens", -1, ">= 0"),
    ("state_replay_tokens", -1, ">= 0"),
    ("dynamic_chunking_smooth_factor", "high", "number"),
    ("dynamic_chunking_min_chunk_size", 1.5, "integer"),
]


@pytest.mark.parametrize("name,value,allowed", INVALID, ids=[f"{n}={v!r}" for n, v, _ in INVALID])
def test_invalid_scalar_raises_before_io(name, value, allowed):
    # A model path that does not exist: the scalar error must come first.
    with pytest.raises(ValueError) as exc:
        Config("/definitely/not/here", **{name: value})
    msg = str(exc.value)
    assert msg.startswith(f"{name}={value!r} is invalid:"), msg
    import re

    assert re.search(allowed, msg), msg


def test_block_size_message_exact():
    with pytest.raises(ValueError) as exc:
        Config("/nowhere", kv_cache_block_size=24)
    assert str(exc.value) == "kv_cache_block_size=24 is invalid: must be a multiple of 16 or exactly 1"


@pytest.mark.parametrize(
    "name,value",
    [
        ("kv_cache_block_size", 1),
        ("kv_cache_block_size", 64),
        ("tensor_parallel_size", 8),
        ("gpu_memory_utilization", 1.0),
        ("num_kvcache_blocks", 10),
        ("kv_cache_dtype", "fp8"),
        ("index_cache_dtype", "fp4"),
        ("dp_load_balance", "round_robin"),
        ("dp_load_balance", "least_tokens"),
        ("load_dummy", "empty"),
        ("load_dummy", "zero"),
        ("load_dummy", "xavier"),
        ("state_checkpoint_interval_tokens", 0),
        ("state_checkpoint_interval_tokens", -1),
        ("state_checkpoint_interval_tokens", 32),
        ("throughput_log_interval", 0.5),
        ("cache_hit_rate_window", 1),
    ],
)
def test_valid_edge_values(tiny_model_dir, name, value):
    assert getattr(Config(tiny_model_dir, **{name: value}), name) == value


def test_checkpoint_interval_multiple_of_block_size(tiny_model_dir):
    with pytest.raises(ValueError, match="multiple of kv_cache_block_size=64"):
        Config(tiny_model_dir, kv_cache_block_size=64, state_checkpoint_interval_tokens=8192 + 32)
    assert Config(tiny_model_dir, kv_cache_block_size=1, state_checkpoint_interval_tokens=7).state_checkpoint_interval_tokens == 7


# ---------------------------------------------------------------------------
# index_cache_dtype resolution (DeepSeek-V4 fields: no effect in this build)
# ---------------------------------------------------------------------------


def _ds_hf(arch: str, model_type: str = "deepseek_v4"):
    hf = transformers.PretrainedConfig(architectures=[arch], max_position_embeddings=512)
    hf.model_type = model_type
    return hf


def test_index_cache_dtype_inherits_kv(tiny_model_dir):
    assert Config(tiny_model_dir).index_cache_dtype == "bf16"
    assert Config(tiny_model_dir, kv_cache_dtype="fp8").index_cache_dtype == "fp8"


def test_index_cache_dtype_explicit_preserved(tiny_model_dir):
    assert Config(tiny_model_dir, index_cache_dtype="fp4").index_cache_dtype == "fp4"
    hf = _ds_hf("DeepseekV4ForCausalLM")
    assert Config("ds", hf_config=hf, index_cache_dtype="bf16").index_cache_dtype == "bf16"


def test_index_cache_dtype_deepseek_v4_defaults_fp4(monkeypatch):
    monkeypatch.setattr(config_mod, "_gpu_arch", lambda: "gfx950")
    cfg = Config("ds", hf_config=_ds_hf("DeepseekV4ForCausalLM"), kv_cache_block_size=64)
    assert cfg.index_cache_dtype == "fp4"


def test_index_cache_dtype_deepseek_v4_on_gfx942_is_fp8(monkeypatch):
    monkeypatch.setattr(config_mod, "_gpu_arch", lambda: "gfx942")
    assert Config("ds", hf_config=_ds_hf("DeepseekV4ForCausalLM")).index_cache_dtype == "fp8"


def test_index_cache_dtype_deepseek_v41_is_fp8():
    hf = _ds_hf("DeepseekV41ForCausalLM", model_type="deepseek_v4")
    assert Config("ds", hf_config=hf).index_cache_dtype == "fp8"


def test_fp4_indexer_warns_without_block_64(monkeypatch, caplog):
    monkeypatch.setattr(config_mod, "_gpu_arch", lambda: None)
    with caplog.at_level(logging.WARNING, logger="atom.config"):
        Config("ds", hf_config=_ds_hf("DeepseekV4ForCausalLM"), kv_cache_block_size=16)
    assert "kv_cache_block_size=64" in caplog.text


# ---------------------------------------------------------------------------
# dynamic chunking, state checkpoint demand, profiler dir
# ---------------------------------------------------------------------------


def test_dynamic_chunking_turned_off_with_warning(tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="atom.config"):
        cfg = Config(tiny_model_dir, enable_dynamic_chunking=True, dynamic_chunking_smooth_factor=5.0)
    assert cfg.enable_dynamic_chunking is False
    assert "enable_dynamic_chunking turned off" in caplog.text
    # Range checks apply only while the feature is on.
    assert cfg.dynamic_chunking_smooth_factor == 5.0


def test_dynamic_chunking_env_not_read_when_off(tiny_model_dir, clean_atom_env):
    clean_atom_env.setenv("ATOM_DYNAMIC_CHUNKING_SMOOTH_FACTOR", "not-a-number")
    assert Config(tiny_model_dir).dynamic_chunking_smooth_factor is None


def test_check_dynamic_chunking_rules(clean_atom_env):
    assert check_dynamic_chunking(None, 4096) == 0.75
    clean_atom_env.setenv("ATOM_DYNAMIC_CHUNKING_SMOOTH_FACTOR", "0.25")
    assert check_dynamic_chunking(None, 4096) == 0.25
    assert check_dynamic_chunking(0, 1) == 0.0
    assert check_dynamic_chunking(1, 1) == 1.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"dynamic_chunking_smooth_factor=.* \[0, 1\]"):
            check_dynamic_chunking(bad, 4096)
    with pytest.raises(ValueError, match="dynamic_chunking_min_chunk_size=0"):
        check_dynamic_chunking(0.5, 0)


def test_state_checkpoint_demand_env_override(tiny_model_dir, clean_atom_env):
    assert Config(tiny_model_dir, state_checkpoint_demand=False).state_checkpoint_demand is False
    clean_atom_env.setenv("ATOM_STATE_CHECKPOINT_DEMAND", "0")
    assert Config(tiny_model_dir).state_checkpoint_demand is False
    clean_atom_env.setenv("ATOM_STATE_CHECKPOINT_DEMAND", "1")
    assert Config(tiny_model_dir, state_checkpoint_demand=False).state_checkpoint_demand is True


def test_torch_profiler_dir_from_env_and_created(tiny_model_dir, tmp_path, clean_atom_env):
    target = tmp_path / "prof" / "nested"
    clean_atom_env.setenv("ATOM_TORCH_PROFILER_DIR", str(target))
    cfg = Config(tiny_model_dir)
    assert cfg.torch_profiler_dir == str(target)
    assert target.is_dir()


def test_torch_profiler_dir_explicit(tiny_model_dir, tmp_path):
    target = tmp_path / "p2"
    assert Config(tiny_model_dir, torch_profiler_dir=str(target)).torch_profiler_dir == str(target)
    assert target.is_dir()


def test_torch_profiler_dir_env_read_at_construction(tiny_model_dir, tmp_path, clean_atom_env):
    assert Config(tiny_model_dir).torch_profiler_dir is None
    clean_atom_env.setenv("ATOM_TORCH_PROFILER_DIR", str(tmp_path / "late"))
    assert Config(tiny_model_dir).torch_profiler_dir == str(tmp_path / "late")


def test_profiler_dir_not_created_when_model_invalid(tmp_path, clean_atom_env):
    target = tmp_path / "never"
    with pytest.raises(ValueError):
        Config(str(tmp_path / "missing"), torch_profiler_dir=str(target))
    assert not target.exists()


# ---------------------------------------------------------------------------
# online quant config
# ---------------------------------------------------------------------------


def test_online_quant_config_empty_is_none(tiny_model_dir):
    assert Config(tiny_model_dir, online_quant_config={}).online_quant_config is None
    assert Config(tiny_model_dir, online_quant_config="{}").online_quant_config is None


def test_online_quant_config_valid(tiny_model_dir):
    cfg = Config(
        tiny_model_dir,
        online_quant_config={
            "global_quant_config": "ptpc_fp8",
            "layer_quant_config": {"*expert*": "mxfp4"},
            "exclude_layer": "lm_head",
        },
    )
    assert cfg.online_quant_config["exclude_layer"] == ["lm_head"]
    assert cfg.online_quant_config["global_quant_config"] == "ptpc_fp8"


@pytest.mark.parametrize(
    "value,match",
    [
        ({"global_quant_config": "int3"},
         r"online_quant_config.global_quant_config='int3' is invalid: must be one of \['mxfp4', 'ptpc_fp8'\]"),
        ({"layer_quant_config": {"*": "bogus"}}, r"online_quant_config.layer_quant_config\['\*'\]='bogus'"),
        ({"layer_quant_config": ["*"]}, "online_quant_config.layer_quant_config=.* must map layer patterns"),
        ({"exclude_layer": "re:(unclosed"}, r"online_quant_config.exclude_layer='re:\(unclosed' is invalid: bad regex"),
        ({"exclude_layer": ""}, "online_quant_config.exclude_layer='' is invalid"),
        ({"unknown": 1}, "unknown keys"),
        ({"exclude_layer": [1]}, "exclude_layer"),
        ("[1,2]", "online_quant_config"),
        ("{bad json", "online_quant_config"),
    ],
)
def test_online_quant_config_invalid(value, match):
    with pytest.raises(ValueError, match=match):
        Config("/nowhere", online_quant_config=value)


# ---------------------------------------------------------------------------
# CompilationLevel / CUDAGraphMode
# ---------------------------------------------------------------------------


def test_compilation_levels():
    assert (
        CompilationLevel.NO_COMPILATION,
        CompilationLevel.DYNAMO_AS_IS,
        CompilationLevel.DYNAMO_ONCE,
        CompilationLevel.PIECEWISE,
    ) == (0, 1, 2, 3)


def test_cudagraph_mode_values():
    assert CUDAGraphMode.NONE.value == 0
    assert CUDAGraphMode.TR_HYBRID.value == 1
    assert CUDAGraphMode.FULL.value == 2
    assert CUDAGraphMode.FULL_DECODE_ONLY.value == (2, 0)
    assert CUDAGraphMode.FULL_AND_TR_HYBRID.value == (2, 1)


@pytest.mark.parametrize(
    "mode,decode,mixed,tr,full,separate",
    [
        (CUDAGraphMode.NONE, CUDAGraphMode.NONE, CUDAGraphMode.NONE, False, False, False),
        (CUDAGraphMode.TR_HYBRID, CUDAGraphMode.TR_HYBRID, CUDAGraphMode.TR_HYBRID, True, False, False),
        (CUDAGraphMode.FULL, CUDAGraphMode.FULL, CUDAGraphMode.FULL, False, True, False),
        (CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL, CUDAGraphMode.NONE, False, True, True),
        (CUDAGraphMode.FULL_AND_TR_HYBRID, CUDAGraphMode.FULL, CUDAGraphMode.TR_HYBRID, True, True, True),
    ],
)
def test_cudagraph_mode_helpers(mode, decode, mixed, tr, full, separate):
    assert mode.decode_mode() is decode
    assert mode.mixed_mode() is mixed
    assert mode.uses_tr_hybrid() is tr
    assert mode.has_full_cudagraphs() is full
    assert mode.separate_routine() is separate


def test_full_and_tr_hybrid_recorded_as_tr_hybrid():
    assert CUDAGraphMode.FULL_AND_TR_HYBRID.native_mode() is CUDAGraphMode.TR_HYBRID
    assert CUDAGraphMode.FULL_DECODE_ONLY.native_mode() is CUDAGraphMode.FULL_DECODE_ONLY


def test_cudagraph_mode_parse():
    assert CUDAGraphMode.parse("full_decode_only") is CUDAGraphMode.FULL_DECODE_ONLY
    assert CUDAGraphMode.parse(2) is CUDAGraphMode.FULL
    assert CUDAGraphMode.parse([2, 1]) is CUDAGraphMode.FULL_AND_TR_HYBRID
    with pytest.raises(ValueError, match="cudagraph_mode='sometimes' is invalid"):
        CUDAGraphMode.parse("sometimes")


# ---------------------------------------------------------------------------
# CompilationConfig
# ---------------------------------------------------------------------------


def test_compilation_config_defaults():
    cc = CompilationConfig()
    assert cc.level == 0
    assert cc.use_cudagraph is True
    assert cc.cudagraph_capture_sizes is None
    assert cc.cuda_graph_sizes == [512]  # [] post-init -> [512]
    assert cc.debug_dump_path == "" and cc.cache_dir == ""
    assert cc.use_inductor is True
    assert cc.cudagraph_mode is None
    assert cc.splitting_ops is None
    assert cc.cudagraph_copy_inputs is False
    assert cc.compile_sizes is None
    assert cc.inductor_compile_config == {}


def test_compilation_config_declared_cuda_graph_sizes_empty():
    f = {f.name: f for f in dataclasses.fields(CompilationConfig)}["cuda_graph_sizes"]
    assert f.default_factory() == []


def test_default_capture_sizes_from_512():
    sizes = CompilationConfig().init_with_cudagraph_sizes()
    assert sizes == [1, 2, 3, 4, 5, 6, 7, 8] + list(range(16, 513, 16))


def test_single_size_generates_ladder():
    assert CompilationConfig(cuda_graph_sizes=[64]).init_with_cudagraph_sizes() == [
        1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 48, 64,
    ]
    assert CompilationConfig(cuda_graph_sizes=[40]).init_with_cudagraph_sizes()[-1] == 32
    assert CompilationConfig(cuda_graph_sizes=[4]).init_with_cudagraph_sizes() == [1, 2, 3, 4]


def test_several_sizes_used_as_is():
    assert CompilationConfig(cuda_graph_sizes=[3, 1, 9]).init_with_cudagraph_sizes() == [1, 3, 9]


def test_capture_sizes_override_sorted_deduped():
    cc = CompilationConfig(cudagraph_capture_sizes=[8, 2, 2, 4], cuda_graph_sizes=[512])
    assert cc.cudagraph_capture_sizes == [2, 4, 8]
    assert cc.init_with_cudagraph_sizes() == [2, 4, 8]
    assert cc.max_capture_size == 8


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"level": 4}, r"level=4 is invalid: must be an integer in \[0, 3\]"),
        ({"level": -1}, r"level=-1 is invalid"),
        ({"cudagraph_capture_sizes": [0]}, "cudagraph_capture_sizes"),
        ({"cudagraph_capture_sizes": []}, "non-empty"),
        ({"cuda_graph_sizes": [-4]}, "cuda_graph_sizes"),
        ({"cudagraph_mode": "bogus"}, "cudagraph_mode"),
        ({"splitting_ops": [""]}, "splitting_ops"),
        ({"compile_sizes": [0]}, "compile_sizes"),
        ({"compile_sizes": ["all"]}, "compile_sizes"),
        ({"use_cudagraph": "yes"}, "use_cudagraph"),
        ({"inductor_compile_config": []}, "inductor_compile_config"),
    ],
)
def test_compilation_config_invalid(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CompilationConfig(**kwargs)


def test_level3_sets_mode_and_splitting_ops():
    cc = CompilationConfig(level=3)
    assert cc.cudagraph_mode is CUDAGraphMode.TR_HYBRID
    assert cc.splitting_ops == ["aiter.unified_attention_with_output", "aiter.mla_attention"]


def test_level3_keeps_explicit_choices():
    cc = CompilationConfig(level=3, cudagraph_mode=CUDAGraphMode.FULL, splitting_ops=["x.y"])
    assert cc.cudagraph_mode is CUDAGraphMode.FULL
    assert cc.splitting_ops == ["x.y"]


@pytest.mark.parametrize("level", [0, 1, 2])
def test_lower_levels_leave_mode_unset(level):
    cc = CompilationConfig(level=level)
    assert cc.cudagraph_mode is None and cc.splitting_ops is None


def test_padded_size():
    cc = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8, 16])
    assert cc.padded_size(1) == 1
    assert cc.padded_size(3) == 4
    assert cc.padded_size(16) == 16
    assert cc.padded_size(17) is None
    with pytest.raises(ValueError, match="batch_size=0"):
        cc.padded_size(0)


def test_compile_sizes_expansion():
    cc = CompilationConfig(cudagraph_capture_sizes=[1, 4], compile_sizes=[64, "cudagraph_capture_sizes"])
    assert cc.get_compile_sizes() == [1, 4, 64]


def test_config_capture_sizes_derived(tiny_model_dir):
    cfg = Config(tiny_model_dir, compilation_config=CompilationConfig(level=3, cuda_graph_sizes=[32]))
    assert cfg.capture_sizes == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32]


def test_config_capture_sizes_explicit_pushed_into_compilation(tiny_model_dir):
    cfg = Config(tiny_model_dir, capture_sizes=[8, 2])
    assert cfg.capture_sizes == [2, 8]
    assert cfg.compilation_config.padded_size(3) == 8


def test_enforce_eager_disables_graphs(tiny_model_dir):
    cfg = Config(tiny_model_dir, enforce_eager=True, compilation_config=CompilationConfig(level=3))
    assert cfg.capture_sizes == []
    assert cfg.compilation_config.level == CompilationLevel.NO_COMPILATION
    assert cfg.compilation_config.cudagraph_mode is CUDAGraphMode.NONE
    assert cfg.compilation_config.use_cudagraph is False


def test_use_cudagraph_false_means_no_capture(tiny_model_dir):
    cfg = Config(tiny_model_dir, compilation_config=CompilationConfig(level=3, use_cudagraph=False))
    assert cfg.capture_sizes == []


# ---------------------------------------------------------------------------
# ParallelConfig
# ---------------------------------------------------------------------------


def test_parallel_config_defaults():
    pc = ParallelConfig()
    assert pc.data_parallel_size == 1
    assert pc.data_parallel_size_local == 1  # None -> data_parallel_size
    assert pc.data_parallel_rank == 0
    assert pc.data_parallel_rank_local is None
    assert pc.data_parallel_master_port == 29500
    assert pc.data_parallel_base_port == 0
    assert pc.data_parallel_master_ip == "127.0.0.1"
    assert pc.world_size == 1
    assert pc.world_size_across_dp == 1


def test_parallel_config_size_local_defaults_to_size():
    assert ParallelConfig(data_parallel_size=4).data_parallel_size_local == 4
    assert ParallelConfig(data_parallel_size=4, data_parallel_size_local=2).data_parallel_size_local == 2


def test_parallel_config_env_overrides(clean_atom_env):
    for name, value in {
        "ATOM_DP_SIZE": "4",
        "ATOM_DP_SIZE_LOCAL": "2",
        "ATOM_DP_RANK": "3",
        "ATOM_DP_RANK_LOCAL": "1",
        "ATOM_DP_MASTER_IP": "10.0.0.7",
        "ATOM_DP_MASTER_PORT": "31000",
    }.items():
        clean_atom_env.setenv(name, value)
    pc = ParallelConfig(data_parallel_size=1)
    assert pc.data_parallel_size == 4
    assert pc.data_parallel_size_local == 2
    assert pc.data_parallel_rank == 3
    assert pc.data_parallel_rank_local == 1
    assert pc.data_parallel_master_ip == "10.0.0.7"
    assert pc.data_parallel_master_port == 31000
    pc.world_size = 2
    assert pc.world_size_across_dp == 8


def test_parallel_config_bad_env(clean_atom_env):
    clean_atom_env.setenv("ATOM_DP_SIZE", "two")
    with pytest.raises(ValueError, match="ATOM_DP_SIZE='two' is invalid"):
        ParallelConfig()


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"data_parallel_size": 0}, "data_parallel_size"),
        ({"data_parallel_size": 2, "data_parallel_size_local": 3}, "data_parallel_size_local"),
        ({"data_parallel_size": 2, "data_parallel_rank": 2}, "data_parallel_rank"),
        ({"data_parallel_size": 2, "data_parallel_rank_local": 2}, "data_parallel_rank_local"),
        ({"data_parallel_master_port": 0}, "data_parallel_master_port"),
        ({"data_parallel_base_port": 70000}, "data_parallel_base_port"),
        ({"data_parallel_master_ip": ""}, "data_parallel_master_ip"),
        ({"world_size": 0}, "world_size"),
    ],
)
def test_parallel_config_invalid(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}="):
        ParallelConfig(**kwargs)


# ---------------------------------------------------------------------------
# SpeculativeConfig
# ---------------------------------------------------------------------------


def test_speculative_defaults():
    spec = SpeculativeConfig()
    assert spec.method == ""
    assert spec.model is None
    assert spec.num_speculative_tokens is None
    assert spec.draft_model_hf_config is None


def test_mtp_tables_match_guide():
    assert SpeculativeConfig._MTP_TYPE_MAP == {
        "deepseek_v3": "deepseek_mtp",
        "glm_moe_dsa": "deepseek_mtp",
        "qwen3_next": "qwen3_next_mtp",
        "qwen3_5": "qwen3_5_mtp",
        "qwen3_5_moe": "qwen3_5_mtp",
        "qwen3_5_text": "qwen3_5_mtp",
        "qwen3_5_moe_text": "qwen3_5_mtp",
    }
    assert SpeculativeConfig._MTP_CONFIG == {
        "deepseek_mtp": ("num_nextn_predict_layers", "DeepSeekMTPModel"),
        "qwen3_next_mtp": ("num_nextn_predict_layers", "Qwen3NextMTPModel"),
        "qwen3_5_mtp": ("mtp_num_hidden_layers", "Qwen3_5MTPModel"),
    }
    # Tables are class attributes, not dataclass fields.
    assert {f.name for f in dataclasses.fields(SpeculativeConfig)} == {
        "method", "model", "num_speculative_tokens", "draft_model_hf_config",
    }


def _plain(model_type: str, **attrs) -> transformers.PretrainedConfig:
    hf = transformers.PretrainedConfig(**attrs)
    hf.model_type = model_type
    return hf


@pytest.mark.parametrize(
    "base,mtp,arch",
    [
        ("deepseek_v3", "deepseek_mtp", "DeepSeekMTPModel"),
        ("glm_moe_dsa", "deepseek_mtp", "DeepSeekMTPModel"),
        ("qwen3_next", "qwen3_next_mtp", "Qwen3NextMTPModel"),
        ("qwen3_5", "qwen3_5_mtp", "Qwen3_5MTPModel"),
        ("qwen3_5_moe", "qwen3_5_mtp", "Qwen3_5MTPModel"),
        ("qwen3_5_text", "qwen3_5_mtp", "Qwen3_5MTPModel"),
        ("qwen3_5_moe_text", "qwen3_5_mtp", "Qwen3_5MTPModel"),
        ("deepseek_mtp", "deepseek_mtp", "DeepSeekMTPModel"),
    ],
)
def test_hf_config_override_table(base, mtp, arch):
    out = SpeculativeConfig.hf_config_override(_plain(base))
    assert out.model_type == mtp
    assert out.architectures == [arch]
    assert out.n_predict == 1
    assert out.num_nextn_predict_layers == 1


def test_hf_config_override_forces_one_with_warning(caplog):
    hf = _plain("deepseek_v3", num_nextn_predict_layers=3)
    with caplog.at_level(logging.WARNING, logger="atom.config"):
        out = SpeculativeConfig.hf_config_override(hf)
    assert out is hf
    assert out.num_nextn_predict_layers == 1
    assert "num_nextn_predict_layers=3" in caplog.text


def test_hf_config_override_no_warning_for_one(caplog):
    with caplog.at_level(logging.WARNING, logger="atom.config"):
        SpeculativeConfig.hf_config_override(_plain("qwen3_next", num_nextn_predict_layers=1))
    assert caplog.text == ""


def test_hf_config_override_qwen35_injects_experts():
    out = SpeculativeConfig.hf_config_override(
        _plain("qwen3_5_moe_text", mtp_num_hidden_layers=2, num_experts=64)
    )
    assert out.mtp_num_hidden_layers == 1
    assert out.n_shared_experts == 1
    assert out.n_routed_experts == 64
    dense = SpeculativeConfig.hf_config_override(_plain("qwen3_5_text"))
    assert dense.n_routed_experts == 0
    assert dense.mtp_num_hidden_layers == 1


def test_hf_config_override_non_mtp_untouched():
    hf = _plain("llama", architectures=["LlamaForCausalLM"])
    out = SpeculativeConfig.hf_config_override(hf)
    assert out.model_type == "llama"
    assert out.architectures == ["LlamaForCausalLM"]
    assert not hasattr(out, "n_predict")


def _tiny_deepseek_dir(tmp_path) -> str:
    cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, max_position_embeddings=512, num_nextn_predict_layers=2,
        architectures=["DeepseekV3ForCausalLM"],
    )
    cfg.save_pretrained(tmp_path / "ds3")
    return str(tmp_path / "ds3")


def test_config_fills_mtp_draft_from_target(tmp_path):
    path = _tiny_deepseek_dir(tmp_path)
    cfg = Config(path, speculative_config=SpeculativeConfig(method="mtp", num_speculative_tokens=1))
    spec = cfg.speculative_config
    assert spec.model == path
    assert spec.draft_model_hf_config.model_type == "deepseek_mtp"
    assert spec.draft_model_hf_config.architectures == ["DeepSeekMTPModel"]
    assert spec.draft_model_hf_config.num_nextn_predict_layers == 1
    # The target config is not touched.
    assert cfg.hf_config.model_type == "deepseek_v3"
    assert cfg.hf_config.num_nextn_predict_layers == 2
    assert "deepseek_mtp" in repr(spec)


def test_speculative_config_loads_draft_from_model(tmp_path):
    path = _tiny_deepseek_dir(tmp_path)
    spec = SpeculativeConfig(method="mtp", model=path, num_speculative_tokens=1)
    assert spec.draft_model_hf_config.model_type == "deepseek_mtp"


def test_speculative_config_from_dict(tmp_path):
    path = _tiny_deepseek_dir(tmp_path)
    cfg = Config(path, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    assert isinstance(cfg.speculative_config, SpeculativeConfig)


@pytest.mark.parametrize("n", [2, 0, None])
def test_num_speculative_tokens_must_be_one(n):
    with pytest.raises(ValueError, match=f"speculative_config.num_speculative_tokens={n!r} is invalid: must be 1"):
        Config("/nowhere", speculative_config=SpeculativeConfig(method="mtp", num_speculative_tokens=n))


@pytest.mark.parametrize("method", ["eagle", "", None])
def test_speculative_method_must_be_mtp(method):
    with pytest.raises(ValueError, match=r"speculative_config.method=.* \['mtp'\]"):
        Config("/nowhere", speculative_config=SpeculativeConfig(method=method, num_speculative_tokens=1))


# ---------------------------------------------------------------------------
# KV cache descriptors
# ---------------------------------------------------------------------------


def test_kv_cache_tensor_and_config():
    k = torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16)
    v = torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16)
    t0 = KVCacheTensor(layer_num=0, k_cache=k, v_cache=v)
    t1 = KVCacheTensor(layer_num=1, k_cache=k, k_scale=torch.ones(4, dtype=torch.float32))
    assert t0.nbytes == 2 * k.numel() * 2
    assert t1.v_cache is None and t1.v_scale is None
    assert t1.nbytes == k.numel() * 2 + 4 * 4
    kv = KVCacheConfig([t0, t1])
    assert len(kv) == 2
    assert kv.get(1) is t1
    assert list(kv) == [t0, t1]
    assert kv.nbytes == t0.nbytes + t1.nbytes
    assert "bfloat16[4, 16, 2, 8]" in repr(t0)
    with pytest.raises(KeyError, match="layer 7"):
        kv.get(7)


def test_kv_cache_config_rejects_duplicates_and_negative():
    with pytest.raises(ValueError, match="unique"):
        KVCacheConfig([KVCacheTensor(0), KVCacheTensor(0)])
    with pytest.raises(ValueError, match="layer_num=-1"):
        KVCacheTensor(-1)
    assert len(KVCacheConfig()) == 0


def test_config_does_not_mutate_given_compilation_config(tiny_model_dir):
    cc = CompilationConfig(level=3)
    before = copy.deepcopy(cc)
    Config(tiny_model_dir, enforce_eager=True, compilation_config=cc)
    assert cc == before


def test_explicit_empty_capture_sizes_means_no_capture(tiny_model_dir):
    assert Config(tiny_model_dir, capture_sizes=[], compilation_config=CompilationConfig(level=3)).capture_sizes == []


def test_explicit_capture_sizes_do_not_mutate_shared_compilation_config(tiny_model_dir):
    cc = CompilationConfig(level=3)
    cfg = Config(tiny_model_dir, capture_sizes=[4], compilation_config=cc)
    assert cfg.capture_sizes == [4]
    assert cc.cudagraph_capture_sizes is None


def test_dataclasses_replace_round_trip_without_disk(tiny_model_dir, monkeypatch):
    cfg = Config(tiny_model_dir, compilation_config=CompilationConfig(level=3))
    monkeypatch.setattr(config_mod, "get_hf_config", lambda *a, **k: pytest.fail("disk access"))
    again = dataclasses.replace(cfg, max_num_seqs=8)
    assert again.max_num_seqs == 8
    assert again.hf_config is cfg.hf_config
    assert again.stop_token_ids == cfg.stop_token_ids
    assert again.capture_sizes == cfg.capture_sizes
    assert again.max_model_len == cfg.max_model_len
    eager = dataclasses.replace(cfg, enforce_eager=True)
    assert eager.capture_sizes == []
    assert dataclasses.replace(eager, max_num_seqs=2).capture_sizes == []
