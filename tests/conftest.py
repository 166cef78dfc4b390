"""Shared fixtures: tiny random HF models written to temp folders (nothing downloaded)."""
from __future__ import annotations

import os

# pytest-xdist workers share the cores (-n 2 on 2 cores); where they run without
# OMP_NUM_THREADS=1 (which `make test` sets, so there this changes nothing), torch gives each a
# thread per core, and a worker's OpenMP threads that wait for a descheduled sibling spin
# (libgomp's default wait policy) and take the core from the other worker. They sleep instead
# (set before torch loads libgomp); the threads, the split of the work, and so every value are
# as before. (test_token_id_forms_are_one_prompt_each under plain `pytest -n 2`: 1.4 s alone;
# beside another worker 18 s spinning, 2 s asleep.)
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on CPU tensors (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _interpreter_patches_once_per_launch() -> None:
    """Triton's interpreter (3.x) re-patches `triton.language` on every call of a
    @triton.jit helper inside a kernel (`InterpretedFunction.__call__` -> `_patch_lang`:
    `inspect.getmembers` over tl, tl.core, tl.math, ...), although the launch
    (`GridExecutor.__call__`) patched the same modules already and keeps them patched until
    it returns: about a quarter of an interpreted test's time. The same patches again are a
    no-op (builtins already swapped are skipped, the rest are equivalent stateless closures),
    so inside a launch a helper whose language modules are patched skips it; a helper that
    sees a module the launch did not patch, or a call outside a launch, patches as before.
    What runs, and every value, is the interpreter's own; only the repeated patching goes.
    Left alone where triton is missing, not interpreted, or its internals differ."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    try:
        import threading

        import triton.language as tl
        from triton.runtime import interpreter as ip
    except ImportError:
        return
    grid_call = getattr(getattr(ip, "GridExecutor", None), "__call__", None)
    patch_lang = getattr(ip, "_patch_lang", None)
    if grid_call is None or patch_lang is None or not hasattr(ip, "_LangPatchScope") \
            or getattr(patch_lang, "once_per_launch", False):
        return
    state = threading.local()  # .patched: the language modules this thread's launch has patched

    def _patch_lang(fn):
        patched = getattr(state, "patched", None)
        if patched is None:  # outside a launch: as before
            return patch_lang(fn)
        langs = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        if langs and langs <= patched:
            return ip._LangPatchScope()  # patched by this launch already (nothing to restore)
        scope = patch_lang(fn)
        state.patched = patched | langs
        return scope

    def _grid_call(self, *args, **kwargs):
        outer = getattr(state, "patched", None)
        state.patched = frozenset()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            state.patched = outer

    _patch_lang.once_per_launch = True
    ip._patch_lang = _patch_lang
    ip.GridExecutor.__call__ = _grid_call


_interpreter_patches_once_per_launch()

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            initializer_range=0.45)


def make_tiny_model(path, arch: str = "llama", **overrides) -> str:
    """Save a random-weight Llama or Qwen3 (fp32, safetensors) and return its folder."""
    import transformers
    kw = {**TINY, **overrides}
    if arch == "llama":
        cfg = transformers.LlamaConfig(rope_theta=10000.0, tie_word_embeddings=False, **kw)
        cls = transformers.LlamaForCausalLM
    elif arch == "llama3":
        cfg = transformers.LlamaConfig(
            rope_theta=500000.0, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 256}, **kw)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen3":
        kw.setdefault("head_dim", 32)
        cfg = transformers.Qwen3Config(rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6, **kw)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    cfg.eos_token_id = 2
    cfg.bos_token_id = 1
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llama3(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama3"), "llama3")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The embedded SmolLM2-135M-Instruct, converted once into the user cache (`make` does it)."""
    from atom.model_loader.embedded import ensure_embedded_model
    return ensure_embedded_model()


def random_prompts(lens, seed: int = 1, vocab: int = 512) -> list[list[int]]:
    """Prompts of the given lengths, ids drawn from [3, vocab) with a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def hf_reference(path, prompts, n: int = 16, **load_kwargs) -> list[list[int]]:
    """n greedy tokens per prompt from transformers (fp32) on the checkpoint at `path`
    (`load_kwargs` go to `from_pretrained`)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load_kwargs).eval()
    return [hf_greedy(model, p, n) for p in prompts]


def check_greedy_in_setting(path, prompts, ref, setting: str, overrides: dict, sp, num_kvcache_blocks: int) -> None:
    """An engine on `path` with `overrides` gives `ref` greedy tokens; the setting took effect
    ("preemption": preemptions happened; "chunked...": no step over 32 tokens, and a second
    run hits the prefix cache with the same tokens); every KV block is free afterwards."""
    from atom import LLM
    llm = LLM(path, enable_log_stats=False, **{"num_kvcache_blocks": num_kvcache_blocks, **overrides})
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    steps = llm.stats.steps()
    if setting == "preemption":
        assert steps["preemptions"].sum() > 0
    if setting.startswith("chunked"):
        assert (steps["prefill_tokens"] + steps["decode_tokens"]).max() <= 32
        again = llm.generate(prompts, sp, use_tqdm=False)  # prefix-cache hits
        assert [o.token_ids for o in again] == ref and sum(o.num_cached_tokens for o in again) > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Reference: n greedy tokens from a transformers model, EOS not treated specially
    (what ignore_eos means in ATOM and vLLM: keep going, never suppress)."""
    dev = model.device
    past, x, out = None, torch.tensor([prompt_ids], device=dev), []
    with torch.inference_mode():
        for _ in range(n):
            o = model(input_ids=x, past_key_values=past, use_cache=True)
            past = o.past_key_values
            t = int(o.logits[0, -1].argmax())
            out.append(t)
            x = torch.tensor([[t]], device=dev)
    return out
