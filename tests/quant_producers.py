"""Checkpoints written by the real quantization producers (llm-compressor / compressed-tensors,
AMD Quark), made once per machine by `tests/producers/make_checkpoints.py` running in the
producers' own venv, for the tests to load.

Where the producers' Python is: `$ATOM_PRODUCER_PYTHON`, else `.venv-prod/bin/python` at the
repository root (`make producers` creates it; `make test` depends on it, so CI has it). Where
the checkpoints go: `$ATOM_QUANT_CKPT_CACHE`, else `~/.cache/atom/quant-producers/<key>`, the
key a hash of the script and the producers' versions, so a changed script or a new producer
version makes them anew and an unchanged one reuses them. The test suite runs in several
processes (pytest-xdist), so making them holds a lock file in that folder: a second process
waits, then finds them made.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "producers" / "make_checkpoints.py"
#: the pinned producers (pyproject.toml's `producers` extra, what `make producers` installs)
VERSIONS = re.search(r"^producers = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1) + " torch==2.13.0"


def producer_python() -> str | None:
    """The producers' interpreter, or None when it is not installed here."""
    exe = os.environ.get("ATOM_PRODUCER_PYTHON") or str(ROOT / ".venv-prod" / "bin" / "python")
    return exe if os.access(exe, os.X_OK) else None


def cache_dir() -> Path:
    env = os.environ.get("ATOM_QUANT_CKPT_CACHE")
    if env:
        return Path(env)
    key = hashlib.sha256(SCRIPT.read_bytes() + VERSIONS.encode()).hexdigest()[:12]
    return Path(os.environ.get("ATOM_MODEL_CACHE", Path.home() / ".cache" / "atom")) / "quant-producers" / key


def make_checkpoints(schemes: list[str], env: dict | None = None, timeout: int = 1200) -> Path:
    """Every scheme's folder (checkpoint + reference.json) under `cache_dir()`, produced by
    the script in the producers' venv for those not there yet."""
    exe = producer_python()
    if exe is None:
        raise FileNotFoundError("no producer venv")
    out = cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        _make_missing(exe, out, schemes, env, timeout)
    return out


def _make_missing(exe: str, out: Path, schemes: list[str], env: dict | None, timeout: int) -> None:
    missing = [s for s in schemes if not (out / s / "reference.json").exists()]
    if missing:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        env.pop("PYTHONPATH", None)  # the producers' venv imports nothing of the engine's
        proc = subprocess.run([exe, str(SCRIPT), str(out), *missing], env=env, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise RuntimeError(f"{SCRIPT.name} failed (exit {proc.returncode}) for {missing}; its output is above")


def reference(folder: Path) -> dict:
    return json.loads((folder / "reference.json").read_text())
