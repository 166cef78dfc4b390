"""The engine's API as vLLM users expect it (issue 6): each test reproduces a defect and
checks the right behaviour. The embedded model (SmolLM2-135M) where tokens matter, a tiny
random Llama where only the mechanics do."""
import gc
import logging
import tracemalloc

import numpy as np
import pytest
import torch

from atom import LLM, EngineArgs, SamplingParams
from atom.config import Config
from atom.model_engine.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("embedded", num_kvcache_blocks=64, enable_log_stats=False)


@pytest.fixture(scope="module")
def ids(llm):
    return llm.tokenizer.encode("The capital of France is")


@pytest.fixture(scope="module")
def ref(llm, ids):
    """Greedy tokens of `ids` from a list-of-ints prompt (the form that always worked)."""
    return llm.generate([ids], GREEDY, use_tqdm=False)[0].token_ids


def all_free(llm) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and llm.engine.is_finished() and not llm.engine.requests


@pytest.fixture
def no_model_load(monkeypatch):
    """A refusal must come before the ModelRunner is built (and so before weights load)."""
    monkeypatch.setattr(ModelRunner, "__init__", lambda *a, **k: pytest.fail("ModelRunner built"))


# --- 1. an interrupted generate leaves the engine clean ---------------------------------
@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupted_generate_aborts_its_requests(llm, ids, monkeypatch, exc):
    prompts = [ids, ids[:3]]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    fresh = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    engine, real_step, calls = llm.engine, llm.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 2:  # after one real step: blocks are held, requests half done
            assert llm.engine.block_manager.num_free_blocks < llm.engine.block_manager.num_blocks
            raise exc("interrupted")
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    with pytest.raises(exc):
        llm.generate(prompts, sp, use_tqdm=False)
    monkeypatch.undo()
    assert all_free(llm)  # before the fix: both requests stayed, holding their blocks
    assert [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == fresh


# --- 2. vLLM-style prompts and sampling params ------------------------------------------
def test_prompt_token_ids_dict_generates_from_those_ids(llm, ids, ref):
    for prompt in ({"prompt_token_ids": ids}, [{"prompt_token_ids": ids}]):
        (out,) = llm.generate(prompt, GREEDY, use_tqdm=False)
        # before: the dict was iterated and "prompt_token_ids" became a text prompt
        assert out.prompt_token_ids == ids and out.token_ids == ref and out.error is None


def test_prompt_text_dict(llm, ids, ref):
    outs = llm.generate([{"prompt": "The capital of France is"}, "The capital of France is"],
                        GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [ref, ref] and outs[0].prompt == "The capital of France is"
    (both,) = llm.generate({"prompt": "shown", "prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert both.prompt == "shown" and both.prompt_token_ids == ids and both.token_ids == ref


def test_other_dict_shapes_are_refused_by_name(llm, ids):
    outs = llm.generate([{"text": "hi"}, ids], GREEDY, use_tqdm=False)
    assert outs[0].finish_reason == "error"
    assert "'text'" in outs[0].error and "'prompt'" in outs[0].error and "'prompt_token_ids'" in outs[0].error
    assert outs[1].num_output_tokens == 4 and all_free(llm)
    with pytest.raises(TypeError, match=r"keys \['extra', 'prompt'\]"):
        llm.engine.add_request({"prompt": "hi", "extra": 1})


def test_sampling_params_as_a_dict(llm, ids, ref):
    (out,) = llm.generate(ids, {"temperature": 0, "max_tokens": 4, "ignore_eos": True}, use_tqdm=False)
    assert out.token_ids == ref  # before: TypeError from add_request, reported as an error output
    outs = llm.generate([ids, ids], [{"temperature": 0, "max_tokens": 2}, GREEDY], use_tqdm=False)
    assert outs[0].token_ids == ref[:2] and outs[1].token_ids == ref
    with pytest.raises(TypeError, match=r"unknown keys \['stop'\].*stop_strings"):
        llm.generate(ids, {"stop": ["x"]}, use_tqdm=False)
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate(ids, 0.5, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature=-1"):
        llm.generate(ids, {"temperature": -1}, use_tqdm=False)


# --- 3. token ids in numpy / torch / tuple form -----------------------------------------
def id_forms(ids):
    return {
        "numpy scalars": [np.int64(t) for t in ids],
        "torch 0-d ints": [torch.tensor(t) for t in ids],
        "numpy array": np.array(ids, dtype=np.int32),
        "torch tensor": torch.tensor(ids),
        "tuple": tuple(ids),
        "dict of a tensor": {"prompt_token_ids": torch.tensor(ids)},
    }


def test_token_id_forms_are_one_prompt_each(llm, ids, ref):
    for name, prompt in id_forms(ids).items():
        outs = llm.generate(prompt, GREEDY, use_tqdm=False)
        # before: numpy / torch ids were "out of range", a tuple was split into int prompts
        assert len(outs) == 1, name
        assert outs[0].error is None and outs[0].token_ids == ref and outs[0].prompt_token_ids == ids, name
    outs = llm.generate(np.array([ids, ids]), GREEDY, use_tqdm=False)  # 2-D: one prompt per row
    assert [o.token_ids for o in outs] == [ref, ref]


def test_add_request_takes_the_same_single_prompt_forms(llm, ids, ref):
    engine = llm.engine
    forms = {**id_forms(ids), "text dict": {"prompt": "The capital of France is"}}
    rids = {engine.add_request(p, GREEDY): name for name, p in forms.items()}
    done = {}
    while not engine.is_finished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert {rids[r]: o.token_ids for r, o in done.items()} == {name: ref for name in forms}


@pytest.mark.parametrize("bad,named", [(None, "None"), (123, "123"), (np.int64(7), r"(np\.int64\()?7\)?"), (3.5, "3.5")])
def test_non_prompts_are_clear_type_errors(llm, bad, named):
    with pytest.raises(TypeError, match=rf"prompts={named}.*a string, a list/tuple of token ids"):
        llm.generate(bad, GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match=rf"prompt={named}.*a string"):
        llm.engine.add_request(bad, GREEDY)
    assert all_free(llm)


def test_non_integer_ids_are_refused(llm):
    with pytest.raises(TypeError, match="integer dtype"):
        llm.engine.add_request(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="token id 2.5 .* at index 1"):
        llm.engine.add_request([1, 2.5])
    with pytest.raises(TypeError, match="at index 0"):
        llm.engine.add_request([True, 2])
    with pytest.raises(ValueError, match=r"\[49152\].*\[0, 49152\)"):
        llm.engine.add_request(np.array([1, 49152]))  # range is still the engine's check


# --- 4. ATOM_KERNEL_BACKEND --------------------------------------------------------------
@pytest.fixture
def fresh_backend(monkeypatch):
    from atom import platform
    platform.kernel_backend.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    platform.kernel_backend.cache_clear()


def test_bogus_kernel_backend_is_refused_at_engine_start(fresh_backend, no_model_load):
    fresh_backend.setenv("ATOM_KERNEL_BACKEND", "bogus")
    # before: a CPU engine never looked at the variable
    with pytest.raises(ValueError, match=r"ATOM_KERNEL_BACKEND='bogus' is invalid: choose one of "
                                         r"aiter, triton, torch"):
        LLM("embedded")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("backend", ["triton", "aiter"])
def test_gpu_backend_without_gpu_is_refused(fresh_backend, no_model_load, backend):
    import importlib.util
    if backend == "aiter" and importlib.util.find_spec("aiter") is None:
        match = "needs the aiter package"
    else:
        match = "needs a GPU and torch sees none: choose torch"
    fresh_backend.setenv("ATOM_KERNEL_BACKEND", backend)
    with pytest.raises(ValueError, match=rf"ATOM_KERNEL_BACKEND='{backend}' {match}"):
        LLM("embedded")


def test_backend_choice_is_logged_once_at_info(fresh_backend, caplog):
    from atom import platform
    fresh_backend.setenv("ATOM_KERNEL_BACKEND", "torch")
    with caplog.at_level(logging.INFO, logger="atom.platform"):
        assert platform.kernel_backend() == "torch" and platform.kernel_backend() == "torch"
    lines = [r for r in caplog.records if r.name == "atom.platform" and "kernel backend" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and "torch" in lines[0].getMessage()


# --- 5. length errors and the visible status line ---------------------------------------
def test_too_long_prompt_at_the_models_limit(tiny_llama):
    tiny = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=80)  # max_position_embeddings 1024
    assert tiny.config.max_model_len == 1024
    with pytest.raises(ValueError) as e:
        tiny.engine.add_request([5] * 1024)
    # before: "shorten the prompt or raise max_model_len", which cannot be raised
    assert "max_position_embeddings=1024" in str(e.value) and "only a shorter prompt helps" in str(e.value)
    assert "raise max_model_len" not in str(e.value)


def test_too_long_prompt_below_the_models_limit(tiny_llama):
    short = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=80, max_model_len=256)
    with pytest.raises(ValueError, match="max_model_len=256.*raise max_model_len .*up to 1024"):
        short.engine.add_request([5] * 300)


def test_capping_max_model_len_is_a_warning(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="atom.config"):
        cfg = Config(model=tiny_llama, max_model_len=5000)
    assert cfg.max_model_len == 1024
    (rec,) = [r for r in caplog.records if "capped" in r.getMessage()]
    assert rec.levelno == logging.WARNING and "max_model_len=5000" in rec.getMessage()
    assert "max_position_embeddings=1024" in rec.getMessage()


@pytest.fixture
def unconfigured_logging(monkeypatch):
    """Call it in the test body (pytest adds its capture handlers to the root logger after
    fixtures ran): logging as in a fresh script, no handler anywhere, for this test."""
    atom_log = logging.getLogger("atom")
    level = atom_log.level

    def clear():
        monkeypatch.setattr(logging.getLogger(), "handlers", [])
        monkeypatch.setattr(atom_log, "handlers", [])
        return atom_log

    yield clear
    atom_log.setLevel(level)


def test_status_line_visible_by_default(unconfigured_logging, capsys):
    from atom.model_engine.stats import EngineStats
    from atom.utils.log_setup import ensure_visible
    atom_log = unconfigured_logging()
    stats = EngineStats(log_interval=1e-9)
    stats.maybe_log(1, 0, 0.5, force=True)
    assert "Engine:" not in capsys.readouterr().err  # the defect: INFO goes nowhere
    handler = ensure_visible()
    assert handler is not None and ensure_visible() is handler  # idempotent
    assert atom_log.handlers == [handler]
    stats.maybe_log(1, 0, 0.5, force=True)
    assert "Engine: running 1 reqs, waiting 0 reqs, KV usage 50.0%" in capsys.readouterr().err
    logging.getLogger().addHandler(logging.NullHandler())  # the user configures logging later
    stats.maybe_log(1, 0, 0.5, force=True)
    assert "Engine:" not in capsys.readouterr().err  # theirs takes over: no line twice


def test_user_logging_configuration_is_left_alone(unconfigured_logging):
    from atom.utils.log_setup import ensure_visible
    atom_log = unconfigured_logging()
    logging.getLogger().addHandler(logging.NullHandler())
    level = atom_log.level
    assert ensure_visible() is None
    assert atom_log.handlers == [] and atom_log.level == level


def test_llm_construction_makes_status_line_visible(unconfigured_logging, tiny_llama, capsys):
    unconfigured_logging()
    tiny = LLM(tiny_llama, num_kvcache_blocks=16, throughput_log_interval=1e-6)
    tiny.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert "Engine: running" in capsys.readouterr().err


# --- 6. settings this build cannot honour -----------------------------------------------
UNSUPPORTED = [
    (dict(speculative_config={"method": "mtp", "num_speculative_tokens": 1}), "speculative_config=.*mtp"),
    (dict(enable_dp_attention=True, tensor_parallel_size=2), "enable_dp_attention=True"),
]


@pytest.mark.parametrize("kwargs,named", UNSUPPORTED, ids=[n.split("=")[0] for _, n in UNSUPPORTED])
def test_unsupported_settings_are_refused_before_weights_load(kwargs, named, no_model_load):
    Config(model="embedded", **kwargs)  # still constructible for inspection
    with pytest.raises(ValueError, match=f"{named}.* is not implemented in this build yet"):
        LLM("embedded", **kwargs)  # before: accepted, and did nothing


def test_all_unsupported_settings_are_named_at_once(no_model_load):
    with pytest.raises(ValueError) as e:
        LLM("embedded", enable_expert_parallel=True, kv_cache_dtype="fp8", enable_dp_attention=True,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    assert "enable_dp_attention" in str(e.value) and "speculative_config" in str(e.value)
    assert "kv_cache_dtype" not in str(e.value)  # an FP8 KV cache runs
    assert "enable_expert_parallel" not in str(e.value)  # it runs (tests/test_parallel_moe.py)


def test_asyncio_mode_is_the_servers_loop_and_refused_by_llm(no_model_load):
    from atom.model_engine.supported import unsupported_settings
    assert unsupported_settings(Config(model="embedded", asyncio_mode=True)) == []
    with pytest.raises(ValueError, match="asyncio_mode=True is invalid for LLM.*AsyncLLMEngine"):
        LLM("embedded", asyncio_mode=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU warning")
def test_compilation_level_on_cpu_warns_once(caplog):
    from atom.model_engine import supported
    supported._warn_compilation_on_cpu.cache_clear()
    with caplog.at_level(logging.WARNING, logger="atom.model_engine.supported"):
        supported.check_supported(Config(model="embedded"))  # level 0: nothing to say
        assert not [r for r in caplog.records if r.name == "atom.model_engine.supported"]
        for _ in range(2):
            supported.check_supported(Config(model="embedded", compilation_config={"level": 3}))
    (rec,) = [r for r in caplog.records if r.name == "atom.model_engine.supported"]
    assert "compilation_config.level=3 has no effect on a CPU" in rec.getMessage()


# --- 7. dtype and seed -------------------------------------------------------------------
@pytest.mark.parametrize("dtype,expected", [("bfloat16", torch.bfloat16), ("fp16", torch.float16),
                                            (torch.float32, torch.float32), ("auto", torch.float32)])
def test_dtype_runs_on_cpu(dtype, expected, ids, ref):
    m = LLM("embedded", num_kvcache_blocks=16, enable_log_stats=False, dtype=dtype)
    runner = m.engine.runner
    assert m.config.torch_dtype == expected and runner.dtype == expected
    assert {p.dtype for p in runner.model.parameters()} == {expected}
    assert runner.attn_layers[0].k_cache.dtype == expected
    (out,) = m.generate([ids], GREEDY, use_tqdm=False)
    assert out.num_output_tokens == 4
    if expected == torch.float32:
        assert out.token_ids == ref
    else:  # 16-bit rounding may change a near tie: most tokens agree with fp32
        assert sum(a == b for a, b in zip(out.token_ids, ref)) >= 3


@pytest.mark.parametrize("bad", ["int8", "float64", torch.float64, 16])
def test_bad_dtype_is_refused_by_name(bad, no_model_load):
    with pytest.raises(ValueError, match=r"dtype=.* is invalid: choose one of 'auto', 'bfloat16'"):
        LLM("embedded", dtype=bad)


def test_seed_makes_unseeded_sampling_reproducible(tiny_llama):
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9]]

    def sample(seed):
        m = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=16, seed=seed)
        torch.rand(3)  # whatever ran in between: construction already seeded the generation
        return [o.token_ids for o in m.generate(prompts, sp, use_tqdm=False)]

    first = sample(1234)
    assert sample(1234) == first  # before: seed was an unknown keyword
    assert sample(4321) != first
    with pytest.raises(ValueError, match="seed=-1 is invalid"):
        LLM(tiny_llama, seed=-1)


def test_engine_args_dtype_and_seed(tiny_llama):
    import argparse
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--model", tiny_llama, "--dtype", "bf16",
                                                       "--seed", "3"]))
    assert (args.dtype, args.seed) == ("bf16", 3)
    assert args.create_engine_config().torch_dtype == torch.bfloat16
    assert EngineArgs(model=tiny_llama).create_engine_config().torch_dtype == torch.float32
    with pytest.raises(ValueError, match="--dtype='int8' is invalid"):
        EngineArgs(model=tiny_llama, dtype="int8").create_engine_config()


