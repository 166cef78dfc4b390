"""ATOM_* environment variables: defaults, parsing rules, laziness."""

from __future__ import annotations

import pytest
from config_fixtures import clean_atom_env  # noqa: F401

from atom.utils import envs

GUIDE_DEFAULTS = {
    "ATOM_DP_RANK": 0,
    "ATOM_DP_RANK_LOCAL": 0,
    "ATOM_DP_SIZE": 1,
    "ATOM_DP_MASTER_IP": "127.0.0.1",
    "ATOM_DP_MASTER_PORT": 29500,
    "ATOM_DYNAMIC_CHUNKING_SMOOTH_FACTOR": 0.75,
    "ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION": False,
    "ATOM_USE_TRITON_GEMM": False,
    "ATOM_USE_TRITON_MXFP4_BMM": False,
    "ATOM_ENABLE_DS_INPUT_RMSNORM_QUANT_FUSION": True,
    "ATOM_ENABLE_DS_QKNORM_QUANT_FUSION": True,
    "ATOM_ENABLE_ALLREDUCE_RMSNORM_FUSION": True,
    "ATOM_LLAMA_ENABLE_AITER_TRITON_FUSED_RMSNORM_QUANT": True,
    "ATOM_LLAMA_ENABLE_AITER_TRITON_FUSED_SILU_MUL_QUANT": True,
    "ATOM_TORCH_PROFILER_DIR": None,
    "ATOM_PROFILER_MORE": False,
    "ATOM_STATE_CHECKPOINT_DEMAND": True,
    "ATOM_DP_LB_REQ_EQUIV": 512,
    "ATOM_DP_SIZE_LOCAL": None,
    "ATOM_DSV4_STATE_REPLAY": False,
}

DEFAULT_FALSE = [n for n, v in GUIDE_DEFAULTS.items() if v is False]
DEFAULT_TRUE = [n for n, v in GUIDE_DEFAULTS.items() if v is True]


@pytest.mark.parametrize("name,expected", list(GUIDE_DEFAULTS.items()))
def test_defaults_when_unset(name, expected):
    value = getattr(envs, name)
    assert value == expected and type(value) is type(expected)


def test_registry_lists_every_variable():
    assert set(envs.ENV_VARS) == set(GUIDE_DEFAULTS)
    assert set(GUIDE_DEFAULTS) <= set(dir(envs))


def test_removed_enforce_eager_variable_is_gone():
    assert "ATOM_ENFORCE_EAGER" not in envs.ENV_VARS
    with pytest.raises(AttributeError, match="ATOM_ENFORCE_EAGER"):
        envs.ATOM_ENFORCE_EAGER  # noqa: B018


@pytest.mark.parametrize("name", DEFAULT_FALSE)
@pytest.mark.parametrize("raw,expected", [("1", True), ("0", False), ("true", False), ("", False), ("yes", False)])
def test_default_false_booleans(clean_atom_env, name, raw, expected):
    clean_atom_env.setenv(name, raw)
    assert getattr(envs, name) is expected


@pytest.mark.parametrize("name", DEFAULT_TRUE)
@pytest.mark.parametrize("raw,expected", [("1", True), ("0", False), ("true", False), ("", False)])
def test_default_true_booleans(clean_atom_env, name, raw, expected):
    assert getattr(envs, name) is True  # unset
    clean_atom_env.setenv(name, raw)
    assert getattr(envs, name) is expected


def test_numeric_and_string_parsing(clean_atom_env):
    clean_atom_env.setenv("ATOM_DP_SIZE", "8")
    clean_atom_env.setenv("ATOM_DP_RANK", " 3 ")
    clean_atom_env.setenv("ATOM_DP_MASTER_PORT", "40000")
    clean_atom_env.setenv("ATOM_DYNAMIC_CHUNKING_SMOOTH_FACTOR", "0.5")
    clean_atom_env.setenv("ATOM_DP_MASTER_IP", "10.1.2.3")
    clean_atom_env.setenv("ATOM_TORCH_PROFILER_DIR", "/tmp/trace")
    clean_atom_env.setenv("ATOM_DP_LB_REQ_EQUIV", "64")
    clean_atom_env.setenv("ATOM_DP_SIZE_LOCAL", "4")
    assert envs.ATOM_DP_SIZE == 8
    assert envs.ATOM_DP_RANK == 3
    assert envs.ATOM_DP_MASTER_PORT == 40000
    assert envs.ATOM_DYNAMIC_CHUNKING_SMOOTH_FACTOR == 0.5
    assert envs.ATOM_DP_MASTER_IP == "10.1.2.3"
    assert envs.ATOM_TORCH_PROFILER_DIR == "/tmp/trace"
    assert envs.ATOM_DP_LB_REQ_EQUIV == 64
    assert envs.ATOM_DP_SIZE_LOCAL == 4


@pytest.mark.parametrize(
    "name,raw,kind",
    [
        ("ATOM_DP_SIZE", "two", "an integer"),
        ("ATOM_DP_MASTER_PORT", "", "an integer"),
        ("ATOM_DYNAMIC_CHUNKING_SMOOTH_FACTOR", "high", "a number"),
    ],
)
def test_unparsable_values_name_the_variable(clean_atom_env, name, raw, kind):
    clean_atom_env.setenv(name, raw)
    with pytest.raises(ValueError, match=f"{name}={raw!r} is invalid: must be {kind}"):
        getattr(envs, name)


def test_lazy_evaluation(clean_atom_env):
    assert envs.ATOM_USE_TRITON_GEMM is False
    clean_atom_env.setenv("ATOM_USE_TRITON_GEMM", "1")
    assert envs.ATOM_USE_TRITON_GEMM is True
    clean_atom_env.delenv("ATOM_USE_TRITON_GEMM")
    assert envs.ATOM_USE_TRITON_GEMM is False


def test_unknown_attribute():
    with pytest.raises(AttributeError, match="ATOM_NOPE"):
        envs.ATOM_NOPE  # noqa: B018


def test_is_set(clean_atom_env):
    assert envs.is_set("ATOM_DP_SIZE") is False
    clean_atom_env.setenv("ATOM_DP_SIZE", "")
    assert envs.is_set("ATOM_DP_SIZE") is True


def test_describe(clean_atom_env):
    clean_atom_env.setenv("ATOM_PROFILER_MORE", "1")
    rows = {r["name"]: r for r in envs.describe()}
    assert set(rows) == set(GUIDE_DEFAULTS)
    assert rows["ATOM_PROFILER_MORE"]["value"] is True
    assert rows["ATOM_PROFILER_MORE"]["set"] is True
    assert rows["ATOM_DP_SIZE"]["default"] == 1 and rows["ATOM_DP_SIZE"]["set"] is False
    assert all(r["doc"] for r in rows.values())
