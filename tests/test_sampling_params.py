"""SamplingParams defaults and validation."""

from __future__ import annotations

import math

import pytest

from atom.sampling_params import SamplingParams


def test_defaults():
    sp = SamplingParams()
    assert sp.temperature == 1.0
    assert sp.max_tokens == 64
    assert sp.ignore_eos is False
    assert sp.stop_strings is None
    assert sp.top_k == -1
    assert sp.top_p == 1.0
    assert sp.seed is None
    assert sp.stop_token_ids is None
    assert sp.greedy is False
    assert sp.uses_top_k is False and sp.uses_top_p is False


def test_greedy_when_temperature_zero():
    assert SamplingParams(temperature=0).greedy is True
    assert SamplingParams(temperature=0.0).greedy is True
    assert SamplingParams(temperature=1e-6).greedy is False


def test_int_temperature_becomes_float():
    sp = SamplingParams(temperature=2)
    assert sp.temperature == 2.0 and isinstance(sp.temperature, float)


@pytest.mark.parametrize("t", [-0.1, math.inf, math.nan, "1.0", None, True])
def test_bad_temperature(t):
    with pytest.raises(ValueError, match=r"temperature=.* is invalid: must be a finite number >= 0"):
        SamplingParams(temperature=t)


@pytest.mark.parametrize("n", [0, -1, 1.5, "8", True])
def test_bad_max_tokens(n):
    with pytest.raises(ValueError, match=r"max_tokens=.* is invalid: must be an integer >= 1"):
        SamplingParams(max_tokens=n)


def test_max_tokens_one_ok():
    assert SamplingParams(max_tokens=1).max_tokens == 1


@pytest.mark.parametrize("k", [-1, 0, 1, 50])
def test_top_k_valid(k):
    sp = SamplingParams(top_k=k)
    assert sp.top_k == k
    assert sp.uses_top_k is (k >= 1)


@pytest.mark.parametrize("k", [-2, 2.0, "5"])
def test_top_k_invalid(k):
    with pytest.raises(ValueError, match=r"top_k=.* is invalid: must be -1 or 0 \(off\) or an integer >= 1"):
        SamplingParams(top_k=k)


@pytest.mark.parametrize("p", [1e-3, 0.5, 1, 1.0])
def test_top_p_valid(p):
    sp = SamplingParams(top_p=p)
    assert sp.top_p == float(p)
    assert sp.uses_top_p is (p < 1)


@pytest.mark.parametrize("p", [0, 0.0, -0.5, 1.01, math.nan, "0.9"])
def test_top_p_invalid(p):
    with pytest.raises(ValueError, match=r"top_p=.* is invalid: must be in \(0, 1\]"):
        SamplingParams(top_p=p)


def test_seed():
    assert SamplingParams(seed=0).seed == 0
    assert SamplingParams(seed=1234).seed == 1234
    for bad in (1.5, "7", True):
        with pytest.raises(ValueError, match="seed=.* is invalid"):
            SamplingParams(seed=bad)


def test_single_stop_string_wrapped():
    assert SamplingParams(stop_strings="\n\n").stop_strings == ["\n\n"]


def test_stop_strings_list_and_tuple():
    assert SamplingParams(stop_strings=["a", "bc"]).stop_strings == ["a", "bc"]
    assert SamplingParams(stop_strings=("x",)).stop_strings == ["x"]
    assert SamplingParams(stop_strings=[]).stop_strings == []


@pytest.mark.parametrize("bad", ["", [""], ["ok", ""], [1], 5, {"a": 1}])
def test_stop_strings_invalid(bad):
    with pytest.raises(ValueError, match="stop_strings=.* is invalid"):
        SamplingParams(stop_strings=bad)


def test_stop_token_ids():
    assert SamplingParams(stop_token_ids=[1, 2]).stop_token_ids == [1, 2]
    assert SamplingParams(stop_token_ids=(3,)).stop_token_ids == [3]
    for bad in ([-1], [1.0], 3, ["1"]):
        with pytest.raises(ValueError, match="stop_token_ids=.* is invalid"):
            SamplingParams(stop_token_ids=bad)


def test_ignore_eos():
    assert SamplingParams(ignore_eos=True).ignore_eos is True
    with pytest.raises(ValueError, match="ignore_eos='yes' is invalid"):
        SamplingParams(ignore_eos="yes")