# --- 9. bounded per-step records --------------------------------------------------------
def test_records_stay_bounded_over_many_requests(tiny_llama):
    window = 50
    m = LLM(tiny_llama, enable_log_stats=False, num_kvcache_blocks=64, stats_window=window)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def run(n):  # n requests, 10 per generate call, 2 steps per call
        for b in range(n // 10):
            m.generate([[5 + (b + i) % 50, 6, 7] for i in range(10)], sp, use_tqdm=False)

    def growth(n) -> int:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        run(n)
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before

    run(1100)  # fills the fixed-size windows (the hit rate's keeps 1000 requests)
    tracemalloc.start()
    try:
        # Refill the windows under tracing first: tracemalloc ignores frees of blocks allocated
        # before it started, so the records a window drops would otherwise not count against
        # the records it keeps.
        run(100)
        bounded = growth(900)
        assert m.stats.num_steps == 420 and len(m.stats.steps()) == window
        assert len(m.stats.request_rows) == window
        m.stats.set_window(None)  # the control: what the unbounded lists cost
        unbounded = growth(900)
    finally:
        tracemalloc.stop()
    assert len(m.stats.request_rows) == window + 900
    # ~60 KB (interpreter free lists keep a few blocks alive) vs ~550 KB for 900 more records
    assert 4 * bounded < unbounded and unbounded > 300_000, (bounded, unbounded)
    with pytest.raises(ValueError, match="stats_window=0 is invalid"):
        LLM(tiny_llama, stats_window=0)
